"""Profiling: where the CPU time goes, from a sampling profiler."""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import CodeType
from typing import Any

from pyinstrument import Profiler
from pyinstrument.renderers import ConsoleRenderer
from sqlalchemy.pool.base import _ConnectionFairy
from sqlalchemy.sql.elements import ClauseElement

from benchmarks.server import ROOT
from benchmarks.workloads import new_observations
from coda_memory import MemoryService
from coda_memory.core.affinity import extract_tool_affinities
from coda_memory.core.consolidation import plan_consolidation, planning
from coda_memory.core.prompt import format_memory_section
from coda_memory.postgres import PostgresStore, unit
from coda_memory.postgres.append import append_observations
from coda_memory.postgres.known import Known
from coda_memory.postgres.repositories import FactRepository

#: Where sampled CPU time goes: the first frame from the leaf up that matches decides. C
#: code (asyncpg's protocol, SQLAlchemy's row processing, pydantic-core) has no frames of
#: its own, so its time lands on the Python frame that called it; pyinstrument records
#: the built-in functions called from Python, such as a socket's send (py-spy does not).
PROFILE_CATEGORIES: tuple[tuple[str, Callable[[str, str], bool]], ...] = (
    (
        "socket send and receive (system calls)",
        lambda f, p: p == "<built-in>" and f in ("socket.send", "socket.recv", "socket.recv_into"),
    ),
    (
        "asyncpg (protocol, row decoding; mostly C)",
        lambda f, p: "/asyncpg/" in p or (p.endswith("selector_events.py") and "_read_" in f),
    ),
    ("pydantic (Python side)", lambda f, p: "/pydantic" in p),
    (
        "rows -> pydantic models in repositories (SQLAlchemy rows + pydantic-core, C)",
        lambda f, p: p.endswith("repositories.py") and _is_row_conversion(f),
    ),
    ("SQLAlchemy (compile, execute, results, pool)", lambda f, p: "/sqlalchemy/" in p),
    ("consolidation engine (plan, decay, model)", lambda f, p: _in_engine(p)),
    ("prompt section + affinities", lambda f, p: p.endswith(("prompt.py", "affinity.py"))),
    ("coda_memory Postgres store (statements, rows)", lambda f, p: "/coda_memory/postgres/" in p),
    (
        "coda_memory service",
        lambda f, p: p.endswith(
            tuple(f"coda_memory/{name}.py" for name in ("service", "writer", "stats", "stores"))
        ),
    ),
    ("greenlet bridge", lambda f, p: "greenlet" in p),
    ("asyncio event loop (task switches, callbacks)", lambda f, p: "/asyncio/" in p),
)


def _in_engine(path: str) -> bool:
    return "/coda_memory/" in path and path.endswith(
        ("consolidation.py", "sessions.py", "decay.py", "model.py", "sanitize.py")
    )


def _is_row_conversion(function: str) -> bool:
    return function.rsplit(".", 1)[-1] in ("_fact", "_observation", "_event", "<listcomp>")


def _where(code: CodeType) -> tuple[str, str]:
    """(the file's last two path parts, the function's name) of a code object."""
    return "/".join(Path(code.co_filename).parts[-2:]), code.co_name


#: Inclusive CPU time of chosen functions: (label, file suffix, function name), taken
#: from the functions themselves, so a renamed one fails here instead of reading zero.
_CHOSEN: tuple[tuple[str, CodeType], ...] = (
    ("plan_consolidation (pure Python)", plan_consolidation.__code__),
    ("the plan in steps, as a load runs it (pure Python)", planning.__code__),
    ("PostgresStore.peek (lock-free read)", PostgresStore.peek.__code__),
    ("unit.load (snapshot + 3 reads)", unit.PostgresConsolidationUnit.load.__code__),
    ("unit.write (one write)", unit.PostgresConsolidationUnit.write.__code__),
    ("lock_identity (ensure, lock)", unit.lock_identity.__code__),
    (
        "a consolidation's transaction opened and closed (PostgresStore.consolidation)",
        inspect.unwrap(PostgresStore.consolidation).__code__,  # an asynccontextmanager
    ),
    ("FactRepository.stored (SELECT + rows -> Fact)", FactRepository.stored.__code__),
    ("SQLAlchemy statement compile (cache lookups)", ClauseElement._compile_w_cache.__code__),
    ("SQLAlchemy pool checkout", _ConnectionFairy._checkout.__code__),
    ("format_memory_section", format_memory_section.__code__),
    ("extract_tool_affinities", extract_tool_affinities.__code__),
    ("a load's answer (rank, prompt section, affinities)", MemoryService._answer_steps.__code__),
    ("kept facts made into models (Known.facts)", Known.facts.__code__),
    ("the writer: validating a batch", MemoryService._validate.__code__),
    ("the writer: storing a batch (append_observations)", append_observations.__code__),
    ("the benchmark: making a request's observations", new_observations.__code__),
)
PROFILE_FUNCTIONS: tuple[tuple[str, str, str], ...] = (
    *((label, *_where(code)) for label, code in _CHOSEN),
    ("postgres/unit.py (hot-path statements, rows -> models)", "postgres/unit.py", "*"),
)


Stack = list[tuple[str, str]]


