"""Analytics: the views and functions on a fixture whose every number is worked out here.

The fixture (window: the 30 days to NOW, 2026-03-01 12:00 UTC):

* tools: ``get_account`` used by ana (ok 10 ms and 20 ms on D1, failed 300 ms on D2), ben
  (ok 40 ms, D2) and cy (ok without a duration, D2); ``run_sql`` by ben (failed 5 ms
  twice, D1) and cy (ok 7 ms, D2); ``old_tool`` by ana 50 days before NOW (outside);
* entities: account:42 by ana (3 accesses) and ben (1), account:7 by ana (1), product:x
  by cy (2);
* domains: royalty by ana (2) and ben (1) on D1 and ana (1) on D2, revenue by cy on D2;
* facts (confidence at their anchor, decayed as ``c * 0.95 ** (days / ease)``): below.

Duration buckets are ``1 + floor(4 * log2(ms))`` and a percentile is reported as the
bucket's geometric middle ``2 ** ((bucket - 0.5) / 4)``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Double, literal, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from coda_memory import MemoryService
from coda_memory.core.model import ObservationType
from coda_memory.ports import ObservationRecord
from coda_memory.postgres import PostgresStore
from coda_memory.postgres.analytics import (
    DomainTrend,
    EntityPopularity,
    FactSummary,
    ToolEffectiveness,
    domain_trends,
    entity_popularity,
    fact_summary,
    rebuild_rollups,
    tool_effectiveness,
)
from coda_memory.postgres.migrate import migrate_async
from coda_memory.postgres.rollup import duration_bucket
from coda_memory.postgres.sql import query
from tests.helpers import FakeClock, domain, tool_failed, tool_ok
from tests.postgres.helpers import NOW, consolidate, fact, fetch, record

D1 = date(2026, 2, 27)
D2 = date(2026, 2, 28)
MONTH = timedelta(days=30)

OK, FAILED = ObservationType.TOOL_SUCCESS, ObservationType.TOOL_FAILURE


def at(day: date, hour: int = 10) -> datetime:
    return datetime(day.year, day.month, day.day, hour, tzinfo=UTC)


def call(
    identity: str, tool: str, ok: bool, when: date | datetime, ms: float | None = None
) -> ObservationRecord:
    metadata: dict[str, Any] = {"toolName": tool}
    if ms is not None:
        metadata["durationMs"] = ms
    return record(
        f"{tool} {'ok' if ok else 'failed'}",
        identity_id=identity,
        type=OK if ok else FAILED,
        metadata=metadata,
        created_at=when if isinstance(when, datetime) else at(when),
    )


def access(identity: str, kind: str, key: str, day: date) -> ObservationRecord:
    return record(
        f"accessed {kind}",
        identity_id=identity,
        type=ObservationType.ENTITY_ACCESS,
        metadata={"entityType": kind, "entityId": key},
        created_at=at(day),
    )


def asked(identity: str, name: str, when: date | datetime) -> ObservationRecord:
    return record(
        f"asked about {name}",
        identity_id=identity,
        type=ObservationType.QUERY_PATTERN,
        metadata={"domain": name, "query": f"{name}?"},
        created_at=when if isinstance(when, datetime) else at(when),
    )


FIXTURE: list[ObservationRecord] = [
    call("ana", "get_account", True, D1, 10),
    call("ana", "get_account", True, D1, 20),
    call("ana", "get_account", False, D2, 300),
    call("ben", "get_account", True, D2, 40),
    call("cy", "get_account", True, D2),
    call("ben", "run_sql", False, D1, 5),
    call("ben", "run_sql", False, D1, 5),
    call("cy", "run_sql", True, D2, 7),
    call("ana", "old_tool", True, NOW - timedelta(days=50), 1000),
    access("ana", "account", "42", D1),
    access("ana", "account", "42", D1),
    access("ana", "account", "42", D2),
    access("ben", "account", "42", D2),
    access("ana", "account", "7", D2),
    access("cy", "product", "x", D1),
    access("cy", "product", "x", D1),
    asked("ana", "royalty", D1),
    asked("ana", "royalty", D1),
    asked("ben", "royalty", D1),
    asked("ana", "royalty", D2),
    asked("cy", "revenue", D2),
]

#: Effective confidences at NOW, worked out by hand.
ANA_AFFINITY = 0.8 * 0.95**2  # 2 days old, no ease: 0.722 (bucket 7)
BEN_AFFINITY = 0.64  # anchored at NOW (bucket 6)
CY_LEGACY = 0.93  # anchored at NOW, a tool nobody called in the window (bucket 9)
# cy's get_account affinity, 0.2 twenty days ago, is 0.2 * 0.95**20 = 0.0717 now: expired.
BEN_AVOIDANCE = 0.5 * 0.95 ** (10 / 2.5)  # 10 days at ease 2.5: 0.4073 (bucket 4)
ANA_ENTITY = 0.55  # (bucket 5)
BEN_ENTITY = 0.7 * 0.95  # 1 day at ease 1.0: 0.665 (bucket 6)
ANA_DOMAIN = 0.35  # (bucket 3)


async def seed_facts(store: PostgresStore) -> None:
    days = timedelta(days=1)
    facts = {
        "ana": [
            fact("tool_affinity:get_account", identity_id="ana", confidence=0.8, at=NOW - 2 * days),
            fact("entity_frequency:account:42", identity_id="ana", confidence=0.55),
            fact("domain_preference:royalty", identity_id="ana", confidence=0.35),
        ],
        "ben": [
            fact("tool_affinity:get_account", identity_id="ben", confidence=0.64, ease_factor=2.0),
            fact(
                "tool_avoidance:run_sql",
                identity_id="ben",
                confidence=0.5,
                at=NOW - 10 * days,
                ease_factor=2.5,
            ),
            fact(
                "entity_frequency:account:42",
                identity_id="ben",
                confidence=0.7,
                at=NOW - days,
                ease_factor=1.0,
            ),
        ],
        "cy": [
            fact("tool_affinity:get_account", identity_id="cy", confidence=0.2, at=NOW - 20 * days),
            fact("tool_affinity:legacy_tool", identity_id="cy", confidence=0.93),
        ],
    }
    for identity, upserts in facts.items():
        await consolidate(store, identity, upserts=upserts)


@pytest.fixture
async def seeded(pg_store: PostgresStore) -> PostgresStore:
    await pg_store.append(FIXTURE[:9])
    await pg_store.append(FIXTURE[9:])
    await seed_facts(pg_store)
    return pg_store


def bucket_ms(bucket: int) -> float:
    return float(2 ** ((bucket - 0.5) / 4))


# get_account: 10 ms -> 4 * log2(10) = 13.3 -> bucket 14; 20 ms -> 17.3 -> 18;
# 40 ms -> 21.3 -> 22; 300 ms -> 32.9 -> 33. Four calls with a duration: the median is the
# 2nd (bucket 18), the 95th percentile the 4th (3.8 rounded up: bucket 33).
GET_ACCOUNT = ToolEffectiveness(
    tool_name="get_account",
    users=3,
    successes=4,
    failures=1,
    success_rate=4 / 5,
    p50_duration_ms=bucket_ms(18),
    p95_duration_ms=bucket_ms(33),
    affinity_users=2,  # cy's affinity has expired
    avoidance_users=0,
    mean_affinity_confidence=(ANA_AFFINITY + BEN_AFFINITY) / 2,
    mean_avoidance_confidence=None,
)
# run_sql: 5 ms -> 9.3 -> bucket 10 (twice); 7 ms -> 11.2 -> bucket 12. Median: the 2nd
# of 3 (1.5 rounded up), bucket 10; 95th: the 3rd (2.85), bucket 12.
RUN_SQL = ToolEffectiveness(
    tool_name="run_sql",
    users=2,
    successes=1,
    failures=2,
    success_rate=1 / 3,
    p50_duration_ms=bucket_ms(10),
    p95_duration_ms=bucket_ms(12),
    affinity_users=0,
    avoidance_users=1,
    mean_affinity_confidence=None,
    mean_avoidance_confidence=BEN_AVOIDANCE,
)
ACCOUNT_42 = EntityPopularity(
    entity_type="account",
    entity_id="42",
    users=2,
    accesses=4,
    fact_users=2,
    mean_confidence=(ANA_ENTITY + BEN_ENTITY) / 2,
)
PRODUCT_X = EntityPopularity(
    entity_type="product", entity_id="x", users=1, accesses=2, fact_users=0, mean_confidence=None
)
ACCOUNT_7 = EntityPopularity(
    entity_type="account", entity_id="7", users=1, accesses=1, fact_users=0, mean_confidence=None
)
TRENDS = [
    DomainTrend(day=D1, domain="royalty", queries=3, users=2),
    DomainTrend(day=D2, domain="revenue", queries=1, users=1),
    DomainTrend(day=D2, domain="royalty", queries=1, users=1),
]


def histogram(*buckets: int) -> list[int]:
    counts = [0] * 10
    for bucket in buckets:
        counts[bucket] += 1
    return counts


SUMMARY = [
    FactSummary(
        category="domain_preference",
        facts=1,
        users=1,
        mean_confidence=ANA_DOMAIN,
        histogram=histogram(3),
    ),
    FactSummary(
        category="entity_frequency",
        facts=2,
        users=2,
        mean_confidence=(ANA_ENTITY + BEN_ENTITY) / 2,
        histogram=histogram(5, 6),
    ),
    FactSummary(
        category="tool_affinity",
        facts=3,
        users=3,
        mean_confidence=(ANA_AFFINITY + BEN_AFFINITY + CY_LEGACY) / 3,
        histogram=histogram(7, 6, 9),
    ),
    FactSummary(
        category="tool_avoidance",
        facts=1,
        users=1,
        mean_confidence=BEN_AVOIDANCE,
        histogram=histogram(4),
    ),
]


def approx(rows: Sequence[Any]) -> list[Any]:
    """Rows as dicts whose floats compare with a relative tolerance."""
    return [
        {
            k: pytest.approx(v, rel=1e-9) if isinstance(v, float) else v
            for k, v in row.model_dump().items()
        }
        for row in rows
    ]


async def test_tool_effectiveness(seeded: PostgresStore) -> None:
    rows = await tool_effectiveness(seeded, min_users=1, now=NOW)

    assert approx(rows) == approx([GET_ACCOUNT, RUN_SQL])
    # The documented error bound: within 2 ** (1/8) of a duration in the bucket.
    for exact, reported in [(20, rows[0].p50_duration_ms), (300, rows[0].p95_duration_ms)]:
        assert reported is not None
        assert 2 ** (-1 / 8) <= reported / exact <= 2 ** (1 / 8)


async def test_entity_popularity(seeded: PostgresStore) -> None:
    rows = await entity_popularity(seeded, min_users=1, now=NOW)

    assert approx(rows) == approx([ACCOUNT_42, PRODUCT_X, ACCOUNT_7])
    limited = await entity_popularity(seeded, min_users=1, now=NOW, limit=2)
    assert approx(limited) == approx([ACCOUNT_42, PRODUCT_X])


async def test_domain_trends(seeded: PostgresStore) -> None:
    assert await domain_trends(seeded, min_users=1, now=NOW) == TRENDS
    # A window of one day (in whole UTC days: D2 and NOW's day) keeps D2 only.
    one_day = await domain_trends(seeded, since=timedelta(days=1), min_users=1, now=NOW)
    assert one_day == TRENDS[1:]


async def test_fact_summary(seeded: PostgresStore) -> None:
    rows = await fact_summary(seeded, min_users=1, now=NOW)

    assert approx(rows) == approx(SUMMARY)
    # Ten days on, without reinforcement: 0.35 * 0.95**10 = 0.2095 (bucket 2), ...
    later = await fact_summary(seeded, min_users=1, now=NOW + timedelta(days=10))
    domains = next(r for r in later if r.category == "domain_preference")
    assert domains.histogram == histogram(2)
    assert domains.mean_confidence == pytest.approx(0.35 * 0.95**10)


async def test_facts_decayed_past_what_a_float_holds_are_expired(seeded: PostgresStore) -> None:
    """``0.95 ** (days / ease)`` leaves the floats past an exponent of about 14,500, where
    Postgres's power() fails with "underflow": 40 years on at ease 1, two years on at the
    0.05-day stability that PowerLawDecay keeps as the ease, or 150 days on at an ease of
    0.01 as here. One such fact in the table made every view that decays facts fail, for
    every analyst."""
    functions = (tool_effectiveness, entity_popularity, fact_summary)
    before = [await function(seeded, min_users=1, now=NOW) for function in functions]
    slow_to_learn = fact(
        "tool_affinity:get_account",
        identity_id="dee",
        confidence=1.0,
        at=NOW - timedelta(days=150),
        ease_factor=0.01,
    )
    await consolidate(seeded, "dee", upserts=[slow_to_learn])
    # An ease so small that days / ease leaves the floats ("overflow"), as an import may
    # bring: expired as well.
    subnormal = fact(
        "tool_affinity:get_account",
        identity_id="eve",
        confidence=1.0,
        at=NOW - timedelta(days=1),
        ease_factor=5e-324,
    )
    await consolidate(seeded, "eve", upserts=[subnormal])

    # Expired: it changes nothing.
    assert [await function(seeded, min_users=1, now=NOW) for function in functions] == before
    active = await view(seeded, "SELECT identity_id FROM coda_memory.active_facts")
    assert {row["identity_id"] for row in active}.isdisjoint({"dee", "eve"})
    # Forty years on, every fact has expired and the window holds no usage.
    later = NOW + timedelta(days=40 * 365)
    assert [await function(seeded, min_users=1, now=later) for function in functions] == [
        [],
        [],
        [],
    ]
    for name in ("active_facts", "tool_effectiveness", "entity_popularity", "fact_summary"):
        assert await view(seeded, f"SELECT * FROM coda_memory.{name}", now=later) == []


async def test_rows_behind_fewer_than_min_users_are_hidden(seeded: PostgresStore) -> None:
    tools = await tool_effectiveness(seeded, min_users=2, now=NOW)
    assert [t.tool_name for t in tools] == ["get_account", "run_sql"]
    # run_sql's avoidance confidence is one identity's: withheld.
    assert tools[1].avoidance_users == 1
    assert tools[1].mean_avoidance_confidence is None
    assert tools[0].mean_affinity_confidence == pytest.approx(GET_ACCOUNT.mean_affinity_confidence)

    # run_sql (2 users) disappears at 3; get_account (3 users) at 4.
    assert [t.tool_name for t in await tool_effectiveness(seeded, min_users=3, now=NOW)] == [
        "get_account"
    ]
    assert await tool_effectiveness(seeded, min_users=4, now=NOW) == []
    assert await tool_effectiveness(seeded, now=NOW) == []  # the default is 5

    assert [e.entity_id for e in await entity_popularity(seeded, min_users=2, now=NOW)] == ["42"]
    assert await domain_trends(seeded, min_users=2, now=NOW) == TRENDS[:1]
    summary = await fact_summary(seeded, min_users=2, now=NOW)
    assert [s.category for s in summary] == ["entity_frequency", "tool_affinity"]


@pytest.mark.parametrize(
    ("call_with", "message"),
    [
        ({"since": timedelta(0)}, "since"),
        ({"since": timedelta(days=-1)}, "since"),
        ({"since": timedelta(days=1, hours=12)}, "whole number of days"),
        ({"min_users": 0}, "min_users"),
        ({"min_users": True}, "min_users"),
        ({"limit": 0}, "limit"),
        # The statements take them as a bigint: one more failed in the driver.
        ({"min_users": 2**63}, "min_users"),
        ({"limit": 2**63}, "limit"),
        # Past Postgres's timestamps ("timestamp out of range").
        ({"since": timedelta(days=999_999_999)}, "at most 36,500 days"),
    ],
)
async def test_arguments_are_checked(
    pg_store: PostgresStore, call_with: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        await entity_popularity(pg_store, **call_with)


async def test_a_naive_now_is_refused(pg_store: PostgresStore) -> None:
    with pytest.raises(ValueError, match="timezone"):
        await tool_effectiveness(pg_store, now=datetime(2026, 3, 1))
    with pytest.raises(ValueError, match="min_users"):
        await fact_summary(pg_store, min_users=0)


# -- the views ------------------------------------------------------------------------


async def view(
    store: PostgresStore, sql: str, now: datetime | None = NOW, since: str = ""
) -> list[dict[str, Any]]:
    """Rows of ``sql`` with the views' settings set for its transaction, as an analyst
    would (SET LOCAL), through the store's engine."""
    async with store.engine.connect() as conn:
        await conn.execute(
            text(
                "SELECT set_config('coda_memory.analytics_now', :now, true), "
                "set_config('coda_memory.analytics_window', :since, true)"
            ),
            {"now": "" if now is None else now.isoformat(), "since": since},
        )
        result = await conn.execute(text(sql))
        return [dict(row) for row in result.mappings()]


