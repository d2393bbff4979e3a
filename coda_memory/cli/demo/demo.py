"""``coda-memory demo``: a simulated month of agent sessions, with memory at work.

Everything printed comes from the run: the simulation (:mod:`coda_memory.cli.demo.simulation`)
drives the real emitters and :class:`~coda_memory.service.MemoryService` on Postgres with
a simulated clock, and the demo shows what the memory made of it. Each run starts from
an empty schema of its own (:data:`DEMO_SCHEMA`), dropped and migrated again.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from sqlalchemy import pool, select
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.schema import DropSchema

from coda_memory.cli.demo.plots import INSTALL_HINT, PlotsUnavailable, crossing
from coda_memory.cli.demo.simulation import (
    PERSONAS,
    Persona,
    SessionRecord,
    SimulatedClock,
    ranking,
    simulate,
)
from coda_memory.cli.output import add_row, fmt_count, new_table
from coda_memory.core.model import FactEvent, FactEventKind, LoadedMemory
from coda_memory.postgres import PostgresStore
from coda_memory.postgres.analytics import ToolEffectiveness, tool_effectiveness
from coda_memory.postgres.engine import asyncpg_url
from coda_memory.service import MemoryService

if TYPE_CHECKING:
    from coda_memory.cli.runtime import Target

#: The demo's own schema: dropped and created again on every run.
DEMO_SCHEMA = "coda_memory_demo"
#: ``load_memory``'s timeout in the demo. The library default is 100 ms; a server that
#: just started can take longer for its first connections, and an empty memory because of
#: that would misrepresent the run.
LOAD_TIMEOUT = 1.0
#: The user whose memory the demo follows.
FOCUS = "ana"


@dataclass
class Snapshot:
    """The focus user's memory at one point of the simulation."""

    label: str
    memory: LoadedMemory


@dataclass
class Recorder:
    """Collects what the demo shows while the simulation runs."""

    focus: str
    sessions: list[SessionRecord] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)

    def _has(self, prefix: str) -> bool:
        return any(s.label.startswith(prefix) for s in self.snapshots)

    def __call__(self, record: SessionRecord) -> None:
        self.sessions.append(record)
        if record.persona != self.focus:
            return
        own = [s for s in self.sessions if s.persona == self.focus]
        # The memory a session loads is what the earlier sessions left behind.
        if len(own) == 2:
            self.snapshots.append(
                Snapshot(f"after her first session (loaded on day {record.day})", record.memory)
            )
        elif record.day >= 7 and not self._has("after a week"):
            self.snapshots.append(
                Snapshot(
                    f"after a week: {len(own) - 1} sessions (loaded on day {record.day})",
                    record.memory,
                )
            )


def simulation_start(days: int, now: datetime | None = None) -> datetime:
    """``days`` days before the current hour: the simulated month ends now, so its data
    can be explored afterwards with the real clock (``coda-memory facts …``)."""
    current = (now or datetime.now(UTC)).replace(minute=0, second=0, microsecond=0)
    return current - timedelta(days=days)


def _day(at: datetime, start: datetime) -> int:
    return (at - start).days


async def reset_schema(url: str) -> None:
    """Drop the demo schema with everything in it, then migrate it from scratch."""
    from coda_memory.postgres.migrate import migrate_async

    engine = create_async_engine(asyncpg_url(url), poolclass=pool.NullPool)
    try:
        async with engine.begin() as conn:
            await conn.execute(DropSchema(DEMO_SCHEMA, cascade=True, if_exists=True))
    finally:
        await engine.dispose()
    await migrate_async(url, schema=DEMO_SCHEMA)


