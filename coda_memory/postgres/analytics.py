"""Cross-user analytics: tool effectiveness, entity popularity, domain trends, fact summary.

Every number comes from the views migration 0002 creates in the store's schema, so an
analyst's ad-hoc SQL and these functions agree:

* ``tool_effectiveness``, ``entity_popularity`` and ``domain_trends`` read the usage
  rollup (:mod:`coda_memory.postgres.rollup`, which explains its design), written
  with the observations it counts, so a 90-day trend still answers after raw observations
  are pruned;
* ``fact_summary`` and the fact columns count active facts, as ``active_facts`` lists
  them: facts whose effective confidence is at least 0.1, decayed as the default
  ``ExponentialDecay`` and ``AdaptiveDecay`` do (``confidence * 0.95 ^ (days /
  coalesce(ease_factor, 1))``); a service configured with other decay parameters is not
  reflected;
* ``analytics_window`` holds the instant and the window. A view takes no parameters, so
  the views read them from two settings, ``coda_memory.analytics_now`` (default
  ``now()``) and ``coda_memory.analytics_window`` (default 30 days); each function sets
  them for its own transaction only, then filters, orders and limits the view's rows
  (``entity_popularity`` looks up the facts of its top entities only).

The window is ``[now - since, now]`` in whole UTC days, both ends included. ``users`` of
tools and entities counts the identities whose latest use falls in the window: the
distinct users of the window whenever it ends at the latest data, as a window ending now
does (for a window in the past, identities that came back later are not counted).

Cross-tenant aggregates are k-anonymous: a row behind fewer than ``min_users`` distinct
identities is left out, and a mean over fewer than ``min_users`` identities (the affinity
and avoidance confidences of a tool, the fact confidence of an entity) is None. The views
themselves apply no threshold; analysts filter on ``users``.

:func:`rebuild_rollups` recomputes the rollup from the stored observations, for data
loaded in bulk without :meth:`~coda_memory.postgres.PostgresStore.append`.
"""

from __future__ import annotations

