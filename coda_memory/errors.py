"""Errors coda-memory raises on purpose; everything else is a bug or the driver's own."""

from __future__ import annotations


class CodaMemoryError(Exception):
    """Base class of coda-memory's own errors."""


class SchemaNotMigrated(CodaMemoryError):
    """The database has no coda-memory tables: run the migrations first."""


class AccessDenied(CodaMemoryError):
    """The database role lacks a grant that the call needs (the analytics read views
    granted to analyst roles and the schema's owner; rebuilding the rollup takes the
    owner). The message says which grant; nothing was changed."""


class ConnectionLost(CodaMemoryError):
    """The database connection died in the middle of a unit of work, or the server it
    reached only reads (a hot standby, a writer that a failover demoted); nothing of it
    was committed unless the commit itself had already been acknowledged. Also what
    every call of a store raises when no connection can be made (a refused connection,
    an unknown host or database: the message names the server and its reason),
    ``start()`` included."""


class StoreBusy(CodaMemoryError):
    """A lock or a timeout kept a write out for now (a table locked past the writer's lock
    timeout, a deadlock, a cancelled statement, no connection free within the pool's
    timeout): nothing of it was stored by the try that met it, and the same write is
    worth retrying. Also what ``MemoryService.consolidate()`` raises when a table held
    past the store's lock timeout kept its first read out: it consolidated nothing; and
    what a Postgres ``start()`` raises when one kept its warm-up out.

    ``may_have_stored``: an earlier try of the same call lost its connection around its
    COMMIT, so the write may be stored already; a retry must look for it (its batch key)
    rather than be taken for a first attempt."""

    def __init__(self, message: str, *, may_have_stored: bool = False) -> None:
        super().__init__(message)
        self.may_have_stored = may_have_stored


class ForeignAlembicHistory(CodaMemoryError):
    """The schema's Alembic version table holds revisions that are not coda-memory's, or
    the schema has none yet and is on the search path, where another application's
    Alembic would take coda-memory's for its own: migrating there would mix two
    histories. Use a schema of coda-memory's own."""


class MigrationUnderWay(CodaMemoryError):
    """Another migration of the schema holds its lock, and the migration was given a
    connection of the caller's (``config.attributes["connection"]``), whose transaction
    cannot wait for it; migrate again once it is done. (``migrate``, ``migrate_async``,
    ``coda-memory migrate`` and ``alembic upgrade`` with a URL wait their turn.)"""


class HostCallbackError(CodaMemoryError):
    """A function the host gave the service (its ``token_counter``) raised. The message
    names the function and the error's class only: the function was given the prompt
    section's text, which its own message may quote, and the log line that reports the
    failed load must not carry it."""


class ServiceClosed(CodaMemoryError):
    """The service was closed: it takes no more work (``load_memory`` answers empty, and
    ``emit_observation`` drops what it is given)."""
