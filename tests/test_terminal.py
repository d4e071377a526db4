"""The progress bar on a pipe: quiet between redraws, the finished count and note at the end."""

from commpress.bench.progress import Progress


def test_progress_on_a_pipe_draws_the_start_and_the_end_only(capsys):
    bar = Progress(50, "demo fp16")
    for done in range(1, 51):
        bar.update(done, f"loss {done / 10:.1f}")
    err = capsys.readouterr().err
    draws = [d for d in err.split("\r") if d.strip()]
    assert len(draws) == 2, draws  # well within PIPE_SECONDS: no redraw between start and end
    assert draws[-1].startswith("demo fp16: 100%") and "50/50" in draws[-1] and "loss 5.0" in draws[-1]
    assert err.endswith("\n")  # the finished line is closed
