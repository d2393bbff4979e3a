"""The README's analytics cookbook runs, statement by statement, as the schema's owner on
a database holding one identity's consolidated facts, and answers what its comments say."""

from __future__ import annotations

import asyncio
import re
from datetime import date, timedelta
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


def test_the_cookbook_runs_and_answers_as_its_comments_say(pg_url: str) -> None:
    statements = _cookbook()
    assert len(statements) >= 10
    seed_alice(pg_url, "X")  # get_account works for X on three days, run_sql fails

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
    assert [(r["tool"], r["users"]) for r in answer("FROM active_facts")] == [("run_sql", 1)]
    kinds = [r["kind"] for r in answer("FROM fact_events")]
    assert kinds == ["created", "reinforced", "reinforced"]
    summary = {r["category"]: r["users"] for r in answer("FROM fact_summary")}
    assert summary.get("tool_affinity") == 1, summary
