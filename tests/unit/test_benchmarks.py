"""The benchmark package: every section is registered and reaches the library directly.

The benchmark is not run here (it takes minutes); these checks make a renamed library
function or an unregistered section fail the suite instead of dropping out of the report.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
import time
from pathlib import Path

import benchmarks
import benchmarks.sections
from benchmarks.__main__ import main, parse_args
from benchmarks.environment import CpuMeter
from benchmarks.profiling.run import profile_main
from benchmarks.profiling.sampling import profile_breakdown
from benchmarks.profiling.statements import server_entries
from benchmarks.run import benchmark, selected
from benchmarks.section import Section
from benchmarks.sections import OPTIONS, SECTIONS
from benchmarks.sizes import FULL, QUICK

#: The ``--only`` names the benchmark README documents.
DOCUMENTED_OPTIONS = {
    "consolidation",
    "load",
    "redis",
    "throughput",
    "ingest",
    "scaling",
    "analytics",
    "tenancy",
    "host",
    "typical_load",
    "replay",
    "neighbour",
    "cap",
    "locks",
    "cold_start",
    "long_run",
    "facts_cost",
}

#: Ways of finding the library's API at run time, which let a renamed function drop out
#: of the benchmark silently instead of failing it.
REFLECTION = re.compile(r"\b(getattr|hasattr|importlib|find_spec|getmembers)\b")


def section_modules() -> list[str]:
    return sorted(
        module.name
        for module in pkgutil.iter_modules(benchmarks.sections.__path__)
        if not module.ispkg
    )


def test_every_section_module_is_registered_once() -> None:
    modules = section_modules()
    assert len(modules) == len(SECTIONS) == 18
    for name in modules:
        module = importlib.import_module(f"benchmarks.sections.{name}")
        assert isinstance(module.SECTION, Section)
        assert SECTIONS.count(module.SECTION) == 1, name
    assert len({section.name for section in SECTIONS}) == len(SECTIONS)


def test_sections_run_coroutines_on_a_known_database() -> None:
    for section in SECTIONS:
        assert inspect.iscoroutinefunction(section.run), section.name
        assert list(inspect.signature(section.run).parameters) in (["db", "ctx"], ["big", "ctx"])
        assert section.database in ("main", "big")
        assert section.selected_by <= DOCUMENTED_OPTIONS


def test_only_accepts_the_documented_sections_and_rejects_others() -> None:
    assert set(OPTIONS) == DOCUMENTED_OPTIONS
    assert selected(None) == DOCUMENTED_OPTIONS
    assert selected("load,ingest") == {"load", "ingest"}
    chosen = [s.name for s in SECTIONS if s.selected_by & selected("analytics")]
    assert chosen == ["table_scaling", "analytics"]
    try:
        selected("load,nonsense")
    except SystemExit as error:
        assert "nonsense" in str(error)
    else:
        raise AssertionError("an unknown section was accepted")


def test_quick_mode_entry_points_are_callable() -> None:
    args = parse_args(["--quick", "--out", "scratch"])
    assert args.quick and args.out == Path("scratch") and not args.profile
    assert parse_args(["--quick", "--profile"]).profile
    for entry in (main, benchmark, profile_main):
        assert callable(entry)
    assert QUICK.mode == "quick" and FULL.mode == "full"
    assert [p.name for p in QUICK.profiles] == ["small", "typical", "heavy"]


def test_no_reflection_finds_the_library_api() -> None:
    root = Path(benchmarks.__file__).parent
    offenders = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if REFLECTION.search(line)
    ]
    assert offenders == []


async def test_a_failing_section_is_reported_and_the_run_goes_on() -> None:
    """A section that raises (a statement past a timeout, say) is noted as failed, its
    figures so far kept; the sections after it still run and the report is written."""
    from typing import Any, cast

    from benchmarks.report import Figure, Report
    from benchmarks.run import _run_section
    from benchmarks.section import Context

    async def partial(db: Any, ctx: Context) -> None:
        ctx.report.add(Figure("x", "before the failure", 1.0, "ms"))
        raise TimeoutError("the rebuild took too long")

    section = Section(
        name="broken", title="broken", database="main", run=partial, selected_by=frozenset()
    )
    report = Report()
    ctx = cast(Context, type("Ctx", (), {"report": report})())
    await _run_section(section, cast(Any, None), ctx)
    assert report.failed == ["broken"]
    assert [f.name for f in report.figures] == ["before the failure"]
    assert report.notes == ["section broken failed: TimeoutError: the rebuild took too long"]


def test_server_entries_reads_the_slow_statements_between_two_offsets(tmp_path: Path) -> None:
    log = tmp_path / "log"
    before = "2026-12-04 17:00:00 UTC [1] LOG:  duration: 9.0 ms  statement: COMMIT\n"
    logged = (
        "2026-12-04 17:00:01 UTC [2] LOG:  duration: 12.679 ms  execute __asyncpg_stmt_1__: "
        "SELECT id\n"
        "\tFROM coda_memory.facts WHERE identity_id = $1\n"
        "2026-12-04 17:00:01 UTC [2] DETAIL:  parameters: $1 = 'x'\n"
        "2026-12-04 17:00:02 UTC [3] LOG:  checkpoint starting: time\n"
        "2026-12-04 17:00:03 UTC [2] LOG:  duration: 5.5 ms  parse <unnamed>: COMMIT\n"
    )
    log.write_bytes((before + logged).encode())

    entries = server_entries(log, len(before.encode()), log.stat().st_size)

    assert entries == [(12.679, "facts: load"), (5.5, "COMMIT")]


#: Burns CPU for a number of seconds of process time, given as its first argument.
_BURN = """
import sys, time
def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
"""

#: A process of the stand-in server that starts during the block: it burns 0.2 s, says
#: so, and stays alive until its input closes.
_CHILD = (
    _BURN
    + """
