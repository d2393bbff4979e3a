"""The ``coda-memory`` command line: migrate, inspect, consolidate, prune and analyse.

The database is ``--url`` or ``$CODA_MEMORY_DATABASE_URL``; with neither, an embedded
Postgres in ``$CODA_MEMORY_DATA_DIR`` (default ``./.coda-memory/pgdata``), created and
migrated on first use. Only that embedded database is migrated automatically: an
operator's database is migrated by ``coda-memory migrate`` alone.

Errors are one line on stderr and a non-zero exit (1; 2 for bad usage; 3 when a lock or a
busy identity kept the command out, to run again later); ``--debug``
(anywhere on the line) shows the traceback instead. Listings print as tables, or as JSON
with ``--format json``.

The command line is the ``cli`` extra (typer, rich). Without it, importing this package
still works and :func:`main` prints one line naming the extra.
"""

from __future__ import annotations

import sys
from importlib.util import find_spec

#: The libraries the ``cli`` extra brings.
CLI_REQUIREMENTS = ("typer", "rich")
MISSING_EXTRA = "coda-memory: the command line needs the cli extra: pip install 'coda-memory[cli]'"

HAS_CLI = all(find_spec(name) is not None for name in CLI_REQUIREMENTS)

if HAS_CLI:
    # Importing the command modules registers their commands on ``app``.
    from coda_memory.cli import (
        admin_commands,
        analytics_commands,
        identity_commands,
        import_commands,
        replay_command,
        role_commands,
    )
    from coda_memory.cli.app import app

    __all__ = [
        "CLI_REQUIREMENTS",
        "HAS_CLI",
        "MISSING_EXTRA",
        "admin_commands",
        "analytics_commands",
        "app",
        "identity_commands",
        "import_commands",
        "main",
        "replay_command",
        "role_commands",
    ]


def main() -> None:
    """The console script's entry point."""
    if not HAS_CLI:
        print(MISSING_EXTRA, file=sys.stderr)
        raise SystemExit(1)
    app()
