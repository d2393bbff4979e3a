"""The store's read of an identity's fact history, in pages: a history with no limit
(``history_limit=0``) grows without bound, and read in one reply it outlived redis-py's
socket timeout; each page is a reply of its own, and the read is the one of the whole
list, whatever a commit appends or trims between the pages."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis
from redis.asyncio.connection import Connection

from coda_memory.redis import RedisStore
from coda_memory.redis import unit as unit_module
from tests.redis.test_import_redis import EVENT, ms

PAGE = 5

#: How many fact events each reply that a _Recording connection read carried.
_COUNTS: list[int] = []


def _events(reply: Any) -> int:
    if isinstance(reply, bytes):
        return int(reply.startswith(b'{"identityId"'))
    if isinstance(reply, list):
        return sum(_events(part) for part in reply)
    return 0


class _Recording(Connection):
    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        reply = await super().read_response(*args, **kwargs)
        _COUNTS.append(_events(reply))
        return reply


def _event(n: int) -> str:
    return json.dumps({**EVENT, "identityId": "u1", "subject": f"tool_affinity:t{n}", "at": ms(n)})


def _subjects(events: list[Any]) -> list[str]:
    return [event.subject.removeprefix("tool_affinity:") for event in events]


async def test_a_history_is_read_in_pages_of_bounded_replies(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(unit_module, "LOAD_PAGE", PAGE)
    store = RedisStore.from_url(redis_url, connection_class=_Recording, history_limit=0)
    try:
        key = store.keys.of("history", "u1")
        await store.client.rpush(key, *(_event(n) for n in range(23)))
        _COUNTS.clear()
        assert _subjects(await store.history("u1")) == [f"t{n}" for n in range(23)]
        # The head is read again with each later page (4 of them).
        assert max(_COUNTS) <= PAGE + 1 and sum(_COUNTS) == 23 + 4
        # A history of a whole number of pages.
        await store.client.rpush(key, *(_event(n) for n in range(23, 25)))
        assert _subjects(await store.history("u1")) == [f"t{n}" for n in range(25)]
    finally:
        await store.close()
        _COUNTS.clear()


@pytest.mark.parametrize("write", ["append", "trim"])
async def test_what_a_commit_writes_between_the_pages_leaves_no_event_twice_or_out(
    redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch, write: str
) -> None:
    """A commit between two pages appends at the tail (read or not, the others once),
    or trims the head of a history at its limit: the read starts again, and is the
    history as after the commit."""
    monkeypatch.setattr(unit_module, "LOAD_PAGE", PAGE)
    store = RedisStore.from_url(redis_url, history_limit=0)
    key = store.keys.of("history", "u1")
    writer = redis.Redis.from_url(redis_url.split("?")[0])
    pipelines: list[int] = []
    pipeline = store.client.pipeline

    def between(*args: Any, **kwargs: Any) -> Any:
        pipelines.append(1)
        if len(pipelines) == 2:  # between the second and the third page
            writer.rpush(key, _event(23), _event(24))
            if write == "trim":
                writer.ltrim(key, -23, -1)
        return pipeline(*args, **kwargs)

    monkeypatch.setattr(store.client, "pipeline", between)
    try:
        await store.client.rpush(key, *(_event(n) for n in range(23)))
        read = _subjects(await store.history("u1"))
        first = 0 if write == "append" else 2
        assert read == [f"t{n}" for n in range(first, 25)]
        # The pages after the first of 25 events; after a trim, of the first read (2),
        # and then of the second (4 of 23 events).
        assert len(pipelines) == (5 if write == "append" else 2 + 4)
    finally:
        writer.close()
        await store.close()
