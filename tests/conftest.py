"""Shared fixtures. Postgres fixtures live in tests/pg_fixtures.py.

``make_service`` builds MemoryServices over every store: the tests that use it run once
against the in-memory store, once against a fresh Postgres database and once against
Redis under a key prefix of its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from coda_memory import MemoryService
from tests.helpers import FakeClock

pytest_plugins = ["tests.pg_fixtures", "tests.redis_fixtures"]

ServiceFactory = Callable[..., Awaitable[MemoryService]]


@pytest.fixture(params=["memory", "postgres", "redis"])
def store_url(request: pytest.FixtureRequest) -> str:
    """The URL of an empty store of each kind."""
    if request.param == "memory":
        return "memory://"
    url: str = request.getfixturevalue("redis_url" if request.param == "redis" else "pg_url")
    return url


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def make_service(store_url: str, clock: FakeClock) -> AsyncIterator[ServiceFactory]:
    """A factory of services over one shared store (Postgres: one database)."""
    services: list[MemoryService] = []
    memory_service: list[MemoryService] = []

    async def factory(**options: Any) -> MemoryService:
        options.setdefault("clock", clock)
        options.setdefault("load_timeout", 5.0)
        if store_url == "memory://":
            # Services over the in-memory store share it, like services over one database.
            if memory_service:
                shared = MemoryService(memory_service[0].store, **options)
                services.append(shared)
                return shared
            service = MemoryService.from_url(store_url, **options)
            memory_service.append(service)
        else:
            service = MemoryService.from_url(store_url, **options)
        services.append(service)
        return service

    yield factory
    for service in services:
        await service.close()  # closing the shared in-memory store is a no-op
