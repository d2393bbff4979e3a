"""Redis URLs that redis-py would misread, refused before it reads them.

Checked by ``RedisStore.from_url`` and by the CLI's ``import-redis``: redis-py's own
parser quotes what it misread, which may be part of a password.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit

from coda_memory.core.logs import masked_url

#: The schemes of Redis URLs (redis-py's): TCP, TLS, a Unix socket.
REDIS_SCHEMES = ("redis", "rediss", "unix")

#: What a URL whose password holds one of these characters must do.
_ENCODE = "a password holding /, #, ? or @ must be percent-encoded"


def _port_digits(url: str) -> bool:
    """Whether the port of ``url``'s host part is written in digits (a number the parser
    refused as out of range), not quoted: it may be a piece of a password."""
    try:
        hostinfo = urlsplit(url).netloc.rpartition("@")[2]
    except ValueError:  # (an IPv6 address without its "]")
        return False
    _, bracket, after = hostinfo.partition("]")  # (an IPv6 address's own colons)
    port = (after if bracket else hostinfo).partition(":")[2]
    return port.isascii() and port.isdecimal()


def check_redis_url(url: str) -> None:
    """ValueError, saying why in one line and with the password masked, for a Redis URL
    that redis-py would read wrongly or refuse in words that quote part of the password:
    a scheme other than Redis's, a port or a database that is not a number (redis-py
    reads database 0 for ``/abc``), a port outside 1 to 65535, no ``//`` after
    ``redis:`` or ``rediss:``, or an ``@`` with none after ``unix:`` (not quoted: it would
    show the password), a query whose
    percent-escapes are not UTF-8. The first three may come of a password with a ``/``,
    ``#``, ``?`` or ``@`` not percent-encoded: the URL's host part ends at the first of
    them."""
    masked = masked_url(url)
    if "\x00" in url or any("\ud800" <= char <= "\udfff" for char in url):
        # (An argument or a variable in another encoding arrives with lone surrogates:
        # the client failed as it connected, "surrogates not allowed".)
        raise ValueError(f"invalid Redis URL {masked!r}: it holds NUL or bytes that are not UTF-8")
    try:
        parts = urlsplit(url)
        port = parts.port  # (ValueError when it is not a number, or past 65535)
    except ValueError:
        # (Not chained: the parser's message quotes what it took for the port.)
        what = "is out of range (1 to 65535)" if _port_digits(url) else "is not a number"
        raise ValueError(f"invalid Redis URL {masked!r}: the port {what} ({_ENCODE})") from None
    if port == 0:
        raise ValueError(
            f"invalid Redis URL {masked!r}: the port is out of range (1 to 65535) ({_ENCODE})"
        )
    scheme = parts.scheme.lower()
    given, _, rest = url.partition(":")
    if scheme in ("redis", "rediss") and not rest.startswith("//"):
        # (Not quoted, masked or not: with no "//" there is no host part to mask a
        # password in, and "redis:app:pw@db" was quoted whole.)
        raise ValueError(
            f"invalid Redis URL: no '//' after {given + ':'!r}: use redis://host:port/db "
            "(or rediss://, unix://)"
        )
    if scheme == "unix" and not rest.startswith("//") and "@" in rest:
        # ("unix:app:pw@/run/redis.sock": redis-py took it all for the socket's path, and
        # its error quoted that path, password and all.)
        raise ValueError(
            f"invalid Redis URL: an '@' with no '//' after {given + ':'!r}: write "
            "unix://user:password@/path/redis.sock, or unix:///path for a path holding '@'"
        )
    keys = [pair.partition("=")[0] for pair in parts.query.split("&")]
    if "@" not in parts.netloc and (
        "@" in parts.fragment
        or (scheme != "unix" and "@" in parts.path)
        or any("@" in key for key in keys)
    ):
        # The "@" of a password holding "/", "#" or "?", past where the parser ended the
        # host part: "redis://app:8080#pw@host" reads as host "app", port 8080. (One in a
        # query value, ?password=p@ss, or in a socket's path is the URL's own.)
        raise ValueError(
            f"invalid Redis URL {masked!r}: the host part ends before its '@' ({_ENCODE})"
        )
    if scheme not in REDIS_SCHEMES or not (parts.netloc or parts.path):
        raise ValueError(
            f"invalid Redis URL {masked!r}: use redis://host:port/db (or rediss://, unix://)"
        )
    try:
        parse_qsl(parts.query, keep_blank_values=True, errors="strict")
    except UnicodeDecodeError:
        # (Decoded leniently, "?prefix=%FF" named the prefix "\ufffd": the store used
        # another prefix than the one written, and an import found no identity.)
        raise ValueError(
            f"invalid Redis URL {masked!r}: the percent-escapes of its query are not UTF-8"
        ) from None
    database = parts.path.strip("/")
    if scheme != "unix" and database and not (database.isascii() and database.isdecimal()):
        raise ValueError(
            f"invalid Redis URL {masked!r}: the database (the path after host:port) is not "
            f"a number ({_ENCODE})"
        )
