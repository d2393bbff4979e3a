"""Cross-user analytics: tool effectiveness, entity popularity, domain trends, fact summary.

Every number comes from the views migration 0002 creates in the store's schema, so an
analyst's ad-hoc SQL and these functions agree:

* ``tool_effectiveness``, ``entity_popularity`` and ``domain_trends`` read the usage
  rollup (:mod:`coda_memory.postgres.rollup`, which explains its design), written
  with the observations it counts, so a 90-day trend still answers after raw observations
  are pruned. They only read (a replica will do), so they do not fold the rollups that
  appends owed while a rollup table was locked (:mod:`coda_memory.postgres.rollup_owed`):
  the answers lag by those rows until a later append or ``coda-memory prune`` folds them;
* ``fact_summary`` and the fact columns count active facts, as ``active_facts`` lists
  them: facts whose effective confidence is at least 0.1, decayed as the default
  ``ExponentialDecay`` and ``AdaptiveDecay`` do (``confidence * 0.95 ^ (days /
  coalesce(ease_factor, 1))``); a service configured with other decay parameters is not
  reflected;
* ``analytics_window`` holds the instant and the window. A view takes no parameters, so
  the views read them from two settings, ``coda_memory.analytics_now`` (default
  ``now()``) and ``coda_memory.analytics_window`` (default 30 days); each function sets
  them for its own transaction only, then filters, orders and limits the view's rows
  (``entity_popularity`` looks up the facts of its top entities only), with the
  ``analytics_*.sql`` statements of :mod:`coda_memory.postgres.sql`.

The window is ``[now - since, now]`` in whole UTC days, both ends included. ``users`` of
tools and entities counts the identities whose latest use falls in the window: the
distinct users of the window whenever it ends at the latest data, as a window ending now
does (for a window in the past, identities that came back later are not counted).

Cross-tenant aggregates are k-anonymous: a row behind fewer than ``min_users`` distinct
identities is left out, and a mean over fewer than ``min_users`` identities (the affinity
and avoidance confidences of a tool, the fact confidence of an entity) is None. The views
apply the same rule with the database's floor (``analytics_floor.min_users``, migration
0013) to a role that may not read the ``facts`` table (an analyst), so run as one the
functions apply the larger of the two; from a role that may read ``facts`` (the owner)
the views hide nothing, and ``min_users`` alone applies.

:func:`rebuild_rollups` recomputes the rollup from the stored observations, for data
loaded in bulk without :meth:`~coda_memory.postgres.PostgresStore.append`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date, datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy import text
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from coda_memory.core.model import MAX_SPAN, as_utc
from coda_memory.errors import AccessDenied
from coda_memory.postgres import rollup_upkeep
from coda_memory.postgres.connection import INSUFFICIENT_PRIVILEGE, sqlstate
from coda_memory.postgres.sql import query
from coda_memory.postgres.store import PostgresStore
from coda_memory.postgres.tenancy import set_all_identities

DEFAULT_WINDOW = timedelta(days=30)
DEFAULT_MIN_USERS = 5
DEFAULT_LIMIT = 100
#: The largest ``min_users`` and ``limit``: the statements take them as a bigint.
MAX_COUNT = 2**63 - 1
#: The longest window (a window of millions of days failed with "timestamp out of range").
MAX_WINDOW = MAX_SPAN

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


class ToolEffectiveness(BaseModel):
    """One tool: usage in the window and the active affinity/avoidance facts about it.

    For a role bound by the database's floor (an analyst), a tool used by fewer
    identities than the floor in the window is left out (by a few or by none alike),
    ``affinity_users`` and ``avoidance_users`` are None when fewer identities than the
    floor hold such a fact (0 stays 0), the means are rounded to 2 places, and the facts
    are as at the start of the UTC day of ``now``."""

    model_config = ConfigDict(frozen=True)

    tool_name: str
    users: int
    successes: int
    failures: int
    success_rate: float | None
    p50_duration_ms: float | None
    p95_duration_ms: float | None
    affinity_users: int | None
    avoidance_users: int | None
    mean_affinity_confidence: float | None
    mean_avoidance_confidence: float | None


class EntityPopularity(BaseModel):
    """One entity: accesses in the window and the active facts about it (``fact_users``:
    None under the database's floor, as :class:`ToolEffectiveness`'s counts)."""

    model_config = ConfigDict(frozen=True)

    entity_type: str
    entity_id: str
    users: int
    accesses: int
    fact_users: int | None
    mean_confidence: float | None


class DomainTrend(BaseModel):
    """Queries about one domain on one UTC day."""

    model_config = ConfigDict(frozen=True)

    day: date
    domain: str
    queries: int
    users: int


#: The buckets of :attr:`FactSummary.histogram` (the view ``fact_summary`` makes them).
HISTOGRAM_BUCKETS = 10


class FactSummary(BaseModel):
    """Active facts of one category; ``histogram[i]`` counts effective confidences in
    ``[i/10, (i+1)/10)``, the last bucket including 1.0 (:data:`HISTOGRAM_BUCKETS`).

    For a role bound by the database's floor (an analyst), a histogram with a bucket of
    fewer facts than the floor (0 is not fewer) is None in every bucket, the mean is
    rounded to 2 places, and the facts are as at the start of the UTC day of ``now``."""

    model_config = ConfigDict(frozen=True)

    category: str
    facts: int
    users: int
    mean_confidence: float | None
    histogram: list[int | None]


def _check(since: timedelta, min_users: int, limit: int = DEFAULT_LIMIT) -> None:
    if not isinstance(since, timedelta) or not timedelta(0) < since <= MAX_WINDOW:
        raise ValueError(
            f"since must be a positive timedelta of at most {MAX_WINDOW.days:,} days, not {since!r}"
        )
    if since % timedelta(days=1):
        # Windows are whole UTC days: finer ones would let two queries be subtracted to
        # isolate a few hours of one user's activity.
        raise ValueError(f"since must be a whole number of days, not {since!r}")
    for name, value in (("min_users", min_users), ("limit", limit)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
            raise ValueError(f"{name} must be an integer from 1 to {MAX_COUNT}, not {value!r}")


async def _fetch(
    store: PostgresStore,
    name: str,
    since: timedelta,
    now: datetime | None,
    **parameters: Any,
) -> list[RowMapping]:
    """Run ``name``.sql (of :mod:`coda_memory.postgres.sql`) with the views' instant and
    window set for its transaction."""
    settings = query("analytics_settings", store.schema)
    statement = query(name, store.schema)
    if now is not None and not isinstance(now, datetime):
        raise TypeError(f"now must be a datetime (or None), not {type(now).__name__}")
    window = {"now": None if now is None else as_utc(now), "since": since}

    async def read(conn: AsyncConnection) -> list[RowMapping]:
        await conn.exec_driver_sql(settings.text, tuple(settings.arguments_from(window)))
        arguments = tuple(statement.arguments_from(parameters))
        result = await conn.exec_driver_sql(statement.text, arguments)
        return list(result.mappings())

    with _granted(store, _VIEWS_GRANTED):
        return await store.run(read)


#: Who may read the analytics views, for :class:`~coda_memory.errors.AccessDenied`.
_VIEWS_GRANTED = (
    "the analytics views are granted to analyst roles (`coda-memory grant analyst ROLE`, "
    "run as the schema's owner) and to the schema's owner, not to the app role"
)


@contextmanager
def _granted(store: PostgresStore, who_may: str) -> Iterator[None]:
    """Turn the server's "permission denied" into :class:`AccessDenied`, naming the
    schema and ``who_may``."""
    try:
        yield
    except Exception as exc:
        if sqlstate(exc) == INSUFFICIENT_PRIVILEGE:
            raise AccessDenied(f"permission denied in schema {store.schema!r}: {who_may}") from exc
        raise


async def tool_effectiveness(
    store: PostgresStore,
    *,
    since: timedelta = DEFAULT_WINDOW,
    min_users: int = DEFAULT_MIN_USERS,
    now: datetime | None = None,
) -> list[ToolEffectiveness]:
    """Tools used by at least ``min_users`` identities in the window, most used first
    (for a window that ends before today, identities whose latest use falls inside it)."""
    _check(since, min_users)
    rows = await _fetch(store, "analytics_tools", since, now, min_users=min_users)
    return [ToolEffectiveness.model_validate(dict(row)) for row in rows]


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
    parameters = {"min_users": min_users, "limit": limit}
    # The top entities' facts are looked up in active_facts, which an analyst may not
    # read: the same rows then come from the view's own columns, a slower plan.
    name = (
        "analytics_entities"
        if await _may_read(store, "active_facts")
        else "analytics_entities_view"
    )
    rows = await _fetch(store, name, since, now, **parameters)
    return [EntityPopularity.model_validate(dict(row)) for row in rows]


async def _may_read(store: PostgresStore, view: str) -> bool:
    """Whether the store's role may read ``view`` of its schema."""
    statement = text(
        "SELECT has_table_privilege("
        "format('%I.%I', CAST(:schema AS text), CAST(:view AS text)), 'SELECT')"
    )

    async def read(conn: AsyncConnection) -> bool:
        result = await conn.execute(statement, {"schema": store.schema, "view": view})
        return result.scalar() is True

    with _granted(store, _VIEWS_GRANTED):  # (a role without USAGE on the schema fails here)
        return await store.run(read)


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
    rows = await _fetch(store, "analytics_domains", since, now, min_users=min_users)
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
    rows = await _fetch(store, "analytics_facts", DEFAULT_WINDOW, now, min_users=min_users)
    return [FactSummary.model_validate(dict(row)) for row in rows]


async def rebuild_rollups(store: PostgresStore) -> None:
    """Recompute the usage rollup from the observations stored now, in one transaction.

    For observations loaded in bulk, bypassing :meth:`PostgresStore.append`. Counts of
    observations already pruned are lost, so this is not routine maintenance. The tables
    are truncated: a reader holding a snapshot from before the rebuild (a repeatable-read
    report, ``pg_dump``) sees them empty.
    """

    async def rebuild(conn: AsyncConnection) -> None:
        async with conn.begin():
            await set_all_identities(conn)  # every identity's observations (the owner)
            await rollup_upkeep.rebuild(conn)

    # One transaction, replacing the rollup whole: retried on a dead connection.
    with _granted(store, "rebuilding the rollup takes the schema's owner"):
        await store.run(rebuild)
