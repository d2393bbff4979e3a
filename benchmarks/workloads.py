"""Identities, facts and observations shaped like an agent's, and the databases they go in."""

from __future__ import annotations

import inspect
import json
import random
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from benchmarks.server import Server, quiesce
from coda_memory import MemoryService, MemoryStats, NewObservation, ObservationType
from coda_memory.ports import ObservationRecord
from coda_memory.postgres.migrate import migrate_async

SCHEMA = "coda_memory"
#: The tables the migrations create; any other table in the schema is an analytics rollup.
CORE_TABLES = frozenset({"observations", "facts", "fact_events", "checkpoints", "alembic_version"})
OBSERVATION_COLUMNS = ("identity_id", "type", "content", "metadata", "session_id", "created_at")
FACT_COLUMNS = (
    "identity_id",
    "subject",
    "category",
    "content",
    "confidence",
    "reinforcement_count",
    "last_reinforced_at",
    "confidence_at",
    "created_at",
    "updated_at",
)
EVENT_COLUMNS = (
    "identity_id",
    "subject",
    "category",
    "kind",
    "session_id",
    "at",
    "confidence_after",
    "count_after",
    "quality",
    "hits",
    "trials",
    "recorded_at",
)

#: The service's default queue bound (``queue_size``).
DEFAULT_QUEUE_SIZE: int = inspect.signature(MemoryService).parameters["queue_size"].default
#: The writer's default batch (``batch_size``): one batch may be in flight beyond the queue.
BATCH_SIZE: int = inspect.signature(MemoryService).parameters["batch_size"].default

#: Seconds to wait for stored observations before a run gives up instead of hanging.
DRAIN_TIMEOUT = 600.0


ENTITY_TYPES = ("account", "product", "contract", "isrc")
DOMAINS = ("royalty", "contract", "account", "product", "revenue", "catalog", "payout", "region")
TOOLS = (
    "get_account",
    "search_snowflake_schema",
    "get_products_by_isrc",
    "run_royalty_report",
    "get_contract",
    "run_sql",
    *(f"tool_{n:02d}" for n in range(26)),
)


