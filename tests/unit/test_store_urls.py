"""Memory URLs: which store a URL names, and the URLs refused before any store is made."""

from __future__ import annotations

import coda_memory


def test_dir_lists_the_lazy_migration_helpers() -> None:
    listed = dir(coda_memory)
    assert "migrate" in listed
    assert "migrate_async" in listed
    assert set(coda_memory.__all__) <= set(listed)
