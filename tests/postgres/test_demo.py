"""The demo, end to end on a fresh database, with a short simulation."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from coda_memory.cli import app
from coda_memory.cli.demo import plots
from coda_memory.cli.demo.demo import DEMO_SCHEMA
from coda_memory.postgres import PostgresStore
from tests.postgres.helpers import consolidate, contents, fact, record

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _no_configured_database(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CODA_MEMORY_DATABASE_URL", raising=False)


def demo(url: str, out: Path) -> Result:
    return CliRunner().invoke(app, ["demo", "--url", url, "--out", str(out), "--days", "9"])


def summary(output: str) -> str:
    match = re.search(r"^\d+ sessions over 9 days .*?observations stored", output, re.M | re.S)
    assert match is not None, output
    return match[0]


def test_the_demo_shows_memory_at_work_and_writes_its_plots(pg_url: str, tmp_path: Path) -> None:
    out = tmp_path / "plots"

    result = demo(pg_url, out)

    assert result.exit_code == 0, result.output
    text = result.stdout
    flowing = " ".join(text.split())  # paragraphs are wrapped at the console width
    for section in (
        "coda-memory demo",
        "The simulation",
        "load_memory (consolidation included): median",
        "0 timeouts",
        "ana's memory section, as the agent gets it in its system prompt",
        "after her first session",
        "after a week",
        "after 9 days",
        "## What you know about this user",
        "Tool search for ana",
        "with ana's memory",
        "Forgetting what is no longer used",
        "get_contract is no longer among her tool preferences",
        "History of ana's tool_affinity:get_contract",
        "fell below 0.1",
        "Across all users: tool effectiveness",
        "run_royalty_report",
        f"Plots written to {out.resolve()}/",
        "Finished in",
    ):
        assert section in flowing, section
    assert "\x1b[" not in text  # not a terminal: no colour codes
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 100
    for name in ("tool-effectiveness.png", "fact-history-ana-get_contract.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE
        assert len(data) > 10_000


async def _leave_behind(url: str) -> None:
    """Data the demo did not write, in its schema: an observation, a fact, a checkpoint."""
    store = PostgresStore.from_url(url, schema=DEMO_SCHEMA)
    try:
        await store.append([record("consumed", identity_id="stale")])
        await consolidate(store, "stale", upserts=[fact(identity_id="stale")])
        await store.append([record("pending", identity_id="stale")])
    finally:
        await store.close()


async def _remains(url: str) -> tuple[list[str], int, bool]:
    store = PostgresStore.from_url(url, schema=DEMO_SCHEMA)
    try:
        return (
            contents(await store.observations("stale")),
            len(await store.facts("stale")),
            await store.checkpoint("stale") is not None,
        )
    finally:
        await store.close()


def test_a_rerun_starts_from_a_clean_schema(pg_url: str, tmp_path: Path) -> None:
    first = demo(pg_url, tmp_path)
    asyncio.run(_leave_behind(pg_url))
    assert asyncio.run(_remains(pg_url)) == (["consumed", "pending"], 1, True)

    second = demo(pg_url, tmp_path)

    assert first.exit_code == second.exit_code == 0, second.output
    assert summary(first.stdout) == summary(second.stdout)
    assert asyncio.run(_remains(pg_url)) == ([], 0, False)


def test_an_out_directory_it_cannot_write_is_refused_before_the_month_runs(
    pg_url: str, tmp_path: Path
) -> None:
    """It ran the whole simulation, then failed with FileNotFoundError's one line."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = demo(pg_url, blocker / "charts")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--out" in lines[0] and "cannot write" in lines[0], lines
    assert "coda-memory demo" not in result.stdout  # nothing was simulated


def test_without_matplotlib_it_says_so_and_suggests_no_plot(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its last lines suggested ``history … --plot ana.png``, which fails for want of the
    very extra it had just named."""

    def unavailable(width: float, height: float) -> object:
        raise plots.PlotsUnavailable(plots.INSTALL_HINT)

    monkeypatch.setattr(plots, "_figure", unavailable)

    result = demo(pg_url, tmp_path)

    assert result.exit_code == 0, result.output
    assert f"No plots: {plots.INSTALL_HINT}" in result.stdout
    assert "Plots written" not in result.stdout
    assert "--plot" not in result.stdout
    assert "  coda-memory history ana tool_affinity:get_account --schema" in result.stdout
    assert list(tmp_path.iterdir()) == []
