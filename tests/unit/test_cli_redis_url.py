"""The CLI's Postgres-only commands answer a Redis URL with one line."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from coda_memory.cli import app


@pytest.mark.parametrize(
    "command", [["analytics", "tools"], ["stats"], ["facts", "u1"], ["consolidate", "--all"]]
)
def test_a_redis_url_gets_one_line_saying_postgres_only(command: list[str]) -> None:
    result = CliRunner().invoke(app, [*command, "--url", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: analytics and the other commands need Postgres")
    assert "import-redis" in lines[0]


def test_an_unreachable_redis_shows_its_url_without_the_password() -> None:
    result = CliRunner().invoke(
        app,
        ["import-redis", "redis://:s3cret@127.0.0.1:1/13", "--url", "postgresql://u@127.0.0.1:1/x"],
    )
    assert result.exit_code == 1, result.output
    assert "s3cret" not in result.output
    assert "redis://:***@127.0.0.1:1/13" in result.stderr, result.stderr
