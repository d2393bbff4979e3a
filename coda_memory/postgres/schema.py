"""The Postgres tables, as SQLAlchemy Core metadata.

Every table lives in the schema ``coda_memory``; another schema name is applied at run
time through ``schema_translate_map`` (see :func:`schema_translate_map`), never by building
SQL strings. Tables holding an identity's data are sharded by identity (Citus-style): their
primary key starts with ``identity_id`` and every per-identity statement filters on it. The
global rollup tables (``*_daily``, ``tool_durations``) hold anonymous counts keyed by day;
:mod:`coda_memory.postgres.rollup` explains them.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Date,
    DateTime,
    Double,
    Identity,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Select,
    SmallInteger,
    Table,
    Text,
    Uuid,
    bindparam,
    func,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.types import UserDefinedType

from coda_memory.core.model import FactCategory, FactEventKind, ObservationType

#: The schema name written in the metadata and in the migrations.
DEFAULT_SCHEMA = "coda_memory"

_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")

#: Stable constraint names (advanced-alchemy's convention; index names leave the schema
#: out so they do not change when the schema is translated).
NAMING_CONVENTION: dict[str, str] = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


#: Schemas of the server itself (besides every pg_* one).
_SYSTEM_SCHEMAS = frozenset({"information_schema"})


def validate_schema_name(name: str) -> str:
    """Return ``name`` if it is a plain lower-case identifier that is safe as a schema."""
    if not isinstance(name, str):
        raise TypeError(f"the schema name must be a str, not {type(name).__name__}")
    if _SCHEMA_NAME.fullmatch(name) is None:
        raise ValueError(
            f"invalid schema name {name!r}: use lower-case letters, digits and '_' "
            "(at most 63 characters, not starting with a digit)"
        )
    if name.startswith("pg_"):
        raise ValueError(f"invalid schema name {name!r}: the pg_ prefix is reserved")
    if name in _SYSTEM_SCHEMAS:
        raise ValueError(f"invalid schema name {name!r}: a system schema")
    return name


#: A migration waits at most this long for a table lock: on a live database a blocked
#: migration would queue every query of the table behind it.
MIGRATION_LOCK_TIMEOUT = "5s"


def migration_lock_timeout(*, session: bool = False) -> Select[tuple[str]]:
    """Sets :data:`MIGRATION_LOCK_TIMEOUT` for the current transaction: what every
    transaction of a migration runs first (the migration environment for the first one,
    a migration for one it begins after an ``autocommit_block``). ``session``: for the
    session instead, what an ``autocommit_block`` runs first, each of its statements
    being a transaction of its own (``RESET lock_timeout`` at its end)."""
    setting = bindparam("lock_timeout", MIGRATION_LOCK_TIMEOUT, Text)
    return select(func.set_config("lock_timeout", setting, not session))


def schema_translate_map(schema: str) -> dict[str | None, str]:
    """The execution option that moves every table to ``schema`` (validated here)."""
    return {DEFAULT_SCHEMA: validate_schema_name(schema)}


class Xid8(UserDefinedType[int]):
    """Postgres ``xid8``: a 64-bit transaction id that never wraps around."""

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "XID8"


class PgSnapshot(UserDefinedType[str]):
    """Postgres ``pg_snapshot``; only ever the target of a cast from its text form."""

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "PG_SNAPSHOT"


def _one_of(column: str, values: type[ObservationType | FactCategory | FactEventKind]) -> str:
    # Enum values are fixed identifiers from the model, so this is DDL text, not data.
    allowed = ", ".join(f"'{member.value}'" for member in values)
    return f"{column} IN ({allowed})"


metadata = MetaData(schema=DEFAULT_SCHEMA, naming_convention=NAMING_CONVENTION)

observations = Table(
    "observations",
    metadata,
    Column("identity_id", Text, nullable=False),
    Column("id", BigInteger, Identity(always=True), nullable=False),
    # The writing transaction's id: the consolidation cursor compares it with snapshots.
    Column("xid", Xid8(), nullable=False, server_default=text("pg_current_xact_id()")),
    Column("type", Text, nullable=False),
    Column("content", Text, nullable=False),
    Column("metadata", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("session_id", Text, nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    PrimaryKeyConstraint("identity_id", "id"),
    CheckConstraint(_one_of("type", ObservationType), name="type"),
    # Rows written by hand that no consolidation could read (migration 0019).
    CheckConstraint("jsonb_typeof(metadata) = 'object'", name="metadata_object"),
    CheckConstraint("isfinite(created_at)", name="created_at_finite"),
    Index(None, "identity_id", "xid"),
    Index(None, "identity_id", "created_at"),
)

facts = Table(
    "facts",
    metadata,
    Column("identity_id", Text, nullable=False),
    Column("subject", Text, nullable=False),
    Column("category", Text, nullable=False),
    Column("content", Text, nullable=False),
    Column("confidence", Double, nullable=False),
    Column("reinforcement_count", Integer, nullable=False),
    Column("last_reinforced_at", DateTime(timezone=True), nullable=False),
    # The instant ``confidence`` refers to (Fact.anchor), always stored.
    Column("confidence_at", DateTime(timezone=True), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Column("ease_factor", Double, nullable=True),
    PrimaryKeyConstraint("identity_id", "subject"),
    CheckConstraint(_one_of("category", FactCategory), name="category"),
    CheckConstraint("confidence >= 0 AND confidence <= 1", name="confidence"),
    CheckConstraint("reinforcement_count >= 1", name="reinforcement_count"),
    # Analytics: per-category aggregation (tools, entities) and fact_summary read these
    # instead of the table, and never visit the heap once the visibility map is set.
    Index(
        None,
        "category",
        "subject",
        postgresql_include=["confidence", "confidence_at", "ease_factor"],
    ),
    Index(
        None,
        "category",
        "identity_id",
        postgresql_include=["confidence", "confidence_at", "ease_factor"],
    ),
)

fact_events = Table(
    "fact_events",
    metadata,
    Column("identity_id", Text, nullable=False),
    Column("id", BigInteger, Identity(always=True), nullable=False),
    Column("subject", Text, nullable=False),
    Column("category", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("session_id", Text, nullable=True),
    Column("at", DateTime(timezone=True), nullable=False),
    Column("confidence_before", Double, nullable=True),
    Column("confidence_after", Double, nullable=True),
    Column("count_before", Integer, nullable=True),
    Column("count_after", Integer, nullable=True),
    Column("ease_before", Double, nullable=True),
    Column("ease_after", Double, nullable=True),
    Column("quality", Double, nullable=True),
    Column("hits", Integer, nullable=False),
    Column("trials", Integer, nullable=False),
    # The consolidation's ``now``: when the event was written, as opposed to ``at``.
    Column("recorded_at", DateTime(timezone=True), nullable=False),
    PrimaryKeyConstraint("identity_id", "id"),
    CheckConstraint(_one_of("category", FactCategory), name="category"),
    CheckConstraint(_one_of("kind", FactEventKind), name="kind"),
    Index(None, "identity_id", "subject", "id"),
    Index(
        None,
        "identity_id",
        "session_id",
        postgresql_where=text("session_id IS NOT NULL"),
    ),
)

checkpoints = Table(
    "checkpoints",
    metadata,
    Column("identity_id", Text, nullable=False),
    # The pg_snapshot (text form) of the last consolidation: its observations are consumed.
    Column("snapshot", Text, nullable=True),
    Column("consolidated_at", DateTime(timezone=True), nullable=True),
    Column("runs", BigInteger, nullable=False, server_default=text("0")),
    Column("observations_consumed", BigInteger, nullable=False, server_default=text("0")),
    PrimaryKeyConstraint("identity_id"),
)


#: One row per identity copied from the original Redis layout by ``import-redis``, written
#: in the transaction that copied it: a rerun skips the identity, a killed run resumes.
redis_imports = Table(
    "redis_imports",
    metadata,
    Column("identity_id", Text, nullable=False),
    #: Where it came from: the Redis key prefix.
    Column("source", Text, nullable=False),
    Column("imported_at", DateTime(timezone=True), nullable=False),
    Column("observations", Integer, nullable=False),
    Column("consumed_observations", Integer, nullable=False),
    Column("facts", Integer, nullable=False),
    Column("fact_events", Integer, nullable=False),
    #: The Redis checkpoint: createdAt of the latest observation it had consumed.
    Column("checkpoint_at", DateTime(timezone=True), nullable=True),
    #: Records of the identity the copy left out (``--dry-run`` lists them).
    Column("bad_records", Integer, nullable=False, server_default=text("0")),
    PrimaryKeyConstraint("identity_id", "source"),
)

# The rollup: usage counts that outlive the raw observations (see postgres/rollup.py).

#: Calls of each tool per UTC day, and the identities whose latest call of it was that day.
tool_daily = Table(
    "tool_daily",
    metadata,
    Column("day", Date, nullable=False),
    Column("tool_name", Text, nullable=False),
    Column("shard", SmallInteger, nullable=False),
    Column("successes", BigInteger, nullable=False),
    Column("failures", BigInteger, nullable=False),
    Column("latest_users", BigInteger, nullable=False),
    PrimaryKeyConstraint("day", "tool_name", "shard"),
)

#: Calls per tool, UTC day and duration bucket (log scale, see rollup.duration_bucket).
tool_durations = Table(
    "tool_durations",
    metadata,
    Column("day", Date, nullable=False),
    Column("tool_name", Text, nullable=False),
    Column("shard", SmallInteger, nullable=False),
    Column("bucket", SmallInteger, nullable=False),
    Column("calls", BigInteger, nullable=False),
    PrimaryKeyConstraint("day", "tool_name", "shard", "bucket"),
)

#: The last UTC day each identity called each tool (and the day before that change).
tool_users = Table(
    "tool_users",
    metadata,
    Column("identity_id", Text, nullable=False),
    Column("tool_name", Text, nullable=False),
    Column("last_day", Date, nullable=False),
    Column("previous_day", Date, nullable=True),
    PrimaryKeyConstraint("identity_id", "tool_name"),
)

#: Accesses of each entity per UTC day, and the identities whose latest access was that day.
entity_daily = Table(
    "entity_daily",
    metadata,
    Column("day", Date, nullable=False),
    Column("entity_type", Text, nullable=False),
    Column("entity_id", Text, nullable=False),
    Column("accesses", BigInteger, nullable=False),
    Column("latest_users", BigInteger, nullable=False),
    PrimaryKeyConstraint("day", "entity_type", "entity_id"),
)

#: The last UTC day each identity accessed each entity (and the day before that change).
entity_users = Table(
    "entity_users",
    metadata,
    Column("identity_id", Text, nullable=False),
    Column("entity_type", Text, nullable=False),
    Column("entity_id", Text, nullable=False),
    Column("last_day", Date, nullable=False),
    Column("previous_day", Date, nullable=True),
    PrimaryKeyConstraint("identity_id", "entity_type", "entity_id"),
)

#: Queries per domain and UTC day, and the distinct identities that asked them that day.
domain_daily = Table(
    "domain_daily",
    metadata,
    Column("day", Date, nullable=False),
    Column("domain", Text, nullable=False),
    Column("shard", SmallInteger, nullable=False),
    Column("queries", BigInteger, nullable=False),
    Column("users", BigInteger, nullable=False),
    PrimaryKeyConstraint("day", "domain", "shard"),
)


def _batch_keys(name: str) -> Table:
    """A table of the batches the writer stored, by idempotency key; no identity."""
    return Table(
        name,
        metadata,
        Column("key", Uuid, nullable=False),
        Column("stored", Integer, nullable=False),
        Column("refused", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
        Column(
            "committed_at", DateTime(timezone=True), nullable=False, server_default=text("now()")
        ),
        PrimaryKeyConstraint("key"),
        Index(None, "committed_at"),
    )


#: The batches the writer stored, by idempotency key (exactly-once ingest).
ingest_batches = _batch_keys("ingest_batches")
#: The same keys, for a batch whose first attempt found ``ingest_batches`` locked (see
#: postgres/batch_keys.py).
ingest_batches_spill = _batch_keys("ingest_batches_spill")

#: Appended transactions whose rollup is owed: a rollup table was locked when they
#: stored their rows, so the rows of (identity_id, xid) are folded in later (see
#: postgres/rollup_owed.py). ``kinds``: which rollups, a bit each (1 tools, 2 entities,
#: 4 domains).
rollup_owed = Table(
    "rollup_owed",
    metadata,
    Column("identity_id", Text, nullable=False),
    Column("xid", Xid8(), nullable=False),
    Column("kinds", SmallInteger, nullable=False),
    Column("owed_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    PrimaryKeyConstraint("identity_id", "xid"),
)

#: The UTC days on which each identity asked about each domain.
domain_users = Table(
    "domain_users",
    metadata,
    Column("identity_id", Text, nullable=False),
    Column("domain", Text, nullable=False),
    Column("day", Date, nullable=False),
    PrimaryKeyConstraint("identity_id", "domain", "day"),
)


#: The default k-anonymity floor of the analytics views (migration 0013 writes it).
DEFAULT_ANALYTICS_FLOOR = 5

#: The k-anonymity floor of the analytics views, one row that only the owner may change:
#: a role that may not read ``facts`` (an analyst) sees no group behind fewer than
#: ``min_users`` identities (see the view ``analytics_reader_floor``). ``one_row`` is the
#: key, and its check allows one value, so the table cannot hold a second row.
analytics_floor = Table(
    "analytics_floor",
    metadata,
    Column("one_row", Boolean, nullable=False, server_default=text("true")),
    Column(
        "min_users",
        Integer,
        nullable=False,
        server_default=text(str(DEFAULT_ANALYTICS_FLOOR)),
    ),
    PrimaryKeyConstraint("one_row"),
    CheckConstraint("one_row", name="one_row"),
    CheckConstraint("min_users >= 1", name="min_users"),
)
