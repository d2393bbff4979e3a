"""The Redis store on a server of its own that the tests turn into a replica, fill to
``maxmemory`` or drop the clients of: what a failover, a full server or a restarted proxy
does to a running service. Each test starts its own ``redis-server`` (the machine's is
shared with other tests)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import timedelta
from typing import Any, NamedTuple

import pytest
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import NoPermissionError, ResponseError

from coda_memory import MemoryService
from coda_memory.core.sanitize import sanitize_observation
from coda_memory.errors import AccessDenied, ConnectionLost, StoreBusy
from coda_memory.redis import RedisStore
from coda_memory.redis import unit as unit_module
from coda_memory.redis.codec import to_ms
from tests.helpers import T0, FakeClock, tool_ok
from tests.redis.helpers import bad_refused_alone
from tests.redis_fixtures import _own_server

pytestmark = pytest.mark.redis


@pytest.fixture
def own_redis_url() -> Iterator[str]:
    with contextlib.contextmanager(_own_server)() as url:
        yield url


@pytest.fixture
async def admin(own_redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(own_redis_url)
    yield client
    await client.aclose()


@contextlib.asynccontextmanager
async def _acl_user(
    admin: aioredis.Redis, server_url: str, name: str, **rules: Any
) -> AsyncIterator[str]:
    """The URL of the server as the ACL user ``name``, made for the block with ``rules``
    (``acl_setuser``'s: every key and channel unless they say otherwise), enabled and
    without a password; the user is deleted after."""
    given = {"keys": ["*"], "channels": ["*"], **rules}
    await admin.acl_setuser(name, enabled=True, nopass=True, **given)
    try:
        yield server_url.replace("redis://", f"redis://{name}:any@", 1)
    finally:
        await admin.acl_deluser(name)


class _AclStores(NamedTuple):
    #: As the server's default user, which may do anything (it writes what the other reads).
    owner: RedisStore
    #: As the ACL user.
    store: RedisStore
    #: The server's URL as the ACL user.
    url: str


@contextlib.asynccontextmanager
async def _acl_stores(
    admin: aioredis.Redis, server_url: str, name: str, **rules: Any
) -> AsyncIterator[_AclStores]:
    """A store as the server's default user, and one as the ACL user ``name`` (see
    :func:`_acl_user`), closed after."""
    async with _acl_user(admin, server_url, name, **rules) as url:
        owner = RedisStore.from_url(server_url)
        store = RedisStore.from_url(url)
        try:
            yield _AclStores(owner, store, url)
        finally:
            await store.close()
            await owner.close()


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def _held_back_then_stored(
    service: MemoryService,
    caplog: pytest.LogCaptureFixture,
    fault: Callable[[], Awaitable[object]],
    mend: Callable[[], Awaitable[object]],
    said: str,
    reason: str,
) -> None:
    """With one observation of alice stored, ``fault`` the server; five more are held back
    (the writer tried, logged ``said`` with ``reason``, and waits to retry), none rejected;
    ``mend`` it, and all six are stored."""
    service.emit_observation("alice", tool_ok("get_account", session="s0"))
    await service.drain(10)
    await fault()
    caplog.set_level(logging.WARNING, "coda_memory")
    for n in range(1, 6):
        service.emit_observation("alice", tool_ok("get_account", session=f"s{n}"))
    async with asyncio.timeout(10):
        while f"storing 5 observation(s) {said}" not in caplog.text:
            await asyncio.sleep(0.01)  # polling the log until the writer tried
    assert reason in caplog.text
    assert service.stats().rejected == 0
    await mend()
    await service.drain(10)
    stats = service.stats()
    assert (stats.stored, stats.rejected, stats.pending) == (6, 0, 0)


async def test_a_replica_keeps_the_batches_for_later_and_is_left_when_writable(
    own_redis_url: str, admin: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A failover that made the server a replica (or a URL naming one): every write failed
    with READONLY, which the writer took for bad input and rejected for good, and the
    consolidation lock could not be released."""
    service = MemoryService.from_url(own_redis_url, clock=FakeClock(), load_timeout=5.0)

    async def replica() -> None:
        assert len((await service.load_memory("alice")).facts) == 1
        # A replica of a primary that does not answer: it keeps its data, refuses writes.
        await admin.replicaof("127.0.0.1", _closed_port())

    try:
        await _held_back_then_stored(
            service,
            caplog,
            replica,
            lambda: admin.replicaof("NO", "ONE"),
            "failed",
            "Redis only reads",
        )
        loaded = await service.load_memory("alice")
        assert [(f.subject, f.reinforcement_count) for f in loaded.facts] == [
            ("tool_affinity:get_account", 6)
        ]
    finally:
        await admin.replicaof("NO", "ONE")
        await service.close()


