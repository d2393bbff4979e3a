"""Redis fixtures: a server, and a key prefix of its own for every test.

Contract for other tests:
- ``redis_url`` (function scope): ``redis://host:port/db?prefix=…`` with a prefix that no
  other test (or concurrent run) uses; every key under it is deleted afterwards.
- ``redis_prefix`` (function scope): that prefix.
- ``redis_store`` (function scope): a :class:`RedisStore` on ``redis_url``, closed afterwards.
- ``redis_client`` (function scope): a raw asyncio client (bytes) on the same server.

The server is the one at ``CODA_MEMORY_TEST_REDIS_URL`` when that is set; else the one at
127.0.0.1:6379 when it answers (unless ``CODA_MEMORY_TEST_REDIS_SERVER=spawn``); else a
``redis-server`` (Debian's package, on PATH) started here on a free port in a temporary
directory, without persistence. Tests that use
these fixtures get the ``redis`` marker, so ``-m redis`` selects them.
"""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlencode

import pytest
import redis
import redis.asyncio as aioredis

from coda_memory.redis import RedisStore
from coda_memory.redis.keys import glob_escape

_REDIS_FIXTURES = frozenset({"redis_url", "redis_prefix", "redis_store", "redis_client"})
_RUN = f"coda:test:{os.getpid()}:{secrets.token_hex(3)}"
_counter = itertools.count(1)
_DEFAULT = "redis://127.0.0.1:6379/0"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        callspec = getattr(item, "callspec", None)
        parametrised_redis = callspec is not None and "redis" in callspec.params.values()
        if _REDIS_FIXTURES & fixtures or parametrised_redis:
            item.add_marker(pytest.mark.redis)


def _answers(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=2)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        client.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _own_server(*options: str) -> Iterator[str]:
    """A redis-server of the test's own (``options`` added to its command line); its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no Redis server: nothing answers at 127.0.0.1:6379 and no redis-server")
    directory = tempfile.mkdtemp(prefix="coda-memory-redis-")
    port = _free_port()
    process = subprocess.Popen(
        [
            *(binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", directory),
            *("--save", "", "--appendonly", "no"),
            *options,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 30
        # Wait for the server to accept connections (it is our own child process). One
        # that is installed but does not come up fails the Redis tests: skipped, they
        # would pass a run that tested no Redis store.
        while not _answers(url):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"{binary} did not start on port {port} "
                    f"(exit code {process.poll()}; None: still running after 30 s)"
                )
            time.sleep(0.05)  # polling the child until it accepts connections
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def _redis_server() -> Iterator[str]:
    configured = os.environ.get("CODA_MEMORY_TEST_REDIS_URL")
    if configured:
        yield configured  # a configured server that does not answer is an error
    elif os.environ.get("CODA_MEMORY_TEST_REDIS_SERVER") != "spawn" and _answers(_DEFAULT):
        yield _DEFAULT
    else:
        yield from _own_server()


@pytest.fixture
def redis_prefix(_redis_server: str) -> Iterator[str]:
    prefix = f"{_RUN}:{next(_counter)}:"
    yield prefix
    client = redis.Redis.from_url(_redis_server)
    try:
        keys = list(client.scan_iter(match=glob_escape(prefix) + "*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def redis_url(_redis_server: str, redis_prefix: str) -> str:
    separator = "&" if "?" in _redis_server else "?"
    return f"{_redis_server}{separator}{urlencode({'prefix': redis_prefix})}"


@pytest.fixture
async def redis_store(redis_url: str) -> AsyncIterator[RedisStore]:
    store = RedisStore.from_url(redis_url)
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
async def redis_client(_redis_server: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(_redis_server)
    try:
        yield client
    finally:
        await client.aclose()
