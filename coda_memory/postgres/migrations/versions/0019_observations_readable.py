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

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.exc import DBAPIError, IntegrityError

from coda_memory.postgres.migrate import migration_warning
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
    migration = op.get_context()
    schema = migrating_schema(migration)
    # Added unless there (a run cut short during a validation, a kill or a lock timeout,
    # left them committed with the revision still 0018: added again, they failed every
    # later upgrade with "already exists").
    present = set() if context.is_offline_mode() else _checks_present(schema)
    for name, condition in CHECKS:
        if name not in present:
            op.create_check_constraint(
                op.f(name), "observations", condition, schema=schema, postgresql_not_valid=True
            )
    validations = [
        (f'ALTER TABLE "{schema}".observations VALIDATE CONSTRAINT {name}', condition)
        for name, condition in CHECKS
    ]
    # Offline, and in a transaction of the caller's (which holds the checks' lock until it
    # commits), no statement can run after a commit: the operator validates.
    if context.is_offline_mode():
        for validate, _ in validations:
            op.execute(f"-- then, outside a transaction: {validate}")
        return
    if migration._in_external_transaction:
        for validate, _ in validations:
            _warn_not_valid(schema, validate, "run on a transaction of the caller's")
        return
    # Each validation a transaction of its own, after the checks' ACCESS EXCLUSIVE lock is
    # committed; the lock timeout is the session's meanwhile.
    with migration.autocommit_block():
        op.execute(migration_lock_timeout(session=True))
        try:
            for validate, condition in validations:
                try:
                    op.execute(validate)
                except IntegrityError:  # check_violation: a row written by hand before it
                    _warn_not_valid(
                        schema,
                        validate,
                        f"rows written by hand fail it (SELECT ... WHERE NOT ({condition}): "
                        "mend or delete them first)",
                    )
                except DBAPIError as error:  # a lock timeout: validated later, by hand
                    _warn_not_valid(schema, validate, type(error.orig).__name__)
        finally:
            op.execute(sa.text("RESET lock_timeout"))
    # The transaction that began after the block has none of the environment's settings.
    op.execute(migration_lock_timeout())


def _checks_present(schema: str) -> set[str]:
    """The checks of :data:`CHECKS` that ``observations`` has already."""
    rows = op.get_bind().execute(
        sa.text(
            "SELECT conname FROM pg_constraint WHERE conrelid = "
            "to_regclass(quote_ident(:schema) || '.observations') AND conname = ANY(:names)"
        ),
        {"schema": schema, "names": [name for name, _ in CHECKS]},
    )
    return {row[0] for row in rows}


def _warn_not_valid(schema: str, validate: str, why: str) -> None:
    """Say that a check stays ``NOT VALID`` (new rows are checked all the same), why,
    and what validates it."""
    migration_warning(
        "coda-memory: a check of %s.observations stays NOT VALID (%s); new rows are "
        "checked; validate it with: %s",
        schema,
        why,
        validate,
    )


def downgrade() -> None:
    schema = migrating_schema(op.get_context())
    for name, _ in CHECKS:
        op.drop_constraint(op.f(name), "observations", schema=schema)
