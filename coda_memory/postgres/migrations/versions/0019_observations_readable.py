"""Observations every consolidation can read: metadata a JSON object, a finite time.

The library writes nothing else, but a row written by hand (an operator's ``INSERT``, a
script's backfill) with metadata that is an array, a string, a number or ``null``, or
dated ``'infinity'``, stopped every consolidation of its identity for good: each failed
on that row (``'list' object has no attribute 'get'``, a comparison of an infinite
date), so its newer observations were never consumed, its loads answered from stale
facts and its rows were never pruned. The two checks refuse such a row where it is
written, naming the constraint.

Each is added ``NOT VALID``, which reads no row (adding it holds the table's ACCESS
EXCLUSIVE lock, but only for a moment), and validated once that is committed, in a
transaction of its own, which reads the table under a lock (SHARE UPDATE EXCLUSIVE) that
appends and reads do not wait for. A row written by hand before it fails the
validation: the check then stays ``NOT VALID`` (new rows are checked, that one is not),
the upgrade goes on, and a warning says how to find the row; ``ALTER TABLE
coda_memory.observations VALIDATE CONSTRAINT ck_observations_metadata_object`` (or
``ck_observations_created_at_finite``) validates it once the row is mended or deleted.
(Validated, a check is also what SQLAlchemy reflects without a warning: it does not
know the reflected ``not_valid`` option.) Offline (``--sql``), the script leaves them
``NOT VALID``, with the statements to validate them as a comment: in the script's one
transaction the validation would hold that ACCESS EXCLUSIVE lock through the whole scan,
and a row that fails it would stop the script.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.exc import IntegrityError

from coda_memory.postgres.schema import migration_lock_timeout
from coda_memory.postgres.views import migrating_schema

revision: str = "0019"
down_revision: str | Sequence[str] | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: (name, condition), named as the naming convention names the metadata's checks.
CHECKS = (
    ("ck_observations_metadata_object", "jsonb_typeof(metadata) = 'object'"),
    ("ck_observations_created_at_finite", "isfinite(created_at)"),
)


def upgrade() -> None:
    schema = migrating_schema(op.get_context())
    for name, condition in CHECKS:
        op.create_check_constraint(
            op.f(name), "observations", condition, schema=schema, postgresql_not_valid=True
        )
    validations = [
        (f'ALTER TABLE "{schema}".observations VALIDATE CONSTRAINT {name}', name, condition)
        for name, condition in CHECKS
    ]
    if context.is_offline_mode():
        for validate, _, _ in validations:
            op.execute(f"-- then, outside a transaction: {validate}")
        return
    # Each validation a transaction of its own, after the checks' ACCESS EXCLUSIVE lock is
    # committed; the lock timeout is the session's meanwhile.
    with op.get_context().autocommit_block():
        op.execute(migration_lock_timeout(session=True))
        try:
            for validate, name, condition in validations:
                try:
                    op.execute(validate)
                except IntegrityError:  # check_violation: a row written by hand before it
                    logging.getLogger("coda_memory").warning(
                        "coda-memory: rows of %s.observations written by hand fail the new "
                        "check %s (%s), which stays NOT VALID: new rows are checked; mend or "
                        "delete those (SELECT ... WHERE NOT (%s)), then run %s",
                        schema,
                        name,
                        condition,
                        condition,
                        validate,
                    )
        finally:
            op.execute(sa.text("RESET lock_timeout"))


def downgrade() -> None:
    schema = migrating_schema(op.get_context())
    for name, _ in CHECKS:
        op.drop_constraint(op.f(name), "observations", schema=schema)
