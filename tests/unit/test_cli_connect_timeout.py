"""A database that accepts the connection and never answers: one line that says so."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from coda_memory.cli import app, runtime


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose listener accepts connections (the kernel's backlog) and says nothing."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener.getsockname()[1]


@pytest.mark.parametrize("command", [["stats"], ["facts", "u1"], ["migrate"]])
def test_a_database_that_never_answers_is_named_with_the_time_waited(
    silent_port: int, command: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime, "CONNECT_TIMEOUT", 0.3)
    url = f"postgresql://u@127.0.0.1:{silent_port}/x"
    result = CliRunner().invoke(app, [*command, "--url", url])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert lines == [f"error: cannot connect to {url}: no answer within 0.3 s"], result.stderr