async def test_the_views_give_the_same_numbers(seeded: PostgresStore) -> None:
    tools = await view(seeded, "SELECT * FROM coda_memory.tool_effectiveness ORDER BY tool_name")
    # The view hides nothing: a tool known only from an active affinity fact is there.
    legacy = ToolEffectiveness(
        tool_name="legacy_tool",
        users=0,
        successes=0,
        failures=0,
        success_rate=None,
        p50_duration_ms=None,
        p95_duration_ms=None,
        affinity_users=1,
        avoidance_users=0,
        mean_affinity_confidence=CY_LEGACY,
        mean_avoidance_confidence=None,
    )
    assert approx([ToolEffectiveness(**t) for t in tools]) == approx([GET_ACCOUNT, legacy, RUN_SQL])

    entities = await view(
        seeded, "SELECT * FROM coda_memory.entity_popularity ORDER BY users DESC, accesses DESC"
    )
    assert approx([EntityPopularity(**e) for e in entities]) == approx(
        [ACCOUNT_42, PRODUCT_X, ACCOUNT_7]
    )
    trends = await view(seeded, "SELECT * FROM coda_memory.domain_trends ORDER BY day, domain")
    assert [DomainTrend(**t) for t in trends] == TRENDS
    summary = await view(seeded, "SELECT * FROM coda_memory.fact_summary ORDER BY category")
    assert approx([FactSummary(**s) for s in summary]) == approx(SUMMARY)

    active = await view(
        seeded,
        "SELECT identity_id, subject, effective_confidence FROM coda_memory.active_facts "
        "ORDER BY identity_id, subject",
    )
    assert [(a["identity_id"], a["subject"]) for a in active] == [
        ("ana", "domain_preference:royalty"),
        ("ana", "entity_frequency:account:42"),
        ("ana", "tool_affinity:get_account"),
        ("ben", "entity_frequency:account:42"),
        ("ben", "tool_affinity:get_account"),
        ("ben", "tool_avoidance:run_sql"),
        ("cy", "tool_affinity:legacy_tool"),
    ]
    assert [a["effective_confidence"] for a in active] == pytest.approx(
        [ANA_DOMAIN, ANA_ENTITY, ANA_AFFINITY, BEN_ENTITY, BEN_AFFINITY, BEN_AVOIDANCE, CY_LEGACY]
    )


