"""Cross-user analytics, the public path: each function takes what a host has at hand.

``source`` is a :class:`~coda_memory.MemoryService` over Postgres, its ``.store``, a
:class:`~coda_memory.postgres.PostgresStore` (which answer for their own schema: a
``schema`` that names another is a ``ValueError``), or a Postgres URL (a store is opened
for the call, on ``schema``, ``coda_memory`` by default, and closed after it). Anything
else, such as a service over the in-memory store, raises ``TypeError``: the analytics
are SQL over the Postgres views. The queries and their semantics are in
:mod:`coda_memory.postgres.analytics`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Protocol, TypeAlias

from coda_memory.ports import MemoryStore
from coda_memory.postgres import analytics as _queries
from coda_memory.postgres.analytics import (
    DEFAULT_LIMIT,
    DEFAULT_MIN_USERS,
    DEFAULT_WINDOW,
    DomainTrend,
    EntityPopularity,
    FactSummary,
    ToolEffectiveness,
)
from coda_memory.postgres.schema import DEFAULT_SCHEMA
from coda_memory.postgres.store import PostgresStore


class HasStore(Protocol):
    """Anything with a ``store``, as :class:`~coda_memory.MemoryService` has."""

    @property
    def store(self) -> MemoryStore: ...


#: What the analytics functions accept.
AnalyticsSource: TypeAlias = HasStore | MemoryStore | str


@asynccontextmanager
async def _postgres(source: AnalyticsSource, schema: str | None) -> AsyncIterator[PostgresStore]:
    if isinstance(source, str):
        store = PostgresStore.from_url(
            source, schema=DEFAULT_SCHEMA if schema is None else schema, pool_size=1
        )
        try:
            yield store
        finally:
            await store.close()
        return
    store_of = getattr(source, "store", source)
    if not isinstance(store_of, PostgresStore):
        raise TypeError(
            "analytics need a Postgres store (a service from a postgresql:// URL, its "
            f"store, or the URL), not {type(store_of).__name__}"
        )
    if schema is not None and schema != store_of.schema:
        # (Ignored, it answered for the store's own schema: another tenant's, say.)
        raise ValueError(
            f"schema={schema!r} differs from the store's schema ({store_of.schema!r}): "
            "a service or store answers for its own schema; pass a URL for another"
        )
    yield store_of


async def tool_effectiveness(
    source: AnalyticsSource,
    *,
    since: timedelta = DEFAULT_WINDOW,
    min_users: int = DEFAULT_MIN_USERS,
    now: datetime | None = None,
    schema: str | None = None,
) -> list[ToolEffectiveness]:
    """Tools used by at least ``min_users`` identities in the window, most used first.

    The window is whole UTC days, the day of ``now - since`` to the day of ``now`` (both
    included). For a window that ends before today, ``users`` counts only identities
    whose latest use of the tool falls inside it (see the README, "Analytics")."""
    async with _postgres(source, schema) as store:
        return await _queries.tool_effectiveness(store, since=since, min_users=min_users, now=now)


async def entity_popularity(
    source: AnalyticsSource,
    *,
    since: timedelta = DEFAULT_WINDOW,
    min_users: int = DEFAULT_MIN_USERS,
    now: datetime | None = None,
    limit: int = DEFAULT_LIMIT,
    schema: str | None = None,
) -> list[EntityPopularity]:
    """The ``limit`` entities accessed by the most identities in the window."""
    async with _postgres(source, schema) as store:
        return await _queries.entity_popularity(
            store, since=since, min_users=min_users, now=now, limit=limit
        )


async def domain_trends(
    source: AnalyticsSource,
    *,
    since: timedelta = DEFAULT_WINDOW,
    min_users: int = DEFAULT_MIN_USERS,
    now: datetime | None = None,
    schema: str | None = None,
) -> list[DomainTrend]:
    """Queries and distinct users per UTC day and domain in the window."""
    async with _postgres(source, schema) as store:
        return await _queries.domain_trends(store, since=since, min_users=min_users, now=now)


async def fact_summary(
    source: AnalyticsSource,
    *,
    min_users: int = DEFAULT_MIN_USERS,
    now: datetime | None = None,
    schema: str | None = None,
) -> list[FactSummary]:
    """Active facts per category (at ``now``)."""
    async with _postgres(source, schema) as store:
        return await _queries.fact_summary(store, min_users=min_users, now=now)


async def rebuild_rollups(source: AnalyticsSource, *, schema: str | None = None) -> None:
    """Recompute the usage rollup from the observations stored now: the counts of
    observations already pruned (older than ``retention``) are lost, and readers holding
    an older snapshot (a repeatable-read report) see the rollup empty (it is truncated).
    For observations loaded in bulk; not routine maintenance."""
    async with _postgres(source, schema) as store:
        await _queries.rebuild_rollups(store)


__all__ = [
    "AnalyticsSource",
    "DomainTrend",
    "EntityPopularity",
    "FactSummary",
    "HasStore",
    "ToolEffectiveness",
    "domain_trends",
    "entity_popularity",
    "fact_summary",
    "rebuild_rollups",
    "tool_effectiveness",
]
