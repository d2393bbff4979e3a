"""A host application with its own models and Alembic history in ``public``, and
coda-memory migrated beside it: neither history touches the other.

The test writes a small Alembic project into a temporary directory, as a host would have
one: ``models.py`` (two tables), an ``env.py`` that sets ``include_schemas=True`` and uses
:mod:`coda_memory.alembic`'s hooks, and one revision. ``alembic`` runs it as a subprocess.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

import coda_memory
from coda_memory.errors import ForeignAlembicHistory
from tests.postgres.helpers import fetch
from tests.postgres.test_migrations import HEAD

MODELS = """
from sqlalchemy import ForeignKey, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Customer(Base):
    __tablename__ = "customers"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100))


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    customer_id: Mapped[int] = mapped_column(ForeignKey("customers.id"))
    total_cents: Mapped[int]
"""

ENV = """
import asyncio
import os

from alembic import context
from sqlalchemy import pool
from sqlalchemy.ext.asyncio import create_async_engine

from coda_memory.alembic import exclude_schema, exclude_schema_objects
from models import Base

HOOKS = (
    {"include_name": exclude_schema(), "include_object": exclude_schema_objects()}
    if os.environ.get("HOST_USES_CODA_MEMORY_HOOKS") == "1"
    else {}
)


def run(connection):
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        include_schemas=True,
        compare_type=True,
        **HOOKS,
    )
    with context.begin_transaction():
        context.run_migrations()


async def main():
    engine = create_async_engine(os.environ["HOST_DATABASE_URL"], poolclass=pool.NullPool)
    async with engine.connect() as connection:
        await connection.run_sync(run)
        await connection.commit()
    await engine.dispose()