async def test_the_views_default_to_now_and_30_days(seeded: PostgresStore) -> None:
    window = await view(seeded, "SELECT * FROM coda_memory.analytics_window", now=None)
    today = datetime.now(UTC).date()
    assert window[0]["since"] == MONTH
    assert window[0]["end_day"] == today
    assert window[0]["start_day"] == today - MONTH
    # The fixture is in 2026-02; the default window is the real last 30 days.
    assert await view(seeded, "SELECT * FROM coda_memory.domain_trends", now=None) == []

    moved = await view(seeded, "SELECT * FROM coda_memory.analytics_window", since="90 days")
    assert moved[0]["start_day"] == date(2025, 12, 1)
    assert moved[0]["end_day"] == date(2026, 3, 1)


async def test_now_defaults_to_the_database_clock(pg_store: PostgresStore) -> None:
    recent = datetime.now(UTC) - timedelta(minutes=5)
    await pg_store.append(
        [call("ana", "get_account", True, recent, 15), asked("ana", "royalty", recent)]
    )

    tools = await tool_effectiveness(pg_store, min_users=1)
    trends = await domain_trends(pg_store, min_users=1)

    assert [(t.tool_name, t.users, t.successes) for t in tools] == [("get_account", 1, 1)]
    assert [(t.day, t.queries) for t in trends] == [(recent.date(), 1)]


