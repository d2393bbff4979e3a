"""The views that decay facts cap the decay's exponent, so that old facts expire.

The views of 0002 compute ``confidence * 0.95 ^ (days / ease)``. Past an exponent of about
14,500 the power is smaller than any float and Postgres's ``power()`` fails with
"underflow". ``PowerLawDecay`` keeps its stability as the ease, down to 0.05 day by
default, so one of its facts left two years at that stability (or any fact 40 years old
at ease 1) made every query of ``active_facts``, ``tool_effectiveness``,
``entity_popularity`` and ``fact_summary`` fail, for every analyst and every identity.
An ease below about 1e-302 (an import may bring one) made the division itself fail with
"overflow". The exponent is now capped at 10,000 (0.95 ^ 10,000 is about 1e-223, far below
the 0.1 threshold) and an ease below 1e-300 divides as 1e-300, so such a fact is expired,
as Python's decay has it, and the numbers of every other fact are unchanged.

The views are replaced in place (``CREATE OR REPLACE VIEW``): their columns, grants, owner
and comments stay. Downgrading puts 0002's definitions back the same way.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

from coda_memory.postgres.views import replace_views

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: The views that decay facts (no view reads another of them).
VIEWS = ("active_facts", "tool_effectiveness", "entity_popularity", "fact_summary")


def upgrade() -> None:
    replace_views(dict.fromkeys(VIEWS, revision))


def downgrade() -> None:
    replace_views(dict.fromkeys(VIEWS, "0002"))