from datetime import date, datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy import (
    BigInteger,
    Column,
    ColumnElement,
    Date,
    DateTime,
    Double,
    Interval,
    MetaData,
    Table,
    Text,
    bindparam,
    case,
    cast,
    func,
    literal,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.selectable import Select

from coda_memory.core.model import as_utc
from coda_memory.postgres import rollup
from coda_memory.postgres.schema import DEFAULT_SCHEMA
from coda_memory.postgres.store import PostgresStore

DEFAULT_WINDOW = timedelta(days=30)
DEFAULT_MIN_USERS = 5
DEFAULT_LIMIT = 100

#: The views migration 0002 creates: the four answers, and the two they build on
#: (``active_facts`` lists facts, so read it for an identity or a category).
VIEWS = (
    "tool_effectiveness",
    "entity_popularity",
    "domain_trends",
    "fact_summary",
    "active_facts",
    "analytics_window",
)

#: The settings the views read their instant and window from.
NOW_SETTING = "coda_memory.analytics_now"
WINDOW_SETTING = "coda_memory.analytics_window"


class ToolEffectiveness(BaseModel):
    """One tool: usage in the window and the active affinity/avoidance facts about it."""

    model_config = ConfigDict(frozen=True)

    tool_name: str
    users: int
    successes: int
    failures: int
    success_rate: float | None
    p50_duration_ms: float | None
    p95_duration_ms: float | None
    affinity_users: int
    avoidance_users: int
    mean_affinity_confidence: float | None
    mean_avoidance_confidence: float | None


class EntityPopularity(BaseModel):
    """One entity: accesses in the window and the active facts about it."""

    model_config = ConfigDict(frozen=True)

    entity_type: str
    entity_id: str
    users: int
    accesses: int
    fact_users: int
    mean_confidence: float | None


class DomainTrend(BaseModel):
    """Queries about one domain on one UTC day."""

    model_config = ConfigDict(frozen=True)

    day: date
    domain: str
    queries: int
    users: int


class FactSummary(BaseModel):
    """Active facts of one category; ``histogram[i]`` counts effective confidences in
    ``[i/10, (i+1)/10)``, the last bucket including 1.0."""

    model_config = ConfigDict(frozen=True)

    category: str
    facts: int
    users: int
    mean_confidence: float | None
    histogram: list[int]


# The views' columns (a MetaData of their own: they are not tables to create).
_views = MetaData(schema=DEFAULT_SCHEMA)

_tool_view = Table(
    "tool_effectiveness",
    _views,
    Column("tool_name", Text),
    Column("users", BigInteger),
    Column("successes", BigInteger),
    Column("failures", BigInteger),
    Column("success_rate", Double),
    Column("p50_duration_ms", Double),
    Column("p95_duration_ms", Double),
    Column("affinity_users", BigInteger),
    Column("avoidance_users", BigInteger),
    Column("mean_affinity_confidence", Double),
    Column("mean_avoidance_confidence", Double),
)
_entity_view = Table(
    "entity_popularity",
    _views,
    Column("entity_type", Text),
    Column("entity_id", Text),
    Column("users", BigInteger),
    Column("accesses", BigInteger),
    Column("fact_users", BigInteger),
    Column("mean_confidence", Double),
)
_domain_view = Table(
    "domain_trends",
    _views,
    Column("day", Date),
    Column("domain", Text),
    Column("queries", BigInteger),
    Column("users", BigInteger),
)
_active_facts = Table(
    "active_facts",
    _views,
    Column("identity_id", Text),
    Column("subject", Text),
    Column("category", Text),
    Column("effective_confidence", Double),
)
_fact_view = Table(
    "fact_summary",
    _views,
    Column("category", Text),
    Column("facts", BigInteger),
    Column("users", BigInteger),
    Column("mean_confidence", Double),
    Column("histogram", ARRAY(BigInteger)),
)


def _check(since: timedelta, min_users: int, limit: int = DEFAULT_LIMIT) -> None:
    if not isinstance(since, timedelta) or since <= timedelta(0):
        raise ValueError(f"since must be a positive timedelta, not {since!r}")
    if isinstance(min_users, bool) or not isinstance(min_users, int) or min_users < 1:
        raise ValueError(f"min_users must be an integer of at least 1, not {min_users!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be an integer of at least 1, not {limit!r}")


def _withheld(mean: ColumnElement[Any], users: ColumnElement[Any], min_users: int) -> Any:
    """``mean``, or NULL when fewer than ``min_users`` identities are behind it."""
    return case((users >= bindparam("min_users", min_users), mean), else_=None)


async def _fetch(
    store: PostgresStore, statement: Select[Any], since: timedelta, now: datetime | None
) -> list[RowMapping]:
    """Run ``statement`` with the views' instant and window set for its transaction."""
    instant: ColumnElement[Any] = (
        literal("", Text)
        if now is None
        else cast(bindparam("now", as_utc(now), DateTime(timezone=True)), Text)
    )
    window = cast(bindparam("since", since, Interval()), Text)
    settings = select(
        func.set_config(NOW_SETTING, instant, True),
        func.set_config(WINDOW_SETTING, window, True),
    )

    async def read(conn: AsyncConnection) -> list[RowMapping]:
        await conn.execute(settings)
        result = await conn.execute(statement)
        return list(result.mappings())

    return await store.run(read)


async def tool_effectiveness(
    store: PostgresStore,
    *,
    since: timedelta = DEFAULT_WINDOW,
    min_users: int = DEFAULT_MIN_USERS,
    now: datetime | None = None,
) -> list[ToolEffectiveness]:
    """Tools used by at least ``min_users`` identities in the window, most used first."""
    _check(since, min_users)
    view = _tool_view
    statement = (
        select(
            *(
                view.c[name]
                for name in (
                    "tool_name",
                    "users",
                    "successes",
                    "failures",
                    "success_rate",
                    "p50_duration_ms",
                    "p95_duration_ms",
                    "affinity_users",
                    "avoidance_users",
                )
            ),
            _withheld(view.c.mean_affinity_confidence, view.c.affinity_users, min_users).label(
                "mean_affinity_confidence"
            ),
            _withheld(view.c.mean_avoidance_confidence, view.c.avoidance_users, min_users).label(
                "mean_avoidance_confidence"
            ),
        )
        .where(view.c.users >= bindparam("min_users", min_users))
        .order_by(view.c.users.desc(), view.c.tool_name)
    )
    rows = await _fetch(store, statement, since, now)
    return [ToolEffectiveness.model_validate(dict(row)) for row in rows]


def _entity_order(rows: Any) -> list[Any]:
    return [rows.c.users.desc(), rows.c.accesses.desc(), rows.c.entity_type, rows.c.entity_id]


async def entity_popularity(
    store: PostgresStore,
    *,
    since: timedelta = DEFAULT_WINDOW,
    min_users: int = DEFAULT_MIN_USERS,
    now: datetime | None = None,
    limit: int = DEFAULT_LIMIT,
) -> list[EntityPopularity]:
    """The ``limit`` entities accessed by the most identities in the window (then by
    accesses), among those accessed by at least ``min_users``."""
    _check(since, min_users, limit)
    view = _entity_view
    # The top entities first, from the view's usage columns alone (the planner then
    # leaves its fact aggregation out), and their facts afterwards: ``limit`` index
    # lookups instead of aggregating every entity fact.
    top = (
        select(view.c.entity_type, view.c.entity_id, view.c.users, view.c.accesses)
        .where(view.c.users >= bindparam("min_users", min_users))
        .order_by(*_entity_order(view))
        .limit(bindparam("limit", limit))
        .subquery("top")
    )
    active = _active_facts
    subject = "entity_frequency:" + top.c.entity_type + ":" + top.c.entity_id
    held = (
        select(
            func.count().label("fact_users"),
            func.avg(active.c.effective_confidence).label("mean_confidence"),
        )
        .where(active.c.category == "entity_frequency", active.c.subject == subject)
        .lateral("held")
    )
    statement = (
        select(
            top,
            held.c.fact_users,
            _withheld(held.c.mean_confidence, held.c.fact_users, min_users).label(
                "mean_confidence"
            ),
        )
        .select_from(top.join(held, true()))
        .order_by(*_entity_order(top))
    )
    rows = await _fetch(store, statement, since, now)
    return [EntityPopularity.model_validate(dict(row)) for row in rows]


async def domain_trends(
    store: PostgresStore,
    *,
    since: timedelta = DEFAULT_WINDOW,
    min_users: int = DEFAULT_MIN_USERS,
    now: datetime | None = None,
) -> list[DomainTrend]:
    """Queries per UTC day and domain in the window, by day and domain; a day's domain
    asked about by fewer than ``min_users`` identities is left out."""
    _check(since, min_users)
    view = _domain_view
    statement = (
        select(view)
        .where(view.c.users >= bindparam("min_users", min_users))
        .order_by(view.c.day, view.c.domain)
    )
    rows = await _fetch(store, statement, since, now)
    return [DomainTrend.model_validate(dict(row)) for row in rows]


async def fact_summary(
    store: PostgresStore,
    *,
    min_users: int = DEFAULT_MIN_USERS,
    now: datetime | None = None,
) -> list[FactSummary]:
    """Active facts per category (at ``now``), by category; a category held by fewer
    than ``min_users`` identities is left out."""
    _check(DEFAULT_WINDOW, min_users)
    view = _fact_view
    statement = (
        select(view)
        .where(view.c.users >= bindparam("min_users", min_users))
        .order_by(view.c.category)
    )
    rows = await _fetch(store, statement, DEFAULT_WINDOW, now)
    return [FactSummary.model_validate(dict(row)) for row in rows]


async def rebuild_rollups(store: PostgresStore) -> None:
    """Recompute the usage rollup from the observations stored now, in one transaction.

    For observations loaded in bulk, bypassing :meth:`PostgresStore.append`. Counts of
    observations already pruned are lost, so this is not routine maintenance.
    """

    async def rebuild(conn: AsyncConnection) -> None:
        async with conn.begin():
            await rollup.rebuild(conn)

    # One transaction, replacing the rollup whole: retried on a dead connection.
    await store.run(rebuild)
