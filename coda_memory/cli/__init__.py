"""The ``coda-memory`` command line: migrate, inspect, consolidate, prune and analyse.

The database is ``--url`` or ``$CODA_MEMORY_DATABASE_URL``; with neither, an embedded
Postgres in ``$CODA_MEMORY_DATA_DIR`` (default ``./.coda-memory/pgdata``), created and
migrated on first use. Only that embedded database is migrated automatically: an
operator's database is migrated by ``coda-memory migrate`` alone.

Errors are one line on stderr and a non-zero exit (1; 2 for bad usage); ``--debug``
shows the traceback instead. Listings print as tables, or as JSON with ``--format json``.
"""

from __future__ import annotations

# Importing the command modules registers their commands on ``app``.
from coda_memory.cli import (
    admin_commands,
    analytics_commands,
    identity_commands,
    import_commands,
    role_commands,
)
from coda_memory.cli.app import app

__all__ = [
    "admin_commands",
    "analytics_commands",
    "app",
    "identity_commands",
    "import_commands",
    "main",
    "role_commands",
]


def main() -> None:
    """The console script's entry point."""
    app()