async def test_now_means_the_same_instant_whatever_the_sessions_date_style(pg_url: str) -> None:
    """``now`` reached the views as text written in the session's DateStyle: with a zone
    abbreviation that Postgres reads back as another zone (IST: Israel, not India), the
    window moved by hours, here a day that began after ``now``."""
    store = PostgresStore.from_url(pg_url)
    await store.append(
        [call(f"u{i}", "nov1", True, datetime(2026, 11, 1, 12, tzinfo=UTC)) for i in range(2)]
        + [call(f"v{i}", "nov2", True, datetime(2026, 11, 2, 2, tzinfo=UTC)) for i in range(2)]
    )
    await store.close()
    database = (await fetch(pg_url, "SELECT current_database()"))[0][0]
    await fetch(pg_url, f"ALTER DATABASE \"{database}\" SET DateStyle = 'Postgres, DMY'")
    await fetch(pg_url, f"ALTER DATABASE \"{database}\" SET TimeZone = 'Asia/Kolkata'")
    store = PostgresStore.from_url(pg_url)  # connections that take the settings
    try:
        now = datetime(2026, 11, 1, 21, tzinfo=UTC)
        tools = await tool_effectiveness(store, now=now, since=timedelta(days=1), min_users=1)
    finally:
        await store.close()
    assert [(t.tool_name, t.users) for t in tools] == [("nov1", 2)]


