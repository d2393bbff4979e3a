"""Shared fixtures. Postgres fixtures live in tests/pg_fixtures.py.

``make_service`` builds MemoryServices over every store: the tests that use it run once
against the in-memory store, once against a fresh Postgres database and once against
Redis under a key prefix of its own.

The tests marked ``both_loops`` run once on the standard library's event loop and once
on uvloop, the loop uvicorn picks by itself when it is installed (``uvicorn[standard]``):
they hold the service's timeouts, hedges, turns and its writer's threads and retries.
The others run on the standard library's loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import pytest
import uvloop

from coda_memory import MemoryService
from tests.helpers import FakeClock

pytest_plugins = ["tests.pg_fixtures", "tests.redis_fixtures"]

ServiceFactory = Callable[..., Awaitable[MemoryService]]

LoopFactories = Mapping[str, Callable[[], asyncio.AbstractEventLoop]]

#: The event loop of every async test (one factory: pytest-asyncio hides its id).
STANDARD_LOOP: LoopFactories = {"asyncio": asyncio.new_event_loop}
#: The event loops a ``both_loops`` test runs on.
BOTH_LOOPS: LoopFactories = {**STANDARD_LOOP, "uvloop": uvloop.new_event_loop}


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> LoopFactories:
    """Both loops for a test marked ``both_loops``; the standard library's for the others."""
    return BOTH_LOOPS if item.get_closest_marker("both_loops") else STANDARD_LOOP


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
