"""The named SQL files: every one prepares against a migrated database."""

from __future__ import annotations

from importlib import resources

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from coda_memory.postgres import sql
from coda_memory.postgres.unit import Statements

SQL_NAMES = sorted(
    entry.name.removesuffix(".sql")
    for entry in resources.files(sql).iterdir()
    if entry.name.endswith(".sql")
)


def test_the_hot_path_statements_are_all_files_of_the_package() -> None:
    statements = Statements.for_schema("coda_memory")
    used = {getattr(statements, field).name for field in Statements.__dataclass_fields__}
    assert used <= set(SQL_NAMES)
    assert len(used) == len(Statements.__dataclass_fields__)


@pytest.mark.parametrize("name", SQL_NAMES)
async def test_every_sql_file_prepares_against_a_migrated_database(pg_url: str, name: str) -> None:
    url = make_url(pg_url).set(drivername="postgresql")
    conn = await asyncpg.connect(url.render_as_string(hide_password=False))
    try:
        query = sql.query(name, "coda_memory")
        prepared = await conn.prepare(query.text)
        # The server agrees on how many parameters there are: each name is one $n.
        assert len(prepared.get_parameters()) == len(query.parameters)
    finally:
        await conn.close()
