"""The Postgres store: observations, facts, history and checkpoints in one schema.

The consolidation cursor
------------------------
Each observation row records the id of the transaction that wrote it
(``xid DEFAULT pg_current_xact_id()``); each checkpoint records the ``pg_snapshot`` of the
consolidation that last advanced it. A consolidation

1. locks the identity's checkpoint row (``SELECT … FOR UPDATE``), then
2. takes the *current* snapshot in a statement of its own, so it is taken after the lock
   was granted, then
3. reads as new exactly the observations whose ``xid`` is visible in the current snapshot
   and was not visible in the stored one (all visible ones when none is stored), and
4. stores the current snapshot on the checkpoint in the same transaction.

A transaction is visible in a snapshot once it committed before the snapshot was taken,
and stays visible in every later snapshot. So an observation is consumed by the first run
whose snapshot sees its transaction committed, and by no other run: an append still in
flight (or not yet begun) during a run is left for a later one, whatever its
``created_at`` says, so clock skew and long transactions cannot lose or repeat
observations. Runs of one identity are serialised by the checkpoint row lock; a run that
waited behind another takes its snapshot after the other committed, so it starts exactly
where the other stopped. Pruning deletes only rows visible in the run's snapshot, so it
never removes an observation the run did not see. A run that does not commit changes
nothing, and its observations are read again by the next one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from functools import partial
from typing import Any, TypeVar

from sqlalchemy import delete
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from coda_memory.core.model import Fact, FactEvent, Observation
from coda_memory.ports import (
    AppendOutcome,
    ObservationRecord,
)
from coda_memory.postgres.append import append_observations
from coda_memory.postgres.connection import driver_transaction, lock_timeout_clause, run
from coda_memory.postgres.engine import create_engine, driver_connection, schema_required
from coda_memory.postgres.repositories import (
    Checkpoint,
    CheckpointRepository,
    FactEventRepository,
    FactRepository,
    ObservationRepository,
)
from coda_memory.postgres.rollup import forget_identity
from coda_memory.postgres.schema import DEFAULT_SCHEMA, redis_imports, validate_schema_name
from coda_memory.postgres.tenancy import SET_TENANT, SET_TENANT_SESSION, set_tenant
from coda_memory.postgres.unit import PostgresConsolidationUnit, Statements, lock_identity, peek

DEFAULT_LOCK_TIMEOUT = timedelta(seconds=5)

T = TypeVar("T")


def _as_tenant(
    identity_id: str, work: Callable[[AsyncConnection], Awaitable[T]]
) -> Callable[[AsyncConnection], Awaitable[T]]:
    """``work`` in a transaction whose tenant is ``identity_id`` (row-level security)."""

    async def scoped(conn: AsyncConnection) -> T:
        await set_tenant(conn, identity_id)
        return await work(conn)

    return scoped


class PostgresStore:
    """:class:`~coda_memory.ports.MemoryStore` on Postgres (asyncpg)."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        schema: str = DEFAULT_SCHEMA,
        lock_timeout: timedelta | None = DEFAULT_LOCK_TIMEOUT,
    ) -> None:
        """Use ``engine``, whose ``schema_translate_map`` must place the tables in
        ``schema`` (:meth:`from_url` builds such an engine)."""
        self.engine = engine
        self.schema = validate_schema_name(schema)
        self._statements = Statements.for_schema(self.schema)
        # The transaction of a consolidation and its settings, in one round trip (the
        # timeout is a formatted integer, not a value from outside). A consolidation need
        # not wait for its commit to reach disk: if a crash loses it, the facts, history
        # and checkpoint are lost together and the next run redoes it from the same
        # (durably stored) observations.
        self._lock_timeout = lock_timeout_clause(lock_timeout)
        self._begin = f"BEGIN; {self._lock_timeout}; SET LOCAL synchronous_commit = off"
        self.lock_timeout = lock_timeout

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        schema: str = DEFAULT_SCHEMA,
        lock_timeout: timedelta | None = DEFAULT_LOCK_TIMEOUT,
        pool_size: int = 5,
        **engine_kwargs: Any,
    ) -> PostgresStore:
        """A store on ``url`` (postgresql://, postgres:// or postgresql+asyncpg://)."""
        engine = create_engine(url, schema=schema, pool_size=pool_size, **engine_kwargs)
        return cls(engine, schema=schema, lock_timeout=lock_timeout)

    async def append(self, records: Sequence[ObservationRecord]) -> AppendOutcome:
        if not records:
            return AppendOutcome(stored=0)
        # One transaction, which a lost connection rolls back: retried (see ``connection``).
        return await self.run(lambda conn: append_observations(conn, self.schema, records))

    @asynccontextmanager
    async def consolidation(self, identity_id: str) -> AsyncIterator[PostgresConsolidationUnit]:
        doing = f"while consolidating {identity_id!r}"
        async with driver_transaction(self.engine, self.schema, self._begin, doing) as driver:
            with schema_required(self.schema):
                # The tenant of the transaction (row-level security).
                await driver.execute(SET_TENANT, identity_id)
                unit = await PostgresConsolidationUnit.open(
                    driver, self._statements, identity_id, partial(driver.execute, "COMMIT")
                )
            yield unit

    async def facts(self, identity_id: str) -> list[Fact]:
        return await self.run(
            _as_tenant(identity_id, lambda conn: FactRepository(conn).stored(identity_id))
        )

    async def peek(self, identity_id: str) -> tuple[list[Fact], bool]:
        async def read(conn: AsyncConnection) -> tuple[list[Fact], bool]:
            driver = await driver_connection(conn)
            # No transaction: the tenant is the session's, until the connection's next
            # transaction sets its own.
            await driver.execute(SET_TENANT_SESSION, identity_id)
            return await peek(driver, self._statements, identity_id)

        return await self.run(read)

    async def history(self, identity_id: str, subject: str | None = None) -> list[FactEvent]:
        return await self.run(
            _as_tenant(
                identity_id, lambda conn: FactEventRepository(conn).history(identity_id, subject)
            )
        )

    async def observations(self, identity_id: str) -> list[Observation]:
        """The identity's stored (not yet pruned) observations, in insertion order."""
        return await self.run(
            _as_tenant(identity_id, lambda conn: ObservationRepository(conn).stored(identity_id))
        )

    async def every_observation(self) -> list[Observation]:
        """Every identity's stored (not yet pruned) observations, in time order."""
        return await self.run(lambda conn: ObservationRepository(conn).every_stored())

    async def checkpoint(self, identity_id: str) -> Checkpoint | None:
        """The identity's checkpoint, or None before its first consolidation."""
        return await self.run(
            _as_tenant(identity_id, lambda conn: CheckpointRepository(conn).get(identity_id))
        )

    async def forget(self, identity_id: str) -> None:
        async def forget(conn: AsyncConnection) -> None:
            async with conn.begin():
                # Opens the transaction, which the lock below joins on the same connection.
                await conn.exec_driver_sql(self._lock_timeout)
                await set_tenant(conn, identity_id)
                # Holding the checkpoint lock, no consolidation of the identity runs
                # meanwhile, so none can write facts after they are deleted.
                driver = await driver_connection(conn)
                await lock_identity(driver, self._statements, identity_id)
                await CheckpointRepository(conn).delete(identity_id)
                await FactEventRepository(conn).delete_identity(identity_id)
                await FactRepository(conn).delete_identity(identity_id)
                await ObservationRepository(conn).delete_identity(identity_id)
                # The identity's rows of the analytics rollup; anonymous counts stay.
                await forget_identity(conn, identity_id)
                await conn.execute(
                    delete(redis_imports).where(redis_imports.c.identity_id == identity_id)
                )

        # Forgetting twice forgets the same: retried on a dead connection.
        await self.run(forget)

    async def run(
        self, work: Callable[[AsyncConnection], Awaitable[T]], *, idempotent: bool = True
    ) -> T:
        """Run ``work`` in a connection of this store, under the connection policy of
        :mod:`coda_memory.postgres.connection` (``work`` idempotent: retried once when the
        connection turns out to be dead)."""
        return await run(self.engine, self.schema, work, idempotent=idempotent)

    async def close(self) -> None:
        await self.engine.dispose()
