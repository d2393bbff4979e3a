"""examples/fastapi_app.py served by uvicorn on a loopback port, driven over real HTTP.

The server runs as its own process with ``-W error``: a warning anywhere in it (the
lifespan, the service, the drivers, uvicorn) is an error that fails the test. It binds
port 0; the test reads the port from uvicorn's "running on" line, which uvicorn prints
only after the lifespan's startup has finished.

It runs on both event loops uvicorn offers: the standard library's, and uvloop, which
uvicorn picks by itself when it is installed (``uvicorn[standard]``).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from sqlalchemy import NullPool, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from coda_memory.postgres.engine import asyncpg_url
from tests.postgres.fault_proxy import FaultProxy
from tests.postgres.helpers import fetch

REPOSITORY = Path(__file__).resolve().parents[2]
RUNNING = re.compile(rb"Uvicorn running on (http://127\.0\.0\.1:\d+)")


@asynccontextmanager
async def serving(
    database_url: str, loop: str, load_timeout: str = "10"
) -> AsyncIterator[tuple[str, asyncio.subprocess.Process, bytes]]:
    """The example under uvicorn: its base URL, its process, and what it printed until
    it served."""
    env = {
        **os.environ,
        "CODA_MEMORY_DATABASE_URL": database_url,
        "MEMORY_LOAD_TIMEOUT": load_timeout,
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-W", "error", "-m", "uvicorn", "examples.fastapi_app:app",
        "--host", "127.0.0.1", "--port", "0", "--no-access-log", "--loop", loop,
        cwd=REPOSITORY, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stderr is not None
    seen = b""
    try:
        async with asyncio.timeout(60):
            while (match := RUNNING.search(seen)) is None:
                line = await process.stderr.readline()
                assert line, f"uvicorn exited before serving: {seen.decode()}"
                seen += line
        yield match[1].decode(), process, seen
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.fixture(params=["asyncio", "uvloop"])
async def server(
    pg_url: str, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    async with serving(pg_url, request.param) as (base, process, _):
        yield base, process


async def test_the_fastapi_example_serves_while_the_database_cannot_be_reached() -> None:
    """The README's lifespan awaited start(), which raised: uvicorn exited ("Application
    startup failed"), and every worker of a deploy made while the database was down
    restarted in a loop. It serves now, with memory empty until the database answers."""
    with socket.socket() as probe:  # a port that refuses connections
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"postgresql://postgres@127.0.0.1:{port}/nowhere"
    async with serving(url, "asyncio", load_timeout="1") as (base, _, printed):
        assert f"memory not warmed up: cannot reach the database at 127.0.0.1:{port}".encode() in (
            printed
        ), printed.decode()
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            answer = await client.post("/chat/alice", json={"query": "royalty", "session_id": "s"})
            assert answer.status_code == 200, answer.text
            assert answer.json()["system_prompt"] == (
                "You are an analyst's assistant for a music publisher."
            )


async def test_the_fastapi_example_serves_while_a_migration_holds_a_table(pg_url: str) -> None:
    """start() during a migration that holds a table raised the driver's
    LockNotAvailableError, which the lifespan did not expect: uvicorn exited
    ("Application startup failed"), and a deploy made while `coda-memory migrate` ran
    restarted in a loop. It serves now, memory starting on first use."""
    engine = create_async_engine(asyncpg_url(pg_url), poolclass=NullPool)
    try:
        async with engine.connect() as holder:
            await holder.execute(text("LOCK TABLE coda_memory.facts IN ACCESS EXCLUSIVE MODE"))
            async with serving(pg_url, "asyncio", load_timeout="1") as (base, _, printed):
                assert b"memory not warmed up: start() was kept out by" in printed, printed.decode()
                await holder.rollback()
                async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                    body = {"query": "royalty", "session_id": "s"}
                    answer = await client.post("/chat/alice", json=body)
                    assert answer.status_code == 200, answer.text
    finally:
        await engine.dispose()


async def _until_stored(client: httpx.AsyncClient) -> dict[str, int]:
    """The service's counters once nothing emitted is pending (polls /stats)."""
    async with asyncio.timeout(30):
        while True:
            stats: dict[str, int] = (await client.get("/stats")).json()
            if stats["pending"] == 0:
                return stats
            await asyncio.sleep(0.02)


