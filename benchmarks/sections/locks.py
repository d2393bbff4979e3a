"""13. Lock isolation: an ACCESS EXCLUSIVE lock held on each table of the schema in turn
(10 s in full mode, 2 s in quick) while host-shaped requests keep coming, 8 in flight,
through a service with the library's defaults, for identities seeded afresh for each
table. Per table: the slowest load against the timeout + 10 ms, the loads that came back
empty, the observations stored while the lock was held (and in its last second), the
longest wait for a connection of the request and writer pools (pool exhaustion), log
lines per second per cause, and the time to recover after the release, with the same 8
requests still coming."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from benchmarks.environment import stolen_seconds
from benchmarks.host import HostRequests, collector_pauses, seed_host, timed_out
from benchmarks.logcount import counted_logs
from benchmarks.report import Figure
from benchmarks.section import Context, Section
from benchmarks.workloads import DRAIN_TIMEOUT, SCHEMA, Database, facts_per_identity
from coda_memory import MemoryService

#: How long recovery after a release may take before the run stops waiting.
RECOVERY_LIMIT = 30.0
#: The interval of the library's log throttle (one line a second per cause).
LOG_INTERVAL = 1.0
#: How often the probe checks a connection out of each pool, and the stats are read.
PROBE_EVERY = 0.1


class _Probe:
    """While the requests run: every :data:`PROBE_EVERY`, a connection checked out of the
    request pool and of the writer pool, timed (how long a request would wait for one),
    and the service's stats read (for ingest in the last second of the hold)."""

    def __init__(self, service: MemoryService) -> None:
        self.service = service
        self.longest_wait = {"request": 0.0, "writer": 0.0}
        self.samples: list[tuple[float, int]] = []  # (time, stored)
        self._stop = asyncio.Event()

    async def run(self) -> None:
        store: Any = self.service.store
        engines = {"request": store.request_engine, "writer": store.writer_engine}
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), self.service.stats().stored))
            for pool, engine in engines.items():
                started = time.perf_counter()
                async with engine.connect():
                    waited = time.perf_counter() - started
                self.longest_wait[pool] = max(self.longest_wait[pool], waited)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), PROBE_EVERY)

    def stop(self) -> None:
        self._stop.set()

    def stored_between(self, since: float, until: float) -> int:
        """Observations stored from the first sample at or after ``since`` to the last
        at or before ``until`` (the release: what the writer stored after it is the
        recovery's, not ingest going on under the lock)."""
        within = [stored for at, stored in self.samples if since <= at <= until]
        return within[-1] - within[0] if len(within) > 1 else 0


