"""The ports: what the engine needs from a store, and the data it passes across.

A store is a thin adapter. Consolidation of one identity happens inside a
:class:`ConsolidationUnit`, a unit of work that holds the identity's lock and owns the
transaction: it rolls back unless :meth:`ConsolidationUnit.commit` is called.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol

from coda_memory.core.caps import FactCap
from coda_memory.core.consolidation import ConsolidationInput, ConsolidationPlan
from coda_memory.core.logs import identity_label
from coda_memory.core.model import Fact, FactEvent
from coda_memory.core.sanitize import ObservationRecord


@dataclass(frozen=True, slots=True)
class AppendOutcome:
    """What happened to a batch: how many rows were stored, and which were refused."""

    stored: int
    #: (index in the batch, reason) for each row the store refused.
    refused: list[tuple[int, str]] = field(default_factory=list)
    #: Rows accepted and deliberately not kept (the null store).
    discarded: int = 0


@dataclass(frozen=True, slots=True)
class Forgotten:
    """What ``forget`` erased of one identity: its stored observations, facts and fact
    events (the other rows a store keeps of it, such as its checkpoint, go too,
    uncounted). All 0: the identity had nothing stored."""

    observations: int = 0
    facts: int = 0
    fact_events: int = 0


def unidentified(records: Sequence[ObservationRecord], start: int = 0) -> list[tuple[int, str]]:
    """(place in the batch, counted from ``start``; reason) of each record whose identity
    is empty, which every store's ``append`` refuses. Such a record passed no
    ``sanitize_observation`` (a store used directly), and on Postgres a connection whose
    tenant was reset reads as the empty identity: row-level security would show it the
    rows."""
    return [
        (index, "identity_id is empty")
        for index, record in enumerate(records, start)
        if not record.identity_id
    ]


def check_plan_identity(plan: ConsolidationPlan, identity_id: str) -> None:
    """Refuse a plan that touches any identity but the unit's own (every store's write)."""
    owners = {plan.identity_id}
    owners.update(f.identity_id for f in plan.upserts)
    owners.update(e.identity_id for e in plan.events)
    if owners != {identity_id}:
        # By their labels: a host that logs the error logs no identity.
        raise ValueError(
            f"the plan touches identities {sorted(map(identity_label, owners))}, "
            f"but this unit consolidates {identity_label(identity_id)}"
        )


class ConsolidationUnit(Protocol):
    """A unit of work for consolidating one identity; it holds the identity's lock."""

    async def load(self) -> ConsolidationInput:
        """Read new observations, stored facts and the relevant session events, and, for
        observations dated before the last consolidation, the last lives of facts deleted
        since (``ended``). The list of observations is the caller's: the service empties
        it once the consolidation is committed, so it must be one the store does not
        keep."""
        ...

    async def write(self, plan: ConsolidationPlan) -> None:
        """Write facts, deletes and events, advance the checkpoint past what ``load``
        returned, and prune old observations. Nothing is visible before ``commit``. The
        service empties ``plan.events`` after the commit: a store copies what it keeps
        of them."""
        ...

    async def commit(self) -> None:
        """Make everything applied durable and visible, atomically."""
        ...