# -- history beyond raw retention -----------------------------------------------------


async def test_a_90_day_trend_survives_the_pruning_of_its_observations(pg_url: str) -> None:
    clock = FakeClock(datetime(2026, 1, 1, 9, 0, tzinfo=UTC))
    service = MemoryService.from_url(pg_url, clock=clock, load_timeout=5.0)
    try:
        store = service.store
        assert isinstance(store, PostgresStore)
        first_day = clock.now.date()
        for identity in ("ana", "ben"):
            service.emit_observation(identity, tool_ok("get_account"))
            service.emit_observation(identity, domain("royalty"))
        service.emit_observation("ben", tool_failed("get_account"))
        await service.drain()
        await service.consolidate("ana")
        await service.consolidate("ben")

        clock.advance(days=60)
        service.emit_observation("ana", domain("royalty"))
        await service.drain()
        await service.consolidate("ana")
        await service.consolidate("ben")

        # Consolidation pruned the 60-day-old observations (retention: 7 days) ...
        assert [o.created_at for o in await store.observations("ana")] == [clock.now]
        assert await store.observations("ben") == []
        # ... but the 90-day numbers still count them.
        quarter = timedelta(days=90)
        trends = await domain_trends(store, since=quarter, min_users=1, now=clock.now)
        assert trends == [
            DomainTrend(day=first_day, domain="royalty", queries=2, users=2),
            DomainTrend(day=clock.now.date(), domain="royalty", queries=1, users=1),
        ]
        tools = await tool_effectiveness(store, since=quarter, min_users=1, now=clock.now)
        assert [(t.tool_name, t.users, t.successes, t.failures) for t in tools] == [
            ("get_account", 2, 2, 1)
        ]
        # The helpers' calls take 12.5 ms (bucket 15) and 40 ms (bucket 22).
        assert tools[0].p50_duration_ms == pytest.approx(bucket_ms(15))
        assert tools[0].p95_duration_ms == pytest.approx(bucket_ms(22))
        # A 30-day window no longer reaches them.
        assert await tool_effectiveness(store, min_users=1, now=clock.now) == []
    finally:
        await service.close()


# -- what the rollup counts -----------------------------------------------------------