async def _hold(
    db: Database, ctx: Context, service: MemoryService, requests: HostRequests, table: str
) -> dict[str, Any]:
    """The lock held for ``lock_seconds`` while 8 requests stay in flight, and then,
    with the same 8 still coming, the recovery: the seconds from the release until every
    observation emitted before it is stored and a load that began after that answered
    fresh: facts, from its own consolidation (an answer from the facts at hand comes at
    ``ANSWER_BY`` of the timeout, see :func:`~benchmarks.host.timed_out`); RECOVERY_LIMIT
    if that never happens."""
    locker = await ctx.server.connect(db.name)
    held: list[float] = []  # the loads that began while the lock was held
    ended_after_release: list[float] = []  # those of them that ended after the release
    empty = 0
    released: float | None = None
    backlog = 0
    caught_up: float | None = None
    recovered: float | None = None
    probe = _Probe(service)
    try:
        transaction = locker.transaction()
        await transaction.start()
        await locker.execute(f'LOCK TABLE "{SCHEMA}"."{table}" IN ACCESS EXCLUSIVE MODE')
        before = service.stats()
        held_until = time.perf_counter() + ctx.sizes.lock_seconds

        async def client() -> None:
            nonlocal empty, caught_up, recovered
            while recovered is None:
                began = time.perf_counter()
                if released is not None and began - released > RECOVERY_LIMIT:
                    return
                elapsed, was_empty = await requests.one(service)
                if released is None or began < released:
                    held.append(elapsed)
                    if released is not None:
                        ended_after_release.append(elapsed)
                    empty += was_empty
                    continue
                stats = service.stats()
                if caught_up is None and stats.emitted - stats.pending >= backlog:
                    caught_up = time.perf_counter()
                fresh = not was_empty and not timed_out(service, elapsed)
                if caught_up is not None and began >= caught_up and fresh:
                    recovered = time.perf_counter()

        with counted_logs() as logs:
            stolen, started = stolen_seconds(), time.perf_counter()
            probing = asyncio.create_task(probe.run())
            with collector_pauses() as pauses:
                clients = asyncio.gather(*(client() for _ in range(ctx.sizes.host_concurrency)))
                # The hold's length is the measurement's own (the clients run meanwhile).
                await asyncio.sleep(max(0.0, held_until - time.perf_counter()))
                during = service.stats()
                stolen_cores = (stolen_seconds() - stolen) / (time.perf_counter() - started)
                # Stamped before the ROLLBACK goes out: the recovery counts from the
                # instant the lock starts to go, not once this task hears it went.
                released_at = time.perf_counter()
                await transaction.rollback()
                backlog = service.stats().emitted
                released = released_at
                await clients
            probe.stop()
            await probing
            # The throttle reports a cause's held-back lines once it has been quiet for
            # two intervals: they count as lines of their cause.
            await asyncio.sleep(2 * LOG_INTERVAL + 0.1)
    finally:
        await locker.close()
    recovery = RECOVERY_LIMIT if recovered is None else recovered - released
    # The first part of the recovery: until the observations queued at the release were
    # stored (seen at the end of a request, so to within one request's time).
    backlog_stored = RECOVERY_LIMIT if caught_up is None else caught_up - released
    limit_ms = service.load_timeout * 1000 + 10
    ms = [s * 1000 for s in held]
    return {
        "table": table,
        "loads": len(ms),
        "max_load_ms": max(ms, default=0.0),
        "loads_over_limit": sum(1 for v in ms if v > limit_ms),
        # Of those, the loads in flight at the release (ended after it), when the
        # consolidations the lock held out and the writer's backlog start at once.
        "over_limit_ended_after_release": sum(
            1 for s in ended_after_release if s * 1000 > limit_ms
        ),
        "empty": empty,
        "emitted": during.emitted - before.emitted,
        "stored": during.stored - before.stored,
        "stored_last_second": probe.stored_between(held_until - 1.0, released),
        "pending_at_release": during.pending,
        "longest_request_checkout_ms": probe.longest_wait["request"] * 1000,
        "longest_writer_checkout_ms": probe.longest_wait["writer"] * 1000,
        "pool_exhausted_lines": logs.pool_exhausted,
        "log_lines": logs.lines,
        "max_lines_per_s_per_cause": logs.max_per_second_per_cause,
        "recovery_s": recovery,
        "backlog_stored_s": backlog_stored,
        # The writer's pace after the release: what was queued then, over the time it
        # took to store it (in the runs up to 2026-12-06 07:34, over the whole recovery,
        # which also waits for a fresh load: a lower bound).
        "stored_per_s_after_release": during.pending / backlog_stored if backlog_stored else 0.0,
        # Collections of the garbage collector while the lock was held (loop stalls).
        **pauses.summary(),
        # The CPU the hypervisor took meanwhile (a slow spell of a shared host), in cores.
        "stolen_cpu_cores": stolen_cores,
        "top_causes": logs.causes(),
    }


async def _fresh_requests(
    db: Database, n: int, service: MemoryService, ctx: Context
) -> HostRequests:
    """Requests for 50 newly seeded identities with 200 facts each, each loaded once, as
    a host that served them for a while would have (the store keeps their facts). Each
    table gets its own: the requests' new entities grow an identity's facts toward the
    ``max_facts`` cap, and identities that served the earlier tables would make each later
    table's loads costlier than the first's."""
    identities = await seed_host(db, f"lk{n:02d}", 50, 200)
    requests = HostRequests(identities, 200, seed=100 + n)
    for identity in identities:
        await service.load_memory(identity)
    await requests.run(service, 32, ctx.sizes.host_concurrency)
    return requests


