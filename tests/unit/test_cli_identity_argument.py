"""An identity argument the database cannot take is a usage error, before any work."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from coda_memory.cli import app


@pytest.mark.parametrize("command", ["facts", "prompt", "history", "forget", "consolidate"])
@pytest.mark.parametrize("identity", ["\udcff", "a\x00b"], ids=["not-utf-8", "nul"])
def test_an_identity_that_is_not_utf_8_text_is_a_usage_error(command: str, identity: str) -> None:
    # The URL answers nothing: the error must come before any database work.
    result = CliRunner().invoke(app, [command, identity, "--url", "postgresql://u@127.0.0.1:1/x"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "an identity must be UTF-8 text without NUL" in lines[0]


@pytest.mark.parametrize("subject", ["\udcff", "a\x00b"], ids=["not-utf-8", "nul"])
def test_a_history_subject_that_is_not_utf_8_text_is_a_usage_error(subject: str) -> None:
    result = CliRunner().invoke(
        app, ["history", "u1", subject, "--url", "postgresql://u@127.0.0.1:1/x"]
    )
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "a subject must be UTF-8 text without NUL" in lines[0]
