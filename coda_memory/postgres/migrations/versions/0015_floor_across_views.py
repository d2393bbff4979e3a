"""The k-anonymity floor holds across views: ``fact_summary`` counts, for a reader the
floor binds, only the facts of a subject held by at least the floor's number of
identities.

``tool_effectiveness`` (``affinity_users``, ``avoidance_users``) and
``entity_popularity`` (``fact_users``) withhold a subject's count of fewer identities
than the floor, but ``fact_summary`` counted every active fact of a category: its
``facts`` less the counts shown gave a withheld one back ("exactly one identity avoids
this tool"), with no data changed and nothing else needed. What an analyst can subtract
now is made of subjects that could be shown. A reader the floor does not bind (the
owner, an app role) counts every fact, as before, from the index alone.

The view is replaced in place (its columns, grants, owner and comment stay; the comment
is rewritten). Downgrading puts 0014's definition back.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

from coda_memory.postgres.views import replace_views

revision: str = "0015"
down_revision: str | Sequence[str] | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: The views this revision replaces.
VIEWS = ("fact_summary",)


def upgrade() -> None:
    replace_views(dict.fromkeys(VIEWS, revision))


def downgrade() -> None:
    replace_views(dict.fromkeys(VIEWS, "0014"))
