"""The README's code runs: every ```python block is executed here against a fresh,
migrated Postgres (its example URL replaced), unless it is marked as a fragment with
``<!-- fragment: covered by tests/… -->`` naming the test that covers it. Every
``CODA_MEMORY_`` environment variable the code reads is in its table.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
README = (REPOSITORY / "README.md").read_text()
#: The README's example URLs: the app role's, and the analyst role's for analytics.
EXAMPLE_URL = re.compile(r"postgresql://(?:app|analyst)@db/app")
FRAGMENT = re.compile(r"<!-- fragment: covered by (tests/\S+)")
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)


def _blocks() -> list[tuple[str, str, str | None]]:
    """(id, code, covering test) of every Python block, in order."""
    found: list[tuple[str, str, str | None]] = []
    for match in BLOCK.finditer(README):
        before = README[: match.start()].rstrip().splitlines()
        heading = next(line for line in reversed(before) if line.startswith("#"))
        fragment = FRAGMENT.match(before[-1]) if before else None
        name = f"{heading.lstrip('# ')} #{sum(1 for b in found if b[0].startswith(heading))}"
        found.append((name, match[1], fragment[1] if fragment else None))
    return found


BLOCKS = _blocks()
RUNNABLE = [pytest.param(name, code, id=name) for name, code, covered in BLOCKS if covered is None]
#: Lines a block prints, by block (the others print what the data of the moment gives).
PRINTED = {
    "Using it #0": [
        "## What you know about this user",
        "- Uses get_account successfully",
        '- Works with account "Northwind" (id "acct-118")',
        "- Asks about royalty",
        "You are an analyst's assistant.",
    ],
    "OpenTelemetry #0": ["['coda_memory.consolidate', 'coda_memory.load_memory']"],
}
#: The service a block makes, given a timeout that a busy machine does not outlast (the
#: default 100 ms answers with the base prompt alone when the load is late).
PATIENT = (
    "MemoryService.from_url(DATABASE_URL)",
    "MemoryService.from_url(DATABASE_URL, load_timeout=5.0)",
)


def test_the_readme_has_python_blocks_and_every_fragment_names_an_existing_test() -> None:
    assert len(RUNNABLE) >= 3
    for name, _, covered in BLOCKS:
        if covered is not None:
            assert (REPOSITORY / covered.split("::")[0]).is_file(), (name, covered)


@pytest.mark.parametrize(("name", "code"), RUNNABLE)
def test_a_readme_block_runs(name: str, code: str, pg_url: str, tmp_path: Path) -> None:
    code = EXAMPLE_URL.sub(lambda _: pg_url, code).replace(*PATIENT)
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    # -W error: a Python warning fails the block.
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    printed = result.stdout.splitlines()
    assert [line for line in PRINTED.get(name, []) if line not in printed] == [], printed


def test_every_block_expected_to_print_exists() -> None:
    assert set(PRINTED) <= {name for name, _, covered in BLOCKS if covered is None}


def test_using_it_is_a_complete_script() -> None:
    """The main example migrates, makes the service inside the loop and closes it."""
    code = next(code for name, code, _ in BLOCKS if name.startswith("Using it"))
    assert "asyncio.run(main())" in code
    assert "await" not in code.split("async def")[0]  # no top-level await
    assert "await migrate_async(DATABASE_URL)" in code
    assert "async with MemoryService.from_url(DATABASE_URL) as memory:" in code


def _api_table() -> str:
    start = README.index("### The API (`from coda_memory import …`)")
    return README[start : README.index("\n## ", start)]


def test_the_api_table_names_every_public_name_and_error() -> None:
    """What ``from coda_memory import …`` gives, and every error class the library
    raises, is in the table a user reads: a name left out is one nobody knows of."""
    import coda_memory
    from coda_memory import errors

    raised = [
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, Exception)
        if value.__module__ == errors.__name__
    ]
    table = _api_table()
    public = [*coda_memory.__all__, *raised]
    assert [name for name in public if not re.search(rf"`{name}\b", table)] == []


def _broken_table_rows(text: str) -> list[int]:
    """The numbers of the lines that continue a table row on a line of their own (outside
    code blocks): Markdown ends a row at its line's end and makes each such line a row of
    its own, its text in the first column."""
    broken: list[int] = []
    in_table = in_code = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        if in_table and line.strip() and not line.startswith("|"):
            broken.append(number)
        in_table = line.startswith("|") or (in_table and bool(line.strip()))
    return broken


def test_every_table_row_of_the_readme_is_one_line() -> None:
    assert _broken_table_rows("| a | b |\n| --- | --- |\n| one | row\nwrapped |\n") == [4]
    assert _broken_table_rows(README) == []


#: The folders whose files may read an environment variable.
_SOURCE_FOLDERS = ("coda_memory", "scripts", "benchmarks", "tests", "examples", ".ci")
#: What a benchmark, a server or a tool leaves in them: not the project's files.
_LEFT_BEHIND = {"results", ".pgdata", ".cache", "__pycache__"}


def _source_files() -> list[Path]:
    """The repository's own files in :data:`_SOURCE_FOLDERS`: git's list in a checkout;
    in an unpacked sdist (no git), every file but what runs leave behind."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", *_SOURCE_FOLDERS], cwd=REPOSITORY, capture_output=True
    )
    if listed.returncode == 0 and (REPOSITORY / ".git").exists():
        return [REPOSITORY / name for name in filter(None, listed.stdout.decode().split("\0"))]
    return [
        path
        for folder in _SOURCE_FOLDERS
        for path in sorted((REPOSITORY / folder).rglob("*"))
        if not _LEFT_BEHIND & set(path.relative_to(REPOSITORY).parts)
    ]