#: Each rollup table's key, and its counts summed over shards, for :func:`rollup_rows`.
ROLLUP_COLUMNS = {
    "tool_daily": (
        "day, tool_name",
        "sum(successes)::int, sum(failures)::int, sum(latest_users)::int",
    ),
    "tool_durations": ("day, tool_name, bucket", "sum(calls)::int"),
    "entity_daily": (
        "day, entity_type, entity_id",
        "sum(accesses)::int, sum(latest_users)::int",
    ),
    "domain_daily": ("day, domain", "sum(queries)::int, sum(users)::int"),
    "tool_users": ("identity_id, tool_name, last_day", "count(*)::int"),
    "entity_users": ("identity_id, entity_type, entity_id, last_day", "count(*)::int"),
    "domain_users": ("identity_id, domain, day", "count(*)::int"),
}


async def rollup_rows(store: PostgresStore, table: str) -> list[tuple[Any, ...]]:
    """A rollup table's rows with the shards summed away, in key order."""
    group, counts = ROLLUP_COLUMNS[table]
    # Every name comes from ROLLUP_COLUMNS above.
    sql = f"SELECT {group}, {counts} FROM coda_memory.{table} GROUP BY {group} ORDER BY {group}"
    return await fetch(store.engine.url.render_as_string(hide_password=False), sql)


async def test_refused_rows_are_not_counted(pg_store: PostgresStore) -> None:
    batch = [
        call("ana", "get_account", True, D1, 10),
        record("nul \x00 byte", identity_id="ana", metadata={"toolName": "get_account"}),
        call("ben", "get_account", False, D1, 20),
        record(
            "jsonb refuses \\u0000",
            identity_id="cy",
            type=ObservationType.QUERY_PATTERN,
            metadata={"domain": "royalty", "note": "a\x00b"},
        ),
        asked("ana", "royalty", D1),
        record(
            "lone \udc80 surrogate",
            identity_id="dee",
            type=ObservationType.ENTITY_ACCESS,
            metadata={"entityType": "account", "entityId": "1"},
        ),
        access("ana", "account", "1", D1),
    ]

    outcome = await pg_store.append(batch)

    assert [index for index, _ in outcome.refused] == [1, 3, 5]
    assert await rollup_rows(pg_store, "tool_daily") == [(D1, "get_account", 1, 1, 2)]
    assert await rollup_rows(pg_store, "domain_daily") == [(D1, "royalty", 1, 1)]
    assert await rollup_rows(pg_store, "entity_daily") == [(D1, "account", "1", 1, 1)]
    assert await rollup_rows(pg_store, "tool_users") == [
        ("ana", "get_account", D1, 1),
        ("ben", "get_account", D1, 1),
    ]
    assert await rollup_rows(pg_store, "domain_users") == [("ana", "royalty", D1, 1)]
    assert await rollup_rows(pg_store, "entity_users") == [("ana", "account", "1", D1, 1)]


async def test_rows_without_a_usable_key_are_not_counted(pg_store: PostgresStore) -> None:
    await pg_store.append(
        [
            record("no tool name", metadata={"durationMs": 3}, created_at=at(D1)),
            record("long", metadata={"toolName": "t" * 201}, created_at=at(D1)),
            record(
                "text duration", metadata={"toolName": "t", "durationMs": "9"}, created_at=at(D1)
            ),
            record("no domain", type=ObservationType.QUERY_PATTERN, created_at=at(D1)),
            # Not sanitised: too large for a float; counted in the last bucket.
            record("huge", metadata={"toolName": "u", "durationMs": 10**400}, created_at=at(D1)),
        ]
    )

    assert await rollup_rows(pg_store, "tool_daily") == [(D1, "t", 1, 0, 1), (D1, "u", 1, 0, 1)]
    assert await rollup_rows(pg_store, "tool_durations") == [(D1, "u", 127, 1)]
    assert await rollup_rows(pg_store, "domain_daily") == []


async def test_latest_days_move_forward_only(pg_store: PostgresStore) -> None:
    await pg_store.append([call("ana", "t", True, D2), access("ana", "account", "1", D2)])
    # A late observation of an earlier day is counted, but ana's latest day stays D2.
    await pg_store.append([call("ana", "t", True, D1), access("ana", "account", "1", D1)])
    assert await rollup_rows(pg_store, "tool_daily") == [(D1, "t", 1, 0, 0), (D2, "t", 1, 0, 1)]
    assert await rollup_rows(pg_store, "entity_daily") == [
        (D1, "account", "1", 1, 0),
        (D2, "account", "1", 1, 1),
    ]

    later = D2 + timedelta(days=1)
    await pg_store.append([call("ana", "t", True, later), access("ana", "account", "1", later)])
    assert await rollup_rows(pg_store, "tool_daily") == [
        (D1, "t", 1, 0, 0),
        (D2, "t", 1, 0, 0),
        (later, "t", 1, 0, 1),
    ]
    assert await rollup_rows(pg_store, "tool_users") == [("ana", "t", later, 1)]
    assert await rollup_rows(pg_store, "entity_daily") == [
        (D1, "account", "1", 1, 0),
        (D2, "account", "1", 1, 0),
        (later, "account", "1", 1, 1),
    ]


