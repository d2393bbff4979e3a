"""The public analytics take a MemoryService, its store, or a URL, and type-check so.

mypy --strict covers this file: the calls below are the ones a host writes.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from coda_memory import MemoryService
from coda_memory.analytics import (
    domain_trends,
    entity_popularity,
    fact_summary,
    rebuild_rollups,
    tool_effectiveness,
)
from coda_memory.postgres import PostgresStore
from tests.helpers import domain, entity, tool_ok


async def test_a_service_its_store_and_a_url_give_the_same_answers(pg_url: str) -> None:
    memory = MemoryService.from_url(pg_url, load_timeout=5.0)
    try:
        for user in ("ana", "ben"):
            memory.emit_observation(user, tool_ok("get_account"))
            memory.emit_observation(user, entity("account", "acct-118", "Northwind"))
            memory.emit_observation(user, domain("royalty"))
            await memory.drain()
            await memory.consolidate(user)

        now = datetime.now(UTC)  # one instant, so decayed confidences compare equal
        from_service = await tool_effectiveness(memory, min_users=2, now=now)
        from_store = await tool_effectiveness(memory.store, min_users=2, now=now)
        from_url = await tool_effectiveness(pg_url, min_users=2, now=now)
        assert from_service == from_store == from_url
        assert [(r.tool_name, r.users, r.affinity_users) for r in from_url] == [
            ("get_account", 2, 2)
        ]
        assert [r.entity_id for r in await entity_popularity(memory, min_users=2)] == ["acct-118"]
        assert [r.domain for r in await domain_trends(pg_url, min_users=2)] == ["royalty"]
        categories = {r.category for r in await fact_summary(memory.store, min_users=2)}
        assert categories == {"tool_affinity", "entity_frequency", "domain_preference"}
        await rebuild_rollups(memory)
        assert await tool_effectiveness(memory, min_users=2, now=now) == from_service
    finally:
        await memory.close()


async def test_a_service_that_is_not_on_postgres_is_refused() -> None:
    async with MemoryService.from_url("memory://") as memory:
        with pytest.raises(TypeError, match="analytics need a Postgres store"):
            await tool_effectiveness(memory)
        with pytest.raises(TypeError, match="not InMemoryStore"):
            await fact_summary(memory.store)


async def test_a_schema_other_than_the_service_s_own_is_refused(pg_url: str) -> None:
    """``schema=`` was ignored for a service or a store: the call answered for the
    store's own schema (another tenant's, say) as if it were the one asked for."""
    memory = MemoryService.from_url(pg_url, load_timeout=5.0)
    try:
        with pytest.raises(ValueError, match="differs from the store's schema"):
            await tool_effectiveness(memory, schema="tenant_two")
        with pytest.raises(ValueError, match="pass a URL for another"):
            await rebuild_rollups(memory.store, schema="tenant_two")
        store = memory.store
        assert isinstance(store, PostgresStore)
        assert await fact_summary(memory, schema=store.schema) == await fact_summary(memory)
    finally:
        await memory.close()
