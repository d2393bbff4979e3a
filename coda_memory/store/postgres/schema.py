"""The Postgres tables, as SQLAlchemy Core metadata.

Every table lives in the schema ``coda_memory``; another schema name is applied at run
time through ``schema_translate_map`` (see :func:`schema_translate_map`), never by building
SQL strings. Tables are sharded by identity (Citus-style): every primary key and unique
constraint starts with ``identity_id`` and every per-identity statement filters on it.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    Double,
    Identity,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.types import UserDefinedType

from coda_memory.model import FactCategory, FactEventKind, ObservationType

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


def validate_schema_name(name: str) -> str:
    """Return ``name`` if it is a plain lower-case identifier that is safe as a schema."""
    if not isinstance(name, str) or _SCHEMA_NAME.fullmatch(name) is None:
        raise ValueError(
            f"invalid schema name {name!r}: use lower-case letters, digits and '_' "
            "(at most 63 characters, not starting with a digit)"
        )
    if name.startswith("pg_"):
        raise ValueError(f"invalid schema name {name!r}: the pg_ prefix is reserved")
    return name


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