async def test_forget_removes_the_identitys_rollup_rows_only(seeded: PostgresStore) -> None:
    await seeded.forget("ben")

    for table in ("tool_users", "entity_users", "domain_users"):
        identities = {row[0] for row in await rollup_rows(seeded, table)}
        assert identities == {"ana", "cy"}, table
    # Anonymous counts stay; ben is out of the user counts.
    tools = {t.tool_name: t for t in await tool_effectiveness(seeded, min_users=1, now=NOW)}
    assert (tools["get_account"].users, tools["get_account"].successes) == (2, 4)
    assert (tools["get_account"].failures, tools["run_sql"].failures) == (1, 2)
    assert (tools["run_sql"].users, tools["run_sql"].successes) == (1, 1)
    assert tools["run_sql"].avoidance_users == 0  # ben's facts are gone too
    entities = await entity_popularity(seeded, min_users=1, now=NOW)
    assert [(e.entity_id, e.users, e.accesses) for e in entities] == [
        ("42", 1, 4),
        ("x", 1, 2),
        ("7", 1, 1),
    ]
    trends = await domain_trends(seeded, min_users=1, now=NOW)
    assert [(t.day, t.domain, t.queries, t.users) for t in trends] == [
        (D1, "royalty", 3, 1),
        (D2, "revenue", 1, 1),
        (D2, "royalty", 1, 1),
    ]

    # Coming back counts ben once again.
    await seeded.append([asked("ben", "royalty", D1), call("ben", "run_sql", True, D2)])
    trends = await domain_trends(seeded, min_users=1, now=NOW)
    assert (trends[0].queries, trends[0].users) == (4, 2)
    tools = {t.tool_name: t for t in await tool_effectiveness(seeded, min_users=1, now=NOW)}
    assert (tools["run_sql"].users, tools["run_sql"].successes) == (2, 2)


