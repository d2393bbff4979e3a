"""The README's analytics cookbook runs, statement by statement, as the schema's owner on
a database holding one identity's consolidated facts, and answers what its comments say."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg

from tests.postgres.helpers import dsn
from tests.postgres.test_cli import seed_alice

README = Path(__file__).resolve().parents[2] / "README.md"


def _cookbook() -> list[str]:
    """The statements of the SQL block under "Cookbook", in order, without comments."""
    section = README.read_text().split("### Cookbook", 1)[1]
    found = re.search(r"^```sql\n(.*?)^```$", section, re.M | re.S)
    assert found is not None, "the README's cookbook has no SQL block"
    code = re.sub(r"--[^\n]*", "", found[1])  # comments hold semicolons
    return [" ".join(s.split()) for s in code.split(";") if s.strip()]


async def _run(url: str, statements: list[str]) -> list[list[dict[str, Any]]]:
    conn = await asyncpg.connect(dsn(url))
    try:
        return [[dict(r) for r in await conn.fetch(s)] for s in statements]
    finally:
        await conn.close()


async def _avoids(url: str, identity_id: str, tool: str) -> None:
    """A fresh tool_avoidance fact of ``identity_id`` about ``tool``."""
    now = datetime.now(UTC)
    conn = await asyncpg.connect(dsn(url))
    try:
        await conn.execute(
            "INSERT INTO coda_memory.facts VALUES ($1, $2, 'tool_avoidance', 'fails', "
            "0.9, 1, $3, $3, $3, $3, NULL)",
            identity_id,
            f"tool_avoidance:{tool}",
            now,
        )
    finally:
        await conn.close()


def test_the_cookbook_runs_and_answers_as_its_comments_say(pg_url: str) -> None:
    statements = _cookbook()
    assert len(statements) >= 10
    seed_alice(pg_url, "X")  # get_account works for X on three days, run_sql fails
    # A tool name may hold a colon (a namespaced tool): its avoidance counts under it whole.
    asyncio.run(_avoids(pg_url, "X", "crm:lookup"))

    results = dict(zip(statements, asyncio.run(_run(pg_url, statements)), strict=True))

    def answer(marker: str) -> list[dict[str, Any]]:
        (statement,) = (s for s in statements if marker in s)
        return results[statement]

    # One user is under the query's "users >= 5"; today's calls are outside a window
    # that ends on 1 November 2026.
    assert answer("WHERE users >= 5") == []
    assert answer("WHERE successes + failures > 0") == []
    (window,) = answer("FROM analytics_window")
    assert (window["end_day"], window["since"]) == (date(2026, 11, 1), timedelta(days=90))
    avoided = sorted((r["tool"], r["users"]) for r in answer("FROM active_facts"))
    assert avoided == [("crm:lookup", 1), ("run_sql", 1)]
    kinds = [r["kind"] for r in answer("FROM fact_events")]
    assert kinds == ["created", "reinforced", "reinforced"]
    summary = {r["category"]: r["users"] for r in answer("FROM fact_summary")}
    assert summary.get("tool_affinity") == 1, summary


def _erase_entity_block() -> list[str]:
    """The statements of the README's SQL block that erases an entity id's counts."""
    blocks = re.findall(r"^```sql\n(.*?)^```$", README.read_text(), re.M | re.S)
    (block,) = (b for b in blocks if "DELETE FROM coda_memory.entity_daily" in b)
    return [" ".join(s.split()) for s in block.split(";") if s.strip()]


def test_the_readme_erases_an_entity_id_left_in_the_counts_without_breaking_them(
    pg_url: str,
) -> None:
    """forget leaves the per-day counts under the entity ids they count; the README's
    statements erase one, and another identity's next access counts from zero again
    (with only the daily rows deleted, it took one from a day that was gone)."""
    from coda_memory import MemoryService
    from tests.helpers import entity

    async def scenario() -> list[dict[str, Any]]:
        service = MemoryService.from_url(pg_url)
        try:
            for who in ("ana", "ben"):
                service.emit_observation(who, entity("account", "ana@example.com"))
            await service.drain()
            await service.forget("ana")
            await _run(pg_url, _erase_entity_block())
            conn = await asyncpg.connect(dsn(pg_url))
            try:
                await conn.execute("SET coda_memory.all_identities = on")
                left = await conn.fetchval(
                    "SELECT (SELECT count(*) FROM coda_memory.entity_users"
                    " WHERE entity_id = 'ana@example.com')"
                    " + (SELECT count(*) FROM coda_memory.entity_daily"
                    " WHERE entity_id = 'ana@example.com')"
                )
                assert left == 0
                later = datetime.now(UTC) + timedelta(days=1)
                service.emit_observation("ben", entity("account", "ana@example.com", at=later))
                await service.drain()
                rows = await conn.fetch(
                    "SELECT day, accesses, latest_users FROM coda_memory.entity_daily"
                    " WHERE entity_id = 'ana@example.com' ORDER BY day"
                )
            finally:
                await conn.close()
        finally:
            await service.close()
        return [dict(r) for r in rows]

    rows = asyncio.run(scenario())
    assert [(r["accesses"], r["latest_users"]) for r in rows] == [(1, 1)]
