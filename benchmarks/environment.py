"""The machine a run measures on: its load, its description, the commit."""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy.engine import make_url

from benchmarks.report import Report
from benchmarks.server import ROOT


def stolen_seconds() -> float:
    """CPU seconds the hypervisor gave other machines while this one wanted them, since
    boot, all cores together (Linux's "steal"; 0 where the system does not count it)."""
    return float(psutil.cpu_times()._asdict().get("steal", 0.0))


def family_cpu(root: int, *, reaped: bool = False) -> dict[int, float]:
    """CPU seconds (user and system) of process ``root`` and of each of its descendants,
    by pid; nothing for a process that is gone. ``reaped``: with the user CPU of the
    children each one waited for after they exited (pgbench, for this process)."""
    try:
        process = psutil.Process(root)
        family = [process, *process.children(recursive=True)]
    except psutil.Error:
        return {}
    cpu: dict[int, float] = {}
    for member in family:
        try:
            times = member.cpu_times()
        except psutil.Error:
            continue
        cpu[member.pid] = times.user + times.system + (times.children_user if reaped else 0.0)
    return cpu


class CpuMeter:
    """CPU seconds that a block used: in this process (every thread but the meter's own)
    and in the server's processes (the embedded server's postmaster and every backend it
    forks; None for a server given by ``--url``, whose processes this run cannot see).

    Backends come and go (pgbench's, a pool's replacements), so the server's processes
    are sampled every ``interval`` seconds in a thread: one that starts during the block
    counts from zero, and one that exits loses what it used after its last sample (at
    most an interval's worth)."""

    def __init__(self, server_pid: int | None, interval: float = 0.05) -> None:
        self._root = server_pid
        self._interval = interval
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        #: CPU of processes whose pid came back as a new process (counted, then reset).
        self._gone = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._process_start = 0.0
        self._meter_seconds = 0.0
        #: This process's CPU seconds in the block (set when it ends).
        self.process_seconds = 0.0
        #: The server's CPU seconds in the block (None: not seen).
        self.server_seconds: float | None = None

    def _sample(self) -> None:
        assert self._root is not None
        for pid, cpu in family_cpu(self._root).items():
            last = self._last.get(pid)
            if last is None:
                self._first[pid] = 0.0  # started during the block
            elif cpu < last:  # the pid was reused by a new process
                self._gone += last - self._first[pid]
                self._first[pid] = 0.0
            self._last[pid] = cpu

    def _run(self) -> None:
        started = time.thread_time()
        while not self._stop.wait(self._interval):
            self._sample()
        self._meter_seconds = time.thread_time() - started

    def __enter__(self) -> CpuMeter:
        self._process_start = time.process_time()
        if self._root is not None:
            self._first = family_cpu(self._root)
            self._last = dict(self._first)
            self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sample()
            used = sum(cpu - self._first[pid] for pid, cpu in self._last.items())
            self.server_seconds = self._gone + used
        self.process_seconds = time.process_time() - self._process_start - self._meter_seconds

    def per_item_ms(self, count: int) -> tuple[float, float | None]:
        """Milliseconds of CPU per item of ``count`` in the block: this process's, and the
        server's (None when not seen)."""
        server = None if self.server_seconds is None else self.server_seconds * 1000 / count
        return self.process_seconds * 1000 / count, server


class LoadMonitor:
    """Samples how much CPU processes other than this run's use meanwhile: this machine
    is shared, and a busy neighbour slows every figure down. "Ours" is this process, its
    children (pgbench, the memory probe) and the embedded server's processes."""

    def __init__(self, server_pid: int | None, interval: float = 0.5) -> None:
        self._roots = [os.getpid()] + ([server_pid] if server_pid else [])
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-monitor", daemon=True)
        self._last: dict[int, float] = {}
        self.foreign_seconds = 0.0
        #: CPU time the hypervisor gave other machines while this one wanted it (Linux's
        #: "steal"; 0 where the system does not count it): a slow spell of a shared host.
        self.stolen_seconds = 0.0
        self.elapsed = 0.0

    def _ours(self) -> dict[int, float]:
        cpu: dict[int, float] = {}
        for root in self._roots:
            cpu.update(family_cpu(root, reaped=True))
        return cpu

    @staticmethod
    def _busy() -> float:
        times = psutil.cpu_times()
        fields = ("user", "nice", "system", "irq", "softirq")
        values = times._asdict()
        return float(sum(values.get(name, 0.0) for name in fields))

    def _run(self) -> None:
        busy, self._last, clock = self._busy(), self._ours(), time.perf_counter()
        stolen = stolen_seconds()
        while not self._stop.wait(self._interval):
            now_busy, ours, now = self._busy(), self._ours(), time.perf_counter()
            now_stolen = stolen_seconds()
            used = sum(cpu - self._last.get(pid, 0.0) for pid, cpu in ours.items())
            self.foreign_seconds += max(0.0, (now_busy - busy) - used)
            self.stolen_seconds += max(0.0, now_stolen - stolen)
            self.elapsed += now - clock
            busy, self._last, clock, stolen = now_busy, ours, now, now_stolen

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    @contextlib.contextmanager
    def section(self, report: Report, name: str) -> Iterator[None]:
        """Record the section's duration, the other processes' mean CPU use in it and the
        CPU time the hypervisor took (steal)."""
        start, foreign, elapsed = time.perf_counter(), self.foreign_seconds, self.elapsed
        stolen = self.stolen_seconds
        try:
            yield
        finally:
            report.timings[f"{name}_s"] = time.perf_counter() - start
            span = self.elapsed - elapsed
            _share(
                report,
                report.load,
                name,
                self.foreign_seconds - foreign,
                span,
                0.25,
                "other processes on this machine used {cores} of its {count} cores meanwhile",
            )
            _share(
                report,
                report.steal,
                name,
                self.stolen_seconds - stolen,
                span,
                0.1,
                "the hypervisor took {cores} of this machine's {count} cores meanwhile (steal)",
            )


def _share(
    report: Report,
    shares: dict[str, float],
    name: str,
    seconds: float,
    span: float,
    limit: float,
    what: str,
) -> None:
    """Record ``seconds`` of CPU over a section's ``span`` as mean cores in ``shares``,
    with a note (``what``, given ``{cores}`` and ``{count}``) when over ``limit``."""
    cores = seconds / span if span > 0 else 0.0
    shares[name] = cores
    if cores > limit:
        said = what.format(cores=f"{cores:.2f}", count=os.cpu_count())
        report.note(f"{name}: {said}; figures of this section are pessimistic")


def machine(info: dict[str, Any]) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        **info,
    }


def git_commit() -> str | None:
    """The checked-out commit, marked when the library has uncommitted changes (read-only
    git commands only)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", "coda_memory"],
            capture_output=True,
        ).returncode
        untracked = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "--others", "--exclude-standard", "coda_memory"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + (" + uncommitted changes" if changed or untracked else "")


def command_line() -> str:
    argv = list(sys.argv)
    for n, arg in enumerate(argv):
        if "://" in arg:
            try:
                argv[n] = make_url(arg).render_as_string(hide_password=True)
            except Exception:
                argv[n] = "<url>"
    if argv and argv[0].endswith("__main__.py"):
        argv[0] = "-m benchmarks"  # the script's absolute path names the machine, not the run
    python = Path(sys.executable)
    try:
        shown = str(python.relative_to(Path.cwd()))
    except ValueError:
        shown = python.name
    return " ".join([shown, *(a if a == "-m benchmarks" else shlex.quote(a) for a in argv)])
