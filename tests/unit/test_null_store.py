"""null://: memory switched off. Emits are accepted and counted, loads are empty at once."""

from __future__ import annotations

from datetime import timedelta

import pytest

from coda_memory import LoadedMemory, MemoryService
from coda_memory.core.consolidation import plan_consolidation
from coda_memory.core.decay import ExponentialDecay
from coda_memory.core.logs import identity_label
from coda_memory.null import NullStore
from tests.helpers import T0, FakeClock, domain, tool_ok


async def test_emits_are_accepted_discarded_and_counted() -> None:
    service = MemoryService.from_url("null://", clock=FakeClock())
    try:
        for i in range(250):
            service.emit_observation(f"u{i % 3}", tool_ok("t", session=f"s{i}"))
        service.emit_observation("", domain("royalty"))  # bad input is still rejected
        await service.drain(timeout=5)
        stats = service.stats()
        assert (stats.emitted, stats.discarded, stats.stored, stats.rejected) == (251, 250, 0, 1)
        assert stats.pending == 0
        store = service.store
        assert isinstance(store, NullStore)
        assert store.discarded == 250
    finally:
        await service.close()


async def test_loads_are_empty_and_nothing_raises() -> None:
    service = MemoryService.from_url("null://", clock=FakeClock(), load_timeout=0.001)
    try:
        service.emit_observation("u1", tool_ok("t"))
        await service.drain(timeout=5)
        assert await service.load_memory("u1") == LoadedMemory.empty()
        assert await service.consolidate("u1") == []
        assert await service.facts("u1") == []
        assert await service.history("u1") == []
        await service.forget("u1")
        stats = service.stats()
        assert (stats.loads, stats.load_timeouts, stats.load_errors) == (1, 0, 0)
    finally:
        await service.close()


async def test_the_unit_keeps_the_port_checks() -> None:
    store = NullStore()
    async with store.consolidation("u1") as unit:
        batch = await unit.load()
        plan = plan_consolidation("u2", batch, T0 + timedelta(days=1), ExponentialDecay())
        with pytest.raises(ValueError) as refused:
            await unit.write(plan)
        # By their labels: a host that logs the error logs no identity.
        assert identity_label("u2") in str(refused.value)
        assert identity_label("u1") in str(refused.value)
        assert "u1" not in str(refused.value).replace(identity_label("u1"), "")
    async with store.consolidation("u1") as unit:
        with pytest.raises(RuntimeError, match="load"):
            await unit.write(plan_consolidation("u1", batch, T0, ExponentialDecay()))


def test_null_takes_no_store_options() -> None:
    with pytest.raises(TypeError, match="null://"):
        MemoryService.from_url("null://", schema="x")
