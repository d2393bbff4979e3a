"""Which store a memory URL names: ``memory://``, ``null://``, Postgres or Redis.

Each store's module is imported only when its scheme is asked for, so a service over one
store never imports the others' drivers.
"""

from __future__ import annotations

import re
from typing import Any

from coda_memory.core.urls import refuse_malformed
from coda_memory.ports import MemoryStore

#: The schemes of Redis URLs (redis-py's): TCP, TLS, a Unix socket. (Those of
#: ``coda_memory.redis.urls``, not imported from there: that package needs redis-py.)
REDIS_SCHEMES = ("redis", "rediss", "unix")
#: What a URL's scheme may be (RFC 3986), and so be quoted in an error.
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]{0,31}")
#: The schemes of memory URLs that name a store.
SCHEMES = frozenset({"memory", "null", "postgresql", "postgres", *REDIS_SCHEMES})


def url_scheme(url: str) -> str:
    """The scheme of the memory URL ``url``, lower-case and without a driver
    (``postgresql+asyncpg://…`` is ``postgresql``); TypeError for anything but a string
    (an unset environment variable gives None)."""
    if not isinstance(url, str):
        raise TypeError(f"the memory URL must be a str, not {type(url).__name__}")
    return url.split(":", 1)[0].split("+", 1)[0].lower()


def shown_scheme(url: str) -> str:
    """How an error names the scheme of ``url``: quoted when it is one (followed by
    ``://``), or "no scheme" (a libpq connection string, ``host=db user=app
    password=…``, was quoted whole, its password too)."""
    given, colon, rest = url.partition(":")
    if colon and rest.startswith("//") and _SCHEME.fullmatch(given):
        return repr(given)
    # (Before a ":" with no "//", it may be a password: "app:S3cret@db/app".)
    return "no scheme"


def checked_scheme(url: str) -> str:
    """The scheme of ``url`` (see ``url_scheme``), or a ValueError, not quoting it, for a
    URL with whitespace at its start or end, or a ``memory:`` or ``null:`` one without its
    ``//``. (What a store's own URL checks refuse is left to them.)"""
    scheme = url_scheme(url)
    refuse_malformed(url, scheme)
    return scheme


def store_from_url(url: str, store_options: dict[str, Any]) -> MemoryStore:
    """The store ``url`` names, built with ``store_options`` (see ``MemoryService.from_url``)."""
    scheme = checked_scheme(url)
    store: MemoryStore
    if scheme in ("memory", "null"):
        if store_options:
            raise TypeError(f"unexpected options for {scheme}://: {sorted(store_options)}")
        if scheme == "null":
            from coda_memory.null import NullStore

            store = NullStore()
        else:
            from coda_memory.testing import InMemoryStore

            store = InMemoryStore()
    elif scheme in ("postgresql", "postgres"):
        from coda_memory.postgres import PostgresStore

        store = PostgresStore.from_url(url, **store_options)
    elif scheme in REDIS_SCHEMES:
        try:
            from coda_memory.redis import RedisStore
        except ImportError as exc:
            raise ImportError(
                "redis:// needs the redis extra: pip install 'coda-memory[redis]'"
            ) from exc
        store = RedisStore.from_url(url, **store_options)
    else:
        raise ValueError(
            "unsupported memory URL scheme: use memory://, postgresql://…, redis://… "
            f"(rediss://, unix://) or null:// (got {shown_scheme(url)})"
        )
    return store
