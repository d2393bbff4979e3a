"""The planner takes each session to hold few of an identity's fact events.

A consolidation asks, for each observation it reads, whether the observation's session
reinforced a fact in an earlier run (an ``EXISTS`` on ``fact_events`` by identity and
session, through the ``(identity_id, session_id)`` index). The planner estimates how many
events match a session from the column's sampled number of distinct sessions. Where one
session holds nearly all the sampled rows (a host that passed one session id for months,
an import), that number is tiny, each session is taken to match most of the identity's
events, and the check becomes a scan of them all that stops at the first match: an
identity with 400,000 events and a new session scanned all of them once per observation,
and its consolidation outlived the statement timeout every time. A session holds the
events of the facts it reinforced, a handful: ``n_distinct = -0.1`` (one distinct session
per ten events) tells the planner so, whatever the sample, from the next ``ANALYZE`` on
(run here).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Every name below is translated to the configured schema by env.py.
SCHEMA = "coda_memory"
#: Distinct sessions as a share of the events (negative: a ratio, kept as the table grows).
SESSIONS_PER_EVENT = -0.1


def _schema() -> str:
    return op.get_context().version_table_schema or SCHEMA


def upgrade() -> None:
    schema = _schema()
    op.execute(
        f'ALTER TABLE "{schema}".fact_events ALTER COLUMN session_id '
        f"SET (n_distinct = {SESSIONS_PER_EVENT})"
    )
    op.execute(f'ANALYZE "{schema}".fact_events')


def downgrade() -> None:
    schema = _schema()
    op.execute(f'ALTER TABLE "{schema}".fact_events ALTER COLUMN session_id RESET (n_distinct)')
    op.execute(f'ANALYZE "{schema}".fact_events')
