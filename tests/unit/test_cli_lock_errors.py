"""A lock that another transaction held past the lock timeout ends a command with exit 3
and one line; only a command with --lock-wait tells the operator to raise it."""

from __future__ import annotations

import asyncpg
import pytest
import typer

from coda_memory.cli import runtime


async def _locked_out() -> None:
    raise asyncpg.exceptions.LockNotAvailableError("canceling statement due to lock timeout")


def test_a_command_without_lock_wait_is_not_told_to_raise_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """import-redis said "wait longer with --lock-wait", an option it does not have."""
    with pytest.raises(typer.Exit) as exited:
        runtime.run(_locked_out)
    assert exited.value.exit_code == runtime.BUSY_EXIT_CODE
    line = capsys.readouterr().err.strip()
    assert line == (
        "error: another transaction holds a lock this command needs (a migration, a LOCK "
        "TABLE, a long maintenance statement): run it again later"
    )
