"""The Postgres adapter: schema, repositories and the store (asyncpg via SQLAlchemy)."""

from __future__ import annotations

from coda_memory.postgres.repositories import Checkpoint
from coda_memory.postgres.store import PostgresStore
from coda_memory.postgres.unit import PostgresConsolidationUnit

__all__ = ["Checkpoint", "PostgresConsolidationUnit", "PostgresStore"]
