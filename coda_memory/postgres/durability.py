"""The durable end of a run whose writes commit with ``synchronous_commit`` off.

The import's copies and the CLI's consolidations commit without waiting for their WAL to
reach disk (a crash may lose the last of them, which a rerun redoes from the source or
the observations). A run that ended there reported as done what a crash or a failover
right after took back, with nothing to say a rerun was needed. A commit that waits for
its WAL takes every earlier commit's with it, but only a transaction that wrote WAL
waits: :func:`flush_commits` writes a transactional WAL message, which needs no row of
any table (a rewrite of a row found nothing to rewrite when a forget had erased it, and
waited on live traffic that held it).
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from coda_memory.postgres.store import PostgresStore

#: The message's content: empty, its prefix says which run wrote it.
_MESSAGE = text("SELECT pg_logical_emit_message(true, :prefix, '')")


async def flush_commits(store: PostgresStore, prefix: str) -> None:
    """Return once every commit made so far on the server is on disk, as the server's
    ``synchronous_commit`` has it. ``prefix`` names the run in the WAL message (a logical
    decoding consumer of the database sees it, and may ignore it)."""

    async def write(conn: AsyncConnection) -> None:
        async with conn.begin():
            await conn.execute(_MESSAGE, {"prefix": prefix})

    await store.run(write)