async def locks_section(db: Database, ctx: Context) -> None:
    report = ctx.report
    tables = [
        r["table_name"]
        for r in await db.conn.fetch(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = $1 "
            "AND table_type = 'BASE TABLE' AND table_name <> 'alembic_version' ORDER BY 1",
            SCHEMA,
        )
    ]
    service = MemoryService.from_url(db.url)
    rows: list[dict[str, Any]] = []
    try:
        for n, table in enumerate(tables):
            requests = await _fresh_requests(db, n, service, ctx)
            row = await _hold(db, ctx, service, requests, table)
            rows.append(
                row | {"facts_per_identity": await facts_per_identity(db, requests.identities)}
            )
        await service.drain(DRAIN_TIMEOUT)
    finally:
        await service.close()
    report.tables["lock_isolation"] = rows
    section = "13 lock isolation"
    held = f"ACCESS EXCLUSIVE {ctx.sizes.lock_seconds:g} s on each of {len(rows)} tables"
    limit = service.load_timeout * 1000 + 10
    slowest = max(rows, key=lambda r: r["max_load_ms"])
    report.add(
        Figure(
            section,
            f"{held}: slowest load_memory",
            slowest["max_load_ms"],
            "ms",
            target=f"<= timeout + 10 ms ({limit:g} ms)",
            met=slowest["max_load_ms"] <= limit,
            details={
                "table": slowest["table"],
                "loads_over_limit": sum(r["loads_over_limit"] for r in rows),
                "of_them_in_flight_at_the_release": sum(
                    r["over_limit_ended_after_release"] for r in rows
                ),
                "loads": sum(r["loads"] for r in rows),
            },
        )
    )
    # Ingest continued: observations were stored in the last second of the hold too (one
    # batch stored early, then a stall, would pass a count over the whole hold).
    stalled = [
        r["table"] for r in rows if r["table"] != "observations" and r["stored_last_second"] == 0
    ]
    report.add(
        Figure(
            section,
            f"{held}: tables other than observations whose lock stopped ingest "
            "(nothing stored in the hold's last second)",
            len(stalled),
            "",
            target="0",
            met=not stalled,
            details={"tables": stalled},
        )
    )
    emptiest = max(rows, key=lambda r: r["empty"])
    report.add(
        Figure(
            section,
            f"{held}: empty loads while a table was held, most for one table",
            emptiest["empty"],
            "",
            details={
                "table": emptiest["table"],
                "of_loads": emptiest["loads"],
                "all_tables": sum(r["empty"] for r in rows),
            },
        )
    )

    # Pool exhaustion: a checkout that waits longer than a load may take. (SQLAlchemy's
    # "QueuePool limit ... timed out" comes only after its 30 s pool timeout, longer than
    # the hold: counting those lines alone could not fail.) The requests take their
    # connections from the request pool; the writer's pool serves the writer alone, whose
    # connections wait on a locked observations table by design (that stall is ingest's),
    # so its waits count for the other tables.
    timeout_ms = service.load_timeout * 1000
    for pool, held_tables in (
        ("request", rows),
        ("writer", [r for r in rows if r["table"] != "observations"]),
    ):
        worst = max(held_tables, key=lambda r: float(r[f"longest_{pool}_checkout_ms"]))
        wait = worst[f"longest_{pool}_checkout_ms"]
        others = "" if pool == "request" else " (tables other than observations)"
        report.add(
            Figure(
                section,
                f"{held}: longest wait to check a connection out of the {pool} pool{others} "
                f"(a probe every {PROBE_EVERY * 1000:g} ms)",
                wait,
                "ms",
                target=f"< timeout ({timeout_ms:g} ms)",
                met=wait < timeout_ms,
                details={
                    "table": worst["table"],
                    "every_table_ms": {r["table"]: r[f"longest_{pool}_checkout_ms"] for r in rows},
                },
            )
        )
    exhausted = sum(r["pool_exhausted_lines"] for r in rows)
    report.add(
        Figure(
            section,
            f"{held}: pool exhaustion log lines",
            exhausted,
            "",
            target="0",
            met=exhausted == 0,
        )
    )
    loudest = max(rows, key=lambda r: r["max_lines_per_s_per_cause"])
    report.add(
        Figure(
            section,
            f"{held}: log lines per second per cause, max",
            loudest["max_lines_per_s_per_cause"],
            "/s",
            target="<= 1",
            met=loudest["max_lines_per_s_per_cause"] <= 1,
            details={"table": loudest["table"], "causes": loudest["top_causes"]},
        )
    )
    slowest_recovery = max(rows, key=lambda r: r["recovery_s"])
    report.add(
        Figure(
            section,
            f"{held}: recovery after release, max",
            slowest_recovery["recovery_s"],
            "s",
            target="<= 1 s",
            met=slowest_recovery["recovery_s"] <= 1.0,
            details={
                "table": slowest_recovery["table"],
                "backlog_stored_s": slowest_recovery["backlog_stored_s"],
            },
        )
    )
    # The recovery depends on what was queued, so on the pace of the requests meanwhile:
    # the pace at which the backlog went is comparable from one run to the next.
    backlog = max(rows, key=lambda r: r["pending_at_release"])
    report.add(
        Figure(
            section,
            f"{held}: observations queued at the release, most: stored per second after it",
            backlog["stored_per_s_after_release"],
            "/s",
            details={
                "table": backlog["table"],
                "queued": backlog["pending_at_release"],
                "backlog_stored_s": backlog["backlog_stored_s"],
                "recovery_s": backlog["recovery_s"],
            },
        )
    )


SECTION = Section(
    name="locks",
    title="lock isolation: ACCESS EXCLUSIVE on each table in turn",
    database="main",
    run=locks_section,
    selected_by=frozenset({"locks"}),
)
