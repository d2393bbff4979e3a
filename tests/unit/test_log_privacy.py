"""Log lines name no identity and quote nothing that a host's object carried."""

from __future__ import annotations

import logging
import subprocess
import sys
from typing import Any

import pytest

from coda_memory import MemoryService, NewObservation, ObservationType
from coda_memory.cli.app import log_to_stderr

SECRET = "alice.secret@example.com"


class RaisingMetadata:
    """A host's own observation whose metadata raises, quoting what it holds."""

    type = ObservationType.TOOL_SUCCESS
    content = "x"
    session_id = None
    created_at = None

    @property
    def metadata(self) -> Any:
        raise ValueError(f"PAYLOAD SSN-123-45-6789 for {SECRET}")


class RaisingLater(RaisingMetadata):
    """Queued fine; raises, quoting what it holds, when the writer validates it."""

    reads = 0

    @property
    def metadata(self) -> Any:
        type(self).reads += 1
        if type(self).reads > 1:
            raise KeyError(f"Hunter2Payload SSN-123-45-6789 {SECRET}")
        return {"toolName": "get_account"}


@pytest.mark.parametrize(
    ("observation", "line"),
    [
        (RaisingMetadata(), "not queued: ValueError"),
        (RaisingLater(), "rejected: unexpected KeyError"),
    ],
)
async def test_an_error_of_the_hosts_object_is_logged_by_its_class_only(
    observation: Any, line: str, caplog: pytest.LogCaptureFixture
) -> None:
    service = MemoryService.from_url("memory://")
    try:
        with caplog.at_level(logging.DEBUG, "coda_memory"):
            service.emit_observation(SECRET, observation)
            await service.drain()
    finally:
        await service.close()
    assert line in caplog.text
    for secret in (SECRET, "PAYLOAD", "Hunter2Payload", "SSN"):
        assert secret not in caplog.text
    assert service.stats().rejected == 1


@pytest.mark.parametrize("identity", ["\ud800" + SECRET * 2, SECRET + "\x00", "", SECRET * 20])
async def test_load_memory_asks_no_store_for_an_identity_none_could_hold(
    identity: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Postgres's driver refused a lone surrogate with a message quoting the start of the
    identity, which then reached the log."""
    service = MemoryService.from_url("memory://")
    try:
        with caplog.at_level(logging.DEBUG, "coda_memory"):
            loaded = await service.load_memory(identity)
    finally:
        await service.close()
    assert loaded.facts == [] and loaded.prompt_section == ""
    assert service.stats().load_errors == 1
    assert "load_memory got an identity the store cannot hold" in caplog.text
    assert "alice" not in caplog.text


async def test_forget_drops_the_queued_observations_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The host asked for it: the drop is counted (and in what forget returns), not
    warned about."""
    service = MemoryService.from_url("memory://")
    try:
        service.emit_observation(
            "u1",
            NewObservation(
                type=ObservationType.QUERY_PATTERN, content="q", metadata={"domain": "d"}
            ),
        )
        with caplog.at_level(logging.DEBUG, "coda_memory"):
            forgotten = await service.forget("u1")
    finally:
        await service.close()
    assert forgotten.observations == 1
    assert service.stats().dropped == 1
    assert "dropped" not in caplog.text


def test_without_logging_configured_the_library_prints_nothing() -> None:
    """A library leaves its logger's output to the host (a NullHandler); without one,
    Python's last-resort handler printed every warning bare on stderr."""
    script = (
        "import logging, coda_memory\n"
        "logging.getLogger('coda_memory.writer').warning('a warning of the library')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert done.stderr == ""


def test_the_cli_shows_the_librarys_warnings_on_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log_to_stderr()
    log_to_stderr()  # (once, however often a process runs commands)
    logging.getLogger("coda_memory.writer").warning("storing failed; retrying")
    logging.getLogger("coda_memory.writer").info("not shown")
    assert capsys.readouterr().err == "storing failed; retrying\n"


def test_a_failed_fold_of_owed_rollups_logs_no_value_the_server_quoted() -> None:
    """A server's message may quote the value it refused, a tenant's data: the warning of
    an owed rollup not folded said it whole."""
    import asyncpg

    from coda_memory.postgres import rollup_owed

    refused = asyncpg.exceptions.InvalidTextRepresentationError(
        'invalid input syntax for type double precision: "acct-118 Northwind"'
    )
    assert rollup_owed._described(refused) == "InvalidTextRepresentationError (SQLSTATE 22P02)"
    held = asyncpg.exceptions.LockNotAvailableError("canceling statement due to lock timeout")
    assert rollup_owed._described(held) == "canceling statement due to lock timeout"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        # A password holding an unencoded "@" and then a ":": SQLAlchemy took the rest
        # of it for the port, and its int() quoted it.
        ("postgresql://app:Pa55@Hunter2word:x@db.internal/app", "the port is not a number"),
        # A libpq connection string, which has no scheme: quoted whole.
        ("host=db.internal user=app password=Hunter2word dbname=app", "got no scheme"),
        ("Hunter2word", "got no scheme"),
        # Before a ":" with no "//": a user and password without the scheme, or a secret.
        ("Hunter2word:x", "got no scheme"),
        ("app:Hunter2word@db.internal/app", "got no scheme"),
    ],
)
def test_a_url_refused_when_the_service_is_made_quotes_no_password(url: str, says: str) -> None:
    with pytest.raises(ValueError) as refused:
        MemoryService.from_url(url)
    assert says in str(refused.value)
    assert "Hunter2" not in str(refused.value)
    assert refused.value.__suppress_context__ or refused.value.__context__ is None


def test_the_replays_store_refused_for_its_scheme_quotes_no_password() -> None:
    from typer.testing import CliRunner

    from coda_memory.cli import app

    store = "host=db.internal user=app password=Hunter2word dbname=app"
    result = CliRunner().invoke(
        app, ["replay", "--url", "postgresql://u@127.0.0.1:1/x", "--store", store]
    )
    assert result.exit_code == 2, result.output
    assert "unsupported memory URL scheme (no scheme)" in result.stderr
    assert "Hunter2" not in result.stderr
