"""``coda-memory label``: the label log lines give an identity, under the services' key."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from typer.testing import CliRunner, Result

from coda_memory import set_log_key
from coda_memory.cli import app
from coda_memory.core.logs import identity_label


@pytest.fixture(autouse=True)
def _random_key_after(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The command sets the process's key from the environment: a random one after."""
    monkeypatch.delenv("CODA_MEMORY_LOG_KEY", raising=False)
    yield
    set_log_key(None)


def run(*args: str, key: str | None = None) -> Result:
    env = {} if key is None else {"CODA_MEMORY_LOG_KEY": key}
    return CliRunner().invoke(app, list(args), env=env)


def test_label_prints_each_identity_s_label_under_the_key_of_the_services() -> None:
    set_log_key("the services' secret")
    alice, bob = identity_label("alice@example.com"), identity_label("bob")
    set_log_key(None)  # this process's labels no longer match theirs
    assert identity_label("alice@example.com") != alice
    result = run("label", "alice@example.com", "bob", key="the services' secret")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == [f"{alice}\talice@example.com", f"{bob}\tbob"]


def test_label_without_a_key_says_which_variable_to_set() -> None:
    result = run("label", "alice")
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: $CODA_MEMORY_LOG_KEY is not set")


def test_label_refuses_an_identity_no_store_can_hold() -> None:
    result = run("label", "alice", "bad\x00id", key="k")
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "an identity must be UTF-8 text without NUL" in result.stderr


def test_label_escapes_an_identity_a_terminal_or_the_format_would_act_on() -> None:
    """A tab or a line break in an id broke the lines' format (label, a tab, the id), and
    an escape sequence reached the terminal."""
    set_log_key("k")
    shown = identity_label("a\tb\nc\x1b[2J")
    set_log_key(None)
    result = run("label", "a\tb\nc\x1b[2J", key="k")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == [f"{shown}\ta\\tb\\nc\\x1b[2J"]


def test_label_refuses_an_empty_identity() -> None:
    """No service stores one; it printed a label as if it could be found in the logs."""
    result = run("label", "", key="k")
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "an identity is not empty" in result.stderr