async def test_a_server_at_maxmemory_keeps_the_batches_for_later(
    own_redis_url: str, admin: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """maxmemory with noeviction refuses writes (OOM): the writer rejected them for good,
    as bad input."""
    service = MemoryService.from_url(own_redis_url, clock=FakeClock(), load_timeout=5.0)

    async def full() -> None:
        await admin.config_set("maxmemory-policy", "noeviction")
        await admin.config_set("maxmemory", "1")

    try:
        await _held_back_then_stored(
            service,
            caplog,
            full,
            lambda: admin.config_set("maxmemory", "0"),
            "waits",
            "maxmemory",
        )
    finally:
        await admin.config_set("maxmemory", "0")
        await service.close()


async def test_a_lock_is_released_after_the_connections_were_killed(
    own_redis_url: str, admin: aioredis.Redis
) -> None:
    """The unlock went once, over a pooled connection that a killed client (a restarted
    proxy, an idle timeout) had left dead: it was lost, and every consolidation of the
    identity timed out until the lock expired."""
    store = RedisStore.from_url(own_redis_url)
    try:
        async with store.consolidation("alice"):
            assert await admin.keys("*lock*") != []
            await admin.client_kill_filter(_type="normal", skipme=True)
        assert await admin.keys("*lock*") == []
        async with asyncio.timeout(2):  # taken at once, not after lock_timeout
            async with store.consolidation("alice"):
                pass
    finally:
        await store.close()


async def test_a_load_after_the_connections_were_killed_reads_on_a_fresh_one(
    own_redis_url: str, admin: aioredis.Redis
) -> None:
    """A pooled connection that a killed client (or the server's idle timeout) closed
    failed the next load's peek, which answered empty."""
    service = MemoryService.from_url(own_redis_url, clock=FakeClock(), load_timeout=5.0)
    try:
        service.emit_observation("alice", tool_ok("get_account", session="s0"))
        await service.drain(10)
        assert len((await service.load_memory("alice")).facts) == 1
        await admin.client_kill_filter(_type="normal", skipme=True)
        assert len((await service.load_memory("alice")).facts) == 1
        assert (await service.store.facts("alice")) != []
        await admin.client_kill_filter(_type="normal", skipme=True)
        assert len(await service.store.facts("alice")) == 1
        assert service.stats().load_errors == 0
    finally:
        await service.close()


async def test_a_script_error_of_one_identity_refuses_its_rows_alone(
    own_redis_url: str, admin: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """An error that no check of append.lua foresees (here the ACL user may not run TYPE,
    the script's first command, on bad's keys) failed the EXEC's reply as a whole: the
    writer rejected the batch, every identity's rows, though good1's and good2's were
    stored all the same."""
    selectors = [
        ("+type", "~coda:memory:*:good*"),
        ("+type", "~coda:memory:checkpoint"),
        ("+type", "~coda:memory:forgotten-batches"),
    ]
    rules = {"commands": ["+@all", "-type"], "selectors": selectors}
    async with _acl_user(admin, own_redis_url, "writer", **rules) as url:
        service = MemoryService.from_url(url, clock=FakeClock(), load_timeout=5.0)
        caplog.set_level(logging.WARNING, "coda_memory")
        try:
            await bad_refused_alone(service, admin, "coda:memory:")
            assert "Redis failed the identity's append script" in caplog.text
            assert "'bad'" not in caplog.text
            assert await admin.keys("coda:memory:*:bad") == []
            for identity in ("good1", "good2"):
                facts = await service.consolidate(identity)
                assert [f.subject for f in facts] == ["tool_affinity:t"]
        finally:
            await service.close()


ANY_KEY = "Redis evicts any key at maxmemory (maxmemory-policy {})"
WITH_A_TTL = "Redis evicts keys with a TTL at maxmemory (maxmemory-policy {})"


@pytest.mark.parametrize(
    ("policy", "maxmemory", "said"),
    [
        ("allkeys-lru", "100mb", ANY_KEY),
        ("allkeys-lru", "0", None),
        ("volatile-ttl", "100mb", WITH_A_TTL),
        ("noeviction", "100mb", None),
    ],
)
async def test_start_warns_of_a_server_that_evicts_keys_at_maxmemory(
    own_redis_url: str,
    admin: aioredis.Redis,
    caplog: pytest.LogCaptureFixture,
    policy: str,
    maxmemory: str,
    said: str | None,
) -> None:
    """A cache's allkeys-* policy evicts observations, facts and pending sets at
    maxmemory without a word, and a volatile-* one the batch keys (a retried batch is
    then stored twice): nothing told the operator of the latter, and the former was
    warned of on a server without maxmemory (0), which evicts nothing."""
    await admin.config_set("maxmemory-policy", policy)
    await admin.config_set("maxmemory", maxmemory)
    caplog.set_level(logging.WARNING, "coda_memory")
    store = RedisStore.from_url(own_redis_url)
    try:
        await store.start()
    finally:
        await store.close()
    if said is None:
        assert "maxmemory-policy" not in caplog.text
    else:
        assert said.format(policy) in caplog.text


async def test_an_acl_refusal_as_the_script_is_queued_refuses_that_identity_alone(
    own_redis_url: str, admin: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """An ACL key pattern that leaves out one identity's keys refuses its script as it is
    queued, which aborts the whole MULTI/EXEC: every identity of the batch was rejected."""
    keys = ["coda:memory:*:good*", "coda:memory:checkpoint", "coda:memory:forgotten-batches"]
    async with _acl_user(admin, own_redis_url, "writer", keys=keys, commands=["+@all"]) as url:
        service = MemoryService.from_url(url, clock=FakeClock(), load_timeout=5.0)
        caplog.set_level(logging.WARNING, "coda_memory")
        try:
            await bad_refused_alone(service, admin, "coda:memory:")
            assert "Redis refused the identity's append script as it was queued (NOPERM)" in (
                caplog.text
            )
            assert "'bad'" not in caplog.text and ":bad" not in caplog.text
            for identity in ("good1", "good2"):
                facts = await service.consolidate(identity)
                assert [f.subject for f in facts] == ["tool_affinity:t"]
        finally:
            await service.close()


@pytest.mark.parametrize("command", ["multi", "exec"])
async def test_a_user_that_may_not_run_a_transaction_is_refused_before_anything_is_written(
    own_redis_url: str, admin: aioredis.Redis, command: str
) -> None:
    """With MULTI refused, the server ran a batch's scripts at once, outside any
    transaction, and stored them, then refused EXEC ("EXEC without MULTI"): the batch was
    counted as rejected though stored. start() says which command the user lacks, and
    so does the append without it, before anything is written."""
    rules = {"commands": ["+@all", f"-{command}"]}
    async with _acl_stores(admin, own_redis_url, "writer", **rules) as acl:
        store, url = acl.store, acl.url
        with pytest.raises(AccessDenied, match=f"may not run {command.upper()}"):
            await store.start()
        with pytest.raises(AccessDenied, match=f"may not run {command.upper()}"):
            await store.append([sanitize_observation("alice", tool_ok("t"), T0)])
        # Through the writer: the batch rejected, once, naming the command; none stored.
        service = MemoryService.from_url(url, clock=FakeClock(), load_timeout=5.0)
        try:
            service.emit_observation("alice", tool_ok("t"))
            await service.drain(10)
            assert (service.stats().stored, service.stats().rejected) == (0, 1)
        finally:
            await service.close()
        assert await admin.keys("coda:memory:*") == []
        # Its connections answer the next commands (none was left inside a MULTI).
        assert await store.facts("alice") == []
        # Once the user may, the appends go through.
        await admin.acl_setuser("writer", commands=[f"+{command}"])
        assert (await store.append([sanitize_observation("alice", tool_ok("t"), T0)])).stored
        assert await store.client.zcard("coda:memory:pending:alice") == 1


async def test_too_few_replicas_keep_the_batches_for_later(
    own_redis_url: str, admin: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """NOREPLICAS (min-replicas-to-write) reaches redis-py as a plain ResponseError, which
    the store blamed on each identity: the writer rejected the batch for good."""
    service = MemoryService.from_url(own_redis_url, clock=FakeClock(), load_timeout=5.0)
    try:
        await _held_back_then_stored(
            service,
            caplog,
            lambda: admin.config_set("min-replicas-to-write", 1),
            lambda: admin.config_set("min-replicas-to-write", 0),
            "waits",
            "NOREPLICAS",
        )
    finally:
        await admin.config_set("min-replicas-to-write", 0)
        await service.close()


async def test_a_script_cache_flushed_before_the_exec_keeps_the_batch_for_later(
    own_redis_url: str, admin: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SCRIPT FLUSH (or a restart) between the pipeline's script load and its EXEC
    failed each EVALSHA with NOSCRIPT: the writer rejected the batch for good, where a
    retry loads the script again."""
    loaded = Pipeline.load_scripts
    flushed: list[bool] = []

    async def load_then_flush(pipe: Pipeline) -> None:
        await loaded(pipe)  # type: ignore[no-untyped-call]
        if not flushed:
            flushed.append(True)
            await admin.script_flush()

    monkeypatch.setattr(Pipeline, "load_scripts", load_then_flush)
    service = MemoryService.from_url(own_redis_url, clock=FakeClock(), load_timeout=5.0)
    try:
        for identity in ("alice", "bob"):
            service.emit_observation(identity, tool_ok("t"))
        await service.drain(10)
        stats = service.stats()
        assert flushed
        assert (stats.stored, stats.rejected, stats.pending) == (2, 0, 0)
    finally:
        await service.close()


@contextlib.asynccontextmanager
async def _busy_with_a_script(url: str) -> AsyncIterator[None]:
    """The server at ``url`` running another client's script past busy-reply-threshold
    (it answers BUSY to most commands) for the block, killed after it."""
    admin = aioredis.Redis.from_url(url)
    looping = aioredis.Redis.from_url(url)

    async def loop_for_ever() -> None:
        await looping.execute_command("EVAL", "while true do end", 0)  # type: ignore[no-untyped-call]

    script = asyncio.create_task(loop_for_ever())
    try:
        async with asyncio.timeout(10):
            while True:
                try:
                    await admin.execute_command("DBSIZE")  # type: ignore[no-untyped-call]
                except ResponseError as error:
                    if str(error).startswith("BUSY"):
                        break
                    raise
                await asyncio.sleep(0.01)  # polling the server until it answers BUSY
        yield
    finally:
        with contextlib.suppress(ResponseError):
            await admin.script_kill()
        with contextlib.suppress(ResponseError):
            await script
        await looping.aclose()
        await admin.aclose()


async def test_a_script_running_long_at_the_first_append_keeps_the_batch_for_later(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Another client's script running long makes the server answer the first append's
    check of MULTI/EXEC with EXECABORT quoting BUSY: raised as the driver's error, the
    writer took it for permanent and rejected the batch, where the same BUSY met by the
    append itself is retried."""
    with contextlib.contextmanager(_own_server)("--busy-reply-threshold", "50") as url:
        store = RedisStore.from_url(url)
        service = MemoryService.from_url(url, clock=FakeClock(), load_timeout=5.0)
        caplog.set_level(logging.WARNING, "coda_memory")
        try:
            async with _busy_with_a_script(url):
                with pytest.raises(StoreBusy, match="an error of its state") as busy:
                    await store.append([sanitize_observation("alice", tool_ok("t"), T0)])
                assert "BUSY" in str(busy.value.__cause__)
                # start() says it cannot use the server yet, as for a PING answered BUSY.
                with pytest.raises(ConnectionLost, match="cannot reach Redis"):
                    await store.start()
                service.emit_observation("alice", tool_ok("t"))
                async with asyncio.timeout(10):
                    while "storing 1 observation(s) waits" not in caplog.text:
                        await asyncio.sleep(0.01)  # polling the log until the writer tried
                assert service.stats().rejected == 0
            await service.drain(10)
            assert (service.stats().stored, service.stats().rejected) == (1, 0)
            assert await store.client.zcard("coda:memory:pending:alice") == 1
            assert (await store.append([sanitize_observation("bob", tool_ok("t"), T0)])).stored
        finally:
            await service.close()
            await store.close()


async def test_a_server_that_does_not_run_multi_is_refused_naming_it() -> None:
    """A server (or a proxy) with MULTI renamed away answers "unknown command", which
    start() raised as redis-py's own ResponseError (a host never sees the driver's
    errors), and the first append too."""
    with contextlib.contextmanager(_own_server)("--rename-command", "MULTI", "") as url:
        store = RedisStore.from_url(url)
        try:
            with pytest.raises(AccessDenied, match="Redis does not run MULTI"):
                await store.start()
            with pytest.raises(AccessDenied, match="Redis does not run MULTI"):
                await store.append([sanitize_observation("alice", tool_ok("t"), T0)])
            assert await store.client.keys("*") == []
        finally:
            await store.close()


async def test_forget_by_a_user_without_the_forgotten_batches_key_says_which_key(
    own_redis_url: str, admin: aioredis.Redis
) -> None:
    """An ACL user whose key patterns list the prefix's keys one by one, without the
    shared forgotten-batches key: forget raised redis-py's NoPermissionError. It raises
    AccessDenied naming the key's kind (never the identity), erases nothing and leaves no
    lock; the user's appends are refused for every identity, as the README says."""
    keys = ["coda:memory:*:*", "coda:memory:checkpoint"]
    async with _acl_stores(admin, own_redis_url, "writer", keys=keys, commands=["+@all"]) as acl:
        owner, store = acl.owner, acl.store
        await owner.append([sanitize_observation("alice", tool_ok("t"), T0)])
        before = sorted(await admin.keys("coda:memory:*"))
        with pytest.raises(AccessDenied, match="may not touch the forgotten-batches key") as denied:
            await store.forget("alice")
        assert "alice" not in str(denied.value)
        assert "~coda:memory:*" in str(denied.value)
        assert sorted(await admin.keys("coda:memory:*")) == before
        assert await admin.keys("*lock*") == []
        outcome = await store.append(
            [sanitize_observation(who, tool_ok("t"), T0) for who in ("alice", "bob")]
        )
        assert (outcome.stored, len(outcome.refused)) == (0, 2)
        # With the key, the same user forgets.
        await admin.acl_setuser("writer", keys=["coda:memory:forgotten-batches"])
        assert (await store.forget("alice")).observations == 1
        assert await admin.keys("coda:memory:*:alice") == []


async def test_forget_by_a_user_that_may_not_unlink_leaves_the_checkpoint(
    own_redis_url: str, admin: aioredis.Redis
) -> None:
    """A script is not undone by its error: forget erased the identity's checkpoint, then
    failed at its first UNLINK, and every observation it kept was pending again, to be
    consolidated a second time."""
    rules = {"keys": ["coda:memory:*"], "commands": ["+@all", "-unlink"]}
    async with _acl_stores(admin, own_redis_url, "eraser", **rules) as acl:
        owner = MemoryService.from_url(own_redis_url, clock=FakeClock())
        try:
            owner.emit_observation("alice", tool_ok("t"))
            await owner.drain()
            assert [f.subject for f in await owner.consolidate("alice")] == ["tool_affinity:t"]
            checkpoint = await admin.hget("coda:memory:checkpoint", "alice")
            assert checkpoint is not None
            with pytest.raises(AccessDenied, match="may not run a command of forget"):
                await acl.store.forget("alice")
            assert await admin.hget("coda:memory:checkpoint", "alice") == checkpoint
            # Nothing pending again: a consolidation reinforces nothing a second time.
            facts = await owner.consolidate("alice")
            assert [f.reinforcement_count for f in facts] == [1]
        finally:
            await owner.close()


def _event(n: int) -> str:
    """A fact event of alice's as the store writes it, its subject numbered ``n``."""
    at = int(to_ms(T0 + timedelta(seconds=n)))
    return json.dumps(
        {
            "identityId": "alice",
            "subject": f"tool_affinity:t{n}",
            "category": "tool_affinity",
            "kind": "reinforced",
            "sessionId": "s1",
            "at": at,
            "confidenceBefore": 0.5,
            "confidenceAfter": 0.6,
            "countBefore": 1,
            "countAfter": 2,
            "easeBefore": None,
            "easeAfter": 2.5,
            "quality": 1.0,
            "hits": 1,
            "trials": 1,
        }
    )


async def test_a_history_longer_than_a_page_is_read_by_a_user_that_may_only_read(
    own_redis_url: str, admin: aioredis.Redis
) -> None:
    """A history past a page (10,000 events, which history_limit=0 lets grow) read each
    later page with its head in a MULTI/EXEC, which a user with +@read alone may not run:
    history() raised redis-py's NoPermissionError. It reads the head after each page, in
    one round trip without a transaction, and gets every event once, in order."""
    events = unit_module.LOAD_PAGE * 2 + 5
    assert events > 10_000
    async with _acl_stores(admin, own_redis_url, "reader", commands=["+@read"]) as acl:
        key = acl.owner.keys.of("history", "alice")
        async with acl.owner.client.pipeline(transaction=False) as pipe:
            for start in range(0, events, 1_000):
                pipe.rpush(key, *(_event(n) for n in range(start, min(start + 1_000, events))))
            await pipe.execute()
        read = await acl.store.history("alice")
        assert [event.subject for event in read] == [f"tool_affinity:t{n}" for n in range(events)]
        # The user may indeed not run a transaction.
        with pytest.raises(NoPermissionError):
            await acl.store.client.execute_command("MULTI")  # type: ignore[no-untyped-call]


async def test_observations_by_a_user_that_may_only_read_says_what_it_needs(
    own_redis_url: str, admin: aioredis.Redis
) -> None:
    """observations() reads in pages that are each a script (one consistent read of the
    sorted set after the last member read, as the loads' reads are), which a user with
    +@read alone may not run: it raised redis-py's NoPermissionError. It raises
    AccessDenied naming what the read needs, never the identity; with it, it reads."""
    async with _acl_stores(admin, own_redis_url, "reader", commands=["+@read"]) as acl:
        await acl.owner.append([sanitize_observation("alice", tool_ok("t"), T0)])
        with pytest.raises(AccessDenied, match=r"\+evalsha and \+script\|load") as denied:
            await acl.store.observations("alice")
        assert "alice" not in str(denied.value)
        assert "~coda:memory:*" in str(denied.value)
        # The script cache emptied: redis-py loads the script again (SCRIPT LOAD).
        await admin.script_flush()
        await admin.acl_setuser("reader", commands=["+evalsha"])
        with pytest.raises(AccessDenied, match=r"\+script\|load"):
            await acl.store.observations("alice")
        await admin.acl_setuser("reader", commands=["+script|load"])
        assert [o.created_at for o in await acl.store.observations("alice")] == [T0]
