"""The Redis store under the cancellations hosts make (a client that disconnects, a
shutdown deadline, an anyio cancel scope that cancels at every turn of the loop): no
identity's lock is left held, and an append cut off on its way stores nothing.

A lock left held stayed for ``lock_ttl`` (30 s) with a token nobody knew, and every
consolidation and ``forget`` of the identity meanwhile, in any process, waited
``lock_timeout`` and failed. The store reaches Redis through :class:`ReplyGate`, a
loopback proxy that holds the server's replies from the first command holding a marker
on, so a test cancels exactly while a command's reply is awaited."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis.asyncio as aioredis

from coda_memory.core.sanitize import sanitize_observation
from coda_memory.errors import ConnectionLost
from coda_memory.redis import RedisStore
from tests.helpers import T0, tool_ok

#: How a RESP array of EVALSHA starts, after its length.
_EVALSHA = b"$7\r\nEVALSHA\r\n"


class ReplyGate:
    """A loopback TCP proxy to Redis. :meth:`hold_from` arms it: the first chunk the
    client sends that holds ``marker`` is forwarded, and from then on no reply reaches
    any client (``holding`` is set) until :meth:`open`. :meth:`cut_before_last_evalsha`
    arms it otherwise: that chunk is forwarded only up to its last EVALSHA, then both
    sockets close, as a connection lost half-way through sending a batch."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.connections = 0
        self.holding = asyncio.Event()
        self._open = asyncio.Event()
        self._open.set()
        self._marker: bytes | None = None
        self._cut = False
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def hold_from(self, marker: bytes) -> None:
        self._marker = marker

    def cut_before_last_evalsha(self) -> None:
        self._marker, self._cut = _EVALSHA, True

    def open(self) -> None:
        self._open.set()

    async def close(self) -> None:
        self._open.set()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        server_r, server_w = await asyncio.open_connection(self.host, self.port)
        for task in (
            asyncio.create_task(self._upstream(client_r, server_w, client_w)),
            asyncio.create_task(self._downstream(server_r, client_w)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _upstream(
        self,
        reader: asyncio.StreamReader,
        server_w: asyncio.StreamWriter,
        client_w: asyncio.StreamWriter,
    ) -> None:
        try:
            while data := await reader.read(1 << 20):
                if self._marker is not None and self._marker in data:
                    self._marker = None
                    if self._cut:
                        start = data.rfind(b"*", 0, data.rindex(_EVALSHA))
                        server_w.write(data[:start])
                        await server_w.drain()
                        client_w.close()
                        return
                    self._open.clear()
                    self.holding.set()
                server_w.write(data)
                await server_w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            # close() sends what is buffered before the FIN: the server runs it.
            server_w.close()

    async def _downstream(
        self, reader: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> None:
        try:
            while data := await reader.read(1 << 20):
                await self._open.wait()
                client_w.write(data)
                await client_w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            client_w.close()


@pytest.fixture
async def gate(_redis_server: str) -> AsyncIterator[ReplyGate]:
    parts = urlsplit(_redis_server)
    proxy = ReplyGate(parts.hostname or "127.0.0.1", parts.port or 6379)
    try:
        yield proxy
    finally:
        await proxy.close()


@pytest.fixture
async def store(gate: ReplyGate, redis_url: str) -> AsyncIterator[RedisStore]:
    """A store on ``redis_url`` (its database and prefix) through the proxy, with a lock
    wait short enough for a held lock to fail the test quickly."""
    parts = urlsplit(redis_url)
    port = await gate.start()
    url = urlunsplit(parts._replace(netloc=f"127.0.0.1:{port}"))
    store = RedisStore.from_url(url, lock_timeout=timedelta(seconds=1))
    try:
        await store.client.ping()  # a pooled connection, made with the replies flowing
        yield store
    finally:
        await store.close()


async def _consolidate(store: RedisStore, identity: str) -> None:
    async with store.consolidation(identity) as unit:
        await unit.load()


async def _until(condition: Callable[[], Awaitable[int] | bool]) -> None:
    """Wait, a millisecond at a time, until ``condition`` holds (at most 5 s)."""
    async with asyncio.timeout(5):
        while True:
            held = condition()
            if await held if inspect.isawaitable(held) else held:
                return
            await asyncio.sleep(0.001)


async def _lock_is_free(store: RedisStore, client: aioredis.Redis, identity: str) -> None:
    """The identity's lock key is gone, and a consolidation takes the lock at once."""
    assert not await client.exists(store.keys.of("lock", identity))
    await _consolidate(store, identity)


async def test_a_lock_taken_as_the_caller_is_cancelled_is_released(
    gate: ReplyGate, store: RedisStore, redis_client: aioredis.Redis
) -> None:
    """Cancelled while ``SET … NX`` waits for its reply: the server takes the lock
    anyway, and only the cancelled frame knew its token."""
    gate.hold_from(b"NX")
    task = asyncio.ensure_future(_consolidate(store, "ana"))
    await gate.holding.wait()
    await _until(lambda: redis_client.exists(store.keys.of("lock", "ana")))  # taken
    task.cancel()
    gate.open()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _lock_is_free(store, redis_client, "ana")


async def test_a_second_cancellation_does_not_stop_the_release(
    gate: ReplyGate, store: RedisStore, redis_client: aioredis.Redis
) -> None:
    """Cancelled while ``unit.load()`` waits, then again while the release reconnects
    (redis-py drops a connection cut mid-reply), as an anyio cancel scope does."""
    gate.hold_from(_EVALSHA)  # the load script's reply
    task = asyncio.ensure_future(_consolidate(store, "ana"))
    await gate.holding.wait()
    connections = gate.connections
    task.cancel()
    await _until(lambda: gate.connections > connections)  # the release's
    task.cancel()
    gate.open()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _lock_is_free(store, redis_client, "ana")


async def test_a_cancelled_forget_releases_the_lock(
    gate: ReplyGate, store: RedisStore, redis_client: aioredis.Redis
) -> None:
    """Cancelled after the lock was taken, while the forget script is being loaded (after
    a restart, a failover or SCRIPT FLUSH, EVALSHA answers NOSCRIPT first)."""
    await store.append([sanitize_observation("ana", tool_ok("get_account"), T0)])
    await redis_client.script_flush()
    gate.hold_from(_EVALSHA)  # the forget script's NOSCRIPT
    task = asyncio.ensure_future(store.forget("ana"))
    await gate.holding.wait()
    task.cancel()
    gate.open()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _lock_is_free(store, redis_client, "ana")
    forgotten = await store.forget("ana")  # nothing was erased before
    assert forgotten.observations == 1


async def test_an_append_cut_off_on_its_way_stores_nothing(
    gate: ReplyGate, store: RedisStore, redis_client: aioredis.Redis
) -> None:
    """A batch of two identities whose connection is lost after the first identity's
    script reached the server: nothing is stored, as the writer counts such a batch
    (dropped, or stored again by its retry), instead of the first identity's part."""
    batch = [
        sanitize_observation(identity, tool_ok("get_account"), T0) for identity in ("ana", "bo")
    ]
    gate.cut_before_last_evalsha()
    with pytest.raises(ConnectionLost):
        await store.append(batch)
    for identity in ("ana", "bo"):
        assert await redis_client.zcard(store.keys.of("obs", identity)) == 0
    outcome = await store.append(batch)  # a new connection: the retry stores it whole
    assert outcome.stored == 2
    for identity in ("ana", "bo"):
        assert await redis_client.zcard(store.keys.of("obs", identity)) == 1