asyncio.run(main())
"""

REVISION = '''
"""host tables"""
import sqlalchemy as sa
from alembic import op

revision = "h0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade():
    op.create_table(
        "customers",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(100), nullable=False),
    )
    op.create_table(
        "orders",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("customer_id", sa.Integer(), sa.ForeignKey("customers.id"), nullable=False),
        sa.Column("total_cents", sa.Integer(), nullable=False),
    )


def downgrade():
    op.drop_table("orders")
    op.drop_table("customers")
'''

INI = """
[alembic]
script_location = %(here)s/host_migrations
prepend_sys_path = .
path_separator = os
"""

#: All an installed wheel needs for `alembic upgrade head`: no logging sections.
WHEEL_INI = """
[alembic]
script_location = coda_memory.postgres:migrations
"""


@pytest.fixture
def host_project(tmp_path: Path) -> Path:
    (tmp_path / "models.py").write_text(textwrap.dedent(MODELS))
    (tmp_path / "alembic.ini").write_text(INI)
    (tmp_path / "coda-memory.ini").write_text(WHEEL_INI)
    migrations = tmp_path / "host_migrations"
    (migrations / "versions").mkdir(parents=True)
    (migrations / "env.py").write_text(ENV)
    (migrations / "script.py.mako").write_text(
        '"""${message}"""\nrevision = ${repr(up_revision)}\n'
        "down_revision = ${repr(down_revision)}\n\n\ndef upgrade():\n    ${upgrades}\n\n\n"
        "def downgrade():\n    ${downgrades}\n"
    )
    (migrations / "versions" / "h0001_host_tables.py").write_text(REVISION)
    return tmp_path


def alembic(
    project: Path, url: str, *args: str, hooks: bool = True, ini: str = "alembic.ini"
) -> subprocess.CompletedProcess[str]:
    executable = Path(sys.executable).with_name("alembic")
    env = {
        **os.environ,
        "HOST_DATABASE_URL": url,
        "CODA_MEMORY_DATABASE_URL": url,
        "HOST_USES_CODA_MEMORY_HOOKS": "1" if hooks else "0",
    }
    env.pop("CODA_MEMORY_SCHEMA", None)
    return subprocess.run(
        [str(executable), "-c", ini, *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def rows(url: str, sql: str) -> list[tuple[object, ...]]:
    return [tuple(row) for row in asyncio.run(fetch(url, sql))]


def test_host_history_and_coda_memory_live_side_by_side(
    host_project: Path, empty_pg_url: str
) -> None:
    upgraded = alembic(host_project, empty_pg_url, "upgrade", "head")
    assert upgraded.returncode == 0, upgraded.stderr
    coda_memory.migrate(empty_pg_url)
    coda_memory.migrate(empty_pg_url)  # the function, every time

    assert rows(empty_pg_url, "SELECT version_num FROM public.alembic_version") == [("h0001",)]
    assert rows(empty_pg_url, "SELECT version_num FROM coda_memory.alembic_version") == [(HEAD,)]

    check = alembic(host_project, empty_pg_url, "check")
    assert check.returncode == 0, check.stderr
    assert "No new upgrade operations detected" in check.stdout + check.stderr

    revision = alembic(host_project, empty_pg_url, "revision", "--autogenerate", "-m", "none")
    assert revision.returncode == 0, revision.stderr
    written = [p for p in (host_project / "host_migrations" / "versions").iterdir()]
    generated = next(p for p in written if p.name != "h0001_host_tables.py")
    assert "coda_memory" not in generated.read_text()
    assert "drop_table" not in generated.read_text()


def test_without_the_hooks_the_host_autogenerate_would_drop_our_tables(
    host_project: Path, empty_pg_url: str
) -> None:
    """The control: what exclude_schema prevents."""
    assert alembic(host_project, empty_pg_url, "upgrade", "head").returncode == 0
    coda_memory.migrate(empty_pg_url)

    check = alembic(host_project, empty_pg_url, "check", hooks=False)

    assert check.returncode != 0
    assert "coda_memory" in check.stdout + check.stderr


def test_a_wheel_needs_only_a_two_line_ini_for_alembic_upgrade_head(
    host_project: Path, empty_pg_url: str
) -> None:
    upgraded = alembic(host_project, empty_pg_url, "upgrade", "head", ini="coda-memory.ini")
    assert upgraded.returncode == 0, upgraded.stderr
    assert rows(empty_pg_url, "SELECT version_num FROM coda_memory.alembic_version") == [(HEAD,)]

    check = alembic(host_project, empty_pg_url, "check", ini="coda-memory.ini")
    assert check.returncode == 0, check.stderr


def test_a_two_line_ini_still_shows_what_an_upgrade_left_undone(
    host_project: Path, empty_pg_url: str
) -> None:
    """With no logging configured, the package's NullHandler swallowed 0019's warning
    that a check stays NOT VALID: the operator never learnt of the row to mend."""
    assert (
        alembic(host_project, empty_pg_url, "upgrade", "0018", ini="coda-memory.ini").returncode
        == 0
    )
    rows(
        empty_pg_url,
        "INSERT INTO coda_memory.observations (identity_id, type, content, metadata, "
        "created_at) VALUES ('ana', 'query_pattern', 'q', '[]'::jsonb, now())",
    )
    upgraded = alembic(host_project, empty_pg_url, "upgrade", "head", ini="coda-memory.ini")
    assert upgraded.returncode == 0, upgraded.stderr
    (line,) = [line for line in upgraded.stderr.splitlines() if "stays NOT VALID" in line]
    assert "ck_observations_metadata_object" in line and "VALIDATE CONSTRAINT" in line


def test_a_schema_holding_the_host_history_is_refused(
    host_project: Path, empty_pg_url: str
) -> None:
    assert alembic(host_project, empty_pg_url, "upgrade", "head").returncode == 0

    with pytest.raises(ForeignAlembicHistory, match="'h0001', which is not one of this"):
        coda_memory.migrate(empty_pg_url, schema="public")

    assert rows(empty_pg_url, "SELECT version_num FROM public.alembic_version") == [("h0001",)]
    tables = "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1"
    assert rows(empty_pg_url, tables) == [("alembic_version",), ("customers",), ("orders",)]


def test_a_schema_where_the_host_alembic_would_look_is_refused_before_its_first_upgrade(
    host_project: Path, empty_pg_url: str
) -> None:
    """Migrated first into ``public`` (on the search path), coda-memory's version table
    was where the host's Alembic looks for its own: the host's first upgrade then
    failed on a revision it did not know."""
    with pytest.raises(ForeignAlembicHistory, match="schema 'public' is on the search path"):
        coda_memory.migrate(empty_pg_url, schema="public")

    tables = "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1"
    assert rows(empty_pg_url, tables) == []
    upgraded = alembic(host_project, empty_pg_url, "upgrade", "head")
    assert upgraded.returncode == 0, upgraded.stderr
    assert rows(empty_pg_url, "SELECT version_num FROM public.alembic_version") == [("h0001",)]


def test_a_schema_named_after_the_role_that_migrates_is_not_refused(empty_pg_url: str) -> None:
    """On the search path through ``$user`` only: a DBA's ``CREATE SCHEMA memory
    AUTHORIZATION memory`` for the role that migrates. A host's Alembic, run as its own
    role, never looks there."""
    owner = f"coda_own_{secrets.token_hex(4)}"
    database = make_url(empty_pg_url).database
    rows(empty_pg_url, f'CREATE ROLE "{owner}" LOGIN')
    try:
        rows(empty_pg_url, f'GRANT CREATE ON DATABASE "{database}" TO "{owner}"')
        rows(empty_pg_url, f'CREATE SCHEMA "{owner}" AUTHORIZATION "{owner}"')
        owner_url = make_url(empty_pg_url).set(username=owner).render_as_string(False)

        coda_memory.migrate(owner_url, schema=owner)

        assert rows(empty_pg_url, f'SELECT version_num FROM "{owner}".alembic_version') == [(HEAD,)]
    finally:
        rows(empty_pg_url, f'DROP OWNED BY "{owner}"')
        rows(empty_pg_url, f'DROP ROLE "{owner}"')


def test_the_default_schema_on_the_owner_roles_search_path_is_refused_with_the_way_out(
    empty_pg_url: str,
) -> None:
    """A DBA's setup: ``CREATE SCHEMA coda_memory AUTHORIZATION owner`` and ``ALTER ROLE
    owner SET search_path = coda_memory, public``. A host's Alembic run as that role would
    read coda-memory's version table for its own, even with its own further down the
    path: refused, the message saying how to go on (it pointed at the default schema it
    was given)."""
    owner = f"coda_own_{secrets.token_hex(4)}"
    database = make_url(empty_pg_url).database
    rows(empty_pg_url, f'CREATE ROLE "{owner}" LOGIN')
    try:
        rows(empty_pg_url, f'GRANT CREATE ON DATABASE "{database}" TO "{owner}"')
        rows(empty_pg_url, f'CREATE SCHEMA coda_memory AUTHORIZATION "{owner}"')
        rows(empty_pg_url, f'ALTER ROLE "{owner}" SET search_path = coda_memory, public')
        owner_url = make_url(empty_pg_url).set(username=owner).render_as_string(False)

        with pytest.raises(ForeignAlembicHistory, match="take it off the search path"):
            coda_memory.migrate(owner_url)

        rows(empty_pg_url, f'ALTER ROLE "{owner}" RESET search_path')
        coda_memory.migrate(owner_url)
        assert rows(empty_pg_url, "SELECT version_num FROM coda_memory.alembic_version") == [
            (HEAD,)
        ]
    finally:
        rows(empty_pg_url, f'DROP OWNED BY "{owner}"')
        rows(empty_pg_url, f'DROP ROLE "{owner}"')
