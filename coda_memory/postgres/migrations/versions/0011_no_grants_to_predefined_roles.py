"""Predefined roles get no privilege of their own on the tables 0006 and 0007 added.

Migrations 0006 and 0007 granted ``rollup_owed`` and ``ingest_batches_spill`` to every
role that could insert into ``ingest_batches``, asking ``has_table_privilege``, which also
answers yes for ``pg_write_all_data`` (it may write every table) and for members of an
app role. So ``pg_write_all_data`` was granted SELECT there too, and its members, who may
read no table of the schema, could read every identity's owed rollup rows. The statement
now takes only the roles granted INSERT on ``ingest_batches`` itself
(``sql/tenancy/grant_like.sql``); this revokes what predefined roles (``pg_*``)
were granted on the two tables. Downgrading grants nothing back.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Every name below is translated to the configured schema by env.py.
SCHEMA = "coda_memory"
#: The tables that 0006 and 0007 granted like ingest_batches.
TABLES = ("rollup_owed", "ingest_batches_spill")


def _schema() -> str:
    return op.get_context().version_table_schema or SCHEMA


def upgrade() -> None:
    schema = _schema()
    for table in TABLES:
        # The roles come from the catalog and are quoted by format('%I').
        op.execute(
            "DO $revoke$ DECLARE grantee name; BEGIN "
            "FOR grantee IN SELECT DISTINCT r.rolname "
            "FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) AS acl "
            "JOIN pg_roles r ON r.oid = acl.grantee "
            f"WHERE c.oid = '\"{schema}\".{table}'::regclass "
            "AND r.rolname LIKE 'pg\\_%' "
            "LOOP EXECUTE format("
            f"'REVOKE ALL ON \"{schema}\".{table} FROM %I', grantee); "
            "END LOOP; END $revoke$"
        )


def downgrade() -> None:
    pass  # what predefined roles were granted was a leak: it is not granted back
