"""The Redis adapter: the original server's key layout and JSON, read and written by a
store with coda-memory's guarantees. Needs the ``redis`` extra."""

from __future__ import annotations

try:
    import redis  # noqa: F401 (the extra, checked before any module of the adapter needs it)
except ModuleNotFoundError as missing:
    if missing.name != "redis":
        raise
    raise ModuleNotFoundError(
        "the Redis store needs the redis extra: pip install 'coda-memory[redis]'", name="redis"
    ) from None

from coda_memory.redis.keys import DEFAULT_PREFIX, Keys
from coda_memory.redis.store import LockLost, LockTimeout, RedisStore, RedisStoreStats
from coda_memory.redis.unit import RedisConsolidationUnit

__all__ = [
    "DEFAULT_PREFIX",
    "Keys",
    "LockLost",
    "LockTimeout",
    "RedisConsolidationUnit",
    "RedisStore",
    "RedisStoreStats",
]
