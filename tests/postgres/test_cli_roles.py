"""The command line run as a role that row-level security limits: the app role's
maintenance fails with one line instead of answering as if no identity existed, and an
analyst's analytics work."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from coda_memory.errors import AccessDenied
from coda_memory.postgres import PostgresStore, maintenance
from tests.postgres.helpers import superuser
from tests.postgres.test_cli import assert_one_line_error, run, seed_alice, table_locked

README = Path(__file__).resolve().parents[2] / "README.md"


def _owner_policy_snippet() -> str:
    """The README's SQL that makes the policies name a new owner, for schema coda_memory."""
    found = re.search(
        r"<!-- owner-policy: .*?-->\n```sql\n(.*?)^```$", README.read_text(), re.M | re.S
    )
    assert found is not None, "the README's owner-policy snippet is missing"
    return found[1].replace(":'schema'", "'coda_memory'")


@pytest.fixture
def roles(pg_url: str) -> Iterator[tuple[str, str]]:
    """URLs of an app role and an analyst role (LOGIN), granted with coda-memory grant."""
    suffix = secrets.token_hex(4)
    app_role, analyst = f"coda_cli_app_{suffix}", f"coda_cli_analyst_{suffix}"
    asyncio.run(superuser(pg_url, *(f'CREATE ROLE "{r}" LOGIN' for r in (app_role, analyst))))
    try:
        for kind, role in (("app", app_role), ("analyst", analyst)):
            granted = run("grant", kind, role, "--url", pg_url)
            assert granted.exit_code == 0, granted.output
        as_role = (
            make_url(pg_url).set(username=role).render_as_string(False)
            for role in (app_role, analyst)
        )
        yield next(as_role), next(as_role)
    finally:
        asyncio.run(
            superuser(
                pg_url,
                *(f'DROP OWNED BY "{r}"' for r in (app_role, analyst)),
                *(f'DROP ROLE "{r}"' for r in (app_role, analyst)),
            )
        )


@pytest.mark.parametrize(
    "command",
    [["stats"], ["consolidate", "--all"], ["facts", "alice"], ["prune"], ["prompt", "alice"]],
)
def test_maintenance_as_the_app_role_says_what_it_needs(
    pg_url: str, roles: tuple[str, str], command: list[str]
) -> None:
    seed_alice(pg_url)
    app_url, _ = roles
    result = run(*command, "--url", app_url)
    assert_one_line_error(result, 1, "the role of ")
    assert "cannot read every identity's rows" in result.stderr
    assert "schema's owner" in result.stderr


def test_analytics_as_the_app_role_says_which_grant_it_lacks(
    pg_url: str, roles: tuple[str, str]
) -> None:
    """The app role may not read the aggregate views: the one line says so, and which
    roles may (the library's AccessDenied), without sending to --debug."""
    seed_alice(pg_url)
    app_url, _ = roles
    result = run("analytics", "tools", "--min-users", "1", "--url", app_url)
    assert_one_line_error(result, 1, "permission denied in schema 'coda_memory'")
    assert "coda-memory grant analyst ROLE" in result.stderr
    assert "--debug" not in result.stderr


def test_the_owner_still_sees_every_identity(pg_url: str, roles: tuple[str, str]) -> None:
    seed_alice(pg_url)
    result = run("facts", "alice", "--url", pg_url)
    assert result.exit_code == 0, result.output
    assert "tool_affinity:get_account" in result.stdout


@pytest.mark.parametrize("kind", ["tools", "entities", "domains", "facts"])
def test_analytics_as_the_analyst_role_answer_as_for_the_owner(
    pg_url: str, roles: tuple[str, str], kind: str
) -> None:
    """The analyst reads the aggregate views only (not active_facts, which entities
    reads for the owner), and gets the owner's answer: at the default floor (5), none of
    the groups of two users; with the floor at 1, the same rows."""
    seed_alice(pg_url)
    seed_alice(pg_url, "bob")
    _, analyst_url = roles
    arguments = ("analytics", kind, "--min-users", "1", "-f", "json")
    as_owner = run(*arguments, "--url", pg_url)
    assert as_owner.exit_code == 0, as_owner.output
    assert json.loads(as_owner.stdout), "the seeded identities count in every answer"
    floored = run(*arguments, "--url", analyst_url)
    assert floored.exit_code == 0, floored.output
    assert json.loads(floored.stdout) == []

    asyncio.run(superuser(pg_url, "UPDATE coda_memory.analytics_floor SET min_users = 1"))
    try:
        as_analyst = run(*arguments, "--url", analyst_url)
    finally:
        asyncio.run(superuser(pg_url, "UPDATE coda_memory.analytics_floor SET min_users = 5"))
    assert as_analyst.exit_code == 0, as_analyst.output
    # (Confidences decay between the two runs: compared to six places.)
    assert _rounded(json.loads(as_analyst.stdout)) == _rounded(json.loads(as_owner.stdout))