async def test_concurrent_appends_do_not_deadlock_and_add_up(pg_url: str) -> None:
    identities = [f"user-{n}" for n in range(12)]
    tools = ["alpha", "beta", "gamma", "delta"]
    days = [D1, D2]

    def batch(seed: int) -> list[ObservationRecord]:
        # Every batch touches every tool, domain and entity, in its own order.
        rows: list[ObservationRecord] = []
        for n in range(40):
            identity = identities[(seed * 7 + n * 5) % len(identities)]
            day = days[(seed + n) % 2]
            tool = tools[(seed + n // 2) % len(tools)]
            rows.append(call(identity, tool, n % 4 != 0, day, 1.0 + n))
            rows.append(asked(identity, tools[(seed + n) % len(tools)], day))
            rows.append(access(identity, "account", str((seed + n) % 5), day))
        return rows[::-1] if seed % 2 else rows

    batches = [batch(seed) for seed in range(24)]
    stores = [PostgresStore.from_url(pg_url, pool_size=3) for _ in range(6)]
    try:
        outcomes = await asyncio.wait_for(
            asyncio.gather(
                *(stores[i % len(stores)].append(rows) for i, rows in enumerate(batches))
            ),
            timeout=120,
        )
        assert all(o.stored == 120 and not o.refused for o in outcomes)
        everything = [row for rows in batches for row in rows]

        tool_calls = [r for r in everything if r.type in (OK, FAILED)]
        latest: dict[tuple[str, str], date] = {}
        for r in tool_calls:
            key = (r.identity_id, r.metadata["toolName"])
            latest[key] = max(latest.get(key, r.created_at.date()), r.created_at.date())
        store = stores[0]
        daily = await rollup_rows(store, "tool_daily")
        assert {(day, tool) for day, tool, *_ in daily} == {(d, t) for d in days for t in tools}
        for day, tool, successes, failures, latest_users in daily:
            mine = [
                r
                for r in tool_calls
                if r.metadata["toolName"] == tool and r.created_at.date() == day
            ]
            assert successes == sum(r.type is OK for r in mine)
            assert failures == sum(r.type is FAILED for r in mine)
            assert latest_users == sum(d == day for (_, t), d in latest.items() if t == tool)
        durations = await rollup_rows(store, "tool_durations")
        assert sum(row[-1] for row in durations) == len(tool_calls)

        queries = [r for r in everything if r.type is ObservationType.QUERY_PATTERN]
        for day, name, count, users in await rollup_rows(store, "domain_daily"):
            mine = [
                r for r in queries if r.metadata["domain"] == name and r.created_at.date() == day
            ]
            assert count == len(mine)
            assert users == len({r.identity_id for r in mine})

        accesses = [r for r in everything if r.type is ObservationType.ENTITY_ACCESS]
        entity_rows = await rollup_rows(store, "entity_daily")
        assert sum(row[3] for row in entity_rows) == len(accesses)
        per_entity = {
            key: len({r.identity_id for r in accesses if r.metadata["entityId"] == key})
            for key in {r.metadata["entityId"] for r in accesses}
        }
        for key, users in per_entity.items():
            assert sum(row[4] for row in entity_rows if row[2] == key) == users
    finally:
        for store in stores:
            await store.close()


# -- rebuilding, and the migration's backfill -----------------------------------------


async def test_rebuild_recomputes_the_same_numbers(seeded: PostgresStore) -> None:
    before = {
        table: await rollup_rows(seeded, table)
        for table in ("tool_daily", "tool_durations", "entity_daily", "domain_daily")
    }

    await rebuild_rollups(seeded)

    for table, rows in before.items():
        assert await rollup_rows(seeded, table) == rows, table
    assert approx(await tool_effectiveness(seeded, min_users=1, now=NOW)) == approx(
        [GET_ACCOUNT, RUN_SQL]
    )


async def test_upgrading_a_live_database_backfills_the_rollup(empty_pg_url: str) -> None:
    await migrate_async(empty_pg_url, revision="0001")
    url = empty_pg_url
    for row in FIXTURE:
        await fetch(
            url,
            "INSERT INTO coda_memory.observations "
            "(identity_id, type, content, metadata, session_id, created_at) "
            "VALUES (:identity, :type, :content, CAST(:metadata AS jsonb), NULL, :at)",
            identity=row.identity_id,
            type=row.type.value,
            content=row.content,
            metadata=json.dumps(row.metadata),
            at=row.created_at,
        )

    await migrate_async(empty_pg_url)

    store = PostgresStore.from_url(empty_pg_url)
    try:
        await seed_facts(store)
        assert approx(await tool_effectiveness(store, min_users=1, now=NOW)) == approx(
            [GET_ACCOUNT, RUN_SQL]
        )
        entities = await entity_popularity(store, min_users=1, now=NOW)
        assert approx(entities) == approx([ACCOUNT_42, PRODUCT_X, ACCOUNT_7])
        assert await domain_trends(store, min_users=1, now=NOW) == TRENDS
        quarter = await tool_effectiveness(store, since=timedelta(days=90), min_users=1, now=NOW)
        assert [(t.tool_name, t.users, t.successes) for t in quarter] == [
            ("get_account", 3, 4),
            ("run_sql", 2, 1),
            ("old_tool", 1, 1),
        ]
        # 1000 ms: 4 * log2(1000) = 39.9 -> bucket 40.
        assert quarter[2].p50_duration_ms == pytest.approx(bucket_ms(40))
    finally:
        await store.close()


async def test_the_duration_buckets(pg_store: PostgresStore) -> None:
    # Below 1 ms: 0; else 1 + floor(4 * log2(ms)), at most 127.
    expected = {0.0: 0, 0.99: 0, 1.0: 1, 1.2: 2, 10.0: 14, 300.0: 33, 1e7: 94, 1e12: 127}
    async with pg_store.engine.connect() as conn:
        for ms, bucket in expected.items():
            value = literal(ms, Double)
            assert (await conn.execute(select(duration_bucket(value)))).scalar_one() == bucket


async def test_analytics_in_a_custom_schema(empty_pg_url: str) -> None:
    await migrate_async(empty_pg_url, schema="tenant_one")
    store = PostgresStore.from_url(empty_pg_url, schema="tenant_one")
    try:
        await store.append(FIXTURE)
        await seed_facts(store)

        assert approx(await tool_effectiveness(store, min_users=1, now=NOW)) == approx(
            [GET_ACCOUNT, RUN_SQL]
        )
        assert approx(await fact_summary(store, min_users=1, now=NOW)) == approx(SUMMARY)
    finally:
        await store.close()
    views = await fetch(
        empty_pg_url,
        "SELECT table_schema, count(*) FROM information_schema.views "
        "WHERE table_schema LIKE 'tenant%' OR table_schema = 'coda_memory' GROUP BY 1",
    )
    assert views == [("tenant_one", 7)]


async def test_the_analytics_settings_turn_jit_off_for_their_transaction_only(
    seeded: PostgresStore,
) -> None:
    # On a server built with JIT, the plan of fact_summary over a million facts costs
    # enough to be compiled, which took longer than it saved (806 ms against 513 ms).
    settings = query("analytics_settings", seeded.schema)
    window = {"now": None, "since": timedelta(days=30)}

    async def read(conn: AsyncConnection) -> tuple[str, str]:
        await conn.exec_driver_sql(settings.text, tuple(settings.arguments_from(window)))
        inside = (await conn.exec_driver_sql("SHOW jit")).scalar_one()
        await conn.commit()
        after = (await conn.exec_driver_sql("SHOW jit")).scalar_one()
        return inside, after

    assert await seeded.run(read) == ("off", "on")
