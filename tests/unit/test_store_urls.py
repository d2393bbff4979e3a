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


@pytest.mark.parametrize("url", ["memory", "memory:", "Memory:", "null", "null:", "memory:/x"])
def test_a_memory_or_null_url_without_its_slashes_is_refused(url: str) -> None:
    expected = "null://" if url.startswith("null") else "memory://"
    with pytest.raises(ValueError, match=f"use {expected}"):
        MemoryService.from_url(url)


@pytest.mark.parametrize("url", ["memory://", "MEMORY://", "null://", "Null://"])
def test_a_memory_or_null_url_with_its_slashes_is_taken(url: str) -> None:
    MemoryService.from_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app:S3cret@db/app\n",
        " postgresql://app:S3cret@db/app",
        "postgresql://app:S3cret@db/app\t",
        "redis://:S3cret@db:6379/0\n",
        "memory://\n",
        " null://",
    ],
)
def test_a_url_with_whitespace_about_it_is_refused_unquoted(url: str) -> None:
    with pytest.raises(ValueError, match="whitespace") as caught:
        MemoryService.from_url(url)
    assert "S3cret" not in str(caught.value)


def test_a_postgres_url_with_whitespace_about_it_is_refused_by_the_store_too() -> None:
    with pytest.raises(ValueError, match="whitespace") as caught:
        PostgresStore.from_url("postgresql://app:S3cret@db/app\n")
    assert "S3cret" not in str(caught.value)


@pytest.mark.parametrize("url", ["memory", "null:", "memory://\n", " redis://db:6379/0"])
def test_migrate_refuses_what_from_url_refuses(url: str) -> None:
    # (It did nothing for them: a store without a schema has nothing to migrate.)
    with pytest.raises(ValueError, match=r"use memory://|use null://|whitespace"):
        coda_memory.migrate(url)