def profile_breakdown(samples: Sequence[tuple[Stack, float]], cpu_ms: float) -> dict[str, Any]:
    """Busy samples (stacks root first, as (function, file)) by category and by chosen
    function, scaled so that they add up to ``cpu_ms``, the measured CPU time per run."""
    categories: dict[str, float] = defaultdict(float)
    functions: dict[str, float] = defaultdict(float)
    total = 0.0
    for frames, weight in samples:
        if frames and frames[-1][1].endswith("selectors.py"):
            continue  # idle in the event loop: accounted for as wall - CPU
        total += weight
        chosen = "other (stdlib, benchmark loop)"
        for function, path in reversed(frames):
            hit = next((name for name, test in PROFILE_CATEGORIES if test(function, path)), None)
            if hit is not None:
                chosen = hit
                break
        categories[chosen] += weight
        seen: set[str] = set()
        for function, path in frames:
            for label, suffix, name in PROFILE_FUNCTIONS:
                short = function.rsplit(".", 1)[-1]
                if label not in seen and name in (short, "*") and path.endswith(suffix):
                    functions[label] += weight
                    seen.add(label)
    scale = cpu_ms / total if total else 0.0
    return {
        "samples": total,
        "categories_ms_per_run": {
            k: v * scale for k, v in sorted(categories.items(), key=lambda kv: -kv[1])
        },
        "functions_ms_per_run": {k: functions[k] * scale for k, _, _ in PROFILE_FUNCTIONS},
    }


def pyinstrument_samples(session: Any) -> list[tuple[Stack, float]]:
    samples: list[tuple[Stack, float]] = []
    for stack, seconds in session.frame_records:
        frames: Stack = []
        for info in stack:
            parts = info.split("\x01", 1)[0].split("\x00")
            frames.append((parts[0], parts[1] if len(parts) > 1 else ""))
        samples.append((frames, seconds))
    return samples


_SPY_FRAME = re.compile(r"^(.*) \((.*):\d+\)$")


def py_spy() -> str | None:
    found = shutil.which("py-spy")
    local = Path(sys.executable).parent / "py-spy"
    return found or (str(local) if local.exists() else None)


def read_spy(path: Path) -> list[tuple[Stack, float]]:
    samples: list[tuple[Stack, float]] = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames: Stack = []
        for frame in stack.split(";"):
            match = _SPY_FRAME.match(frame)
            frames.append((match.group(1), match.group(2)) if match else (frame, ""))
        samples.append((frames, float(count)))
    return samples


def shorten_paths(path: Path) -> None:
    """Strip install prefixes from a profile's file names (a third of py-spy's collapsed
    stacks), once they have been read."""
    prefixes = sorted(
        {str(ROOT) + "/", *(p + "/" for p in sys.path if p and Path(p).is_dir())},
        key=len,
        reverse=True,
    )
    pattern = re.compile("|".join(re.escape(p) for p in prefixes))
    path.write_text(pattern.sub("", path.read_text()))


async def profiled(
    operation: Callable[[str], Awaitable[Any]], identities: Sequence[str], out: Path
) -> dict[str, Any]:
    """Run ``operation`` for each identity, one after another, under a sampling profiler
    (see :func:`profiled_work`)."""

    async def each() -> None:
        for identity in identities:
            await operation(identity)

    return await profiled_work(each, len(identities), out)


async def profiled_work(work: Callable[[], Awaitable[Any]], runs: int, out: Path) -> dict[str, Any]:
    """Run ``work`` (``runs`` runs of something) under a sampling profiler: py-spy when
    it is installed (it samples from outside, so the code runs at full speed), else
    pyinstrument. Returns wall and CPU time per run and where the CPU time went."""
    spy = py_spy()
    recorder: subprocess.Popen[bytes] | None = None
    profiler: Any = None
    if spy is not None:
        raw = out.with_suffix(".collapsed.txt")
        command = [spy, "record", "--pid", str(os.getpid()), "--rate", "1000", "--format"]
        command += ["raw", "--output", str(raw), "--nonblocking", "--full-filenames"]
        recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        await asyncio.sleep(1.0)  # py-spy attaches
    else:
        profiler = Profiler(interval=0.0005, async_mode="disabled")
        profiler.start()
    wall, cpu = time.perf_counter(), time.process_time()
    await work()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    samples: list[tuple[Stack, float]]
    if recorder is not None:
        recorder.send_signal(signal.SIGINT)
        await asyncio.to_thread(recorder.communicate)
        samples = read_spy(raw)
        shorten_paths(raw)
        sampler, tree = "py-spy (1 kHz, collapsed stacks)", raw.name
    else:
        session = profiler.stop()
        out.write_text(ConsoleRenderer(unicode=False, color=False).render(session))
        shorten_paths(out)  # its header names this file by its absolute path
        samples = pyinstrument_samples(session)
        sampler, tree = "pyinstrument (0.5 ms; adds per-call overhead)", out.name
    return {
        "sampler": sampler,
        "tree": tree,
        "wall_ms_per_run": wall * 1000 / runs,
        "cpu_ms_per_run": cpu * 1000 / runs,
        **profile_breakdown(samples, cpu * 1000 / runs),
    }