async def run_demo(
    target: Target,
    *,
    out: Path,
    days: int,
    console: Console,
    started: float | None = None,
) -> None:
    """Run the demo on ``target`` (its schema is ignored: the demo uses its own).
    ``started`` is the ``time.perf_counter()`` the reported duration counts from."""
    started = time.perf_counter() if started is None else started
    persona = next(p for p in PERSONAS if p.identity_id == FOCUS)
    console.rule("[bold]coda-memory demo")
    console.print(
        f"{len(PERSONAS)} simulated users hold sessions with an agent over {days} days. "
        "Before each session the agent server calls load_memory, which consolidates the "
        "user's observations into facts; during it, tool calls (some fail), entity lookups "
        "and questions are recorded as observations. Nothing below is written by hand: "
        "it all comes from this run.\n",
        markup=False,
    )
    await reset_schema(target.url)
    console.print(
        f"Database: {target.display}, schema {DEMO_SCHEMA} (dropped and migrated again).",
        markup=False,
    )
    start = simulation_start(days)
    clock = SimulatedClock(start)
    store = PostgresStore.from_url(target.url, schema=DEMO_SCHEMA, pool_size=2)
    service = MemoryService(store, clock=clock, load_timeout=LOAD_TIMEOUT)
    try:
        # Open the pool's first connection before the first timed load_memory.
        async with store.engine.connect() as conn:
            await conn.execute(select(1))
        recorder = Recorder(FOCUS)
        with console.status("simulating sessions…"):
            await simulate(service, clock, days=days, on_session=recorder, start=start)
        clock.now = start + timedelta(days=days)
        month_end = clock.now
        final = await service.load_memory(FOCUS)
        recorder.snapshots.append(
            Snapshot(f"after {days} days: {_sessions_of(recorder, FOCUS)} sessions", final)
        )
        _show_simulation(console, recorder, service, days)
        _show_growth(console, recorder.snapshots)
        _show_ranking(console, persona, final)

        effectiveness = await tool_effectiveness(
            store, since=timedelta(days=days + 1), min_users=1, now=month_end
        )
        plots: list[Path] = []
        await _show_expiry(console, service, clock, start, persona, final, out, plots)
        _show_effectiveness(console, effectiveness, days)
        plot_error = _draw_effectiveness(effectiveness, days, out, plots)
    finally:
        await service.close()
    console.print()
    console.rule("[bold]Done")
    if plots:
        console.print(f"Plots written to {out.resolve()}/:", markup=False)
        for path in plots:
            console.print(f"  {path.name}", markup=False)
    if plot_error:
        console.print(plot_error, markup=False)
    url_option = "" if target.embedded else " --url …"
    plot_option = "" if plot_error else f" --plot {FOCUS}.png"  # (it would fail the same way)
    console.print("Explore the data the demo left behind:", markup=False)
    for command in (
        f"facts {FOCUS}",
        f"history {FOCUS} tool_affinity:get_account{plot_option}",
        "analytics entities --min-users 1",
    ):
        console.print(f"  coda-memory {command} --schema {DEMO_SCHEMA}{url_option}", markup=False)
    console.print(f"Finished in {time.perf_counter() - started:.1f} s.", markup=False)


def _sessions_of(recorder: Recorder, identity_id: str) -> int:
    return sum(1 for s in recorder.sessions if s.persona == identity_id)


def _show_simulation(
    console: Console, recorder: Recorder, service: MemoryService, days: int
) -> None:
    sessions = recorder.sessions
    calls = [call for s in sessions for call in s.tools_called]
    failed = sum(1 for _, ok in calls if not ok)
    stats = service.stats()
    latencies = sorted(s.load_ms for s in sessions)
    per_user = ", ".join(
        f"{p.identity_id} {_sessions_of(recorder, p.identity_id)}" for p in PERSONAS
    )
    console.print()
    console.rule("The simulation")
    console.print(
        f"{len(sessions)} sessions over {days} days ({per_user}); {len(calls)} tool calls, "
        f"{failed} of them failed; {stats.stored} observations stored"
        + (f", {stats.rejected} rejected" if stats.rejected else "")
        + ".",
        markup=False,
    )
    if latencies:
        p95 = latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))]
        console.print(
            f"load_memory (consolidation included): median {statistics.median(latencies):.1f} "
            f"ms, p95 {p95:.1f} ms, {stats.load_timeouts} timeouts. The demo's timeout is "
            f"{LOAD_TIMEOUT:g} s (the library default is 100 ms).",
            markup=False,
        )


def _show_growth(console: Console, snapshots: Sequence[Snapshot]) -> None:
    console.print()
    console.rule(f"{FOCUS}'s memory section, as the agent gets it in its system prompt")
    for snapshot in snapshots:
        facts = len(snapshot.memory.facts)
        body = Text(snapshot.memory.prompt_section or "(empty: no facts yet)")
        console.print(
            Panel(
                body,
                title=Text(f"{snapshot.label}, {facts} facts"),
                title_align="left",
                expand=False,
            )
        )


def _show_ranking(console: Console, persona: Persona, memory: LoadedMemory) -> None:
    query = persona.questions[0]
    plain, boosted = ranking(query, memory)
    console.print()
    console.rule(f"Tool search for {FOCUS}")
    console.print(
        f"Query: {query!r}. Keyword relevance alone, then with {FOCUS}'s tool affinities "
        "added (score + affinity * 2; a failing tool's avoidance subtracts).",
        markup=False,
    )
    table = new_table(
        None,
        [
            ("rank", "right"),
            ("without memory", "left"),
            ("score", "right"),
            (f"with {FOCUS}'s memory", "left"),
            ("score", "right"),
            ("affinity", "right"),
        ],
    )
    for rank, ((tool, score), (boosted_tool, boosted_score)) in enumerate(
        zip(plain, boosted, strict=True), start=1
    ):
        affinity = memory.tool_affinities.get(boosted_tool)
        add_row(
            table,
            str(rank),
            tool,
            f"{score:.2f}",
            boosted_tool,
            f"{boosted_score:.2f}",
            "" if affinity is None else f"{affinity:+.2f}",
        )
    console.print(table)


