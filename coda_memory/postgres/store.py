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

import asyncpg
from sqlalchemy import Text, bindparam, func, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from coda_memory.core.model import Fact, FactEvent, Observation
from coda_memory.errors import ConnectionLost
from coda_memory.ports import (
    AppendOutcome,
    ObservationRecord,
)
from coda_memory.postgres.append import append_observations
from coda_memory.postgres.engine import create_engine, driver_connection, schema_required
from coda_memory.postgres.repositories import (
    Checkpoint,
    CheckpointRepository,
    FactEventRepository,
    FactRepository,
    ObservationRepository,
)
from coda_memory.postgres.rollup import forget_identity
from coda_memory.postgres.schema import DEFAULT_SCHEMA, validate_schema_name
from coda_memory.postgres.unit import PostgresConsolidationUnit, Statements, peek_result

DEFAULT_LOCK_TIMEOUT = timedelta(seconds=5)

T = TypeVar("T")

#: How often to retry creating and locking a checkpoint that ``forget`` deleted meanwhile.
_LOCK_ATTEMPTS = 3


async def lock_identity(
    conn: AsyncConnection, identity_id: str, lock_timeout: timedelta | None
) -> Checkpoint:
    """Lock the identity's checkpoint row until the transaction ends, creating it first.

    ``lock_timeout`` bounds the wait for the row (None or zero: wait as long as it takes).
    """
    if lock_timeout is not None:
        milliseconds = max(0, round(lock_timeout.total_seconds() * 1000))
        setting = bindparam("lock_timeout", f"{milliseconds}ms", Text)
        await conn.execute(select(func.set_config("lock_timeout", setting, True)))
    checkpoints = CheckpointRepository(conn)
    for _ in range(_LOCK_ATTEMPTS):
        await checkpoints.ensure(identity_id)
        # None when ``forget`` deleted the row between the two statements: create it again.
        checkpoint = await checkpoints.lock(identity_id)
        if checkpoint is not None:
            return checkpoint
    raise RuntimeError(f"could not lock the checkpoint of {identity_id!r}")


#: What asyncpg raises on a connection that is gone.
_DEAD_CONNECTION = (asyncpg.ConnectionDoesNotExistError, asyncpg.InterfaceError, OSError)
#: ... and, mid-operation, when the server's termination message races the next request.
_BROKEN_CONNECTION = (*_DEAD_CONNECTION, asyncpg.exceptions.InternalClientError)


async def _end_transaction(conn: AsyncConnection, driver: Any) -> None:
    """Roll back what was not committed; a connection that can't is thrown away."""
    if driver.is_closed():
        await conn.invalidate()
        return
    if driver.is_in_transaction():
        try:
            await driver.execute("ROLLBACK")
        except Exception:
            # A connection that cannot roll back is broken, and its transaction is gone
            # with it on the server: discard it without hiding the error being raised.
            await conn.invalidate()


