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
* ``import-redis`` updates the row of an identity it copies facts to;
* the cap applied on the server (``facts_cap.sql``) rewrites the row when it deletes.

So equal versions mean equal facts; a process that reads a version it knows uses the
facts it keeps, whoever wrote them, and one that reads another version reads the facts
again. An identity without a checkpoint row has no version and is never kept. Facts
written outside coda-memory (a hand-made ``UPDATE``) must also update the identity's
checkpoint row, or processes keep answering with the facts they know.

At most ``capacity`` facts are kept, in total, least recently used identities first out;
an identity with more facts than that is not kept.

Answering from them
-------------------
A load whose consolidation fails or outlives its timeout answers from the facts kept here
(``PostgresStore.kept_facts``), without checking their version (that would take a round
trip when the database is in trouble). They are dropped as soon as this process sees
another version stored (a peek, or the lock of a consolidation):
after a ``forget`` or a write by another process, only a load whose consolidation fails
before it reaches the identity's checkpoint can still answer from them.

Out of the garbage collector's sight
------------------------------------
A fact is kept as a dict of its field values holding only strings, numbers, datetimes and
None (the category as its plain value). CPython's cyclic garbage collector does not track
such a dict, so the tens of thousands of kept facts add nothing to a full collection,
which pauses the event loop for as long as it walks the tracked objects (about 15 ms per
40,000 facts kept as models). :meth:`Known.facts` builds the models again, about 1 µs
each, for the request that needs them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from coda_memory.core.model import Fact, FactCategory, fact_id, trusted_fact
from coda_memory.core.turns import mapped

#: Facts kept per store by default (about 1 kB each).
DEFAULT_KNOWN_FACTS = 50_000

#: Categories by value, and back: kept facts hold the plain value.
_CATEGORIES = {category.value: category for category in FactCategory}
_VALUES: dict[FactCategory, str] = {category: category.value for category in FactCategory}


#: The fields kept as they are (all but the category).
_PLAIN = tuple(name for name in Fact.model_fields if name != "category")


def _kept(fact: Fact) -> dict[str, Any]:
    """``fact`` as kept: its values as a read returns them (``confidence_at`` is always
    stored), in a dict the garbage collector does not track (built by insertion of
    untracked values only: a copy of a tracked dict would be tracked)."""
    values = fact.__dict__
    kept = {name: values[name] for name in _PLAIN}
    kept["category"] = _VALUES[values["category"]]
    if kept["confidence_at"] is None:
        kept["confidence_at"] = kept["last_reinforced_at"]
    return kept


def kept_from_row(identity_id: str, row: Any) -> dict[str, Any]:
    """A stored fact's row as kept: the values of ``_kept(fact_from_row(identity_id,
    row))``, without building the model between (a read keeps what it reads)."""
    subject = row["subject"]
    last_reinforced_at = row["last_reinforced_at"]
    confidence_at = row["confidence_at"]
    return {
        "id": fact_id(subject),
        "identity_id": identity_id,
        "subject": subject,
        "content": row["content"],
        "confidence": row["confidence"],
        "reinforcement_count": row["reinforcement_count"],
        "last_reinforced_at": last_reinforced_at,
        "created_at": row["created_at"],
        "updated_at": row["updated_at"],
        "ease_factor": row["ease_factor"],
        "confidence_at": last_reinforced_at if confidence_at is None else confidence_at,
        "category": row["category"],
    }


def _fact(kept: dict[str, Any]) -> Fact:
    values = kept.copy()
    values["category"] = _CATEGORIES[values["category"]]
    return trusted_fact(values)


@dataclass(frozen=True, slots=True)
class Known:
    """An identity's stored facts and the version they go with."""

    version: str
    #: The facts as kept (see above), by subject.
    kept: dict[str, dict[str, Any]]

    @classmethod
    async def of(cls, version: str, facts: Sequence[Fact]) -> Known:
        """``facts`` (in stored form) with their version, giving the event loop turns
        (:mod:`coda_memory.core.turns`)."""
        kept = await mapped(facts, _kept)
        return cls(version, {values["subject"]: values for values in kept})

    @classmethod
    async def read(cls, version: str, identity_id: str, rows: Sequence[Any]) -> Known:
        """The facts of the stored ``rows`` (``stored_facts.sql``'s columns) with their
        version, giving the event loop turns."""
        kept = await mapped(rows, partial(kept_from_row, identity_id))
        return cls(version, {values["subject"]: values for values in kept})

    def __len__(self) -> int:
        return len(self.kept)

    async def facts(self) -> list[Fact]:
        """The facts, as a read of the identity's rows would return them (new models),
        giving the event loop turns (:mod:`coda_memory.core.turns`)."""
        return await mapped(list(self.kept.values()), _fact)


class KnownFacts:
    """Each identity's facts as last read or written by this process, by version."""

    def __init__(self, capacity: int = DEFAULT_KNOWN_FACTS) -> None:
        if capacity < 0:
            raise ValueError("the known facts' capacity must not be negative")
        self.capacity = capacity
        self._entries: OrderedDict[str, Known] = OrderedDict()
        self._size = 0
        #: What the entries weigh against the capacity: each its facts, and at least 1
        #: (an identity whose facts all expired keeps an entry of none, which counted
        #: nothing: a stream of them grew the entries without bound).
        self._weight = 0
        #: Facts dropped to make room for other identities' (``stats().kept_facts_dropped``).
        self.dropped = 0
        #: Requests that read an identity's facts from the database, none being kept at
        #: its current version (``stats().facts_reads``).
        self.reads = 0

    def __len__(self) -> int:
        """How many facts are kept, all identities together."""
        return self._size

    def entry(self, identity_id: str) -> Known | None:
        """The identity's kept facts and their version (None: none kept)."""
        entry = self._entries.get(identity_id)
        if entry is not None:
            self._entries.move_to_end(identity_id)
        return entry

    def put(self, identity_id: str, known: Known | None) -> bool:
        """Keep ``known`` as the identity's facts (None: keep none); whether it is kept
        (not when it holds more facts than the capacity)."""
        self.discard(identity_id)
        if known is None or len(known) > self.capacity:
            return False
        self._entries[identity_id] = known
        self._size += len(known)
        self._weight += _weight(known)
        while self._weight > self.capacity:
            _, evicted = self._entries.popitem(last=False)
            self._size -= len(evicted)
            self._weight -= _weight(evicted)
            self.dropped += len(evicted)
        return True

    def seen(self, identity_id: str, version: str | None) -> None:
        """The identity's stored version is ``version``: kept facts of another version
        are dropped (see "Answering from them")."""
        entry = self._entries.get(identity_id)
        if entry is not None and entry.version != version:
            self.discard(identity_id)

    def discard(self, identity_id: str) -> None:
        entry = self._entries.pop(identity_id, None)
        if entry is not None:
            self._size -= len(entry)
            self._weight -= _weight(entry)


def _weight(known: Known) -> int:
    """What an entry weighs against the capacity: its facts, at least 1."""
    return max(1, len(known))


def written(version: str, stored: Known, upserts: Sequence[Fact], deletes: Sequence[str]) -> Known:
    """The facts stored after a write of ``upserts`` and ``deletes`` over ``stored``,
    with the ``version`` the write left."""
    kept = stored.kept.copy()
    for subject in deletes:
        kept.pop(subject, None)
    for fact in upserts:
        kept[fact.subject] = _kept(fact)
    return Known(version, kept)
