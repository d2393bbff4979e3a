"""The writer's queue is bounded in bytes as well as in items: each queued observation is
counted at about what it holds in memory (coda_memory.writer)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator

import pytest

from coda_memory import MemoryService
from coda_memory.core.model import NewObservation, ObservationType
from coda_memory.core.sanitize import MAX_METADATA_BYTES
from coda_memory.testing import InMemoryStore
from coda_memory.writer import _ITEM_OVERHEAD, _approximate_bytes


def _observation(content: str, metadata: dict[str, object]) -> NewObservation:
    return NewObservation(type=ObservationType.TOOL_SUCCESS, content=content, metadata=metadata)


def test_text_is_counted_at_its_size_in_memory_ascii_or_not() -> None:
    for text in ("", "get_account ok", "déjà vu", "日本語の結果", "emoji 🎉" * 50, "x" * 10_000):
        observation = _observation(text, {})
        assert _approximate_bytes(observation) == _ITEM_OVERHEAD + sys.getsizeof(text)


def test_metadata_is_counted_entry_by_entry_nested_or_flat() -> None:
    flat: dict[str, object] = {
        "toolName": "get_account",
        "durationMs": 84.0,
        "ok": True,
        "note": None,
    }
    expected = 64 + sum(sys.getsizeof(key) for key in flat)
    expected += sys.getsizeof("get_account") + 3 * 32
    assert _approximate_bytes(_observation("", flat)) == (
        _ITEM_OVERHEAD + sys.getsizeof("") + expected
    )
    nested: dict[str, object] = {"clé": "värde", "items": ["a", 1], "blob": b"raw"}
    expected = 64 + sum(sys.getsizeof(key) for key in nested)
    expected += sys.getsizeof("värde") + (64 + sys.getsizeof("a") + 32) + sys.getsizeof(b"raw")
    assert _approximate_bytes(_observation("", nested)) == (
        _ITEM_OVERHEAD + sys.getsizeof("") + expected
    )


def test_emits_beyond_queue_bytes_are_dropped_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No event loop runs, so nothing is stored: what fits in ``queue_bytes`` waits, the
    rest is dropped, logged as such (it was logged as "queue full", the count's limit)."""
    big = _observation("é" * 20_000, {"toolName": "t"})  # about 40 kB each
    each = _approximate_bytes(big) + sys.getsizeof("u1")  # (the identity's too)
    service = MemoryService(InMemoryStore(), queue_bytes=5 * each)
    with caplog.at_level(logging.WARNING, "coda_memory"):
        for _ in range(8):
            service.emit_observation("u1", big)
    stats = service.stats()
    assert (stats.emitted, stats.pending, stats.dropped) == (8, 5, 3)
    assert "dropped 1 observation(s) (queue_bytes full)" in caplog.text


class _CountedList(list[int]):
    """A list that counts the items read from it."""

    read = 0

    def __iter__(self) -> Iterator[int]:
        for item in super().__iter__():
            _CountedList.read += 1
            yield item


def test_metadata_of_more_values_than_validation_takes_is_rejected_unread_at_emit() -> None:
    """Walked whole on the caller's event loop to size it, a list of a million numbers
    held the caller 0.1 s (5 million: 1.6 s), only to be rejected by the writer."""
    service = MemoryService(InMemoryStore())
    huge = _CountedList(range(MAX_METADATA_BYTES + 1))
    observation = NewObservation.model_construct(
        type=ObservationType.TOOL_SUCCESS, content="", metadata={"toolName": "t", "rows": huge}
    )
    service.emit_observation("u1", observation)
    stats = service.stats()
    assert (stats.emitted, stats.rejected, stats.pending, _CountedList.read) == (1, 1, 0, 0)
    # At the limit, it is sized and queued (and left to validation, which measures it).
    fits: dict[str, object] = {"toolName": "t", "rows": list(range(MAX_METADATA_BYTES - 10))}
    service.emit_observation("u1", _observation("", fits))
    assert service.stats().pending == 1


@pytest.mark.parametrize("where", ["identity", "session"])
def test_identity_and_session_ids_count_against_queue_bytes(where: str) -> None:
    """The queue holds each observation's ids as well: uncounted, observations whose ids
    were long (each its own, 200 kB here, which the writer rejects later) filled memory
    far past ``queue_bytes``."""
    service = MemoryService(InMemoryStore(), queue_bytes=1_000_000)
    for n in range(10):
        long_id = f"{n}" + "x" * 200_000
        identity, session = (long_id, None) if where == "identity" else ("u1", long_id)
        observation = NewObservation.model_construct(
            type=ObservationType.TOOL_SUCCESS,
            content="",
            metadata={"toolName": "t"},
            session_id=session,
            created_at=None,
        )
        service.emit_observation(identity, observation)
    stats = service.stats()
    assert stats.pending * 200_000 <= 1_000_000
    assert stats.dropped == 10 - stats.pending
