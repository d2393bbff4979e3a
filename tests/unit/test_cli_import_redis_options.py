"""import-redis's Redis URL is checked before anything connects, and what it prints of a
bad record can't drive the operator's terminal."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from coda_memory.cli import app
from coda_memory.cli.output import printable

#: Answers nothing: every error below must come before any connection.
UNREACHABLE = "postgresql://u@127.0.0.1:1/x"


@pytest.mark.parametrize(
    ("redis_url", "says"),
    [
        # redis-py read database 0 for this one, and the copy went on (exit 0).
        ("redis://127.0.0.1:6379/abc", "the database (the path after host:port) is not"),
        ("redis://u:secret@127.0.0.1:6379/x?prefix=p", "the database (the path after host"),
        # The "database" was the end of the password, and was quoted.
        ("redis://default:s3cr/et-secret@127.0.0.1:6379/13", "must be percent-encoded"),
        # These were said to need a percent-encoded password.
        ("http://x", "use redis://host:port/db"),
        ("postgresql://u@db/x", "use redis://host:port/db"),
        ("", "use redis://host:port/db"),
        # The prefix was read as "\ufffd": the run scanned another prefix, and said
        # "no identity found".
        ("redis://127.0.0.1:6379/0?prefix=%FF", "are not UTF-8"),
        ("redis://u:secret@127.0.0.1:6379/0?prefix=a%C3&x=1", "are not UTF-8"),
        # An argument in another encoding (lone surrogates): "cannot connect", exit 1.
        ("redis://:p\udcffsecret@127.0.0.1:6379/9", "bytes that are not UTF-8"),
        ("redis://127.0.0.1:6379/9?prefix=a\x00b", "holds NUL"),
    ],
)
def test_a_url_that_is_not_a_redis_database_is_a_usage_error(redis_url: str, says: str) -> None:
    result = CliRunner().invoke(app, ["import-redis", redis_url, "--url", UNREACHABLE])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr
    assert "secret" not in result.output


@pytest.mark.parametrize(
    "redis_url", ["redis://127.0.0.1:1", "redis://127.0.0.1:1/", "redis://127.0.0.1:1/14"]
)
def test_a_redis_url_with_or_without_a_database_passes_the_check(redis_url: str) -> None:
    result = CliRunner().invoke(app, ["import-redis", redis_url, "--url", UNREACHABLE])
    assert "invalid Redis URL" not in result.output  # it goes on, and can't connect


def test_a_bad_records_reason_is_printed_with_its_control_characters_escaped() -> None:
    assert printable("ZRANGE coda:memory:obs:\x1b[2J\x1b]0;TITLE\x07 0 -1") == (
        "ZRANGE coda:memory:obs:\\x1b[2J\\x1b]0;TITLE\\x07 0 -1"
    )
    assert printable("not JSON (JSONDecodeError)") == "not JSON (JSONDecodeError)"


def test_without_the_redis_extra_the_error_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """It was a 46-line traceback ending in "No module named 'redis'"."""
    for name in [n for n in sys.modules if n.startswith(("coda_memory.redis", "coda_memory.migr"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "redis", None)
    result = CliRunner().invoke(
        app, ["import-redis", "redis://127.0.0.1:1/0", "--url", UNREACHABLE]
    )
    assert result.exit_code == 1, result.output
    assert result.stderr == (
        "error: import-redis needs the redis extra: pip install 'coda-memory[cli,redis]'\n"
    )
    # And the adapter names its extra to a program that imports it.
    with pytest.raises(ModuleNotFoundError, match=r"needs the redis extra: pip install"):
        import coda_memory.redis  # noqa: F401


def test_keys_in_the_listing_are_printed_as_they_are(capsys: pytest.CaptureFixture[str]) -> None:
    """Rich read ``:x:`` and ``:m:`` in keys as emoji codes (❌, Ⓜ)."""
    from coda_memory.cli import import_commands

    import_commands._list_bad([("p:s1:*:x:", "not copied"), ("p:s1:history:m", "fact event")])
    assert capsys.readouterr().out == (
        "bad record: p:s1:*:x:: not copied\nbad record: p:s1:history:m: fact event\n"
    )