async def _show_expiry(
    console: Console,
    service: MemoryService,
    clock: SimulatedClock,
    start: datetime,
    persona: Persona,
    memory: LoadedMemory,
    out: Path,
    plots: list[Path],
) -> None:
    if not persona.stops_using:
        return
    tool, last_day = next(iter(persona.stops_using.items()))
    subject = f"tool_affinity:{tool}"
    console.print()
    console.rule("Forgetting what is no longer used")
    fact = next((f for f in memory.facts if f.subject == subject), None)
    if fact is None:
        console.print(f"{FOCUS} has no active {subject} fact in this run.", markup=False)
        return
    decay = service.decay
    console.print(
        f"{FOCUS} stopped calling {tool} after day {last_day - 1}. On day {_day(clock.now, start)} "
        f"its fact has confidence {fact.confidence:.2f} ({fact.reinforcement_count} "
        f"reinforcements, the last on day {_day(fact.last_reinforced_at, start)}), decaying "
        f"without reinforcement; below {decay.expiry_threshold:g} a fact expires.",
        markup=False,
    )
    expires = crossing(fact, decay, clock.now + timedelta(days=3650))
    if expires is None:
        return
    clock.now = expires + timedelta(days=1)
    after = await service.load_memory(FOCUS)
    gone = tool not in after.tool_affinities
    console.print(
        f"Advancing the clock to day {_day(clock.now, start)} and loading {FOCUS}'s memory: "
        + (
            f"{tool} is no longer among her tool preferences."
            if gone
            else f"{tool} is still among her tool preferences."
        ),
        markup=False,
    )
    events = await service.history(FOCUS, subject)
    console.print(_events_table(subject, events, start, decay.expiry_threshold))
    try:
        from coda_memory.cli.demo.plots import plot_fact_history

        out.mkdir(parents=True, exist_ok=True)
        path = out / f"fact-history-{FOCUS}-{tool}.png"
        plots.append(
            plot_fact_history(
                events,
                decay,
                path,
                until=clock.now,
                title=f"{subject} for {FOCUS!r}: reinforced while used, then decaying",
            )
        )
    except PlotsUnavailable:
        pass  # reported once, with the other plot


def _events_table(
    subject: str, events: Sequence[FactEvent], start: datetime, threshold: float
) -> Table:
    table = new_table(
        f"History of {FOCUS}'s {subject}",
        [
            ("day", "right"),
            ("event", "left"),
            ("session", "left"),
            ("confidence", "left"),
            ("count", "right"),
        ],
    )
    for event in events:
        expired = event.kind is FactEventKind.EXPIRED
        if expired:
            change = f"fell below {threshold:g}"
        else:
            before = "-" if event.confidence_before is None else f"{event.confidence_before:.2f}"
            change = f"{before} → {event.confidence_after or 0.0:.2f}"
        add_row(
            table,
            str(_day(event.at, start)),
            Text(event.kind.value, style="bold red" if expired else ""),
            event.session_id or "",
            change,
            str(event.count_before if expired else event.count_after),
        )
    return table


def _show_effectiveness(console: Console, rows: Sequence[ToolEffectiveness], days: int) -> None:
    console.print()
    console.rule("Across all users: tool effectiveness")
    console.print(
        f"analytics.tool_effectiveness over the {days} simulated days (min_users=1; the "
        "default of 5 hides tools used by fewer users). Affinity and avoidance: users "
        "whose memory holds a tool_affinity or tool_avoidance fact for the tool.",
        markup=False,
    )
    headers = ("tool", "users", "calls", "success", "p50 ms", "affinity", "avoidance")
    table = new_table(None, [(h, "left" if h == "tool" else "right") for h in headers])
    for row in sorted(rows, key=lambda r: (-(r.success_rate or 0.0), r.tool_name)):
        add_row(
            table,
            row.tool_name,
            str(row.users),
            str(row.successes + row.failures),
            "-" if row.success_rate is None else f"{100 * row.success_rate:.0f}%",
            "-" if row.p50_duration_ms is None else f"{row.p50_duration_ms:.0f}",
            fmt_count(row.affinity_users),
            fmt_count(row.avoidance_users),
        )
    console.print(Group(table) if rows else Text("(no tool calls recorded)"))


def _draw_effectiveness(
    rows: Sequence[ToolEffectiveness], days: int, out: Path, plots: list[Path]
) -> str | None:
    """Draw the tool chart; returns a note when plots could not be drawn."""
    try:
        from coda_memory.cli.demo.plots import plot_tool_effectiveness

        out.mkdir(parents=True, exist_ok=True)
        plots.append(
            plot_tool_effectiveness(
                rows,
                out / "tool-effectiveness.png",
                title=f"Tool effectiveness across users ({days} simulated days)",
            )
        )
    except PlotsUnavailable:
        return f"No plots: {INSTALL_HINT}"
    return None
