"""Answers of ``load_memory`` given again while nothing changed.

A load whose identity's facts have the version of an answer made less than
:data:`REUSE_FOR` ago, with no observation waiting, gets that answer again: one round
trip to learn that nothing changed, and no fact built, decayed, ranked or formatted. An
agent server that loads one identity many times a second (a burst of requests, a retry
loop, an identity far over its fair share) then costs the other requests a round trip
per load instead of the Python of a whole load.

What a reused answer says is what a new one would say, but for time: its confidences are
those of up to :data:`REUSE_FOR` ago (under the default decay, a relative difference
below one in a million per second), and its prompt section and affinities are made from
them. Anything that changes the facts changes their version (a consolidation in any
process, ``forget``, an import, the cap applied on the server), and an answer of another
version is not reused.

The answers are kept per identity, most recently used last, at most
:data:`CAPACITY_FACTS` facts in all: their models are objects that the cyclic garbage
collector walks (see :mod:`~coda_memory.core.turns`), so few are kept. While a table is
held and the writer is slow, loads of random identities find nothing new, and their
answers churn through the capacity: a kept answer lives through a young collection and
is walked again by each collection of the middle generation until it goes. With
``entity_users`` held under 8 concurrent host-shaped requests, answers of 5,000 facts in
all made those collections up to 9.1 to 16 ms long (105 ms of collections per 5 s),
and of 1,000 facts, 5.0 to 8.0 ms (70 ms per 5 s), in four interleaved windows each;
as few answers were given again either way.

Only the answer of a load that found nothing to consolidate is kept. A load that
consolidated found its identity writing, and the next load of such an identity most
often finds new observations again, so its answer would seldom be given again; but kept,
every fact of it would outlive the next young collection, which walks it. In the
host-shaped run of the benchmark (every request emits, then loads), keeping them made the
collector's pauses 260 ms per 1,600 requests instead of 76 ms, and the event loop's lag
p99 12.8 ms instead of 9.4 ms (the medians of four interleaved runs each). A burst of
loads of an unchanged identity gets the answer of its second load again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta

from coda_memory.core.caps import DEFAULT_MAX_FACTS
from coda_memory.core.model import LoadedMemory

#: How long an answer may be given again while its identity's facts keep their version.
REUSE_FOR = timedelta(seconds=1)
#: Facts of all kept answers together: two answers of identities at the default cap.
CAPACITY_FACTS = 2 * DEFAULT_MAX_FACTS


@dataclass(frozen=True, slots=True)
class Answer:
    """An answer, the version of the facts it was made from, and when it was made."""

    version: str
    made_at: datetime
    loaded: LoadedMemory


def _weight(loaded: LoadedMemory) -> int:
    """What an answer weighs against the capacity: its facts, at least 1."""
    return max(1, len(loaded.facts))


def own_copy(loaded: LoadedMemory) -> LoadedMemory:
    """``loaded`` with lists and dicts of its own (the facts are frozen models, shared)."""
    return LoadedMemory.model_construct(
        facts=list(loaded.facts),
        prompt_section=loaded.prompt_section,
        tool_affinities=dict(loaded.tool_affinities),
    )


class RecentAnswers:
    """Each identity's last answer, for :data:`REUSE_FOR`."""

    def __init__(
        self, reuse_for: timedelta = REUSE_FOR, capacity_facts: int = CAPACITY_FACTS
    ) -> None:
        self.reuse_for = reuse_for
        self.capacity_facts = capacity_facts
        self._answers: OrderedDict[str, Answer] = OrderedDict()
        #: Their facts, each answer counted as at least 1 (an empty answer counted
        #: nothing: a stream of identities with no facts grew the answers without bound).
        self._facts = 0

    def __len__(self) -> int:
        return len(self._answers)

    def fresh(self, identity_id: str, now: datetime) -> Answer | None:
        """The identity's answer if it was made within ``reuse_for`` of ``now`` (an older
        one is dropped)."""
        answer = self._answers.get(identity_id)
        if answer is None:
            return None
        if self._stale(answer, now):
            self.discard(identity_id)
            return None
        self._answers.move_to_end(identity_id)
        return answer

    def _stale(self, answer: Answer, now: datetime) -> bool:
        """Whether ``answer`` was made longer than ``reuse_for`` from ``now`` (either way:
        a clock that went back)."""
        return abs(now - answer.made_at) > self.reuse_for

    def put(self, identity_id: str, version: str, made_at: datetime, loaded: LoadedMemory) -> None:
        """Keep a copy of ``loaded`` (the caller's stays its own) as the identity's answer
        for ``version``; none when it alone is over the capacity."""
        self.discard(identity_id)
        size = _weight(loaded)
        if size > self.capacity_facts:
            return
        # The least recently used first: those made longer than reuse_for ago are of no
        # use any more (each was dropped only when its identity asked again).
        while self._answers:
            if not self._stale(next(iter(self._answers.values())), made_at):
                break
            _, stale = self._answers.popitem(last=False)
            self._facts -= _weight(stale.loaded)
        self._answers[identity_id] = Answer(version, made_at, own_copy(loaded))
        self._facts += size
        while self._facts > self.capacity_facts:
            _, evicted = self._answers.popitem(last=False)
            self._facts -= _weight(evicted.loaded)

    def given(self, answer: Answer) -> LoadedMemory:
        """``answer``'s answer as the caller's own (lists and dicts of its own)."""
        return own_copy(answer.loaded)

    def discard(self, identity_id: str) -> None:
        answer = self._answers.pop(identity_id, None)
        if answer is not None:
            self._facts -= _weight(answer.loaded)
