"""Build a :class:`LinkLayout` with ``ip``/``tc``, run one command per rank in it, tear it down.

``with Network(layout) as net:`` creates everything and removes every namespace it
created on the way out, whether the body returns, raises or is interrupted (the CLI turns
SIGTERM/SIGHUP into exceptions too). Needs root and iproute2.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from commpress.linkemu.layout import LinkLayout

__all__ = ["LinkEmuError", "Network", "check_can_run", "remove_stale"]


class LinkEmuError(RuntimeError):
    """linkemu cannot run here, or building the network failed."""


def check_can_run() -> None:
    """Raise :class:`LinkEmuError` unless this process is root and has ``ip`` and ``tc``."""
    if os.geteuid() != 0:
        raise LinkEmuError(
            "linkemu needs root: it creates network namespaces, veth pairs and tc qdiscs; run it with sudo "
            "(inside a container: --cap-add NET_ADMIN)"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkEmuError(f"linkemu needs iproute2 ({', '.join(missing)} not found): apt-get install iproute2")


class Network:
    """The namespaces and links of ``layout``, alive inside a ``with`` block."""

    def __init__(self, layout: LinkLayout) -> None:
        self.layout = layout
        self.created: list[str] = []

    def __enter__(self) -> Network:
        check_can_run()
        existing = set(_netns_list())
        clash = sorted(set(self.layout.namespaces) & existing)
        if clash:
            raise LinkEmuError(f"network namespace {clash[0]} already exists: another linkemu run uses this prefix")
        try:
            for cmd in self.layout.setup_commands():
                _ip(cmd)
                if cmd[:3] == ["ip", "netns", "add"]:
                    self.created.append(cmd[3])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Delete every namespace this object created (their interfaces go with them)."""
        while self.created:
            ns = self.created.pop()
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)

    def popen(self, rank: int, cmd: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: object) -> subprocess.Popen:
        """Start ``cmd`` inside rank ``rank``'s namespace (in its own process group)."""
        full_env = {**os.environ, **(env or {})}
        argv = ["ip", "netns", "exec", self.layout.rank_ns(rank), *cmd]
        return subprocess.Popen(argv, env=full_env, start_new_session=True, **kwargs)  # type: ignore[call-overload]

    def run(self, cmd: Sequence[str], port: int = 29500, timeout: float | None = None, log_dir: str | None = None) -> int:
        """Run ``cmd`` once per rank with the torch.distributed variables set; rank 0 prints
        to this terminal, the others to ``log_dir/rank{r}.log`` (a temporary folder unless
        given; a failing rank's log tail is printed). Returns the first non-zero exit code
        (the other ranks are stopped), or 0."""
        logs = Path(log_dir or tempfile.mkdtemp(prefix="linkemu-"))
        logs.mkdir(parents=True, exist_ok=True)
        procs, files = [], []
        try:
            for r in range(self.layout.world_size):
                env = self.layout.rank_env(r, port)
                if r == 0:
                    procs.append(self.popen(r, cmd, env))
                else:
                    fh = (logs / f"rank{r}.log").open("wb")
                    files.append(fh)
                    procs.append(self.popen(r, cmd, env, stdout=fh, stderr=subprocess.STDOUT))
            return _wait_all(procs, logs, timeout)
        finally:
            for p in procs:
                _stop(p)
            for fh in files:
                fh.close()


def _wait_all(procs: list[subprocess.Popen], logs: Path, timeout: float | None) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            if rank:
                tail = (logs / f"rank{rank}.log").read_text(errors="replace")[-3000:]
                print(f"linkemu: rank {rank} exited with {code}; end of its log:\n{tail}", file=sys.stderr)
            return code
        if all(c == 0 for c in codes):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            print(f"linkemu: stopped after {timeout:.0f} s (timeout)", file=sys.stderr)
            return 124
        time.sleep(0.1)


def _stop(proc: subprocess.Popen) -> None:
    """Terminate ``proc``'s process group, then kill it if it lingers."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _ip(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        hint = " (is the sch_tbf kernel module available?)" if cmd[0] == "tc" else ""
        raise LinkEmuError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}{hint}")


def _netns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_stale(prefix: str = "cpe") -> list[str]:
    """Delete namespaces left by linkemu runs that were killed outright (SIGKILL): those
    named ``{prefix}{pid}-...`` whose process no longer exists. Returns their names."""
    check_can_run()
    gone = []
    for ns in _netns_list():
        head = ns.split("-", 1)[0]
        pid = head[len(prefix) :]
        if head.startswith(prefix) and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
            gone.append(ns)
    return gone