def test_every_environment_variable_is_documented() -> None:
    table = set(re.findall(r"^\| `(CODA_MEMORY_[A-Z_]+)` \|", README, re.M))
    read: dict[str, Path] = {}
    for path in _source_files():
        if path.is_file() and path.suffix in ("", ".py", ".sh", ".toml"):
            for name in re.findall(r"\b(CODA_MEMORY_[A-Z][A-Z_]*[A-Z])\b", path.read_text()):
                read.setdefault(name, path)

    assert read, "the scan found nothing"
    assert {name: str(path) for name, path in read.items() if name not in table} == {}


#: Options the paragraph above the CLI table documents for every command.
_SHARED_OPTIONS = {"--url", "--schema", "--decay", "--format", "--debug", "--help"}


def _commands() -> list[tuple[str, list[str]]]:
    """(``coda-memory …`` command line, its long options) of every command."""
    import typer

    from coda_memory.cli import app

    found: list[tuple[str, list[str]]] = []

    def visit(command: Any, path: str) -> None:
        # (typer's click, which need not be the click installed beside it)
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                visit(sub, f"{path} {name}")
            return
        options = [
            name
            for parameter in command.params
            if parameter.param_type_name == "option" and not parameter.hidden
            for name in parameter.opts
            if name.startswith("--")
        ]
        found.append((path, options))

    visit(typer.main.get_command(app), "coda-memory")
    return found


@pytest.mark.parametrize(("command", "options"), _commands())
def test_the_cli_table_lists_every_option_of_every_command(
    command: str, options: list[str]
) -> None:
    """An operator reads the README's table, not ``--help``: it must not miss an option."""
    group, _, name = command.rpartition(" ")
    # "coda-memory analytics tools|entities|…" is one row for the four analytics commands.
    rows = [
        line
        for line in README.splitlines()
        if line.startswith(f"| `{command} ")
        or line.startswith(f"| `{command}`")
        or (group.endswith("analytics") and line.startswith(f"| `{group} ") and name in line)
    ]
    assert rows, f"no row of the CLI table for {command}"
    missing = [o for o in options if o not in _SHARED_OPTIONS and not any(o in r for r in rows)]
    assert not missing, f"{command}: {missing} not in its README row"
