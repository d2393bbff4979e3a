"""The stores under contract: every test that takes ``store`` runs once per store.

A new store joins the suite with one entry in :data:`STORES`: a function that opens an
empty store of that kind (it may ask ``request`` for other fixtures, such as a fresh
database). Besides the port, a store under contract offers two read-only inspections that
the port has no use for but the contract needs: the identity's stored observations (to see
what retention pruned) and its checkpoint (to see what ``forget`` left behind).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

import pytest

from coda_memory.core.model import Observation
from coda_memory.ports import MemoryStore
from coda_memory.postgres import PostgresStore
from coda_memory.redis import RedisStore
from coda_memory.testing import InMemoryStore


class InspectableStore(MemoryStore, Protocol):
    """The port, plus what the contract inspects behind it."""

    async def observations(self, identity_id: str) -> list[Observation]:
        """The identity's stored (not yet pruned) observations."""
        ...

    async def checkpoint(self, identity_id: str) -> object | None:
        """The identity's checkpoint, or None before its first consolidation."""
        ...


def _memory(request: pytest.FixtureRequest) -> InspectableStore:
    return InMemoryStore()


def _postgres(request: pytest.FixtureRequest) -> InspectableStore:
    return PostgresStore.from_url(request.getfixturevalue("pg_url"))


def _redis(request: pytest.FixtureRequest) -> InspectableStore:
    return RedisStore.from_url(request.getfixturevalue("redis_url"))


StoreOpener = Callable[[pytest.FixtureRequest], InspectableStore]

#: One entry per store kind.
STORES = [
    pytest.param(_memory, id="memory"),
    pytest.param(_postgres, id="postgres", marks=pytest.mark.postgres),
    pytest.param(_redis, id="redis", marks=pytest.mark.redis),
]


@pytest.fixture(params=STORES)
def _new_store(request: pytest.FixtureRequest) -> InspectableStore:
    # Synchronous, so that openers may use synchronous fixtures (the Postgres ones run
    # their own event loop to create databases).
    opener: StoreOpener = request.param
    return opener(request)


@pytest.fixture
async def store(_new_store: InspectableStore) -> AsyncIterator[InspectableStore]:
    """An empty store of each kind, closed afterwards."""
    try:
        yield _new_store
    finally:
        await _new_store.close()
