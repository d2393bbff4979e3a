"""The store's list of identities reads the checkpoint map (a field for every identity
ever consolidated) in pages, where HKEYS read it in one reply."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio.connection import Connection

from coda_memory.redis import RedisStore
from coda_memory.redis import store as store_module

#: How many items (at any depth) each reply that a _Recording connection read carried.
_SIZES: list[int] = []


def _items(reply: Any) -> int:
    if isinstance(reply, list):
        return sum(_items(part) for part in reply)
    return 1


class _Recording(Connection):
    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        reply = await super().read_response(*args, **kwargs)
        _SIZES.append(_items(reply))
        return reply


async def test_the_checkpoint_map_is_read_in_pages(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "IDENTITIES_PAGE", 100, raising=False)
    store = RedisStore.from_url(redis_url, connection_class=_Recording)
    try:
        names = [f"u{n:04}" for n in range(2_500)]
        await store.client.hset(store.keys.checkpoint, mapping=dict.fromkeys(names, 1000))
        await store.client.zadd(store.keys.of("obs", "v1"), {"x": 1})
        _SIZES.clear()
        assert await store.identities() == [*names, "v1"]
        # A field and its value each (HSCAN's count is a hint: a page may hold more).
        assert max(_SIZES) <= 2 * 3 * 100
    finally:
        await store.close()
        _SIZES.clear()
