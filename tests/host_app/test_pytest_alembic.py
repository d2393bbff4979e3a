"""pytest-alembic's four built-in tests, run on coda-memory's migrations.

The fixtures are the ones its documentation shows: ``alembic_config`` (here the packaged
migrations' programmatic configuration) and ``alembic_engine`` (an ``AsyncEngine`` on an
empty database, which env.py accepts as ``config.attributes["connection"]``). The plugin
itself is disabled in addopts (its collector fails on pytest 9), so the runner fixture
and the tests are imported here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from alembic.config import Config
from pytest_alembic.plugin.fixtures import alembic_runner
from pytest_alembic.tests import (
    test_model_definitions_match_ddl,
    test_single_head_revision,
    test_up_down_consistency,
    test_upgrade,
)
from sqlalchemy import pool
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from coda_memory.postgres.engine import asyncpg_url
from coda_memory.postgres.migrate import alembic_config as packaged_config

__all__ = [
    "alembic_runner",
    "test_model_definitions_match_ddl",
    "test_single_head_revision",
    "test_up_down_consistency",
    "test_upgrade",
]


@pytest.fixture
def alembic_config() -> Config:
    return packaged_config()


@pytest.fixture
def alembic_engine(empty_pg_url: str) -> Iterator[AsyncEngine]:
    # NullPool: every test step runs in its own event loop (asyncio.run in env.py).
    engine = create_async_engine(asyncpg_url(empty_pg_url), poolclass=pool.NullPool)
    try:
        yield engine
    finally:
        asyncio.run(engine.dispose())