async def test_the_fastapi_example_serves_memory_over_http(
    server: tuple[str, asyncio.subprocess.Process], pg_url: str
) -> None:
    base, process = server
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        first = await client.post(
            "/chat/alice", json={"query": "what royalty did acct-118 earn?", "session_id": "s1"}
        )
        assert first.status_code == 200, first.text
        assert (
            first.json()["system_prompt"] == "You are an analyst's assistant for a music publisher."
        )
        assert sorted(first.json()["called"]) == ["get_account", "run_royalty_report"]
        failing = await client.post(
            "/chat/alice",
            json={"query": "account acct-999", "session_id": "s2", "account_id": "acct-999"},
        )
        assert failing.json()["called"] == ["get_account"]
        stats = await _until_stored(client)
        assert stats["stored"] == stats["emitted"] > 0
        assert stats["rejected"] == stats["dropped"] == 0

        second = await client.post(
            "/chat/alice", json={"query": "royalty for acct-118", "session_id": "s3"}
        )
        prompt = second.json()["system_prompt"]
        assert "## What you know about this user" in prompt
        assert 'Works with account "Northwind Records" (id "acct-118")' in prompt
        assert "get_account has failed for this user" in prompt
        facts = {f["subject"] for f in (await client.get("/memory/alice")).json()}
        assert {"tool_affinity:run_royalty_report", "domain_preference:royalty"} <= facts
        assert (await client.get("/memory/bob")).json() == []

    # Shutdown runs the lifespan's exit: the last request's observations are stored.
    process.send_signal(signal.SIGINT)
    _, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, stderr.decode()
    assert b"Application shutdown complete" in stderr
    assert b"Traceback" not in stderr and b"Warning" not in stderr, stderr.decode()
    stored = await fetch(
        pg_url, "SELECT count(*) FROM coda_memory.observations WHERE session_id = 's3'"
    )
    assert stored[0][0] >= 3


async def test_the_fastapi_example_shuts_down_within_dockers_grace_period_on_a_stalled_database(
    pg_url: str,
) -> None:
    """The example closes the service "within less than the platform's grace period" (docker
    stop: 10 s). With the database no longer answering, close() spends its timeout on the
    queue and then seconds more on the batch under way, the consolidations it cancels and
    the pools: with the example's default timeout of 8 s, shutdown took 11 to 12 s, and docker's
    SIGKILL would have cut it short."""
    stalled = False
    proxy = FaultProxy.in_front_of(pg_url, lambda _commit: "blackhole" if stalled else None)
    port = await proxy.start()
    # (The proxy reads plain messages: no TLS. It reaches a server on a Unix socket itself.)
    proxied = make_url(pg_url).difference_update_query(["host"]).set(host="127.0.0.1", port=port)
    proxied = proxied.update_query_dict({"ssl": "disable"})
    url = proxied.render_as_string(hide_password=False)
    try:
        async with serving(url, "asyncio", "0.1") as (base, process, _):
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                for n in range(3):
                    body = {"query": "royalty for acct-118", "session_id": f"s{n}"}
                    assert (await client.post(f"/chat/u{n}", json=body)).status_code == 200
                await _until_stored(client)
                stalled = True  # every COMMIT from now on waits for ever
                for n in range(3):
                    body = {"query": "royalty for acct-118", "session_id": f"t{n}"}
                    assert (await client.post(f"/chat/u{n}", json=body)).status_code == 200
            began = time.monotonic()
            process.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(process.communicate(), 60)
            took = time.monotonic() - began
        assert b"Application shutdown complete" in stderr, stderr.decode()
        assert proxy.blackholes > 0
        assert took < 9.5, f"shutdown took {took:.1f} s"
    finally:
        await proxy.close()
