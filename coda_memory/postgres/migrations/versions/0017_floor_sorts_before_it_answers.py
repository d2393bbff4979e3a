"""The floored views sort their rows before the first, so that a plan under a reader's
``LIMIT`` tells nothing of the groups the floor left out.

``tool_effectiveness``, ``entity_popularity`` and ``domain_trends`` streamed their rows
(merge joins and group aggregates over sorted input): under ``LIMIT n`` the plan stopped
after the n-th row kept, and ``EXPLAIN ANALYZE`` of ``LIMIT 1``, ``LIMIT 2``, … showed, in
its per-node counts, between which names shown a left-out tool or entity sorts, and how
many identities such a group holds ("exactly one identity avoids this tool", which
migration 0015 closed in ``fact_summary``). Each view now ends in ``ORDER BY`` a count,
which no index gives: the sort takes every row the floor kept before it gives one, and
the counts below it are those of the whole answer, whatever the ``LIMIT``.

The views are replaced in place (their columns, grants, owner and comments stay).
Downgrading puts 0014's and 0013's definitions back.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

from coda_memory.postgres.views import replace_views

revision: str = "0017"
down_revision: str | Sequence[str] | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: The views this revision replaces, with the revision each one's definition came from.
VIEWS = {"tool_effectiveness": "0014", "entity_popularity": "0013", "domain_trends": "0013"}


def upgrade() -> None:
    replace_views(dict.fromkeys(VIEWS, revision))


def downgrade() -> None:
    replace_views(VIEWS)
