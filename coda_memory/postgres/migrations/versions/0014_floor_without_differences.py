"""The k-anonymity floor of 0013 holds against two differences within the views.

* ``fact_summary``: a row showed ``facts`` and its histogram with the buckets of fewer
  facts than the floor withheld; when one bucket was withheld, ``facts`` less the others
  gave it back (one user's fact, in its tenth of the scale), and withholding more
  buckets is not enough (under a floor of 2, a withheld bucket holds one fact). A
  histogram with a bucket of fewer facts than the floor (none is not fewer) is now
  withheld whole.
* ``tool_effectiveness``: a tool that as many identities as the floor hold facts about
  stayed, with its usage at 0, on the days nobody used it, and was left out on the days a
  few did: stepping the window told on which days those few used it. For a reader the
  floor binds, a tool is now shown only when as many identities used it in the window.

Both views are replaced in place (their columns, grants, owner and comments stay; the
comments are rewritten). Downgrading puts 0013's definitions back.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

from coda_memory.postgres.views import replace_views

revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: The views this revision replaces.
VIEWS = ("tool_effectiveness", "fact_summary")


def upgrade() -> None:
    replace_views(dict.fromkeys(VIEWS, revision))


def downgrade() -> None:
    replace_views(dict.fromkeys(VIEWS, "0013"))
