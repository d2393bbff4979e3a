"""The last answers of ``load_memory``: what a load that outlives its timeout answers
with, at once.

A load that times out answers with the facts of its identity's last consolidation. When
every load of a busy process times out at once (a table locked, the store slow), building
each of those answers again (a view per fact, the prompt section) queues them behind one
another on the event loop, and the last ones come back well after their timeout. So the
service keeps each identity's last answer, up to :data:`DEFAULT_ANSWERS_FACTS` facts in all
(least recently used identities first out), and a late load returns a copy of it.
"""

from __future__ import annotations

from collections import OrderedDict

from coda_memory.core.model import LoadedMemory, trusted

#: Facts of the last answers kept per service, in all (about 1 kB each).
DEFAULT_ANSWERS_FACTS = 20_000


class LastAnswers:
    """Each identity's last answer, up to ``capacity`` facts in all."""

    def __init__(self, capacity: int = DEFAULT_ANSWERS_FACTS) -> None:
        self.capacity = capacity
        self._answers: OrderedDict[str, LoadedMemory] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        """How many facts are kept, all identities together."""
        return self._size

    def put(self, identity_id: str, loaded: LoadedMemory) -> None:
        """Keep ``loaded`` as the identity's last answer (an empty one is not kept)."""
        self.discard(identity_id)
        if not loaded.facts or len(loaded.facts) > self.capacity:
            return
        self._answers[identity_id] = loaded
        self._size += len(loaded.facts)
        while self._size > self.capacity:
            _, evicted = self._answers.popitem(last=False)
            self._size -= len(evicted.facts)

    def get(self, identity_id: str) -> LoadedMemory | None:
        """A copy of the identity's last answer (None: none kept): the caller may change
        its lists."""
        loaded = self._answers.get(identity_id)
        if loaded is None:
            return None
        self._answers.move_to_end(identity_id)
        return trusted(
            LoadedMemory,
            facts=list(loaded.facts),
            prompt_section=loaded.prompt_section,
            tool_affinities=dict(loaded.tool_affinities),
        )

    def discard(self, identity_id: str) -> None:
        loaded = self._answers.pop(identity_id, None)
        if loaded is not None:
            self._size -= len(loaded.facts)