burn(0.2)
print("done", flush=True)
sys.stdin.read()
"""
)

#: A stand-in for the server: it burns 0.3 s before it says "ready" (not the block's);
#: then, told "go", it starts a child (above), burns 0.3 s itself, and says "done" once
#: both are done; it stays alive until its input closes.
_SERVER = (
    _BURN
    + """
import subprocess
burn(0.3)
print("ready", flush=True)
sys.stdin.readline()
child = subprocess.Popen(
    [sys.executable, sys.argv[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
)
burn(0.3)
child.stdout.readline()
print("done", flush=True)
sys.stdin.read()
child.stdin.close()
child.wait()
"""
)


def test_cpu_meter_counts_the_servers_processes_from_the_block_on(tmp_path: Path) -> None:
    (tmp_path / "server.py").write_text(_SERVER)
    (tmp_path / "child.py").write_text(_CHILD)
    with subprocess.Popen(
        [sys.executable, str(tmp_path / "server.py"), str(tmp_path / "child.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as server:
        assert server.stdin is not None and server.stdout is not None
        try:
            assert server.stdout.readline().strip() == "ready"
            with CpuMeter(server.pid) as cpu:
                server.stdin.write("go\n")
                server.stdin.flush()
                assert server.stdout.readline().strip() == "done"
        finally:
            server.stdin.close()
            server.wait(timeout=10)
    # 0.5 s burnt in the block (the child's interpreter start adds a little); the 0.3 s
    # burnt before it is not counted, and this process only waited.
    assert cpu.server_seconds is not None
    assert 0.45 <= cpu.server_seconds <= 0.75
    assert cpu.process_seconds < 0.2


def test_cpu_meter_without_a_server_process_counts_this_process_only() -> None:
    with CpuMeter(None) as cpu:
        end = time.process_time() + 0.1
        while time.process_time() < end:
            pass
    assert cpu.server_seconds is None
    assert 0.09 <= cpu.process_seconds <= 0.3


def test_the_profile_puts_socket_calls_apart_and_scales_to_the_cpu_measured() -> None:
    loop = ("_run_once", "/usr/lib/python3.11/asyncio/base_events.py")
    write = ("write", "/usr/lib/python3.11/asyncio/selector_events.py")
    plan = ("planning", "/src/coda_memory/core/consolidation.py")
    samples = [
        ([loop, write, ("socket.send", "<built-in>")], 3.0),
        ([loop, write], 1.0),  # the transport's own Python: the event loop's
        ([loop, plan], 4.0),
        ([loop, ("select", "/usr/lib/python3.11/selectors.py")], 10.0),  # idle: left out
    ]
    breakdown = profile_breakdown(samples, cpu_ms=2.0)
    categories = breakdown["categories_ms_per_run"]
    assert categories == {
        "consolidation engine (plan, decay, model)": 1.0,
        "socket send and receive (system calls)": 0.75,
        "asyncio event loop (task switches, callbacks)": 0.25,
    }
    functions = breakdown["functions_ms_per_run"]
    assert functions["the plan in steps, as a load runs it (pure Python)"] == 1.0


def test_log_lines_count_by_the_throttles_cause_in_any_one_second() -> None:
    """Counted by message text and calendar second, one cause's lines ("… (and 13 more
    like it …)", its held-back report) counted as several causes, and two lines 0.2 s
    apart across a second's boundary as one a second."""
    import logging

    from benchmarks.logcount import LogCounter
    from coda_memory.core.caps import CAUSE_ATTRIBUTE

    counter = LogCounter()
    for created, text in ((10.9, "load timed out"), (11.1, "load timed out (and 3 more)")):
        record = logging.LogRecord("coda_memory", logging.WARNING, "", 0, text, (), None)
        record.created = created
        vars(record)[CAUSE_ATTRIBUTE] = "timeout"
        counter.emit(record)
    assert counter.max_per_second_per_cause == 2