class PostgresStore:
    """:class:`~coda_memory.ports.MemoryStore` on Postgres (asyncpg)."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        schema: str = DEFAULT_SCHEMA,
        retention: timedelta = timedelta(days=7),
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
        milliseconds = 0 if lock_timeout is None else round(lock_timeout.total_seconds() * 1000)
        self._begin = (
            f"BEGIN; SET LOCAL lock_timeout = '{max(0, milliseconds)}ms'; "
            "SET LOCAL synchronous_commit = off"
        )
        self.retention = retention
        self.lock_timeout = lock_timeout

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        schema: str = DEFAULT_SCHEMA,
        retention: timedelta = timedelta(days=7),
        lock_timeout: timedelta | None = DEFAULT_LOCK_TIMEOUT,
        pool_size: int = 5,
        **engine_kwargs: Any,
    ) -> PostgresStore:
        """A store on ``url`` (postgresql://, postgres:// or postgresql+asyncpg://)."""
        engine = create_engine(url, schema=schema, pool_size=pool_size, **engine_kwargs)
        return cls(engine, schema=schema, retention=retention, lock_timeout=lock_timeout)

    async def append(self, records: Sequence[ObservationRecord]) -> AppendOutcome:
        if not records:
            return AppendOutcome(stored=0)
        return await self._retrying(lambda conn: append_observations(conn, self.schema, records))

    @asynccontextmanager
    async def consolidation(self, identity_id: str) -> AsyncIterator[PostgresConsolidationUnit]:
        async with self.engine.connect() as conn:
            driver = await driver_connection(conn)
            try:
                with schema_required(self.schema):
                    try:
                        await driver.execute(self._begin)
                    except _DEAD_CONNECTION:
                        # Died while idle in the pool (server restart, terminated
                        # backend): nothing was done yet, so try once on a fresh one.
                        driver = await self._reconnect(conn)
                        await driver.execute(self._begin)
                    unit = await PostgresConsolidationUnit.open(
                        driver, self._statements, identity_id, partial(driver.execute, "COMMIT")
                    )
                yield unit
            except _BROKEN_CONNECTION as error:
                raise ConnectionLost(
                    f"the connection died while consolidating {identity_id!r}: {error!r}"
                ) from error
            finally:
                await _end_transaction(conn, driver)

    async def facts(self, identity_id: str) -> list[Fact]:
        return await self._retrying(lambda conn: FactRepository(conn).stored(identity_id))

    async def peek(self, identity_id: str) -> tuple[list[Fact], bool]:
        with schema_required(self.schema):
            async with self.engine.connect() as conn:
                driver = await driver_connection(conn)
                try:
                    rows = await driver.fetch(self._statements.peek, identity_id)
                except _DEAD_CONNECTION:
                    driver = await self._reconnect(conn)  # read-only: retry once
                    rows = await driver.fetch(self._statements.peek, identity_id)
        return peek_result(identity_id, rows)

    async def history(self, identity_id: str, subject: str | None = None) -> list[FactEvent]:
        return await self._retrying(
            lambda conn: FactEventRepository(conn).history(identity_id, subject)
        )

    async def observations(self, identity_id: str) -> list[Observation]:
        """The identity's stored (not yet pruned) observations, in insertion order."""
        return await self._retrying(lambda conn: ObservationRepository(conn).stored(identity_id))

    async def checkpoint(self, identity_id: str) -> Checkpoint | None:
        """The identity's checkpoint, or None before its first consolidation."""
        return await self._retrying(lambda conn: CheckpointRepository(conn).get(identity_id))

    async def forget(self, identity_id: str) -> None:
        with schema_required(self.schema):
            async with self.engine.begin() as conn:
                # Holding the checkpoint lock, no consolidation of the identity runs
                # meanwhile, so none can write facts after they are deleted.
                await lock_identity(conn, identity_id, self.lock_timeout)
                await CheckpointRepository(conn).delete(identity_id)
                await FactEventRepository(conn).delete_identity(identity_id)
                await FactRepository(conn).delete_identity(identity_id)
                await ObservationRepository(conn).delete_identity(identity_id)
                # The identity's rows of the analytics rollup; anonymous counts stay.
                await forget_identity(conn, identity_id)

    async def _retrying(self, work: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        """Run ``work`` in a connection; once more on a new pool when the connection turned
        out to be dead (see ``create_engine``). ``work`` must be read-only or a single
        transaction, which a lost connection rolls back."""
        with schema_required(self.schema):
            try:
                async with self.engine.connect() as conn:
                    return await work(conn)
            except DBAPIError as error:
                if not error.connection_invalidated:
                    raise
            await self.engine.dispose(close=False)
            async with self.engine.connect() as conn:
                return await work(conn)

    async def _reconnect(self, conn: AsyncConnection) -> Any:
        """Replace a dead connection; its pooled siblings are presumed dead too (a server
        restart kills them all), so the pool is replaced as well."""
        await conn.invalidate()
        await self.engine.dispose(close=False)
        return await driver_connection(conn)

    async def close(self) -> None:
        await self.engine.dispose()
