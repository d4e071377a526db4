"""linkemu: the topology as data everywhere; real namespaces, rates and clean-up as root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from commpress.errors import ConfigError
from commpress.linkemu import LinkEmuError, LinkLayout, Network, check_can_run, parse_rate
from commpress.linkemu.layout import burst_for

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="linkemu creates network namespaces: needs root (CI runs as root)")


def test_parse_rate():
    assert parse_rate("100mbit") == 100_000_000 and parse_rate("1gbit") == 10**9 and parse_rate("1.5Mbit") == 1_500_000
    assert parse_rate("none") is None and parse_rate(None) is None
    for bad in ("fast", "100mb", "-1gbit", "1bit"):
        with pytest.raises(ConfigError, match="rate"):
            parse_rate(bad)


def test_burst_matches_the_measured_settings():
    assert burst_for(10**9) == 500_000 and burst_for(10**8) == 128 * 1024


def test_topology_validation():
    with pytest.raises(ConfigError, match="nodes = 3"):
        LinkLayout.build("t", 4, nodes=3)
    with pytest.raises(ConfigError, match="expected one rate or 4"):
        LinkLayout.build("t", 4, "1gbit,1gbit")
    with pytest.raises(ConfigError, match="inter_rate needs nodes > 1"):
        LinkLayout.build("t", 2, inter_rate="1gbit")
    t = LinkLayout.build("t", 3, "1gbit,none,100mbit")
    assert t.rates == (10**9, None, 10**8)


def test_flat_commands_limit_both_ends_of_each_rank_link():
    t = LinkLayout.build("t", 2, "100mbit")
    cmds = [" ".join(c) for c in t.setup_commands()]
    assert t.namespaces == ["t-hub0", "t-r0", "t-r1"]
    tbf = [c for c in cmds if " tbf " in c]
    assert len(tbf) == 4 and all("rate 100000000bit" in c for c in tbf)
    assert any(c.startswith("tc -n t-r1 qdisc add dev eth0") for c in tbf)
    assert any(c.startswith("tc -n t-hub0 qdisc add dev r1") for c in tbf)
    assert "ip -n t-r1 addr add 10.213.0.2/16 dev eth0" in cmds
    env = t.rank_env(1, 1234)
    assert env["MASTER_ADDR"] == "10.213.0.1" and env["GLOO_SOCKET_IFNAME"] == "eth0" and env["RANK"] == "1"
    assert env["COMMPRESS_LINKEMU_ADDR"] == "10.213.0.2"


def test_two_level_commands_limit_only_the_trunks():
    t = LinkLayout.build("t", 4, nodes=2, inter_rate="100mbit")
    assert [t.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    tbf = [" ".join(c) for c in t.setup_commands() if "tbf" in c]
    # two trunks (node hub <-> core), limited at both ends; rank links unlimited
    assert len(tbf) == 4 and {c.split()[6] for c in tbf} == {"uplink", "n0", "n1"}
    assert "between nodes: 100 Mbit/s" in t.describe()
    assert t.label == "2 nodes, 100mbit between, unlimited inside"
    assert LinkLayout.build("t", 2, "1gbit").label == "1gbit"
    assert LinkLayout.build("t", 2, "1gbit,500kbit").rank_env(0, 1)["COMMPRESS_LINK"] == "1gbit,500kbit"


def test_not_root_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(LinkEmuError, match="linkemu needs root"):
        check_can_run()
    from commpress.cli import main

    assert main(["linkemu", "--ranks", "2", "--", "true"]) == 2


# --- real namespaces (root) ---------------------------------------------------------

_RECEIVER = textwrap.dedent(
    """
    import socket, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 5001)); s.listen(1)
    c, _ = s.accept(); first = c.recv(1 << 16); t0 = time.perf_counter(); n = 0
    while chunk := c.recv(1 << 16):
        n += len(chunk)
    print(n * 8 / (time.perf_counter() - t0))
    """
)
_SENDER = textwrap.dedent(
    """
    import socket, sys, time
    for _ in range(100):
        try:
            s = socket.create_connection((sys.argv[1], 5001)); break
        except OSError:
            time.sleep(0.05)
    s.sendall(bytes(int(sys.argv[2]))); s.close()
    """
)


def _bits_per_second(net: Network, src: int, dst: int, nbytes: int) -> float:
    """Goodput of one TCP transfer from rank ``src`` to rank ``dst`` (after the first chunk,
    which the tbf bucket lets through at once)."""
    rx = net.popen(dst, [sys.executable, "-c", _RECEIVER], stdout=subprocess.PIPE)
    tx = net.popen(src, [sys.executable, "-c", _SENDER, net.layout.address(dst), str(nbytes)])
    out, _ = rx.communicate(timeout=60)
    assert tx.wait(timeout=60) == 0 and rx.returncode == 0
    return float(out)


def _ours(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


@needs_root
def test_rate_limit_in_effect_and_cleaned_up(tmp_path):
    prefix = f"cpt{os.getpid()}"
    rate = 20_000_000
    with Network(LinkLayout.build(prefix, 2, "20mbit")) as net:
        assert sorted(_ours(prefix)) == sorted(net.layout.namespaces)
        measured = _bits_per_second(net, 0, 1, 1_500_000)
        # TCP goodput through tbf stays below the configured rate (headers take ~3%); the
        # lower bound only guards against a broken link on a loaded machine
        assert 0.3 * rate < measured < 1.1 * rate, measured
        code = net.run(
            [sys.executable, "-c", "import os; print(os.environ['RANK'], os.environ['MASTER_ADDR'])"], log_dir=str(tmp_path)
        )
        assert code == 0
        assert (tmp_path / "rank1.log").read_text().split() == ["1", "10.213.0.1"]
    assert _ours(prefix) == []


@needs_root
def test_two_nodes_fast_inside_slow_between():
    prefix = f"cpt{os.getpid()}n"
    rate = 20_000_000
    with Network(LinkLayout.build(prefix, 4, nodes=2, inter_rate="20mbit")) as net:
        between = _bits_per_second(net, 0, 2, 1_500_000)
        inside = _bits_per_second(net, 0, 1, 1_500_000)
        assert between < 1.1 * rate, between
        assert inside > 5 * rate, inside  # unlimited veth + bridge: hundreds of Mbit/s at least
    assert _ours(prefix) == []


@needs_root
def test_cli_failure_and_interrupt_remove_everything(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cli = [sys.executable, "-m", "commpress", "linkemu", "--ranks", "2", "--logs", str(tmp_path), "--"]
    fail = subprocess.run([*cli, sys.executable, "-c", "import os,sys; sys.exit(3 if os.environ['RANK']=='1' else 0)"], env=env)
    assert fail.returncode == 3
    proc = subprocess.Popen([*cli, "sleep", "60"], env=env, stderr=subprocess.PIPE, text=True)
    prefix = f"cpe{proc.pid}"
    deadline = time.monotonic() + 120  # the CLI imports torch first: slow on a loaded machine
    while len(_ours(prefix)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_ours(prefix)) == 3
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in err
    assert _ours(prefix) == []
    assert _ours(f"cpe{os.getpid()}") == []


@needs_root
def test_remove_stale_deletes_only_dead_runs():
    from commpress.linkemu.network import remove_stale

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, alive = f"cpe{dead.pid}-r0", f"cpe{os.getpid()}-r0"
    for ns in (stale, alive):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        assert stale in remove_stale()
        assert _ours(stale) == [] and _ours(alive) == [alive]
    finally:
        subprocess.run(["ip", "netns", "del", alive], check=False)
