"""The server's side of slow requests: statements that took SLOW_SERVER_MS or more on the
server, from its log.

A section runs its requests inside :func:`slow_statements_logged`, which has the embedded
server log such statements (``log_min_duration_statement``, for every session, the open
ones too), and reads them back with :func:`slow_since`. A load that was slow while no
statement was slow on the server waited for the event loop, not for Postgres. Against a
server of the caller's (``--url``) the log is not the benchmark's to read: nothing is
logged and the figures are None.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from benchmarks.profiling.statements import log_offset, server_entries
from benchmarks.server import Server

#: Statements that take this long on the server are logged, and counted.
SLOW_SERVER_MS = 5
#: The key of the count in a section's row.
SLOW_KEY = f"server_over_{SLOW_SERVER_MS}ms"


@asynccontextmanager
async def slow_statements_logged(conn: Any, server: Server) -> AsyncIterator[None]:
    """While the block runs, the embedded server logs every statement that takes
    SLOW_SERVER_MS or more (ALTER SYSTEM and a reload, reset at the end)."""
    if server.log_file is None:
        yield
        return
    await conn.execute(f"ALTER SYSTEM SET log_min_duration_statement = {SLOW_SERVER_MS}")
    await conn.execute("SELECT pg_reload_conf()")
    try:
        yield
    finally:
        await conn.execute("ALTER SYSTEM RESET log_min_duration_statement")
        await conn.execute("SELECT pg_reload_conf()")


def slow_since(server: Server, start: int) -> dict[str, Any]:
    """What the server logged as slow since log offset ``start`` (:func:`log_offset`): how
    many statements, the slowest, and the count per statement."""
    if server.log_file is None:
        return {SLOW_KEY: None}
    entries = server_entries(server.log_file, start, log_offset(server))
    return {
        SLOW_KEY: len(entries),
        "server_max_ms": max((ms for ms, _ in entries), default=0.0),
        "server_slow_statements": dict(Counter(label for _, label in entries).most_common()),
    }
