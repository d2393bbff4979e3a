"""Redis URLs that redis-py would misread, refused before it reads them.

Checked by ``RedisStore.from_url`` and by the CLI's ``import-redis``: redis-py's own
parser quotes what it misread, which may be part of a password.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from coda_memory.core.logs import masked_url

#: The schemes of Redis URLs (redis-py's): TCP, TLS, a Unix socket.
REDIS_SCHEMES = ("redis", "rediss", "unix")

#: What a URL whose password holds one of these characters must do.
_ENCODE = "a password holding /, #, ? or @ must be percent-encoded"


def check_redis_url(url: str) -> None:
    """ValueError, saying why in one line and with the password masked, for a Redis URL
    that redis-py would read wrongly or refuse in words that quote part of the password:
    a scheme other than Redis's, a port or a database that is not a number (redis-py
    reads database 0 for ``/abc``). Both come of a password with a ``/``, ``#``, ``?``
    or ``@`` not percent-encoded: the URL's host part ends at the first of them."""
    masked = masked_url(url)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (ValueError when it is not a number)
    except ValueError:
        # (Not chained: the parser's message quotes what it took for the port.)
        raise ValueError(
            f"invalid Redis URL {masked!r}: the port is not a number ({_ENCODE})"
        ) from None
    if "@" in url.partition("://")[2] and "@" not in parts.netloc:
        # An "@" past where the parser ended the host part (at a "/", "#" or "?" of the
        # password): "redis://app:8080#pw@host" reads as host "app", port 8080.
        raise ValueError(
            f"invalid Redis URL {masked!r}: the host part ends before its '@' ({_ENCODE})"
        )
    scheme = parts.scheme.lower()
    if scheme not in REDIS_SCHEMES or not (parts.netloc or parts.path):
        raise ValueError(
            f"invalid Redis URL {masked!r}: use redis://host:port/db (or rediss://, unix://)"
        )
    database = parts.path.strip("/")
    if scheme != "unix" and database and not (database.isascii() and database.isdecimal()):
        raise ValueError(
            f"invalid Redis URL {masked!r}: the database (the path after host:port) is not "
            f"a number ({_ENCODE})"
        )
