"""The key layout: the original server's keys, and the few coda-memory adds beside them.

With the default prefix ``coda:memory:``:

======================================  ==========  =========================================
key                                     type        holds
======================================  ==========  =========================================
``coda:memory:obs:{identityId}``        sorted set  observations (JSON), scored by createdAt
                                                    epoch ms: the original server's key
``coda:memory:facts:{identityId}``      hash        facts (JSON) by ``fact.id``: the original
                                                    server's key
``coda:memory:checkpoint``              hash        identityId -> epoch ms of the latest
                                                    consumed observation: the original
                                                    server's checkpoint map
``coda:memory:pending:{identityId}``    sorted set  observations coda-memory appended and no
                                                    consolidation consumed yet (the same JSON
                                                    as in ``obs:``), scored by ingest number
``coda:memory:state:{identityId}``      hash        ``seq`` (the ingest sequence), ``runs``,
                                                    ``consumed``, ``consolidatedAt``
``coda:memory:history:{identityId}``    list        fact events (JSON), the newest last,
                                                    capped per identity
``coda:memory:sessions:{identityId}``   hash        session id -> the session's latest
                                                    reinforcing event per fact (JSON array)
``coda:memory:session-times:{id}``      sorted set  session id, scored by its latest event
``coda:memory:batches:{identityId}``    sorted set  recent batch keys, scored by when each
                                                    was stored (a retry stores nothing twice)
``coda:memory:lock:{identityId}``       string      the consolidation lock's token (expires)
``coda:memory:forgotten-batches``       sorted set  the recent batch keys of forgotten
                                                    identities, as the SHA-1 of the batch key
                                                    and the identity's ``batches:`` key name
                                                    (no identity), scored by when each was
                                                    stored (a retry after a forget stores
                                                    nothing again)
======================================  ==========  =========================================

The original server reads only ``obs:``, ``facts:`` and the checkpoint map, and never a
key it does not know, so the added keys cannot disturb it.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "coda:memory:"

#: The per-identity kinds of key, in the table's order (the checkpoint map is shared).
IDENTITY_KINDS = (
    "obs",
    "facts",
    "pending",
    "state",
    "history",
    "sessions",
    "session-times",
    "batches",
    "lock",
)


def glob_escape(text: str) -> str:
    """``text`` with the glob characters of SCAN's MATCH escaped."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under one prefix."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str):
            raise TypeError("the key prefix must be a string")

    @property
    def checkpoint(self) -> str:
        return f"{self.prefix}checkpoint"

    @property
    def forgotten_batches(self) -> str:
        return f"{self.prefix}forgotten-batches"

    def of(self, kind: str, identity_id: str) -> str:
        """The key of ``kind`` (one of :data:`IDENTITY_KINDS`) for the identity."""
        return f"{self.prefix}{kind}:{identity_id}"

    def read_keys(self, identity_id: str) -> list[str]:
        """The keys the peek and load scripts read: checkpoint map, pending, obs, facts."""
        return [
            self.checkpoint,
            self.of("pending", identity_id),
            self.of("obs", identity_id),
            self.of("facts", identity_id),
        ]

    def pattern(self, kind: str) -> str:
        """A SCAN MATCH pattern for every identity's key of ``kind``."""
        return f"{glob_escape(self.prefix)}{kind}:*"

    def identity_of(self, kind: str, key: str) -> str:
        """The identity id in a key of ``kind``."""
        return key[len(self.prefix) + len(kind) + 1 :]
