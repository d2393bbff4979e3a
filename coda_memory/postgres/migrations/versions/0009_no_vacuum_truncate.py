"""The tables a request reads or writes are never truncated by VACUUM.

When the last pages of a table are empty, (auto)vacuum truncates them under an ``ACCESS
EXCLUSIVE`` lock. It gives the lock up when it sees a waiter, but only every 20 ms, and
dropping the truncated pages from shared buffers scans all of them, which on a server
with a large ``shared_buffers`` takes longer still. A request waits at most
``table_lock_timeout`` (25 ms) for a table of a consolidation, so such a truncation could
fail consolidations and hold out peeks for as long. With ``vacuum_truncate = false``,
vacuum leaves the empty pages in place (later rows reuse them; ``VACUUM (TRUNCATE)``
still returns them on demand).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Every name below is translated to the configured schema by env.py.
SCHEMA = "coda_memory"
#: The tables of a peek and of a consolidation (coda_memory.postgres.store).
TABLES = ("checkpoints", "observations", "facts", "fact_events")


def _schema() -> str:
    return op.get_context().version_table_schema or SCHEMA


def upgrade() -> None:
    schema = _schema()
    for table in TABLES:
        op.execute(f'ALTER TABLE "{schema}".{table} SET (vacuum_truncate = false)')


def downgrade() -> None:
    schema = _schema()
    for table in TABLES:
        op.execute(f'ALTER TABLE "{schema}".{table} RESET (vacuum_truncate)')