def test_analytics_as_the_analyst_keep_the_statement_timeout_set_on_its_role(
    pg_url: str, roles: tuple[str, str]
) -> None:
    """A DBA's bound on the analysts' statements (ALTER ROLE … SET statement_timeout)
    applies to analytics: the command set it to 0 for its connections, and a read that a
    held table kept waiting ran until --lock-wait (10 s), then stopped as busy (exit 3)."""
    seed_alice(pg_url)
    _, analyst_url = roles
    analyst = make_url(analyst_url).username
    asyncio.run(superuser(pg_url, f"ALTER ROLE \"{analyst}\" SET statement_timeout = '200ms'"))
    with table_locked(pg_url, "tool_daily"):
        result = run("analytics", "tools", "--min-users", "1", "--url", analyst_url)
    assert_one_line_error(result, 1, "the server cancelled a statement: canceling statement")
    assert "due to statement timeout" in result.stderr
    assert "statement_timeout that the role or the database sets" in result.stderr


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def test_analytics_min_users_or_limit_past_a_bigint_is_a_usage_error(pg_url: str) -> None:
    for option in ("--min-users", "--limit"):
        result = run("analytics", "entities", option, str(2**63), "--url", pg_url)
        assert result.exit_code == 2, (option, result.output)
        assert "DBAPIError" not in result.output


def test_a_new_owner_is_refused_until_the_policies_name_it(pg_url: str) -> None:
    """After ``ALTER … OWNER`` the policy still names the role that ran the migration: the
    new owner, subject to row-level security (FORCE), would count nothing. The README's
    snippet, run as the new owner, names it instead."""
    seed_alice(pg_url)
    owner = f"coda_cli_owner_{secrets.token_hex(4)}"
    asyncio.run(
        superuser(
            pg_url,
            f'CREATE ROLE "{owner}" LOGIN',
            f'ALTER SCHEMA coda_memory OWNER TO "{owner}"',
            # Every table of the schema (the rollups and alembic_version too).
            "DO $$ DECLARE t text; BEGIN"
            " FOR t IN SELECT tablename FROM pg_tables WHERE schemaname = 'coda_memory' LOOP"
            f" EXECUTE format('ALTER TABLE coda_memory.%I OWNER TO %I', t, '{owner}');"
            " END LOOP; END $$",
        )
    )
    try:
        owner_url = make_url(pg_url).set(username=owner).render_as_string(False)
        result = run("stats", "--url", owner_url)
        assert_one_line_error(result, 1, "the role of ")
        assert "cannot read every identity's rows" in result.stderr
        # The README's remedy, run as the new owner, makes the policies name it.
        asyncio.run(superuser(owner_url, _owner_policy_snippet()))
        result = run("facts", "alice", "--url", owner_url)
        assert result.exit_code == 0, result.output
        assert "tool_affinity:get_account" in result.stdout
    finally:
        asyncio.run(
            superuser(
                pg_url,
                f'REASSIGN OWNED BY "{owner}" TO CURRENT_USER',
                f'DROP OWNED BY "{owner}"',
                f'DROP ROLE "{owner}"',
            )
        )


def test_a_member_of_the_role_the_policy_names_sees_every_identity(pg_url: str) -> None:
    seed_alice(pg_url)
    member = f"coda_cli_member_{secrets.token_hex(4)}"
    asyncio.run(
        superuser(
            pg_url,
            f'CREATE ROLE "{member}" LOGIN',
            # The role that ran the migration (the policy names it) is this superuser.
            f"DO $$ BEGIN EXECUTE format('GRANT %I TO %I', current_user, '{member}'); END $$",
        )
    )
    try:
        member_url = make_url(pg_url).set(username=member).render_as_string(False)
        result = run("facts", "alice", "--url", member_url)
        assert result.exit_code == 0, result.output
        assert "tool_affinity:get_account" in result.stdout
    finally:
        asyncio.run(superuser(pg_url, f'DROP OWNED BY "{member}"', f'DROP ROLE "{member}"'))


def test_the_analyst_is_not_asked_for_the_revision_it_may_not_read(
    pg_url: str, roles: tuple[str, str]
) -> None:
    """Every CLI command an analyst ran sent a SELECT on alembic_version that the server
    refused, leaving "ERROR: permission denied for table alembic_version" in its log (an
    alert, for an operator who watches it): the privilege is asked first."""
    _, analyst_url = roles

    async def revision() -> BaseException:
        store = PostgresStore.from_url(analyst_url)
        try:
            with pytest.raises(AccessDenied) as raised:
                await maintenance.schema_revision(store)
            return raised.value
        finally:
            await store.close()

    denied = asyncio.run(revision())
    assert "may not read coda_memory.alembic_version" in str(denied)
    assert denied.__cause__ is None and denied.__context__ is None  # no refused statement
    assert asyncio.run(_revision_of(pg_url)) is not None  # the owner reads it


async def _revision_of(url: str) -> str | None:
    store = PostgresStore.from_url(url)
    try:
        return await maintenance.schema_revision(store)
    finally:
        await store.close()


def test_migrate_as_a_role_that_may_not_create_says_who_should_run_it(
    pg_url: str, roles: tuple[str, str]
) -> None:
    """The hint every other command gives a role without a grant (analysts may run
    analytics only) sent an operator who ran migrate as the app role the wrong way."""
    app_url, _ = roles
    result = run("migrate", "--url", app_url, "--schema", "coda_cli_elsewhere")
    assert_one_line_error(result, 1, "ProgrammingError: permission denied for database")
    assert "migrate creates the schema" in result.stderr
    assert "the role that is to own them" in result.stderr
    assert "analysts" not in result.stderr
