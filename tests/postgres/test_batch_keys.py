"""The tables of idempotency keys on a real server: a first attempt of a batch goes on
while ``ingest_batches`` is locked (its key goes to ``ingest_batches_spill``), a retry
finds the key in either table and stores nothing twice, and expiry skips a locked table."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest

from coda_memory import MemoryService
from coda_memory.errors import StoreBusy
from coda_memory.postgres import PostgresStore
from coda_memory.postgres.append import append_observations
from coda_memory.postgres.batch_keys import KEY_LOCK_TIMEOUT
from tests.helpers import tool_ok
from tests.postgres.helpers import NOW, fetch, locked, record

#: Generous: the appends must finish within their timeouts, not within this.
SLACK = 2.0


async def keys(url: str, table: str, key: str) -> int:
    rows = await fetch(
        url, f"SELECT count(*) FROM coda_memory.{table} WHERE key = CAST(:key AS uuid)", key=key
    )
    return int(rows[0][0])


async def observations(url: str) -> int:
    return int((await fetch(url, "SELECT count(*) FROM coda_memory.observations"))[0][0])


@pytest.fixture
async def store(pg_url: str) -> AsyncIterator[PostgresStore]:
    store = PostgresStore.from_url(pg_url, writer_lock_timeout=timedelta(milliseconds=300))
    yield store
    await store.close()


async def test_a_first_attempt_goes_on_while_ingest_batches_is_locked(
    store: PostgresStore, pg_url: str
) -> None:
    key = str(uuid.uuid4())
    async with locked(pg_url, "ingest_batches"):
        started = time.monotonic()
        outcome = await store.append([record("a"), record("b")], batch_key=key, first_attempt=True)
        assert time.monotonic() - started < KEY_LOCK_TIMEOUT.total_seconds() + SLACK
        assert outcome.stored == 2
    assert await keys(pg_url, "ingest_batches_spill", key) == 1
    assert await keys(pg_url, "ingest_batches", key) == 0
    assert store.ingest_counts.keys_spilled == 1
    # Its retry (the acknowledgement was lost) finds the key there: nothing stored twice.
    again = await store.append([record("a"), record("b")], batch_key=key)
    assert again == outcome
    assert await observations(pg_url) == 2
    assert store.ingest_counts.keys_spilled == 1


async def test_a_first_attempt_records_its_key_in_ingest_batches_when_it_can(
    store: PostgresStore, pg_url: str
) -> None:
    key = str(uuid.uuid4())
    async with locked(pg_url, "ingest_batches_spill"):
        assert (await store.append([record("a")], batch_key=key, first_attempt=True)).stored == 1
    assert await keys(pg_url, "ingest_batches", key) == 1
    assert await keys(pg_url, "ingest_batches_spill", key) == 0
    assert store.ingest_counts.keys_spilled == 0
    assert (await store.append([record("a")], batch_key=key)).stored == 1
    assert await observations(pg_url) == 1


@pytest.mark.parametrize("table", ["ingest_batches", "ingest_batches_spill"])
async def test_a_retry_waits_for_either_table_of_keys(
    store: PostgresStore, pg_url: str, table: str
) -> None:
    # Its earlier attempt may have recorded the key in either table: it must look in both.
    key = str(uuid.uuid4())
    assert (await store.append([record("a")], batch_key=key, first_attempt=True)).stored == 1
    async with locked(pg_url, table):
        with pytest.raises(StoreBusy):
            await asyncio.wait_for(store.append([record("a")], batch_key=key), 0.3 + SLACK)
    assert (await store.append([record("a")], batch_key=key)).stored == 1
    assert await observations(pg_url) == 1


async def test_a_retry_of_a_batch_with_refused_rows_returns_the_outcome_recorded_with_the_key(
    store: PostgresStore, pg_url: str
) -> None:
    key = str(uuid.uuid4())
    rows = [record("a"), record("b", type="not_a_type"), record("c")]  # type: ignore[arg-type]
    async with locked(pg_url, "ingest_batches"):
        first = await store.append(rows, batch_key=key, first_attempt=True)
    assert first.stored == 2 and [index for index, _ in first.refused] == [1]
    assert await store.append(rows, batch_key=key) == first
    assert await observations(pg_url) == 2


async def test_expiry_deletes_old_keys_from_the_table_that_is_not_locked(
    store: PostgresStore, pg_url: str
) -> None:
    old = [str(uuid.uuid4()), str(uuid.uuid4())]
    assert (await store.append([record("a")], batch_key=old[0], first_attempt=True)).stored
    async with locked(pg_url, "ingest_batches"):
        assert (await store.append([record("b")], batch_key=old[1], first_attempt=True)).stored
    for table in ("ingest_batches", "ingest_batches_spill"):
        await fetch(
            pg_url, f"UPDATE coda_memory.{table} SET committed_at = now() - interval '2 days'"
        )
    async with locked(pg_url, "ingest_batches"):
        async with store.writer_engine.connect() as conn:
            outcome = await append_observations(
                conn,
                store.schema,
                [record("c")],
                str(uuid.uuid4()),
                expire_keys=True,
                first_attempt=True,
            )
        assert outcome.stored == 1
    assert await keys(pg_url, "ingest_batches", old[0]) == 1  # locked: left for later
    assert await keys(pg_url, "ingest_batches_spill", old[1]) == 0


async def test_the_writer_stores_while_ingest_batches_is_locked(pg_url: str) -> None:
    store = PostgresStore.from_url(pg_url, writer_lock_timeout=timedelta(milliseconds=300))
    service = MemoryService(store, clock=lambda: NOW)
    try:
        async with locked(pg_url, "ingest_batches"):
            for n in range(5):
                service.emit_observation("alice", tool_ok("get_account", f"s{n}"))
            await asyncio.wait_for(service.drain(), SLACK)
            stats = service.stats()
            assert (stats.stored, stats.rejected) == (5, 0)
    finally:
        await service.close()
