"""A member of the owner role sees every identity's rows only when it asks, as the owner.

The policy ``all_identities`` (migration 0004) names the role that ran the migrations, so
it applies to every role with that role's privileges, its members included. Its
expression let through, without ``coda_memory.all_identities = 'on'``, any role but the
owner itself (``current_user <> owner``, meant for the owner's views read by another
role): a login role that is a member of the owner (a DBA's, a deploy's) saw and could
write every identity's rows on a connection that set no identity at all, where the owner
saw none. The expression now lets through without the setting only a role without the
owner's privileges (``NOT pg_has_role(owner, 'USAGE')``): the reader of the owner's
aggregate views, an analyst, as before.

The policies are altered in place on every table that has one, for the role each names.
Downgrading puts 0004's expression back.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from coda_memory.postgres.tenancy import tenancy_sql
from coda_memory.postgres.views import migrating_schema

revision: str = "0020"
down_revision: str | Sequence[str] | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: The policy's expression, as format()'s template of the setting, 'on' and the owner.
MEMBERS_ASK = "'(SELECT current_setting(%L, true)) = %L OR (SELECT NOT pg_has_role(%L, ''USAGE''))'"
#: 0004's (sql/tenancy/owner_policy_0004.sql); sql/tenancy/owner_policy.sql writes MEMBERS_ASK.
OWNER_ONLY_ASKS = "'(SELECT current_setting(%L, true)) = %L OR current_user <> %L'"


def _alter(expression: str) -> None:
    script = tenancy_sql("owner_policy_members", migrating_schema(op.get_context()))
    op.execute(script.replace("{owner_allowed}", expression))


def upgrade() -> None:
    _alter(MEMBERS_ASK)


def downgrade() -> None:
    _alter(OWNER_ONLY_ASKS)