class MemoryStore(Protocol):
    """Storage for observations, facts, checkpoints and fact history."""

    async def append(
        self,
        records: Sequence[ObservationRecord],
        *,
        batch_key: str | None = None,
        first_attempt: bool = False,
    ) -> AppendOutcome:
        """Store a batch; a refused row never stops the good rows from being stored.

        ``batch_key`` identifies the batch across retries: a store that records it stores
        a batch retried after an unknown outcome (a lost COMMIT acknowledgement) once, and
        returns the first outcome. ``first_attempt``: no earlier attempt of the batch can
        have been stored (this is the first, or each earlier one raised
        :class:`~coda_memory.errors.StoreBusy`), so a store may record the key without
        looking for it first. A lost connection raises
        :class:`~coda_memory.errors.ConnectionLost` (or an ``OSError``), a batch that a
        lock or a timeout kept out :class:`~coda_memory.errors.StoreBusy`: the only errors
        worth retrying."""
        ...

    def consolidation(self, identity_id: str) -> AbstractAsyncContextManager[ConsolidationUnit]:
        """Lock the identity (creating its checkpoint on first use) and open a unit of
        work; leaving the context without ``commit`` rolls everything back."""
        ...

    async def facts(self, identity_id: str) -> list[Fact]:
        """The identity's stored facts (stored form, possibly expired by now)."""
        ...

    async def peek(self, identity_id: str) -> tuple[list[Fact], bool]:
        """Without locking: the stored facts, and whether observations committed since the
        last consolidation wait. Lets a consolidation with nothing to do skip the lock.
        When observations wait, a store may leave the facts out (an empty list): the
        consolidation that follows reads them, and a store that keeps them between
        requests answers ``kept_facts`` with them meanwhile (see :class:`StoreExtras`)."""
        ...

    async def history(self, identity_id: str, subject: str | None = None) -> list[FactEvent]:
        """The identity's fact events in the order they happened."""
        ...

    async def forget(self, identity_id: str) -> Forgotten:
        """Delete every observation, fact, event and checkpoint of the identity; say how
        many observations, facts and events were deleted."""
        ...

    async def close(self) -> None:
        """Release connections and other resources."""
        ...


class StoreExtras(Protocol):
    """What a store may offer beyond :class:`MemoryStore`. The service looks each one up
    by name (``getattr``) and does without it when a store lacks it; the Postgres store
    offers them all, the Redis store ``start``, the in-memory store none. Follow
    ``load_memory`` through them: ``unchanged`` (is the last answer still good?), then
    ``keeps_facts`` (may the peek be skipped?), then ``peek_versioned`` (with
    ``cap_facts`` applied on the way), and ``kept_facts`` when the load runs out of
    time."""

    @property
    def request_slots(self) -> int:
        """How many peeks and consolidations may hold a connection at once (the service's
        default ``max_consolidations``)."""
        ...

    async def start(self) -> None:
        """Open and warm the connections before the first request."""
        ...

    async def cancel_openings(self, timeout: float) -> None:
        """Cancel the connections still being opened, and wait for them up to ``timeout``
        seconds (a service that closes itself as its event loop ends: the loop closes
        next)."""
        ...

    def cap_facts(self, cap: FactCap | None) -> None:
        """Apply ``cap`` on the server to an identity that a peek finds far over it."""
        ...

    async def peek_versioned(self, identity_id: str) -> tuple[list[Fact], bool, str | None]:
        """:meth:`MemoryStore.peek`, with the version of the facts it returns (None when
        not known)."""
        ...

    async def unchanged(self, identity_id: str, version: str) -> bool:
        """Whether the identity's facts still have ``version`` and nothing waits, without
        reading a fact."""
        ...

    def keeps_facts(self, identity_id: str) -> bool:
        """Whether the store keeps the identity's facts between requests."""
        ...

    async def kept_facts(self, identity_id: str) -> list[Fact]:
        """The facts kept between requests (none when not kept), as new models."""
        ...

    @property
    def ingest_counts(self) -> object:
        """What the appends did around locks, for ``stats()``: its ``rollups_owed``,
        ``rollups_folded`` and ``keys_spilled``."""
        ...

    @property
    def kept_facts_counts(self) -> object:
        """The facts kept between requests, for ``stats()``: its ``dropped`` (to make
        room for others) and ``reads`` (of an identity's facts from the store)."""
        ...

    @property
    def held_out(self) -> object:
        """The peeks and consolidations a held table kept out, for ``stats()``: its
        ``peeks`` and ``consolidations``; a store also notes each peek it holds out in
        :data:`HELD_OUT`, for the trace of the call."""
        ...


#: What a store held out (``"peek"``) during the current call, for the service's span of
#: it (None: nobody asks). A peek held out answers from the facts alone and raises
#: nothing, so without it a trace showed an ordinary consolidation.
HELD_OUT: ContextVar[list[str] | None] = ContextVar("coda_memory_held_out", default=None)


__all__ = [
    "HELD_OUT",
    "AppendOutcome",
    "ConsolidationInput",
    "ConsolidationPlan",
    "ConsolidationUnit",
    "Forgotten",
    "MemoryStore",
    "ObservationRecord",
    "StoreExtras",
]
