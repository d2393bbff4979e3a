"""The Postgres store: observations, facts, history and checkpoints in one schema.

The consolidation cursor
------------------------
Each observation row records the id of the transaction that wrote it
(``xid DEFAULT pg_current_xact_id()``); each checkpoint records the ``pg_snapshot`` of the
consolidation that last advanced it. A consolidation

1. locks the identity's checkpoint row (``SELECT … FOR UPDATE``), then
2. takes the *current* snapshot in the next statement (the one that reads the new
   observations), so it is taken after the lock was granted, then
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

Facts read once
---------------
The store keeps each identity's facts as it last read or wrote them, with the version
of the checkpoint row they go with (:mod:`~coda_memory.postgres.known`, bounded by
``known_facts``). A peek sends the version it knows and gets the facts only when the
row has another one, and keeps them as it reads them (no model between: when new
observations wait, it builds none); the consolidation that follows locks the row and
reuses the kept facts when the locked row still has their version. After a commit the
store keeps the facts the consolidation left, with the row version its write statement
returned. So an identity that only this process consolidates has its facts read once,
and each request reads one row to learn that nothing else changed them.

An identity far over the service's cap on facts is not read by the peek: the store
first deletes on the server the facts the cap would drop and those expired (with
their events), sparing those that waiting observations may change (``facts_cap.sql``,
:meth:`PostgresStore._apply_cap`; when and why in :class:`~coda_memory.core.caps.FactCap`).
A load that may reuse its last answer asks :meth:`PostgresStore.unchanged` whether the
version it was made from is still the stored one, in one round trip that reads no fact
(:mod:`coda_memory.core.answers`).

Connection budgets
------------------
Three pools, so that what blocks one kind of work cannot take the connections of another:

* the request pool (``pool_size``, no overflow) runs peeks and consolidations, the work of
  ``load_memory``; every statement on it runs under ``statement_timeout`` (which bounds
  lock waits as well), so a locked table costs a request at most that long (but the
  cap's, which ranks every fact of an identity once in a long while, under
  ``CAP_STATEMENT_TIMEOUT``);
* the writer pool (``writer_pool_size``, no overflow) runs appends, under
  ``writer_lock_timeout``: a writer stuck behind a lock fails, backs off and retries
  instead of holding its connection;
* the admin pool (the ``engine``; facts, history, forget, maintenance, analytics) opens
  connections only when such work runs.

Tables held
-----------
DDL and some maintenance hold a whole table (``ACCESS EXCLUSIVE`` for most ``ALTER
TABLE``, ``VACUUM FULL`` or ``LOCK TABLE``; ``SHARE`` for ``CREATE INDEX``). A request
does not wait for such a lock longer than ``table_lock_timeout`` (25 ms):

* the peek's statements run under it (the request connections' ``lock_timeout``); when
  a table it reads is held, the store reads the facts alone (the kept ones only when
  ``facts`` is held too) and says that nothing waits, so the load answers from the
  stored facts at once and the new observations wait, unconsumed, for a load that can
  consolidate them;
* a consolidation first locks the four tables it writes in ``ROW EXCLUSIVE`` mode (the
  mode its statements take anyway, which no other consolidation, append or prune
  conflicts with), and ``rollup_owed``, which its prune reads, in ``ACCESS SHARE``
  mode, under it, in the round trip of its ``BEGIN``; a held table fails the
  consolidation at once, and the load answers from the facts at hand, instead of
  holding a slot and a connection for the statement timeout while every other load
  waits for a slot. Only then does it wait for the checkpoint row (``lock_timeout``),
  which another process consolidating the identity holds for milliseconds.

The service runs at most ``request_slots`` consolidations at once, so requests queue in
the event loop rather than on the pool. :meth:`PostgresStore.start` opens the request
and writer connections, prepares the hot-path statements on each request connection and
runs those of a peek and a consolidation there once
(:func:`~coda_memory.postgres.unit.rehearse`), and prepares an
append's statements on each writer connection, before the first request.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any, TypeVar

from sqlalchemy import delete
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from coda_memory.core.caps import FactCap, LogThrottle
from coda_memory.core.logs import identity_label
from coda_memory.core.model import Fact, FactEvent, Observation
from coda_memory.core.options import require_types, seconds_or_none
from coda_memory.errors import ConnectionLost, StoreBusy
from coda_memory.ports import (
    HELD_OUT,
    AppendOutcome,
    Forgotten,
    ObservationRecord,
)
from coda_memory.postgres.append import (
    IngestCounts,
    append_observations,
    encode,
    prepared_statements,
)
from coda_memory.postgres.connection import (
    LOCK_NOT_AVAILABLE,
    QUERY_CANCELED,
    calls_for_new_pool,
    cannot_connect,
    dispose,
    driver_transaction,
    error_reason,
    is_connection_error,
    let_go,
    lock_timeout_clause,
    released,
    run,
    sqlstate,
    timeout_setting,
    unreachable,
)
from coda_memory.postgres.engine import (
    cancel_openings,
    create_engine,
    driver_connection,
    opened_connections,
    schema_required,
)
from coda_memory.postgres.known import DEFAULT_KNOWN_FACTS, Known, KnownFacts
from coda_memory.postgres.repositories import (
    Checkpoint,
    CheckpointRepository,
    FactEventRepository,
    FactRepository,
    ObservationRepository,
)
from coda_memory.postgres.rollup_owed import RollupDebt
from coda_memory.postgres.rollup_upkeep import forget_identity
from coda_memory.postgres.schema import DEFAULT_SCHEMA, redis_imports, validate_schema_name
from coda_memory.postgres.tenancy import (
    CLEAR_TENANT_SESSION,
    SET_TENANT,
    SET_TENANT_SESSION,
    set_tenant,
)
from coda_memory.postgres.unit import (
    PostgresConsolidationUnit,
    Statements,
    lock_identity,
    peek,
    rehearse,
    stored_facts,
    subjects_waiting,
    unchanged,
)

DEFAULT_LOCK_TIMEOUT = timedelta(seconds=5)
#: How long a request waits for a table that DDL or maintenance holds (see "Tables held").
DEFAULT_TABLE_LOCK_TIMEOUT = timedelta(milliseconds=25)
#: The tables a consolidation writes, in the order it locks them.
_CONSOLIDATION_TABLES = ("checkpoints", "observations", "facts", "fact_events")
#: The setting of a consolidation's transaction that plans its statements once per
#: connection (see ``PostgresStore.__init__``).
GENERIC_PLANS = "SET LOCAL plan_cache_mode = force_generic_plan"
_log = LogThrottle(logging.getLogger("coda_memory"))
#: Every statement of a request (peek, consolidation); lock waits included.
DEFAULT_STATEMENT_TIMEOUT = timedelta(seconds=1)
#: How long an append waits for a lock before it fails and is retried.
DEFAULT_WRITER_LOCK_TIMEOUT = timedelta(seconds=1)
DEFAULT_POOL_SIZE = 8
DEFAULT_WRITER_POOL_SIZE = 2
#: Facts one statement of the cap applied on the server deletes, in a transaction of its
#: own: this many, or a quarter of those beyond the cap when that is more
#: (``facts_cap.sql``).
CAP_CHUNK = 10_000
#: The statement timeout of the cap's statements, which rank all the identity's facts
#: (about 3 µs a fact on a slow machine: 400,000 facts outlived the request timeout of
#: 1 s, and the identity was never capped). They run in the load's background work, on
#: one request connection, once per identity.
CAP_STATEMENT_TIMEOUT = timedelta(seconds=30)


def _with_settings(engine_kwargs: dict[str, Any], **settings: str) -> dict[str, Any]:
    """``engine_kwargs`` with server ``settings`` added to every connection it opens."""
    connect_args = dict(engine_kwargs.get("connect_args", {}))
    connect_args["server_settings"] = {**connect_args.get("server_settings", {}), **settings}
    # The request and writer pools are bounded: no overflow, whatever the admin pool has.
    kwargs = {k: v for k, v in engine_kwargs.items() if k != "max_overflow"}
    return {**kwargs, "connect_args": connect_args}


#: Seconds to open a connection, and to run one statement, before giving up on it.
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_COMMAND_TIMEOUT = 60.0
#: The same for the admin pool, whose rebuilds and analytics scan whole tables.
DEFAULT_ADMIN_COMMAND_TIMEOUT = 3600.0
#: Every so many appends, one also deletes the idempotency keys older than a day.
_EXPIRE_KEYS_EVERY = 1_000

#: SQLSTATEs of an append that a lock or a timeout kept out, which the writer retries:
#: nothing of the batch was stored.
_BUSY = {
    LOCK_NOT_AVAILABLE: "a lock held past the writer's lock timeout",
    "40P01": "a deadlock",
    "40001": "a serialization failure",
    QUERY_CANCELED: "a cancelled statement",
}

T = TypeVar("T")


@dataclass(slots=True)
class HeldOut:
    """Requests that a lock wait kept out, since the store was made (reported in
    ``MemoryService.stats()``)."""

    #: Peeks that a held table stopped: their loads answered from the stored facts.
    peeks: int = 0
    #: Consolidations whose lock wait timed out: a held table (``table_lock_timeout``),
    #: or the identity's checkpoint row past ``lock_timeout`` or ``statement_timeout``,
    #: whichever ends first. A load's also counts in
    #: ``load_errors``.
    consolidations: int = 0


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
        request_engine: AsyncEngine | None = None,
        writer_engine: AsyncEngine | None = None,
        known_facts: int = DEFAULT_KNOWN_FACTS,
        table_lock_timeout: timedelta | None = DEFAULT_TABLE_LOCK_TIMEOUT,
    ) -> None:
        """Use ``engine`` (and ``request_engine`` for peeks and consolidations,
        ``writer_engine`` for appends; ``engine`` when None), whose
        ``schema_translate_map`` must place the tables in ``schema`` (:meth:`from_url`
        builds such engines, with the pools and timeouts the module docstring describes).
        ``known_facts``: how many facts, all identities together, the store keeps between
        requests (0: none; see "Facts read once" above). ``table_lock_timeout``: how long
        a consolidation waits for its tables (see "Tables held" above; None: no limit)."""
        self.engine = engine
        self.request_engine = request_engine if request_engine is not None else engine
        self.writer_engine = writer_engine if writer_engine is not None else engine
        self._known = KnownFacts(known_facts)
        self.schema = validate_schema_name(schema)
        self._statements = Statements.for_schema(self.schema)
        # The transaction of a consolidation and its settings, in one round trip (the
        # timeout is a formatted integer, not a value from outside). A consolidation need
        # not wait for its commit to reach disk: if a crash loses it, the facts, history
        # and checkpoint are lost together and the next run redoes it from the same
        # (durably stored) observations.
        self._lock_timeout = lock_timeout_clause(lock_timeout)
        # Its tables first, in the mode its statements take them anyway, waiting at most
        # table_lock_timeout; then the checkpoint row, waiting at most lock_timeout.
        tables = ", ".join(f'"{self.schema}".{table}' for table in _CONSOLIDATION_TABLES)
        # (rollup_owed is only read, by the retention prune: see consolidation_write.sql.)
        begin = (
            f"BEGIN; {lock_timeout_clause(table_lock_timeout, 'table_lock_timeout')}; "
            f"LOCK TABLE {tables} IN ROW EXCLUSIVE MODE; "
            f'LOCK TABLE "{self.schema}".rollup_owed IN ACCESS SHARE MODE; '
            f"{self._lock_timeout}; SET LOCAL synchronous_commit = off"
        )
        # A consolidation's statements run on their generic plans, made once per
        # connection: Postgres otherwise judges the write (and the read of ended lives)
        # cheaper re-planned with each run's values, and plans it again at every
        # consolidation, about 0.5 ms of the server's CPU, for a plan that the values do
        # not change (every table is reached by the identity's index either way).
        self._begin = f"{begin}; {GENERIC_PLANS}"
        # The cap's transactions: under CAP_STATEMENT_TIMEOUT, and planned as usual (its
        # statement ranks every fact of an identity of any size, once in a long while).
        cap_timeout = timeout_setting(CAP_STATEMENT_TIMEOUT, "CAP_STATEMENT_TIMEOUT")
        self._cap_begin = f"{begin}; SET LOCAL statement_timeout = '{cap_timeout}'"
        self.lock_timeout = lock_timeout
        self._appends = 0
        # When the appends fold rollups owed under a lock (see ``rollup_owed``).
        self.rollup_debt = RollupDebt()
        #: What the appends did around locks (``MemoryService.stats()`` reports it).
        self.ingest_counts = IngestCounts()
        #: Peeks and consolidations that a lock kept out (the same).
        self.held_out = HeldOut()
        self._fact_cap: FactCap | None = None

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        schema: str = DEFAULT_SCHEMA,
        lock_timeout: timedelta | None = DEFAULT_LOCK_TIMEOUT,
        pool_size: int = DEFAULT_POOL_SIZE,
        writer_pool_size: int = DEFAULT_WRITER_POOL_SIZE,
        statement_timeout: timedelta | None = DEFAULT_STATEMENT_TIMEOUT,
        writer_lock_timeout: timedelta | None = DEFAULT_WRITER_LOCK_TIMEOUT,
        table_lock_timeout: timedelta | None = DEFAULT_TABLE_LOCK_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        command_timeout: float | None = DEFAULT_COMMAND_TIMEOUT,
        admin_command_timeout: float | None = DEFAULT_ADMIN_COMMAND_TIMEOUT,
        known_facts: int = DEFAULT_KNOWN_FACTS,
        **engine_kwargs: Any,
    ) -> PostgresStore:
        """A store on ``url`` (postgresql://, postgres:// or postgresql+asyncpg://), with
        a request pool of ``pool_size`` connections whose statements run under
        ``statement_timeout``, a writer pool of ``writer_pool_size`` whose lock waits end
        after ``writer_lock_timeout`` (None: no limit), and an admin pool; a request waits
        ``table_lock_timeout`` at most for a table (see "Tables held"); it keeps up to
        ``known_facts`` facts between requests. A statement that gets no answer within
        ``command_timeout`` seconds (``admin_command_timeout`` on the admin pool, whose
        rollup rebuilds and analytics may scan whole tables) fails with a connection
        error."""
        require_types(
            pool_size=(pool_size, int, "a whole number"),
            writer_pool_size=(writer_pool_size, int, "a whole number"),
            known_facts=(known_facts, int, "a whole number"),
        )
        if pool_size < 1 or writer_pool_size < 1:
            raise ValueError("pool_size and writer_pool_size must be at least 1")
        # Seconds (asyncpg's), where the other timeouts are timedeltas: a timedelta or a
        # string here failed only inside each connection attempt, every load and append.
        if seconds_or_none("connect_timeout", connect_timeout) is None:
            raise TypeError("connect_timeout must be a number of seconds, not None")
        seconds_or_none("command_timeout", command_timeout)
        seconds_or_none("admin_command_timeout", admin_command_timeout)
        # A server that stops answering fails the work with a connection error instead of
        # holding it (and ``close``) forever; explicit ``connect_args`` win.
        connect_args = dict(engine_kwargs.pop("connect_args", {}))
        connect_args.setdefault("timeout", connect_timeout)
        admin_args = {"command_timeout": admin_command_timeout, **connect_args}
        connect_args.setdefault("command_timeout", command_timeout)
        engine = create_engine(url, schema=schema, **{**engine_kwargs, "connect_args": admin_args})
        engine_kwargs["connect_args"] = connect_args
        # The peek's lock waits end after table_lock_timeout (a consolidation sets its
        # own in its transaction).
        request_kwargs = _with_settings(
            engine_kwargs,
            statement_timeout=timeout_setting(statement_timeout, "statement_timeout"),
            lock_timeout=timeout_setting(table_lock_timeout, "table_lock_timeout"),
        )
        request_engine = create_engine(
            url, schema=schema, pool_size=pool_size, max_overflow=0, **request_kwargs
        )
        writer_kwargs = _with_settings(
            engine_kwargs,
            lock_timeout=timeout_setting(writer_lock_timeout, "writer_lock_timeout"),
        )
        writer_engine = create_engine(
            url, schema=schema, pool_size=writer_pool_size, max_overflow=0, **writer_kwargs
        )
        return cls(
            engine,
            schema=schema,
            lock_timeout=lock_timeout,
            request_engine=request_engine,
            writer_engine=writer_engine,
            known_facts=known_facts,
            table_lock_timeout=table_lock_timeout,
        )

    @property
    def request_slots(self) -> int:
        """How many peeks and consolidations can hold a connection at once."""
        size: Any = getattr(self.request_engine.pool, "size", None)
        return int(size()) if callable(size) else DEFAULT_POOL_SIZE

    async def start(self) -> None:
        """Open every connection of the request and writer pools, prepare the hot-path
        statements on the request connections and run each once there (a rehearsal that
        writes nothing: :func:`~coda_memory.postgres.unit.rehearse`), and prepare an
        append's on the writer connections, before the first request."""
        # Connections of an earlier start or call, which may have died since.
        opened_before = any(map(opened_connections, (self.request_engine, self.writer_engine)))
        try:
            try:
                await self._warm_pools()
            except Exception as error:
                if not (opened_before and calls_for_new_pool(self.request_engine, error)):
                    raise  # (a server that can't be reached is not asked twice)
                # Died while idle in the pools (a restarted server, terminated backends):
                # each was thrown away as it failed, and new ones are warmed, once.
                await self._warm_pools()
        except Exception as error:
            # One line that says what failed (a refused connection, a server that never
            # answered: a bare TimeoutError), for a host that decides whether to start
            # without memory warm (everything then starts on first use).
            state = sqlstate(error)
            if state in _BUSY:
                # A table held past the lock timeout (a migration under way), or the
                # statement timeout: the warm-up waits no longer, and the service starts
                # on first use, as for a server not reached (the host's startup went on
                # only for that, and a deploy made during a migration failed to start).
                raise StoreBusy(
                    f"start() was kept out by {_BUSY[state]} ({state}); the service "
                    "starts on first use"
                ) from error
            if not cannot_connect(error):
                raise
            raise ConnectionLost(
                f"{unreachable(self.request_engine, error)}; the service starts on first "
                "use once it answers"
            ) from error

    async def _warm_pools(self) -> None:
        """:meth:`start`'s work on the request and writer pools (see :func:`_warm`)."""
        hot_path = [SET_TENANT, SET_TENANT_SESSION, *(q.text for q in self._statements.all())]
        rehearsal = partial(rehearse, statements=self._statements, begin=self._begin)
        await _all_or_first_error(
            _warm(self.request_engine, self.schema, hot_path, rehearsal),
            _warm(self.writer_engine, self.schema, prepared_statements(self.schema)),
        )

    async def append(
        self,
        records: Sequence[ObservationRecord],
        *,
        batch_key: str | None = None,
        first_attempt: bool = False,
    ) -> AppendOutcome:
        if not records:
            return AppendOutcome(stored=0)
        # One transaction with the batch's key: retried on a dead connection (see
        # ``connection``), and by the caller, without storing anything twice.
        key = batch_key if batch_key is not None else str(uuid.uuid4())
        self._appends += 1
        expire = self._appends % _EXPIRE_KEYS_EVERY == 0
        # A key made here is new; a retry below (the connection died) may follow a
        # COMMIT whose acknowledgement was lost.
        attempts = 0
        first = first_attempt or batch_key is None
        # Encoded once, before a connection is taken, in slices with turns of the loop.
        encoded = await encode(records)

        async def store(conn: AsyncConnection) -> AppendOutcome:
            nonlocal attempts
            attempts += 1
            return await append_observations(
                conn,
                self.schema,
                encoded,
                key,
                expire_keys=expire,
                debt=self.rollup_debt,
                first_attempt=first and attempts == 1,
                counts=self.ingest_counts,
            )

        try:
            return await run(self.writer_engine, self.schema, store, idempotent=True)
        except ConnectionLost:
            raise
        except Exception as error:
            if is_connection_error(error):
                raise ConnectionLost(
                    # The server's reason: a refused connection (too many, a password
                    # rotated), a shutdown, a read-only server are not the same to fix.
                    "no usable connection while storing a batch "
                    f"({type(error).__name__}: {error_reason(error)})"
                ) from error
            if isinstance(error, PoolTimeout):
                # Every writer connection stayed in use (writer_pool_size=1 beside a
                # second append, a server that does not answer) past the pool's timeout:
                # nothing of this try reached the server, and the writer tries again (as
                # an error it did not know, the batch was rejected, its observations lost).
                raise StoreBusy(
                    "no writer connection was free within the pool's timeout",
                    # A try before it ran and lost its connection: stored, maybe.
                    may_have_stored=attempts > 0,
                ) from error
            state = sqlstate(error)
            if state in _BUSY:
                raise StoreBusy(
                    f"the batch was kept out by {_BUSY[state]} ({state})",
                    # The connection died around an earlier try's COMMIT: stored, maybe.
                    may_have_stored=attempts > 1,
                ) from error
            raise

    @asynccontextmanager
    async def consolidation(self, identity_id: str) -> AsyncIterator[PostgresConsolidationUnit]:
        # By its label: a host that logs the exception logs no identity.
        doing = f"while consolidating {identity_label(identity_id)}"
        try:
            async with driver_transaction(
                self.request_engine, self.schema, self._begin, doing
            ) as driver:
                with schema_required(self.schema):
                    # The tenant of the transaction (row-level security).
                    await driver.execute(SET_TENANT, identity_id)
                    try:
                        unit = await PostgresConsolidationUnit.open(
                            driver,
                            self._statements,
                            identity_id,
                            partial(driver.execute, "COMMIT"),
                            self._known.entry(identity_id),
                        )
                    except Exception as error:
                        # The wait for the checkpoint row, ended by the request pool's
                        # statement_timeout before lock_timeout: held out as well.
                        if sqlstate(error) == QUERY_CANCELED:
                            self.held_out.consolidations += 1
                        raise
                    # Kept facts of another version (another process wrote, or forgot
                    # the identity) may not answer should this consolidation fail.
                    self._known.seen(identity_id, unit.locked_version)
                try:
                    yield unit
                finally:
                    if unit.facts_read:
                        self._known.reads += 1
                # The facts as the unit left them (committed) or found them (not
                # committed).
                if unit.known is not None:
                    self._known.put(identity_id, unit.known)
        except Exception as error:
            if sqlstate(error) == LOCK_NOT_AVAILABLE:
                self.held_out.consolidations += 1
            raise

    async def facts(self, identity_id: str) -> list[Fact]:
        return await self.run(
            self._bounded(identity_id, lambda conn: FactRepository(conn).stored(identity_id))
        )

    def _bounded(
        self, identity_id: str, work: Callable[[AsyncConnection], Awaitable[T]]
    ) -> Callable[[AsyncConnection], Awaitable[T]]:
        """``work`` as the identity's tenant (:func:`_as_tenant`), its lock waits ending
        after the store's ``lock_timeout``, as a consolidation's do (``facts``,
        ``history`` and ``forget``): a table that a migration or a ``LOCK TABLE`` holds
        made ``facts`` and ``history`` wait as long as it was held (minutes), with the
        host's request behind them."""
        scoped = _as_tenant(identity_id, work)

        async def bounded(conn: AsyncConnection) -> T:
            await conn.exec_driver_sql(self._lock_timeout)  # (opens the transaction, if none)
            return await scoped(conn)

        return bounded

    @property
    def kept_facts_counts(self) -> KnownFacts:
        """The facts kept between requests, for ``stats()``: its ``dropped`` (to make
        room) and ``reads`` (of an identity's facts from the database)."""
        return self._known

    def keeps_facts(self, identity_id: str) -> bool:
        """Whether this store keeps the identity's facts between requests."""
        return self._known.entry(identity_id) is not None

    async def unchanged(self, identity_id: str, version: str) -> bool:
        """Whether the identity's facts still have ``version`` and no observation waits,
        in one round trip that reads no fact."""
        return await self._read(
            identity_id, lambda raw: unchanged(raw, self._statements, identity_id, version)
        )

    async def kept_facts(self, identity_id: str) -> list[Fact]:
        """The identity's stored facts as this store last read or wrote them (none when
        not kept), as new models each call (the caller's own); the service answers a load
        that times out with them."""
        known = self._known.entry(identity_id)
        return [] if known is None else await known.facts()

    def cap_facts(self, cap: FactCap | None) -> None:
        """Apply ``cap`` on the server to an identity found far over it (see
        :class:`~coda_memory.core.caps.FactCap`; None: never). The service sets it."""
        self._fact_cap = cap

    async def peek(self, identity_id: str) -> tuple[list[Fact], bool]:
        facts, pending, _ = await self.peek_versioned(identity_id)
        return facts, pending

    async def peek_versioned(self, identity_id: str) -> tuple[list[Fact], bool, str | None]:
        """:meth:`peek`, with the version of the facts it returns (None: not known, when
        a held table kept the checkpoint from being read).

        The identity's stored facts (none when new observations wait: the kept ones are
        the consolidation's, and the late load's, see ``kept_facts``) and whether new
        observations wait. When a table the
        peek reads is held (see "Tables held"), the facts alone, read without the
        checkpoint or the observations, with nothing said to wait: the load answers from
        them, and the new observations wait for a load that can consolidate them. With a
        cap on facts (:meth:`cap_facts`), an identity that has more than its read limit
        is first brought down to the cap on the server, sparing the facts that waiting
        observations may change."""
        known = self._known.entry(identity_id)
        cap = self._fact_cap
        statements = self._statements
        try:
            limit = None if cap is None else cap.read_limit
            peeked = await self._read(
                identity_id, lambda raw: peek(raw, statements, identity_id, known, limit)
            )
            if peeked.over and cap is not None:
                await self._apply_cap(identity_id, cap)
                known = None  # its facts are gone: read what the cap left
                peeked = await self._read(
                    identity_id, lambda raw: peek(raw, statements, identity_id, known)
                )
        except Exception as error:
            if sqlstate(error) != LOCK_NOT_AVAILABLE:
                raise
            self.held_out.peeks += 1
            noted = HELD_OUT.get()
            if noted is not None:
                noted.append("peek")
            _log.warning(
                "peek held out",
                "coda-memory: a table the peek reads is held (lock timeout); loads answer "
                "from the stored facts, and new observations wait, meanwhile",
            )
            return await self._facts_alone(identity_id, known), False, None
        if not peeked.read:
            self._known.seen(identity_id, peeked.version)
        else:
            self._known.reads += 1
            # Kept for later peeks and the consolidation that follows (see "Facts read
            # once" above).
            kept = self._known.put(identity_id, peeked.known)
            if not kept and peeked.pending and peeked.known is not None:
                # Too many to keep: the facts the peek left out are the caller's only.
                return await peeked.known.facts(), True, peeked.version
        return peeked.facts, peeked.pending, peeked.version

    async def _read(self, identity_id: str, work: Callable[[Any], Awaitable[T]]) -> T:
        """``work(raw)`` on a request connection (its asyncpg connection), outside a
        transaction, with ``identity_id`` the session's tenant; retried once on a dead
        connection."""

        async def read(conn: AsyncConnection) -> T:
            raw = await driver_connection(conn)
            # No transaction: the tenant is the session's, until the connection's next
            # transaction sets its own. The request pool's connections serve only such
            # reads and consolidations, each setting its tenant first; on a pool that
            # other work shares (a store made on one engine), a connection that sets none
            # must see no row, so the setting is cleared after the read (a round trip),
            # and a connection whose read failed or was cancelled (the setting itself
            # too: the server may have applied it) is not given back.
            if self.request_engine is not self.engine:
                await raw.execute(SET_TENANT_SESSION, identity_id)
                return await work(raw)
            try:
                await raw.execute(SET_TENANT_SESSION, identity_id)
                result = await work(raw)
                await raw.execute(CLEAR_TENANT_SESSION)
            except GeneratorExit:  # (closed unfinished: no await may follow)
                raw.terminate()
                raise
            except BaseException:
                raw.terminate()  # (at once, whatever comes: a cancellation cannot stop it)
                # And out of the pool: given back closed, it made the next work meet a
                # dead connection and the whole pool be replaced (a peek a held table
                # kept out, each time).
                await conn.invalidate()
                raise
            return result

        return await run(self.request_engine, self.schema, read, idempotent=True)

    async def _apply_cap(self, identity_id: str, cap: FactCap) -> None:
        """Delete on the server the identity's live facts ranked beyond
        ``cap.kept_on_server`` (``facts_cap.sql``), the lowest ranked first, in
        transactions of :data:`CAP_CHUNK` facts (or a quarter of those beyond the cap),
        each holding its checkpoint row; the facts kept here for it are dropped. What a
        transaction deleted stays deleted when a later one fails.

        Each transaction first reads the observations waiting for the identity's next
        consolidation, under that lock, and spares the facts they may change: they are
        neither ranked nor deleted. The others keep their stored state whatever the
        observations, so one ranked beyond the cap among them is beyond it after the
        consolidation too, and the consolidation would delete it: the cap on the server
        deletes only what the consolidation would, and an identity far over the cap
        is brought down whether or not observations wait (its consolidation would
        otherwise read every fact). The facts expired at the cap's instant go in the
        same transactions, with the events the consolidation would record for them:
        they count in the identity's facts but not in the rank, and a dormant identity
        far over the cap may hold nearly nothing else."""
        dropped = 0
        try:
            while True:
                row = await self._cap_chunk(identity_id, cap)
                dropped += row["dropped"]
                more_ranked = row["dropped"] and row["beyond"] > row["dropped"]
                more_expired = row["expired"] and row["expirable"] > row["expired"]
                if not (more_ranked or more_expired):
                    break
        finally:
            self._known.discard(identity_id)
            if dropped:
                cap.applied(identity_id, dropped)

    async def _cap_chunk(self, identity_id: str, cap: FactCap) -> Any:
        """One transaction of :meth:`_apply_cap`: its row (``dropped``, ``beyond``, ``expired``,
        ``expirable``)."""
        statement, formula = self._statements.cap, cap.formula
        doing = f"while capping the facts of {identity_label(identity_id)}"
        begin = self._cap_begin
        async with driver_transaction(self.request_engine, self.schema, begin, doing) as raw:
            with schema_required(self.schema):
                await raw.execute(SET_TENANT, identity_id)
                locked = await lock_identity(raw, self._statements, identity_id)
                spared = await subjects_waiting(raw, self._statements, identity_id, locked)
                row = await raw.fetchrow(
                    statement.text,
                    *statement.arguments(
                        identity_id=identity_id,
                        now=cap.clock(),
                        base=formula.base,
                        max_exponent=formula.max_exponent,
                        with_ease=formula.default_ease is not None,
                        default_ease=formula.default_ease,
                        expiry_threshold=formula.expiry_threshold,
                        kept=cap.kept_on_server,
                        chunk=CAP_CHUNK,
                        spared=spared,
                    ),
                )
                await raw.execute("COMMIT")
        return row

    async def _facts_alone(self, identity_id: str, known: Known | None) -> list[Fact]:
        """The identity's stored facts, read from ``facts`` only. The kept ones only when
        ``facts`` is held too: without the checkpoint their version can't be checked, and
        another process may have changed the facts since, or forgotten the identity (the
        kept facts of a forgotten identity answered every load for as long as a
        migration held ``checkpoints``)."""
        try:
            facts = await self._read(
                identity_id, lambda raw: stored_facts(raw, self._statements, identity_id)
            )
        except Exception as error:
            if known is None or sqlstate(error) != LOCK_NOT_AVAILABLE:
                raise
            return await known.facts()
        self._known.reads += 1
        return facts

    async def history(self, identity_id: str, subject: str | None = None) -> list[FactEvent]:
        return await self.run(
            self._bounded(
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

    async def forget(self, identity_id: str) -> Forgotten:
        async def erase(conn: AsyncConnection) -> Forgotten:
            # Holding the checkpoint lock (the driver's statements join the transaction
            # on the same connection), no consolidation of the identity runs meanwhile,
            # so none can write facts after they are deleted.
            driver = await driver_connection(conn)
            await lock_identity(driver, self._statements, identity_id)
            await CheckpointRepository(conn).delete(identity_id)
            fact_events = await FactEventRepository(conn).delete_identity(identity_id)
            facts = await FactRepository(conn).delete_identity(identity_id)
            # The identity's rows of the analytics rollup, its owed rollups folded first
            # (while the observations they count are still there); anonymous counts stay.
            await forget_identity(conn, self.schema, identity_id)
            forgotten = Forgotten(
                fact_events=fact_events,
                facts=facts,
                observations=await ObservationRepository(conn).delete_identity(identity_id),
            )
            # Again, after the observations (each statement reads what is committed when
            # it starts): an append of the identity that committed between the first
            # pass and the observations' delete lost its observations there, and its
            # rollup rows go now, so the forgotten identity is not left counted as a user
            # of what it has no observation of. One that commits after this pass stays
            # whole, as an identity that came back. (One snapshot for the whole erasure,
            # repeatable read, made every append of any identity to a shared daily row
            # fail the forget with a serialization failure: under steady ingest, all of
            # them.)
            await forget_identity(conn, self.schema, identity_id)
            await conn.execute(
                delete(redis_imports).where(redis_imports.c.identity_id == identity_id)
            )
            return forgotten

        bounded = self._bounded(identity_id, erase)

        async def forget(conn: AsyncConnection) -> Forgotten:
            async with conn.begin():  # committed whole
                return await bounded(conn)

        # Forgetting twice forgets the same: retried on a dead connection (the counts are
        # those of the attempt that committed: 0 if a lost COMMIT had in fact committed).
        # The kept facts go whatever the outcome: a forget cancelled once its COMMIT was
        # sent may have erased them, and a stale answer must not bring them back.
        try:
            return await self.run(forget)
        finally:
            self._known.discard(identity_id)

    async def run(
        self, work: Callable[[AsyncConnection], Awaitable[T]], *, idempotent: bool = True
    ) -> T:
        """Run ``work`` in a connection of this store, under the connection policy of
        :mod:`coda_memory.postgres.connection` (``work`` idempotent: retried once when the
        connection turns out to be dead)."""
        return await run(self.engine, self.schema, work, idempotent=idempotent)

    async def close(self) -> None:
        """Close every connection of the store's pools; one that a call still holds is
        closed when the call gives it back (see
        :func:`~coda_memory.postgres.connection.released`)."""
        engines = {self.request_engine, self.writer_engine, self.engine}
        for engine in engines:
            released(engine)
        await dispose(engines)

    async def cancel_openings(self, timeout: float) -> None:
        """Cancel the connections the store's pools are still opening, and wait for them
        up to ``timeout`` seconds (see :func:`~coda_memory.postgres.engine.cancel_openings`)."""
        await cancel_openings({self.request_engine, self.writer_engine, self.engine}, timeout)


async def _warm(
    engine: AsyncEngine,
    schema: str,
    statements: list[str],
    rehearsal: Callable[[Any], Awaitable[None]] | None = None,
) -> None:
    """Check out as many connections as the pool holds, at once (so that each is a new
    one), prepare ``statements`` on each into asyncpg's statement cache, which the hot
    path's ``fetch`` calls then hit, and run ``rehearsal`` on each (its asyncpg
    connection)."""
    size: Any = getattr(engine.pool, "size", None)
    count = int(size()) if callable(size) else 1

    async def one() -> None:
        conn = await engine.connect().start()
        prepared = False
        try:
            driver = await driver_connection(conn)
            await _prepare(driver, statements)
            if rehearsal is not None:
                await rehearsal(driver)
            prepared = True
        finally:
            # Cut short (cancelled, failed), the prepares may have left their implicit
            # transaction open, with its tables' locks: the connection goes.
            await let_go(engine, conn, None if prepared else conn.invalidate)

    with schema_required(schema):
        await _all_or_first_error(*(one() for _ in range(count)))


async def _all_or_first_error(*works: Awaitable[None]) -> None:
    """Run ``works`` together, and once every one has ended raise the first error among
    them: a retry that began as the first failed met connections that the others had
    not yet thrown away."""
    outcomes = await asyncio.gather(*works, return_exceptions=True)
    failure = next((outcome for outcome in outcomes if isinstance(outcome, BaseException)), None)
    if failure is not None:
        raise failure


async def _prepare(driver: Any, statements: list[str]) -> None:
    """Prepare ``statements`` on ``driver`` (an asyncpg connection) into its cache."""
    for text in statements:
        # asyncpg's public prepare() bypasses the cache that fetch() uses.
        await driver._prepare(text, use_cache=True)
    if statements:
        # A prepare ends with a Flush, not a Sync: the implicit transaction it opened,
        # with its tables' locks, would stay open in the pool until the connection's
        # first request (a migration's lock would queue behind it). A simple query
        # commits it.
        await driver.execute("SELECT 1")
