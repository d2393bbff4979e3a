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

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

from sqlalchemy import Text, bindparam, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from coda_memory.model import Fact, FactEvent, Observation
from coda_memory.store.base import (
    AppendOutcome,
    ConsolidationInput,
    ConsolidationPlan,
    ObservationRecord,
)
from coda_memory.store.postgres.append import append_observations
from coda_memory.store.postgres.engine import create_engine, schema_required
from coda_memory.store.postgres.repositories import (
    Checkpoint,
    CheckpointRepository,
    FactEventRepository,
    FactRepository,
    ObservationRepository,
)
from coda_memory.store.postgres.rollup import forget_identity
from coda_memory.store.postgres.schema import DEFAULT_SCHEMA, validate_schema_name

DEFAULT_LOCK_TIMEOUT = timedelta(seconds=5)

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


class PostgresConsolidationUnit:
    """A unit of work over one identity: it holds the checkpoint row lock and the
    transaction, and writes nothing visible until :meth:`commit`."""

    def __init__(self, conn: AsyncConnection, schema: str, checkpoint: Checkpoint) -> None:
        """Use :meth:`open`; ``checkpoint`` is the row ``conn``'s transaction has locked."""
        self._conn = conn
        self._schema = schema
        self.identity_id = checkpoint.identity_id
        #: The checkpoint as it was when the lock was granted.
        self.checkpoint = checkpoint
        self._snapshot: str | None = None
        self._committed = False

    @classmethod
    async def open(
        cls,
        conn: AsyncConnection,
        schema: str,
        identity_id: str,
        lock_timeout: timedelta | None,
    ) -> PostgresConsolidationUnit:
        """Begin the transaction and lock the identity's checkpoint (creating it)."""
        await conn.begin()
        return cls(conn, schema, await lock_identity(conn, identity_id, lock_timeout))

    async def load(self) -> ConsolidationInput:
        self._check_open()
        with schema_required(self._schema):
            self._snapshot = await CheckpointRepository(self._conn).current_snapshot()
            new = await ObservationRepository(self._conn).new(
                self.identity_id, self._snapshot, self.checkpoint.snapshot
            )
            stored = await FactRepository(self._conn).stored(self.identity_id)
            sessions = {o.session_id for o in new if o.session_id is not None}
            events = await FactEventRepository(self._conn).reinforcing(self.identity_id, sessions)
        return ConsolidationInput(observations=new, facts=stored, session_events=events)

    async def apply(self, plan: ConsolidationPlan) -> None:
        self._check_open()
        if self._snapshot is None:
            raise RuntimeError("apply() needs load() first: the plan must come from this unit")
        self._check_identity(plan)
        with schema_required(self._schema):
            facts = FactRepository(self._conn)
            await facts.upsert(self.identity_id, plan.upserts)
            await facts.delete(self.identity_id, plan.deletes)
            await FactEventRepository(self._conn).append(self.identity_id, plan.events, plan.now)
            await CheckpointRepository(self._conn).advance(
                self.identity_id, self._snapshot, plan.now, plan.consumed
            )
            await ObservationRepository(self._conn).prune(
                self.identity_id, plan.prune_before, self._snapshot
            )

    async def commit(self) -> None:
        self._check_open()
        await self._conn.commit()
        self._committed = True

    def _check_open(self) -> None:
        if self._committed:
            raise RuntimeError("this unit of work is committed; open a new one")

    def _check_identity(self, plan: ConsolidationPlan) -> None:
        owners = {plan.identity_id}
        owners.update(f.identity_id for f in plan.upserts)
        owners.update(e.identity_id for e in plan.events)
        if owners != {self.identity_id}:
            raise ValueError(
                f"the plan touches identities {sorted(owners)!r}, "
                f"but this unit consolidates {self.identity_id!r}"
            )


class PostgresStore:
    """:class:`~coda_memory.store.base.MemoryStore` on Postgres (asyncpg)."""

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
        with schema_required(self.schema):
            async with self.engine.connect() as conn:
                return await append_observations(conn, self.schema, records)

    @asynccontextmanager
    async def consolidation(self, identity_id: str) -> AsyncIterator[PostgresConsolidationUnit]:
        async with self.engine.connect() as conn:
            try:
                with schema_required(self.schema):
                    unit = await PostgresConsolidationUnit.open(
                        conn, self.schema, identity_id, self.lock_timeout
                    )
                yield unit
            finally:
                if conn.in_transaction() and not conn.invalidated:
                    await conn.rollback()

    async def facts(self, identity_id: str) -> list[Fact]:
        with schema_required(self.schema):
            async with self.engine.connect() as conn:
                return await FactRepository(conn).stored(identity_id)

    async def history(self, identity_id: str, subject: str | None = None) -> list[FactEvent]:
        with schema_required(self.schema):
            async with self.engine.connect() as conn:
                return await FactEventRepository(conn).history(identity_id, subject)

    async def observations(self, identity_id: str) -> list[Observation]:
        """The identity's stored (not yet pruned) observations, in insertion order."""
        with schema_required(self.schema):
            async with self.engine.connect() as conn:
                return await ObservationRepository(conn).stored(identity_id)

    async def checkpoint(self, identity_id: str) -> Checkpoint | None:
        """The identity's checkpoint, or None before its first consolidation."""
        with schema_required(self.schema):
            async with self.engine.connect() as conn:
                return await CheckpointRepository(conn).get(identity_id)

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

    async def close(self) -> None:
        await self.engine.dispose()