class FixedClock:
    """The service clock: a fixed instant, moved by hand."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


@dataclass(frozen=True)
class FactShape:
    """What an identity with ``count`` facts has: tool affinities and avoidances,
    domains and entities (subject, category, content), in a fixed order."""

    count: int

    @property
    def tools(self) -> int:
        return min(len(TOOLS), max(1, self.count // 10))

    @property
    def avoided(self) -> int:
        return min(self.tools, self.count // 40)

    @property
    def domains(self) -> int:
        return min(len(DOMAINS), max(1 if self.count > 2 else 0, self.count // 25))

    @property
    def entities(self) -> int:
        return max(0, self.count - self.tools - self.avoided - self.domains)

    def rows(self) -> Iterator[tuple[str, str, str]]:
        for tool in TOOLS[: self.tools]:
            yield f"tool_affinity:{tool}", "tool_affinity", f"Uses {tool} successfully"
        for tool in TOOLS[: self.avoided]:
            yield f"tool_avoidance:{tool}", "tool_avoidance", f"{tool} has failed for this user"
        for domain in DOMAINS[: self.domains]:
            yield f"domain_preference:{domain}", "domain_preference", f"Asks about {domain}"
        for n in range(self.entities):
            kind, key = entity(n)
            yield f"entity_frequency:{kind}:{key}", "entity_frequency", f"Works with {kind} {key}"


def entity(n: int) -> tuple[str, str]:
    kind = ENTITY_TYPES[n % len(ENTITY_TYPES)]
    return kind, f"{kind[:4]}-{n}"


async def seed_identities(
    conn: Any,
    identities: Sequence[str],
    facts: int,
    at: datetime,
    rng: random.Random,
    max_age: timedelta = timedelta(days=4),
    sessions: int = 1,
) -> None:
    """Give each identity ``facts`` stored facts, a 'created' event per fact and a
    checkpoint, as consolidations before ``at`` would have left them; bulk-loaded with
    COPY. Facts were last reinforced up to ``max_age`` before ``at``; their events fall
    in ``sessions`` sessions per identity, in turn. The checkpoint's snapshot is taken
    after the facts commit, so observations emitted later are new to the next
    consolidation."""
    shape = list(FactShape(facts).rows())
    chunk = max(1, 200_000 // max(1, facts))
    span = max_age.total_seconds()
    for start in range(0, len(identities), chunk):
        fact_rows: list[tuple[Any, ...]] = []
        event_rows: list[tuple[Any, ...]] = []
        for identity in identities[start : start + chunk]:
            for n, (subject, category, content) in enumerate(shape):
                last = at - timedelta(seconds=rng.uniform(span / 50, span))
                created = last - timedelta(days=rng.uniform(0, 30))
                confidence = round(rng.uniform(0.45, 0.95), 4)
                count = rng.randint(1, 30)
                fact_rows.append(
                    (identity, subject, category, content, confidence, count, last, last, created)
                )
                event_rows.append(
                    (
                        identity,
                        subject,
                        category,
                        "created",
                        f"{identity}-s{n % sessions}",
                        created,
                        0.5,
                        1,
                    )
                )
        await conn.copy_records_to_table(
            "facts",
            schema_name=SCHEMA,
            columns=FACT_COLUMNS,
            records=[(*row, row[6]) for row in fact_rows],
        )
        await conn.copy_records_to_table(
            "fact_events",
            schema_name=SCHEMA,
            columns=EVENT_COLUMNS,
            records=[(*row, 1.0, 1, 1, row[5]) for row in event_rows],
        )
    await conn.execute(
        f"INSERT INTO {SCHEMA}.checkpoints (identity_id, snapshot, consolidated_at, runs) "
        "SELECT i, pg_current_snapshot()::text, $2, 1 FROM unnest($1::text[]) AS i",
        list(identities),
        at,
    )


async def seed_history(
    conn: Any, identities: Sequence[str], per_identity: int, at: datetime
) -> None:
    """Give each identity ``per_identity`` observations that its checkpoint has consumed
    (as consolidations before ``at`` would have), made within the retention window so no
    consolidation prunes them: the history a long-lived identity keeps."""
    await conn.execute(
        f"INSERT INTO {SCHEMA}.observations "
        "(identity_id, type, content, metadata, session_id, created_at) "
        "SELECT i, 'tool_success', 'ok', jsonb_build_object('toolName', 'tool_' || n % 40), "
        "i || '-h' || n / 10, $3::timestamptz - n * interval '1 second' "
        "FROM unnest($1::text[]) AS i, generate_series(1, $2) AS n",
        list(identities),
        per_identity,
        at - timedelta(hours=2),
    )
    # Consumed: the checkpoints' snapshot is taken after those rows committed.
    await conn.execute(
        f"UPDATE {SCHEMA}.checkpoints SET snapshot = pg_current_snapshot()::text "
        "WHERE identity_id = ANY($1::text[])",
        list(identities),
    )


def new_observations(
    identity: str,
    facts: int,
    count: int,
    sessions: int,
    at: datetime,
    rng: random.Random,
    session_prefix: str = "n",
) -> Iterator[NewObservation]:
    """``count`` observations over ``sessions`` sessions ending at ``at``: tool calls (one
    in ten failing), entity accesses (four in five of known entities) and a query domain,
    in the proportions an agent session produces them. Sessions are named
    ``{identity}-{session_prefix}{n}``."""
    shape = FactShape(facts)
    for n in range(count):
        session = f"{identity}-{session_prefix}{n * sessions // count}"
        created_at = at - timedelta(seconds=(count - n) * 7)
        slot = n % 10
        if slot <= 3:
            tool = TOOLS[rng.randrange(min(len(TOOLS), shape.tools + 2))]
            failed = slot == 3 and rng.random() < 0.5
            yield NewObservation(
                type=ObservationType.TOOL_FAILURE if failed else ObservationType.TOOL_SUCCESS,
                content=f"{tool} {'failed' if failed else 'ok'}",
                metadata={"toolName": tool, "durationMs": round(rng.uniform(20, 900), 1)}
                | ({"error": "timed out"} if failed else {}),
                session_id=session,
                created_at=created_at,
            )
        elif slot <= 8:
            known = shape.entities > 0 and rng.random() < 0.8
            kind, key = entity(
                rng.randrange(shape.entities) if known else shape.entities + rng.randrange(500)
            )
            yield NewObservation(
                type=ObservationType.ENTITY_ACCESS,
                content=f"accessed {kind}",
                metadata={"entityType": kind, "entityId": key, "entityName": f"{kind} {key}"},
                session_id=session,
                created_at=created_at,
            )
        else:
            domain = DOMAINS[rng.randrange(max(1, shape.domains))]
            yield NewObservation(
                type=ObservationType.QUERY_PATTERN,
                content=f"asked about {domain}",
                metadata={"domain": domain, "query": f"how is {domain} this month?"},
                session_id=session,
                created_at=created_at,
            )


async def emit_all(
    service: MemoryService, items: Iterable[tuple[str, NewObservation]], limit: int = 50_000
) -> int:
    """Emit every observation and wait until all are stored (draining every ``limit``
    so the bounded queue never drops any)."""
    emitted = 0
    for identity, observation in items:
        service.emit_observation(identity, observation)
        emitted += 1
        if emitted % limit == 0:
            await service.drain(DRAIN_TIMEOUT)
    await service.drain(DRAIN_TIMEOUT)
    stats = service.stats()
    if stats.dropped or stats.rejected:
        raise RuntimeError(f"observations were lost while seeding: {stats}")
    return emitted


@dataclass
class Database:
    """A migrated database of the run and the service that works on it."""

    name: str
    url: str
    conn: Any
    service: MemoryService
    clock: FixedClock

    async def close(self) -> None:
        await self.service.close()
        await self.conn.close()


async def facts_per_identity(db: Database, identities: Sequence[str]) -> float:
    """The mean number of stored facts of ``identities``."""
    value = await db.conn.fetchval(
        f"SELECT count(*)::float8 / cardinality($1::text[]) FROM {SCHEMA}.facts "
        "WHERE identity_id = ANY($1::text[])",
        list(identities),
    )
    return float(value)


async def open_database(server: Server, suffix: str, now: datetime, pool_size: int = 8) -> Database:
    name, url = await server.create_database(suffix)
    await migrate_async(url)
    clock = FixedClock(now)
    service = MemoryService.from_url(url, clock=clock, pool_size=pool_size)
    return Database(name, url, await server.connect(name), service, clock)


async def prepare_profile(
    db: Database,
    identities: Sequence[str],
    facts: int,
    new: int,
    sessions: int,
    rng: random.Random,
    history: int = 0,
) -> None:
    """Seed ``facts`` facts per identity (and ``history`` consumed observations: see
    :func:`seed_history`), then emit and store ``new`` observations each.

    Ends with VACUUM ANALYZE, as autovacuum would by the time such data is read: the
    measured runs then see planner statistics and hint bits, and no autovacuum worker
    competes with them for this machine's two cores.
    """
    now = db.clock.now
    await seed_identities(db.conn, identities, facts, now - timedelta(hours=1), rng)
    if history:
        await seed_history(db.conn, identities, history, now)
    if new:
        await emit_all(
            db.service,
            (
                (identity, observation)
                for identity in identities
                for observation in new_observations(identity, facts, new, sessions, now, rng)
            ),
        )
    await quiesce(db.conn)


@dataclass(frozen=True)
class TimedLoads:
    """What ``load_memory`` did for identities loaded one after another."""

    seconds: list[float]
    empty: int
    #: Loads whose answer had both a prompt section and tool affinities.
    with_prompt_and_affinities: int
    timeouts: int
    errors: int


def timeouts_between(before: MemoryStats, after: MemoryStats) -> int:
    """The loads that timed out between two ``stats()``, whatever they answered: the
    empty ones (``load_timeouts``) and those answered from the facts at hand
    (``load_stale``, which a failed consolidation also counts)."""
    return (after.load_timeouts - before.load_timeouts) + (after.load_stale - before.load_stale)


async def timed_loads(service: MemoryService, identities: Sequence[str]) -> TimedLoads:
    """``load_memory`` for each identity in turn, timed, with the service's counters."""
    before = service.stats()
    seconds: list[float] = []
    empty = complete = 0
    for identity in identities:
        start = time.perf_counter()
        loaded = await service.load_memory(identity)
        seconds.append(time.perf_counter() - start)
        empty += not loaded.facts
        complete += bool(loaded.prompt_section and loaded.tool_affinities)
    after = service.stats()
    return TimedLoads(
        seconds,
        empty,
        complete,
        timeouts_between(before, after),
        after.load_errors - before.load_errors,
    )


