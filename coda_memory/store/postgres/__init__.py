"""The Postgres adapter: schema, repositories and the store (asyncpg via SQLAlchemy)."""

from __future__ import annotations

from coda_memory.store.postgres.repositories import Checkpoint
from coda_memory.store.postgres.store import PostgresStore
from coda_memory.store.postgres.unit import PostgresConsolidationUnit

__all__ = ["Checkpoint", "PostgresConsolidationUnit", "PostgresStore"]
