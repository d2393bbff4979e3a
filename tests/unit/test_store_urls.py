"""Memory URLs: which store a URL names, and the URLs refused before any store is made."""

from __future__ import annotations

import pytest

import coda_memory
from coda_memory import MemoryService
from coda_memory.postgres import PostgresStore
from coda_memory.postgres.engine import asyncpg_url


def test_dir_lists_the_lazy_migration_helpers() -> None:
    listed = dir(coda_memory)
    assert "migrate" in listed
    assert "migrate_async" in listed
    assert set(coda_memory.__all__) <= set(listed)


@pytest.mark.parametrize(
    "url", ["POSTGRESQL://app@db/app", "Postgres://app@db/app", "PostgreSQL+AsyncPG://app@db/app"]
)
def test_a_postgres_scheme_is_case_insensitive(url: str) -> None:
    # (As REDIS:// and MEMORY:// are taken: RFC 3986's schemes are case-insensitive.)
    assert asyncpg_url(url).drivername == "postgresql+asyncpg"
    service = MemoryService.from_url(url)
    assert isinstance(service.store, PostgresStore)