async def timed_consolidations(db: Database, identities: Sequence[str]) -> list[float]:
    seconds: list[float] = []
    for identity in identities:
        start = time.perf_counter()
        await db.service.consolidate(identity)
        seconds.append(time.perf_counter() - start)
    return seconds


async def consumed(conn: Any, identities: Sequence[str], at_least: int) -> int:
    """How many of ``identities`` had a consolidation that consumed ``at_least`` rows."""
    value = await conn.fetchval(
        f"SELECT count(*) FROM {SCHEMA}.checkpoints "
        "WHERE identity_id = ANY($1::text[]) AND observations_consumed >= $2",
        list(identities),
        at_least,
    )
    return int(value)


def names(prefix: str, count: int) -> list[str]:
    return [f"{prefix}-{n:06d}" for n in range(count)]


def ingest_observations(count: int, rng: random.Random) -> list[tuple[str, NewObservation]]:
    now = datetime.now(UTC)
    items: list[tuple[str, NewObservation]] = []
    identities = names("i", 1_000)
    while len(items) < count:
        identity = identities[len(items) % len(identities)]
        for observation in new_observations(identity, 200, 10, 1, now, rng):
            items.append((identity, observation))
    return items[:count]


def copy_rows(records: Sequence[ObservationRecord]) -> list[tuple[Any, ...]]:
    return [
        (
            r.identity_id,
            str(r.type),
            r.content,
            json.dumps(r.metadata, separators=(",", ":")),
            r.session_id,
            r.created_at,
        )
        for r in records
    ]
