"""The Redis store: the original server's key layout, with coda-memory's guarantees.

Observations and facts live where the original TypeScript server kept them, in the same
JSON (see :mod:`~coda_memory.redis.codec` and :mod:`~coda_memory.redis.keys`), so either
server can read what the other wrote. What the original design lacked comes from a few
extra keys under the same prefix: a pending set per identity, so that what is new never
depends on a timestamp (see :mod:`~coda_memory.redis.unit`); a lock per identity, so that
concurrent consolidations from any number of processes queue up and consume every
observation exactly once; a capped fact history; and per-session reinforcement records.

Everything that must change together is one Lua script, which Redis runs atomically.
redis-py is imported here, so the package needs the ``redis`` extra
(``pip install 'coda-memory[redis]'``); nothing outside ``coda_memory.redis`` imports it
(``export``, the import's reader, does too).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Sequence,
)
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from importlib import resources
from typing import Any, NoReturn, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    ExecAbortError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from coda_memory.core.cancellation import run_to_end, to_the_end
from coda_memory.core.logs import identity_label, short_error
from coda_memory.core.model import MAX_INT32, MAX_SPAN, Fact, FactEvent, Observation
from coda_memory.core.options import NONE, require_types
from coda_memory.errors import AccessDenied, ConnectionLost, StoreBusy
from coda_memory.ports import AppendOutcome, Forgotten, ObservationRecord, unidentified
from coda_memory.redis import unit as unit_module
from coda_memory.redis.codec import (
    BadRecord,
    checkpoint_ms,
    event_from_value,
    from_ms,
    observation_body,
    observation_from_json,
    to_ms,
)
from coda_memory.redis.keys import DEFAULT_PREFIX, IDENTITY_KINDS, Keys
from coda_memory.redis.unit import COMMIT_KEYS, PendingMoved, RedisConsolidationUnit, parse_facts
from coda_memory.redis.urls import check_redis_url

_log = logging.getLogger("coda_memory")

DEFAULT_LOCK_TIMEOUT = timedelta(seconds=5)
#: How long a lock outlives a consolidation whose process died holding it.
DEFAULT_LOCK_TTL = timedelta(seconds=30)
#: Fact events kept per identity (the oldest go first).
DEFAULT_HISTORY_LIMIT = 1_000
#: How long a session's reinforcement records are kept after its latest reinforcement.
DEFAULT_SESSION_HORIZON = timedelta(days=30)

#: How long, and how many, of an identity's batch keys its ``batches:`` set keeps (about
#: 26 KB at most): a batch retried after a lost reply finds its key there, and is not
#: stored again, unless a day passed or more than this many later batches of the
#: identity were stored meanwhile (while the writer retries, Redis is mostly unreachable
#: for the other writers too).
BATCH_KEYS_FOR_MS = 24 * 60 * 60 * 1000
BATCH_KEYS_KEPT = 200
#: How many batch keys of forgotten identities ``forgotten-batches`` keeps at most (about
#: 10 MB), for a day: a batch of an identity stored before a ``forget`` and retried after
#: it (its reply lost) is not stored again, as on Postgres, whose batch keys carry no
#: identity (500 forgets a day of identities with 200 recent batches each).
FORGOTTEN_BATCH_KEYS_KEPT = 100_000
T = TypeVar("T")

#: How many ``lock_ttl`` a running consolidation keeps its lock for at most (10 minutes
#: by default): one that hangs (a reply that never comes, with no ``socket_timeout``)
#: then lets it expire, as a dead process's, rather than hold its identity for ever.
LOCK_KEPT_FOR_TTLS = 20

#: The fields of the checkpoint map (one per identity consolidated) that one reply of
#: ``identities()`` carries, about (HSCAN's count).
IDENTITIES_PAGE = 1_000

#: Reads in pages of a list (the fact history) whose head a commit trimmed meanwhile,
#: before it is read in one reply (see ``RedisStore._whole_list``).
LIST_READ_ATTEMPTS = 5

#: How many times a lock's release is sent when the connection it went on was dead.
RELEASE_ATTEMPTS = 3

_SCRIPTS = ("append", "peek", "load", "commit", "unlock", "forget", "expire", "renew", "page")
#: The keys of an identity that an append writes, in the order append.lua takes them.
_APPEND_KEYS = ("state", "obs", "pending", "batches")


@functools.cache
def _client_options() -> frozenset[str]:
    """What redis-py's ``Redis.from_url`` takes besides the URL: its own parameters, the
    pool's and every connection class's (TCP, TLS, Unix socket)."""
    from redis.asyncio import connection

    taken: set[str] = set()
    for function in (
        aioredis.Redis.from_url,
        connection.ConnectionPool.__init__,
        connection.AbstractConnection.__init__,
        connection.Connection.__init__,
        connection.SSLConnection.__init__,
        connection.UnixDomainSocketConnection.__init__,
    ):
        for parameter in inspect.signature(function).parameters.values():
            if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
                taken.add(parameter.name)
    return frozenset(taken - {"self", "url", "decode_responses"})


def _unknown_query_parameters(url: str, client: Any) -> list[str]:
    """The query parameters of ``url`` that no part of ``client`` takes: redis-py hands
    every parameter of a URL to its connections, whose class refuses those it does not
    know (``ssl_cert_reqs`` on a ``redis://`` one) only as it connects."""
    given = {key for key, value in parse_qsl(urlsplit(url).query) if value}
    taken: set[str] = {"db", "path"}
    pool = client.connection_pool
    for cls in (*pool.connection_class.__mro__, type(pool)):
        init = cls.__dict__.get("__init__")
        if init is not None:
            taken.update(inspect.signature(init).parameters)
    return sorted(given - taken)


#: The codes of the errors of the server's state, which every identity of an append
#: batch meets alike (a replica, maxmemory, a script cache emptied, too few replicas, a
#: failed save, a server loading or busy with a script): the batch is retried whole. Any
#: other error fails one identity's script alone (a key of another type, a key or command
#: its ACL user may not touch, a Lua error on what something else wrote in its keys), and
#: that identity's rows are refused: retried, such an error held every identity's
#: observations back for good. (append.lua raises no error of its own: what it finds
#: unusable in its keys, it returns.) redis-py names some by their class.
_SERVER_STATE_CODES = frozenset(
    {
        "READONLY",
        "OOM",
        "NOSCRIPT",
        "NOREPLICAS",
        "MISCONF",
        "MASTERDOWN",
        "BUSY",
        "LOADING",
        "TRYAGAIN",
        "CLUSTERDOWN",
        "EXECABORT",
        "NoScriptError",
        "BusyLoadingError",
        "TryAgainError",
        "ClusterDownError",
        "MasterDownError",
    }
)
#: The errors :func:`_lost_while` turns into the store's own, raised as they are.
_NAMED_ERRORS = (RedisConnectionError, RedisTimeoutError, ReadOnlyError, OutOfMemoryError)
#: Where redis-py quotes the error of a command refused as it was queued: its message,
#: or (redis-py 6 and later) the repr of its arguments, ``('MISCONF …',)``.
_QUEUED_CAUSE = re.compile(r" caused error: \(?['\"]?([A-Z]{3,20})\b")


#: How Redis before 7 wraps an error that a script met (an error reply of ``redis.call``,
#: or one the server raised for the command, which adds the place again): ``ERR Error
#: running script (call to f_<sha>): @user_script:12: @user_script: 12: -READONLY You
#: can't write …`` (redis-py strips the ``ERR``). Redis 7 passes the error on with its
#: code, and redis-py raises it by its class.
_WRAPPED = re.compile(
    r"(?:ERR )?Error running script \(call to f_[0-9a-f]+\): (?:@?user_script: ?\d+: )*-?(.*)",
    re.DOTALL,
)
#: What Redis says for a command or key of a script that the ACL user may not run or
#: touch: Redis 6 and 7.0 (``The user executing the script can't run this command or
#: subcommand``, ``… can't access at least one of the keys …``), 7.2 and Valkey (``ACL
#: failure in script``).
_SCRIPT_ACL_REFUSAL = re.compile(
    r"The user executing the script (?:can't|is lacking)|ACL failure in script"
)


#: Where redis-py's error for a command refused as it was queued ends its quote of the
#: command (whose arguments are the identity's keys and the rows) and the server's error
#: begins.
_QUEUED_QUOTE_END = " of pipeline caused error: "


def _server_text(error: BaseException) -> str:
    """The server's words in ``error``: for a command refused as it was queued, what
    follows redis-py's quote of the command, which holds the identity and may hold any
    words (an identity holding an ACL refusal's took a MISCONF for the identity's own)."""
    text = str(error)
    if text.startswith("Command # "):
        return text.rpartition(_QUEUED_QUOTE_END)[2]
    return text


def _script_refused_by_acl(error: BaseException) -> bool:
    """Whether ``error`` is a script's command or key that the ACL user may not run or
    touch, in any supported server's words (wrapped by Redis 6 or not)."""
    return _SCRIPT_ACL_REFUSAL.search(_server_text(error)) is not None


def _error_code(error: BaseException) -> str:
    """The code of a Redis error reply (the first word of the server's message, which
    redis-py strips from the errors it has a class for, or of the error it quotes for a
    command refused as it was queued, or of the error a script met, which Redis 6 wraps
    in an ``ERR``), or the error's class."""
    if isinstance(error, NoPermissionError) or _script_refused_by_acl(error):
        return "NOPERM"
    wrapped = _WRAPPED.match(str(error))
    if wrapped is not None:
        # A Lua error of the script's own (no code: "attempt to compare nil …") stays
        # the ERR it came as.
        inner = re.match(r"([A-Z]{3,20}) ", wrapped[1])
        return inner[1] if inner is not None else "ERR"
    code = getattr(error, "status_code", None)
    if isinstance(code, str) and code:
        return code
    text = str(error)
    # (The last quote's: the command's own arguments come before it.)
    queued = _QUEUED_CAUSE.search(text, max(0, text.rfind(" caused error: ")))
    if queued is not None:
        return queued[1]
    first = text.split(" ", 1)[0]
    if type(error) is ResponseError and re.fullmatch(r"[A-Z]{3,20}", first):
        return first
    return type(error).__name__


def _of_the_identity(error: BaseException) -> bool:
    """Whether ``error`` failed one identity's append script alone (see
    :data:`_SERVER_STATE_CODES`)."""
    return not isinstance(error, _NAMED_ERRORS) and _error_code(error) not in _SERVER_STATE_CODES


def _raise_server_state(error: BaseException) -> NoReturn:
    """Raise an append error of the server's state as what the writer retries the batch
    on: the error itself when :func:`_lost_while` names it, else :class:`StoreBusy`
    naming its code (the identities stored already store nothing again: their batch
    keys)."""
    if isinstance(error, _NAMED_ERRORS):
        raise error
    code = _error_code(error)
    if _WRAPPED.match(str(error)) is not None and code in ("READONLY", "OOM"):
        # Redis 6's wrapped READONLY or OOM, as redis-py raises Redis 7's: after a
        # READONLY, the pool's idle connections are left for the primary of the moment
        # (see RedisStore._leave_if_read_only).
        named = ReadOnlyError if code == "READONLY" else OutOfMemoryError
        raise named(str(error)) from error
    raise StoreBusy(
        f"Redis failed the append with {code}, an error of its state",
        may_have_stored=True,
    ) from error


def _aborted_at(error: ResponseError, calls: int) -> int | None:
    """The place of the call whose command the server refused as it was queued, which
    redis-py names in the error it raises for the aborted transaction (``Command # 2``,
    counted from 1); None when it names none."""
    found = re.match(r"Command # (\d+) ", str(error))
    if found is None or not 1 <= int(found[1]) <= calls:
        return None
    return int(found[1]) - 1


def _append_refusal(identity_id: str, result: Any) -> str | None:
    """Why the append script stored none of the identity's rows (None: it stored them):
    what the script found unusable in its keys (a negative reply, see ``append.lua``), or
    the error the server failed it with for that identity alone (:data:`_SERVER_STATE_CODES`).
    An error of the server's state, the same for every identity (a replica, maxmemory, a
    script cache emptied, too few replicas), is raised instead: the batch is retried
    whole under its key, and the identities stored already store nothing again."""
    if isinstance(result, Exception):
        if not _of_the_identity(result):
            _raise_server_state(result)
        return f"Redis failed the identity's append script ({short_error(result, (identity_id,))})"
    if int(result) >= 0:
        return None
    if -int(result) > len(_APPEND_KEYS):
        return (
            "the identity's state key in Redis holds a seq that is not a whole number "
            "of at most 15 digits"
        )
    kind = _APPEND_KEYS[-int(result) - 1]
    return f"the identity's {kind} key in Redis holds another type of value"


#: The identity's keys that ``stats()`` checks for their type but does not count, each
#: with a command of its type that fails on another (WRONGTYPE); the lock is a string.
_TYPE_CHECKED = (
    ("state", "HLEN"),
    ("sessions", "HLEN"),
    ("session-times", "ZCARD"),
    ("batches", "ZCARD"),
)

#: The keys forget.lua counts before it erases them, in its order.
_FORGET_COUNTED = ("obs", "facts", "history")
#: The keys forget.lua takes first, in its order: the identity's lock, then the shared
#: keys it writes.
_FORGET_SHARED = ("lock", "checkpoint", "forgotten-batches")


class LockTimeout(TimeoutError):
    """Another consolidation of the identity held its lock longer than ``lock_timeout``."""


class LockLost(RuntimeError):
    """The lock expired before the commit (another run may have taken it): nothing of
    this consolidation was written."""


def _script_source(name: str) -> str:
    return resources.files("coda_memory.redis").joinpath("lua", f"{name}.lua").read_text()


def split_prefix(url: str) -> tuple[str, str | None]:
    """``url`` without its ``prefix`` query parameter, and that parameter (if any)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    prefixes = [value for key, value in query if key == "prefix"]
    rest = urlencode([(key, value) for key, value in query if key != "prefix"])
    return urlunsplit(parts._replace(query=rest)), (prefixes[-1] if prefixes else None)


@dataclass(frozen=True, slots=True)
class RedisStoreStats:
    """What ``RedisStore.stats`` counts, over every identity under the prefix."""

    prefix: str
    identities: int
    observations: int
    pending_observations: int
    facts: int
    fact_events: int
    used_memory_bytes: int
    #: Keys of an identity that hold another type of value than the layout's (something
    #: else wrote them): counted as holding nothing.
    keys_of_another_type: int = 0


class RedisStore:
    """:class:`~coda_memory.ports.MemoryStore` on Redis (redis-py's asyncio client)."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        lock_timeout: timedelta | None = DEFAULT_LOCK_TIMEOUT,
        lock_ttl: timedelta = DEFAULT_LOCK_TTL,
        history_limit: int = DEFAULT_HISTORY_LIMIT,
        session_horizon: timedelta = DEFAULT_SESSION_HORIZON,
    ) -> None:
        """Use ``client``, which must return bytes (``decode_responses=False``)."""
        require_types(
            lock_timeout=(lock_timeout, (timedelta, NONE), "a timedelta (or None)"),
            lock_ttl=(lock_ttl, timedelta, "a timedelta"),
            session_horizon=(session_horizon, timedelta, "a timedelta"),
            history_limit=(history_limit, int, "a whole number (0: unbounded)"),
        )
        if not 0 <= history_limit <= MAX_INT32:
            # Past it, the commit's LTRIM got the limit as a double ("1e+18"), which Redis
            # refused after the facts were written: every later run applied the same
            # pending observations again.
            raise ValueError(f"history_limit must be 0 (unbounded) to {MAX_INT32:,}")
        if lock_ttl <= timedelta(0):
            raise ValueError("lock_ttl must be positive")
        if not timedelta(0) < session_horizon <= MAX_SPAN:
            # Not positive, every run pruned every session's record, and a session
            # reinforced a fact again at each run; past years, every commit failed
            # (its now less the horizon is before year 1).
            raise ValueError(f"session_horizon must be positive, at most {MAX_SPAN.days:,} days")
        self.client = client
        self.keys = Keys(prefix)
        self.lock_timeout = lock_timeout
        self.lock_ttl = lock_ttl
        self.history_limit = history_limit
        self.session_horizon = session_horizon
        self._scripts = {name: client.register_script(_script_source(name)) for name in _SCRIPTS}
        #: Whether the server ran an empty MULTI/EXEC for the client's user (see
        #: :meth:`_check_transactions`).
        self._transactions_checked = False

    @classmethod
    def from_url(cls, url: str, *, prefix: str | None = None, **options: Any) -> RedisStore:
        """A store on ``url`` (``redis://host:port/db``, ``rediss://…``). The key prefix is
        ``prefix``, else the URL's ``?prefix=`` parameter, else ``coda:memory:``.
        ValueError for a URL redis-py would misread (see
        :func:`~coda_memory.redis.urls.check_redis_url`)."""
        check_redis_url(url)
        bare, url_prefix = split_prefix(url)
        store_keys = {"lock_timeout", "lock_ttl", "history_limit", "session_horizon"}
        store_options = {k: v for k, v in options.items() if k in store_keys}
        client_options = {k: v for k, v in options.items() if k not in store_keys}
        unknown = sorted(set(client_options) - _client_options())
        if unknown:
            # redis-py would take them, and fail only at the first connection (which
            # load_memory does not raise): a mistyped option went unnoticed.
            raise TypeError(
                f"unexpected options for redis://: {unknown} (the store takes "
                f"{sorted(store_keys | {'prefix'})}, and redis-py's client its own)"
            )
        client = aioredis.Redis.from_url(bare, decode_responses=False, **client_options)
        unknown = _unknown_query_parameters(bare, client)
        if unknown:
            # (The names only: a value may be a password.) redis-py passed them on to the
            # connection, whose TypeError came at the first connection: start() raised
            # it, and without start() every load answered empty.
            raise ValueError(
                f"unknown Redis URL parameter(s) {unknown}: not taken by redis-py's "
                f"{client.connection_pool.connection_class.__name__}"
            )
        chosen = prefix if prefix is not None else url_prefix
        return cls(client, prefix=DEFAULT_PREFIX if chosen is None else chosen, **store_options)

    def _script(self, name: str) -> Any:
        return self._scripts[name]

    async def start(self) -> None:
        """Reach the server once before the first request (one ``PING``), so that a
        host learns at startup that it cannot; ConnectionLost, naming it, if not."""
        try:
            await self.client.ping()
        except (RedisConnectionError, RedisTimeoutError, OSError, ResponseError) as error:
            # ResponseError: what the connection's own commands met (AUTH, SELECT of a
            # database out of range), or a PING the user may not run, or BUSY (a script of
            # another client running long).
            raise self._unreachable(error) from error
        try:
            with _lost_while("checking the user's permissions"):
                await self._check_transactions()
        except StoreBusy as busy:
            # The EXEC met BUSY (a script that started after the PING), as the PING would
            # have: the service starts on first use, where the writer retries it.
            raise self._unreachable(busy.__cause__ or busy) from busy
        await self._warn_if_evicting()

    def _unreachable(self, error: BaseException) -> ConnectionLost:
        """What ``start()`` raises for a server it cannot use yet: ConnectionLost naming it
        and ``error``."""
        options = self.client.connection_pool.connection_kwargs
        where = options.get("path") or f"{options.get('host', 'localhost')}:" + str(
            options.get("port", 6379)
        )
        return ConnectionLost(
            f"cannot reach Redis at {where} ({short_error(error)}); the service starts "
            "on first use once it answers"
        )

    async def _check_transactions(self) -> None:
        """Run an empty ``MULTI``/``EXEC`` once (it writes nothing), and raise
        :class:`AccessDenied` naming the command when the client's ACL user may not run
        it: an append sends a batch's scripts in one ``MULTI``/``EXEC``, and with
        ``MULTI`` refused the server ran them at once, outside any transaction, and
        stored them, then refused ``EXEC`` ("EXEC without MULTI"), and the batch was
        counted as rejected. Checked by ``start()``, else before the first append (and
        before each one while it fails).

        A server or a proxy that does not run the command (unknown, or renamed away) is
        refused alike, naming it; an error of the server's state (``EXECABORT`` quoting
        ``BUSY``: a script of another client running long) is what ``_append`` makes of
        it, :class:`StoreBusy`, which the writer retries (raised as it was, the batch was
        rejected for good)."""
        if self._transactions_checked:
            return
        single = self.client.client()
        done = False
        try:
            for command in ("MULTI", "EXEC"):
                try:
                    await single.execute_command(command)  # type: ignore[no-untyped-call]
                except ResponseError as error:
                    # An EXEC refused discards the transaction (EXECABORT, quoting NOPERM,
                    # or BUSY, …).
                    refused = isinstance(error, NoPermissionError) or (
                        isinstance(error, ExecAbortError) and "NOPERM" in str(error)
                    )
                    if not refused and (
                        # (An empty transaction aborted for no refusal: the server's
                        # state, whatever redis-py's version calls it; before 7 its
                        # errors carry no code.)
                        isinstance(error, ExecAbortError) or not _of_the_identity(error)
                    ):
                        _raise_server_state(error)
                    if refused:
                        raise AccessDenied(
                            f"the Redis user may not run {command}: coda-memory's appends "
                            "need +multi and +exec (a batch is one MULTI/EXEC); nothing was "
                            f"written ({short_error(error)})"
                        ) from error
                    raise AccessDenied(
                        f"Redis does not run {command} (the server, or a proxy before it): "
                        "coda-memory's appends need MULTI and EXEC (a batch is one "
                        f"MULTI/EXEC); nothing was written ({short_error(error)})"
                    ) from error
            done = True
        finally:
            if not done and single.connection is not None:
                # Maybe left inside MULTI (EXEC refused, or a cancellation between the
                # two): not for the pool, whose next command it would only queue.
                await single.connection.disconnect()
            await single.aclose()
        self._transactions_checked = True

    async def _warn_if_evicting(self) -> None:
        """Log a warning when the server evicts keys at ``maxmemory`` (set, not 0): any
        key under an ``allkeys-*`` policy, common on caches (observations, facts and
        pending sets would go without a word), and the keys with a TTL under a
        ``volatile-*`` one (the batch keys among them: a retried batch whose key was
        evicted is stored twice), where ``noeviction`` refuses the writes, which the
        writer retries. Nothing when the server does not say (an ACL user without INFO)."""
        try:
            memory = await self.client.info("memory")
        except (RedisConnectionError, RedisTimeoutError, ResponseError):
            return
        policy = memory.get("maxmemory_policy")
        if isinstance(policy, bytes):
            policy = policy.decode(errors="replace")
        try:
            limit = int(memory.get("maxmemory", 0))
        except (TypeError, ValueError):
            limit = 0
        if limit <= 0 or not isinstance(policy, str):
            return
        if policy.startswith("allkeys-"):
            _log.warning(
                "coda-memory: Redis evicts any key at maxmemory (maxmemory-policy %s): "
                "memory would be lost without a word; set maxmemory-policy noeviction",
                policy,
            )
        elif policy.startswith("volatile-"):
            _log.warning(
                "coda-memory: Redis evicts keys with a TTL at maxmemory (maxmemory-policy "
                "%s): the batch keys among them, so a retried batch could be stored twice, "
                "and the consolidation locks; set maxmemory-policy noeviction",
                policy,
            )

    # -- writes -------------------------------------------------------------------------

    async def append(
        self,
        records: Sequence[ObservationRecord],
        *,
        batch_key: str | None = None,
        first_attempt: bool = False,
    ) -> AppendOutcome:
        """Store a batch once per ``batch_key`` (see :data:`BATCH_KEYS_KEPT`); a lost
        connection raises ConnectionLost."""
        try:
            with _lost_while("storing observations"):
                await self._check_transactions()
                return await self._append(records, batch_key or str(uuid.uuid4()))
        except ConnectionLost as lost:
            await self._leave_if_read_only(lost)
            raise

    async def _leave_if_read_only(self, lost: ConnectionLost) -> None:
        """After a write that a replica refused (a failover demoted the server, or the URL
        names a replica): the idle connections are closed, so that the next ones, made
        anew, reach the server that is the primary now (the pool kept them, and every
        write failed until the process restarted)."""
        if isinstance(lost.__cause__, ReadOnlyError):
            await self.client.connection_pool.disconnect(inuse_connections=False)

    async def _append(self, records: Sequence[ObservationRecord], key: str) -> AppendOutcome:
        by_identity: dict[str, list[tuple[int, ObservationRecord]]] = {}
        for index, record in enumerate(records):
            by_identity.setdefault(record.identity_id, []).append((index, record))
        refused = unidentified(records)
        # One MULTI/EXEC: a batch cut off on its way (the writer cancels an append that
        # outlives close()'s grace) stores nothing, as the writer then counts it, rather
        # than the identities whose scripts had reached the server.
        now_ms = round(time.time() * 1000)
        kept = [key, now_ms, BATCH_KEYS_FOR_MS, BATCH_KEYS_KEPT]
        calls: list[tuple[str, list[int], list[Any]]] = []  # identity, indexes, arguments
        for identity, rows in by_identity.items():
            if not identity:  # refused above: no identity's keys
                continue
            args: list[Any] = []
            indexes: list[int] = []
            for index, record in rows:
                try:
                    body = observation_body(record)
                except (TypeError, ValueError) as exc:
                    refused.append((index, f"metadata is not JSON: {exc}"))
                    continue
                args += [to_ms(record.created_at), body]
                indexes.append(index)
            if args:
                calls.append((identity, indexes, args))
        while calls:
            try:
                results = await self._append_calls(calls, kept)
            except ExecAbortError as error:
                _raise_server_state(error)
            except ResponseError as error:
                # A command refused as it was queued (an ACL key pattern that leaves out
                # one identity's keys) aborts the whole transaction, and redis-py raises
                # the command's error: that identity's rows are refused (the error's
                # message quotes the command, keys and all: its code only), and the
                # other identities' sent again.
                if not isinstance(error.__cause__, ExecAbortError):
                    if not _of_the_identity(error):
                        # (BUSY to the script check or to MULTI, a script of another
                        # client's running long: the batch was rejected for good.)
                        _raise_server_state(error)
                    raise
                place = _aborted_at(error, len(calls))
                if place is None or not _of_the_identity(error):
                    _raise_server_state(error)
                _, indexes, _ = calls.pop(place)
                code = _error_code(error)
                queued = f"Redis refused the identity's append script as it was queued ({code})"
                refused.extend((index, queued) for index in indexes)
                continue
            # An identity whose script the server failed, or that found its keys unusable,
            # stores nothing of its rows; the other identities' are stored.
            for (identity, indexes, _), result in zip(calls, results, strict=True):
                failed = _append_refusal(identity, result)
                if failed is not None:
                    refused.extend((index, failed) for index in indexes)
            break
        refused.sort()
        return AppendOutcome(stored=len(records) - len(refused), refused=refused)

    async def _append_calls(
        self, calls: Sequence[tuple[str, list[int], list[Any]]], kept: list[Any]
    ) -> list[Any]:
        """Each call's append script in one MULTI/EXEC, and each one's reply or error in
        its place: MULTI/EXEC rolls nothing back, so the other identities' scripts ran,
        and their rows are stored."""
        async with self.client.pipeline(transaction=True) as pipe:
            for identity, _, args in calls:
                await self._script("append")(
                    keys=[
                        *(self.keys.of(kind, identity) for kind in _APPEND_KEYS),
                        self.keys.forgotten_batches,
                    ],
                    args=[*kept, len(args) // 2, *args],
                    client=pipe,
                )
            results: list[Any] = await pipe.execute(raise_on_error=False)
            return results

    # -- consolidation ------------------------------------------------------------------

    async def _acquire(self, identity_id: str, token: str) -> None:
        """Take the identity's lock with ``token``, waiting up to ``lock_timeout``.

        Each ``SET … NX`` runs to its reply even when the caller is cancelled meanwhile
        (:func:`~coda_memory.core.cancellation.to_the_end`): once sent, the server takes
        the lock whether or not anyone reads the reply, and only this frame knows the
        token. A lock taken as the caller was cancelled is released before the
        cancellation is raised (else it stayed held for ``lock_ttl``, and every
        consolidation of the identity meanwhile, in any process, timed out). A cancelled
        caller waits ``lock_ttl`` at most for a reply: the lock has expired by then."""
        key = self.keys.of("lock", identity_id)
        ttl_ms = max(1, round(self.lock_ttl.total_seconds() * 1000))
        loop = asyncio.get_running_loop()
        deadline = (
            None if self.lock_timeout is None else loop.time() + self.lock_timeout.total_seconds()
        )
        delay = 0.001
        while True:
            with _lost_while(f"locking {identity_label(identity_id)}"):
                try:
                    taken, cancelled = await to_the_end(
                        self.client.set(key, token, nx=True, px=ttl_ms),
                        limit=self.lock_ttl.total_seconds(),
                    )
                except (RedisConnectionError, RedisTimeoutError):
                    # The SET may have reached the server with its reply lost: a lock that
                    # nobody would release for lock_ttl, every consolidation of the
                    # identity meanwhile timing out. Released with the token (nothing if
                    # not taken), a second at most: a server that does not answer has the
                    # lock expire.
                    await self._release(identity_id, token, limit=1.0)
                    raise
            if cancelled is not None:
                if taken:
                    await self._release(identity_id, token)
                raise cancelled
            if taken:
                return
            if delay == 0.001:  # busy at the first try: a lock without an expiry ends too
                with _lost_while(f"locking {identity_label(identity_id)}"):
                    await self._script("expire")(keys=[key], args=[ttl_ms])
            if deadline is not None and loop.time() >= deadline:
                raise LockTimeout(
                    f"the consolidation lock of {identity_label(identity_id)} stayed busy"
                )
            # The holder is usually done within milliseconds: poll, backing off to 25 ms.
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.025)

    async def _release(self, identity_id: str, token: str, limit: float | None = None) -> None:
        """Release the identity's lock if ``token`` still holds it, to the end even when
        the caller is cancelled meanwhile (then raised after), waiting at most ``limit``
        seconds (``lock_ttl``, when the lock has expired anyway); on a dead connection the
        lock expires by itself after ``lock_ttl``."""

        async def release() -> None:
            # A dead pooled connection fails once and is thrown away: try again on a
            # fresh one (the unlock is by token, so a repeat is harmless). Sent once over
            # a connection that a killed client or an idle timeout had closed, the unlock
            # was lost, and every consolidation of the identity timed out for lock_ttl.
            for attempt in range(RELEASE_ATTEMPTS):
                try:
                    await self._script("unlock")(
                        keys=[self.keys.of("lock", identity_id)], args=[token]
                    )
                    return
                except (RedisConnectionError, RedisTimeoutError):
                    await asyncio.sleep(0.01 * attempt)
                except ReadOnlyError:
                    return  # a replica now: the lock expires with the old primary's data

        await run_to_end(release(), limit=self.lock_ttl.total_seconds() if limit is None else limit)

    @asynccontextmanager
    async def _locked(self, identity_id: str) -> AsyncIterator[str]:
        """The identity's lock, held for the block (its token), released however the
        block ends, a cancellation included (see ``_acquire`` and ``_release``)."""
        token = secrets.token_hex(16)
        try:
            await self._acquire(identity_id, token)
        except ConnectionLost as lost:
            await self._leave_if_read_only(lost)
            raise
        keeper = asyncio.create_task(self._keep(identity_id, token))
        try:
            yield token
        finally:
            # Not awaited: a renewal on its way is by token, so after the release below
            # it extends nothing.
            keeper.cancel()
            await self._release(identity_id, token)

    async def _keep(self, identity_id: str, token: str) -> None:
        """Extend the identity's lock to ``lock_ttl`` every third of it while ``token``
        holds it (until cancelled, :data:`LOCK_KEPT_FOR_TTLS` times ``lock_ttl`` at
        most). A consolidation that ran longer than ``lock_ttl`` (a backlog of hundreds
        of thousands of observations, read in pages and planned in slices) lost its
        lock and wrote nothing, at every attempt, for ever. A process that stops
        answering (it died, its loop is held) lets the lock expire, and its commit then
        finds it lost."""
        key = self.keys.of("lock", identity_id)
        ttl_ms = max(1, round(self.lock_ttl.total_seconds() * 1000))
        for _ in range(3 * LOCK_KEPT_FOR_TTLS):
            await asyncio.sleep(self.lock_ttl.total_seconds() / 3)
            try:
                if not await self._script("renew")(keys=[key], args=[token, ttl_ms]):
                    return  # expired, and maybe taken: the commit will find it lost
            except (RedisConnectionError, RedisTimeoutError, ResponseError, OSError):
                continue  # the next renewal may reach it; else the lock expires

    @asynccontextmanager
    async def consolidation(self, identity_id: str) -> AsyncIterator[RedisConsolidationUnit]:
        async with self._locked(identity_id) as token:
            try:
                yield RedisConsolidationUnit(
                    keys=self.keys,
                    identity_id=identity_id,
                    token=token,
                    load_script=self._load_script,
                    commit_script=self._commit_script,
                    read_sessions=functools.partial(self._read_sessions, identity_id),
                    read_history=lambda: self.history(identity_id),
                    history_limit=self.history_limit,
                    session_horizon=self.session_horizon,
                )
            except (RedisConnectionError, RedisTimeoutError) as error:
                # The identity by its label: a host logs what it raises, and a span
                # records it.
                raise ConnectionLost(
                    f"the connection died while consolidating {identity_label(identity_id)}: "
                    f"{type(error).__name__}"
                ) from error

    async def _read_sessions(
        self, identity_id: str, sessions: list[str]
    ) -> list[bytes | str | None]:
        """The records of the identity's ``sessions`` (a key of another type as the
        :class:`BadRecord` naming its kind)."""
        with _typed(("sessions",)):
            records: list[bytes | str | None] = await self.client.hmget(
                self.keys.of("sessions", identity_id), sessions
            )
            return records

    async def _load_script(self, *, keys: list[str], args: list[Any]) -> Any:
        with self._checkpoint_checked(), _typed((*_READ_KEYS, "state")):
            return await self._script("load")(keys=keys, args=args)

    async def _commit_script(self, *, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self._script("commit")(keys=keys, args=args)
        except ResponseError as error:
            if "LOCKLOST" in str(error):
                raise LockLost(str(error)) from error
            if "PENDINGMOVED" in str(error):
                raise PendingMoved(str(error)) from error
            kind = _refused_kind(error, COMMIT_KEYS)
            if kind is None:
                raise
            raise BadRecord(
                f"{_another_type(kind)}: nothing of the consolidation was written"
            ) from None

    # -- reads --------------------------------------------------------------------------

    async def facts(self, identity_id: str) -> list[Fact]:
        with _lost_while("reading facts"), _typed(("facts",)):
            values = await _read_twice(
                lambda: self.client.hvals(self.keys.of("facts", identity_id))
            )
        return sorted(parse_facts(identity_id, values), key=lambda f: f.subject)

    async def peek(self, identity_id: str) -> tuple[list[Fact], bool]:
        """Whether observations wait, and the facts: left out when observations wait,
        unless the identity's lock is held (see ``peek.lua``), so that a load that cannot
        consolidate in time, behind a lock that a dead process left for ``lock_ttl``,
        answers with the facts of the last consolidation rather than empty."""
        with _lost_while("reading facts"), self._checkpoint_checked(), _typed(_READ_KEYS):
            reply = await _read_twice(
                lambda: self._script("peek")(
                    keys=[*self.keys.read_keys(identity_id), self.keys.of("lock", identity_id)],
                    args=[identity_id],
                )
            )
        values = reply[1] if len(reply) > 1 else []
        return parse_facts(identity_id, values), bool(int(reply[0]))

    async def history(self, identity_id: str, subject: str | None = None) -> list[FactEvent]:
        with _lost_while("reading fact history"), _typed(("history",)):
            raw = await self._whole_list(self.keys.of("history", identity_id))
        events = []
        for record in raw:
            try:
                events.append(event_from_value(identity_id, json.loads(record)))
            except (ValueError, KeyError, TypeError):
                continue  # a record that does not parse is left out, as by every read
        return [e for e in events if subject is None or e.subject == subject]

    async def _whole_list(self, key: str) -> list[Any]:
        """Every item of the list ``key``, in pages of
        :data:`~coda_memory.redis.unit.LOAD_PAGE` items, each a reply of its own: a
        history with no limit (``history_limit=0``) grows without bound, and read in one
        reply it outlived redis-py's socket timeout. A commit appends at the tail (an
        item appended meanwhile is read or not) and trims the head of a history at its
        limit: each later page is followed by a read of the head, and when it is not the
        one of the first page, the read starts again (:data:`LIST_READ_ATTEMPTS` times,
        then in one reply, as it was). Only a trim changes the head, and the head read
        after the page is the first page's only if nothing trimmed the list before the
        page was read: the two go in one round trip, without ``MULTI``/``EXEC``, which a
        user that may only read has not (with it, a history past a page was refused)."""
        page = unit_module.LOAD_PAGE
        for _ in range(LIST_READ_ATTEMPTS):
            items: list[Any] = await self.client.lrange(key, 0, page - 1)
            head = items[0] if items else None
            while len(items) % page == 0 and items:
                async with self.client.pipeline(transaction=False) as pipe:
                    pipe.lrange(key, len(items), len(items) + page - 1)
                    pipe.lindex(key, 0)
                    more, now = await pipe.execute()
                if now != head:
                    break
                items += more
                if len(more) < page:
                    return items
            else:
                return items
        whole: list[Any] = await self.client.lrange(key, 0, -1)
        return whole

    async def observations(self, identity_id: str) -> list[Observation]:
        """The identity's stored (not yet pruned) observations, oldest ``createdAt``
        first; records that do not parse are left out.

        Read in pages (``page.lua``) of :data:`~coda_memory.redis.unit.LOAD_PAGE`
        observations or :data:`~coda_memory.redis.unit.LOAD_PAGE_BYTES` of them, each a
        reply of its own: read in one, hundreds of thousands outlived redis-py's socket
        timeout (5 s) at every attempt. Each observation stored throughout the read is
        in it once; one appended or pruned meanwhile may be or not.

        A page is a script, as the loads' reads are: an ACL user that may not run it
        (``+@read`` alone) gets :class:`AccessDenied` naming what it needs (``+evalsha``,
        and ``+script|load`` for a server whose script cache lacks it)."""
        key = self.keys.of("obs", identity_id)
        script = self._script("page")
        read: dict[Any, None] = {}  # in order, each once
        cursor: list[Any] = []
        with (
            _lost_while("reading observations"),
            _typed(("obs",)),
            _script_allowed("observations()", self.keys.prefix, identity_id),
        ):
            while True:
                args = [unit_module.LOAD_PAGE, unit_module.LOAD_PAGE_BYTES, *cursor]
                page = await _read_twice(functools.partial(script, keys=[key], args=args))
                more, *items = page
                read.update(dict.fromkeys(items[0::2]))
                if not int(more) or not items:
                    break
                cursor = items[-2:]
        members = list(read)
        observations: list[Observation] = []
        for member in members:
            try:
                observations.append(observation_from_json(identity_id, member))
            except BadRecord:
                continue
        return observations

    async def checkpoint(self, identity_id: str) -> datetime | None:
        """The checkpoint map's entry: ``createdAt`` of the latest consumed observation.
        :class:`BadRecord` for one that is not epoch ms in decimal, as the scripts and the
        import refuse it (its message names the map, neither the identity nor the value:
        a host logs what it raises)."""
        with _lost_while("reading a checkpoint"), self._checkpoint_map_read():
            raw = await self.client.hget(self.keys.checkpoint, identity_id)
        if raw is None:
            return None
        try:
            return from_ms(checkpoint_ms(raw), "checkpoint")
        except BadRecord as exc:
            raise BadRecord(f"{self.keys.checkpoint} (the checkpoint map): {exc}") from None

    @contextlib.contextmanager
    def _checkpoint_map_read(self) -> Iterator[None]:
        """A command on the checkpoint map: one of another type as the :class:`BadRecord`
        the store raises for every corrupt value (not the driver's ResponseError)."""
        try:
            yield
        except ResponseError as exc:
            if not str(exc).startswith("WRONGTYPE"):
                raise
            raise BadRecord(
                f"{self.keys.checkpoint} holds a value of another type than a hash (the"
                " checkpoint map): no identity's checkpoint can be read"
            ) from None

    @contextlib.contextmanager
    def _checkpoint_checked(self) -> Iterator[None]:
        """A script that reads the identity's checkpoint (peek, load): its refusal of one
        that is not epoch ms (BADCHECKPOINT) as the :class:`BadRecord` that
        ``checkpoint()`` raises for it."""
        try:
            yield
        except ResponseError as exc:
            if "BADCHECKPOINT" not in str(exc):
                raise
            raise BadRecord(
                f"{self.keys.checkpoint} (the checkpoint map): the checkpoint is not epoch ms"
                " in decimal"
            ) from None

    async def identities(self) -> list[str]:
        """Every identity with observations, facts, history or a checkpoint, sorted. A key
        that is not UTF-8 (no identity coda-memory stores) gives an identity with its
        bytes as surrogate escapes, which the caller can tell apart and report."""
        with _lost_while("listing identities"):
            found: set[str] = set()
            for kind in ("obs", "facts", "pending", "history"):
                async for key in self.client.scan_iter(match=self.keys.pattern(kind), count=1000):
                    text = _decoded(key)
                    found.add(self.keys.identity_of(kind, text))
            # By HSCAN, a page of about IDENTITIES_PAGE fields a reply: the map holds a
            # field for every identity ever consolidated, and HKEYS read it in one reply.
            with self._checkpoint_map_read():
                async for field, _ in self.client.hscan_iter(
                    self.keys.checkpoint, count=IDENTITIES_PAGE
                ):
                    found.add(_decoded(field))
            return sorted(found)

    async def stats(self) -> RedisStoreStats:
        """Counts over every identity under the prefix (a SCAN: for operators)."""
        with _lost_while("counting"):
            identities = await self.identities()
            observations = pending = facts = events = other_type = 0
            for start in range(0, len(identities), 500):
                async with self.client.pipeline(transaction=False) as pipe:
                    for identity in identities[start : start + 500]:
                        pipe.zcard(_encoded(self.keys.of("obs", identity)))
                        pipe.zcard(_encoded(self.keys.of("pending", identity)))
                        pipe.hlen(_encoded(self.keys.of("facts", identity)))
                        pipe.llen(_encoded(self.keys.of("history", identity)))
                        # Not counted, only checked for their type (_TYPE_CHECKED).
                        for kind, command in _TYPE_CHECKED:
                            pipe.execute_command(command, _encoded(self.keys.of(kind, identity)))
                    # One key of another type failed the whole count (WRONGTYPE).
                    replies = await pipe.execute(raise_on_error=False)
                counts = [_counted(reply) for reply in replies]
                other_type += counts.count(None)
                step = 4 + len(_TYPE_CHECKED)
                observations += sum(n or 0 for n in counts[0::step])
                pending += sum(n or 0 for n in counts[1::step])
                facts += sum(n or 0 for n in counts[2::step])
                events += sum(n or 0 for n in counts[3::step])
            memory = await self.client.info("memory")
            return RedisStoreStats(
                prefix=self.keys.prefix,
                identities=len(identities),
                observations=observations,
                pending_observations=pending,
                facts=facts,
                fact_events=events,
                used_memory_bytes=int(memory.get("used_memory", 0)),
                keys_of_another_type=other_type,
            )

    # -- administration -----------------------------------------------------------------

    async def forget(self, identity_id: str) -> Forgotten:
        k = self.keys
        # The lock goes first in the keys (forget.lua checks it, and releases it last;
        # the release after it, for a script that never ran, finds it gone).
        first = (*_FORGET_SHARED, "batches", *_FORGET_COUNTED)
        kinds = [*first, *(kind for kind in IDENTITY_KINDS if kind not in first)]
        shared = {"checkpoint": k.checkpoint, "forgotten-batches": k.forgotten_batches}
        keys = [shared.get(kind) or k.of(kind, identity_id) for kind in kinds]
        with _lost_while(f"forgetting {identity_label(identity_id)}"):
            try:
                async with self._locked(identity_id) as token:
                    observations, facts, events = await self._script("forget")(
                        keys=keys,
                        args=[
                            token,
                            identity_id,
                            round(time.time() * 1000),
                            BATCH_KEYS_FOR_MS,
                            FORGOTTEN_BATCH_KEYS_KEPT,
                        ],
                    )
            except NoPermissionError as error:
                # An ACL user whose key patterns leave out a key of the script (the shared
                # forgotten-batches key, when they list the prefix's keys one by one): the
                # script never ran, and the lock is released. Redis names no key: the
                # first one refused, by its kind (its name holds the identity).
                kind = await self._refused_kind(zip(kinds, keys, strict=True))
                key = "one of the keys it erases or writes" if kind is None else _kind_named(kind)
                raise AccessDenied(
                    f"the Redis user may not touch {key}: forget needs every key under the "
                    f"prefix (~{k.prefix}*), the checkpoint map and forgotten-batches "
                    f"included; nothing was erased ({short_error(error, (identity_id,))})"
                ) from error
            except ResponseError as error:
                if not _script_refused_by_acl(error):
                    raise
                # A command of the script the user may not run: UNLINK, refused before
                # the checkpoint, so what stays is counted once (nothing is pending
                # again); HDEL, after the keys, which leaves the checkpoint behind. The
                # script is not undone by its error.
                raise AccessDenied(
                    "the Redis user may not run a command of forget (it needs ZADD, UNLINK, "
                    "HDEL, DEL among others); the identity may be partly erased, run it "
                    f"again once allowed ({short_error(error, (identity_id,))})"
                ) from error
        return Forgotten(observations=observations, facts=facts, fact_events=events)

    async def _refused_kind(self, keys: Iterable[tuple[str, str]]) -> str | None:
        """The kind of the first of ``keys`` (kind, key) that the client's ACL user may not
        name in a script (an empty one, run with each key alone), or None when it may name
        each, or may not run a script at all."""
        probe = self.client.register_script("return 0")
        try:
            await probe(keys=[])
        except ResponseError:
            return None  # the command refused, not a key
        for kind, key in keys:
            try:
                await probe(keys=[key])
            except NoPermissionError:
                return kind
            except ResponseError:
                return None
        return None

    async def close(self) -> None:
        await self.client.aclose()


__all__ = ["LockLost", "LockTimeout", "RedisStore", "RedisStoreStats", "split_prefix"]


#: The kinds of the keys that the peek and load scripts read, in their order (see
#: :meth:`Keys.read_keys`; ``checkpoint``: the checkpoint map).
_READ_KEYS = ("checkpoint", "pending", "obs", "facts")


def _kind_named(kind: str) -> str:
    """A key by its kind, never its name (which holds the identity)."""
    if kind == "checkpoint":
        return "the checkpoint map"
    if kind == "forgotten-batches":
        return "the forgotten-batches key (shared by every identity)"
    return f"the identity's {kind} key"


def _another_type(kind: str) -> str:
    """Why a key of ``kind`` is refused: by its kind, never its name (which holds the
    identity, and a host logs what the store raises)."""
    key = "the checkpoint map" if kind == "checkpoint" else f"the identity's {kind} key"
    return f"{key} in Redis holds another type of value"


def _refused_kind(error: ResponseError, kinds: Sequence[str]) -> str | None:
    """The kind of the key that ``error`` refused: a script's ``BADTYPE <place>`` among
    its keys of ``kinds``, or a command's WRONGTYPE on its one key; None for another
    error."""
    text = str(error)
    found = re.match(r"BADTYPE (\d+) ", text)
    if found is not None:
        return kinds[int(found[1]) - 1]
    if text.startswith("WRONGTYPE") and len(kinds) == 1:
        return kinds[0]
    return None


@contextlib.contextmanager
def _typed(kinds: Sequence[str]) -> Iterator[None]:
    """A read of keys of ``kinds`` (a command's one key, or a script's in its order): a
    key of another type as the :class:`BadRecord` the store raises for every corrupt
    value, naming the key's kind (it was the driver's ResponseError, naming nothing)."""
    try:
        yield
    except ResponseError as error:
        kind = _refused_kind(error, kinds)
        if kind is None:
            raise
        raise BadRecord(_another_type(kind)) from None


@contextlib.contextmanager
def _script_allowed(call: str, prefix: str, identity_id: str) -> Iterator[None]:
    """A read that is a Lua script: the ACL user's refusal of the script (its EVALSHA, or
    the SCRIPT LOAD after a server's script cache lost it) or of its key as the
    :class:`AccessDenied` naming what the read needs, not redis-py's NoPermissionError
    (the message names no identity: a host logs what the store raises)."""
    try:
        yield
    except NoPermissionError as error:
        raise AccessDenied(
            f"the Redis user may not run {call}: its reads are Lua scripts, which need "
            f"+evalsha and +script|load besides the read commands, and every key under "
            f"the prefix (~{prefix}*) ({short_error(error, (identity_id,))})"
        ) from error


def _counted(reply: Any) -> int | None:
    """A count's reply: None for a key of another type, any other error raised."""
    if isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE"):
        return None
    if isinstance(reply, Exception):
        raise reply
    return int(reply)


async def _read_twice(read: Callable[[], Awaitable[T]]) -> T:
    """``read()``, once more when the connection it went on was dead: a pooled connection
    that a killed client or the server's idle ``timeout`` closed fails its first command
    (redis-py then drops it), and a load answered empty for it. Reads only: a write whose
    reply was lost may have been applied."""
    try:
        return await read()
    except RedisConnectionError:
        return await read()


@contextlib.contextmanager
def _lost_while(doing: str) -> Iterator[None]:
    """A connection to Redis that drops or times out, as the :class:`ConnectionLost` that
    the Postgres store raises too ("while <doing>"): a host catches one error whatever the
    store, and never the driver's own."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError) as error:
        raise ConnectionLost(
            f"the connection to Redis failed while {doing}: {type(error).__name__}"
        ) from error
    except ReadOnlyError as error:
        # A replica (after a failover, or named by the URL): retried, not blamed on rows.
        raise ConnectionLost(f"Redis only reads (a replica) while {doing}") from error
    except OutOfMemoryError as error:
        # maxmemory with noeviction: a write to retry later, not a bad batch.
        raise StoreBusy(f"Redis refused a write while {doing}: it is at maxmemory") from error


def _decoded(raw: bytes | str) -> str:
    """A key or field as text; bytes that are not UTF-8 as surrogate escapes."""
    return raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else str(raw)


def _encoded(key: str) -> bytes:
    """A key as Redis holds it: the bytes :func:`_decoded` read it from (surrogate
    escapes back to the bytes that were not UTF-8)."""
    return key.encode("utf-8", "surrogateescape")
