"""Facts known to this process: each identity's stored facts as last read or written here,
with the version of its checkpoint row they go with, so that a request whose identity
nothing changed since does not read and decode its facts again.

The version
-----------
A version is the checkpoint row's stored snapshot and the id of the transaction that
wrote the row (``xmin``), as one string (``checkpoint_version`` in the SQL). Every write
of an identity's facts changes it, in the transaction of the write:

* a consolidation updates the checkpoint row in its write statement;
* ``forget`` deletes the row (a later one is a new row, with a new ``xmin``);
* ``import-redis`` updates the row of an identity it copies facts to.

So equal versions mean equal facts; a process that reads a version it knows uses the
facts it keeps, whoever wrote them, and one that reads another version reads the facts
again. An identity without a checkpoint row has no version and is never kept. Facts
written outside coda-memory (a hand-made ``UPDATE``) must also update the identity's
checkpoint row, or processes keep answering with the facts they know.

At most ``capacity`` facts are kept, in total, least recently used identities first out;
an identity with more facts than that is not kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from coda_memory.core.model import Fact

#: Facts kept per store by default (about 1 kB each).
DEFAULT_KNOWN_FACTS = 50_000


def _as_stored(fact: Fact) -> Fact:
    """``fact`` as a read returns it: ``confidence_at`` is always stored."""
    if fact.confidence_at is None:
        return fact.model_copy(update={"confidence_at": fact.anchor})
    return fact


@dataclass(frozen=True, slots=True)
class Known:
    """An identity's stored facts and the version they go with."""

    version: str
    stored: tuple[Fact, ...]

    def facts(self) -> list[Fact]:
        """The facts, as a read of the identity's rows would return them (a new list of
        the same frozen facts: building them again would cost every load)."""
        return list(self.stored)


class KnownFacts:
    """Each identity's facts as last read or written by this process, by version."""

    def __init__(self, capacity: int = DEFAULT_KNOWN_FACTS) -> None:
        if capacity < 0:
            raise ValueError("the known facts' capacity must not be negative")
        self.capacity = capacity
        self._entries: OrderedDict[str, Known] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        """How many facts are kept, all identities together."""
        return self._size

    def entry(self, identity_id: str) -> Known | None:
        """The identity's kept facts and their version (None: none kept)."""
        entry = self._entries.get(identity_id)
        if entry is not None:
            self._entries.move_to_end(identity_id)
        return entry

    def put(self, identity_id: str, known: Known | None) -> None:
        """Keep ``known`` as the identity's facts (None: keep none)."""
        self.discard(identity_id)
        if known is None or len(known.stored) > self.capacity:
            return
        self._entries[identity_id] = known
        self._size += len(known.stored)
        while self._size > self.capacity:
            _, evicted = self._entries.popitem(last=False)
            self._size -= len(evicted.stored)

    def discard(self, identity_id: str) -> None:
        entry = self._entries.pop(identity_id, None)
        if entry is not None:
            self._size -= len(entry.stored)


def written(
    version: str, stored: Sequence[Fact], upserts: Sequence[Fact], deletes: Sequence[str]
) -> Known:
    """The facts stored after a write of ``upserts`` and ``deletes`` over ``stored``,
    with the ``version`` the write left."""
    facts = {fact.subject: fact for fact in stored}  # read from rows: in stored form
    for subject in deletes:
        facts.pop(subject, None)
    for fact in upserts:
        facts[fact.subject] = _as_stored(fact)
    return Known(version, tuple(facts.values()))
