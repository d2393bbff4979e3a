"""coda-memory: memory across sessions for LLM agents, with no LLM call in the memory path.

Observations (tool successes and failures, entity accesses, query domains) are
consolidated into facts whose confidence rises with reinforcement and decays with time;
the facts become a token-budgeted system-prompt section and tool-ranking affinities.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from coda_memory.core.affinity import (
    AFFINITY_WEIGHT,
    boost_tool_scores,
    extract_tool_affinities,
    rank_tools,
)
from coda_memory.core.decay import AdaptiveDecay, DecayStrategy, ExponentialDecay, PowerLawDecay
from coda_memory.core.emitters import (
    DEFAULT_DOMAIN_PATTERNS,
    DEFAULT_ENTITY_EXTRACTORS,
    META_TOOLS,
    EntityExtractors,
    EntityRef,
    ToolResult,
    ToolUse,
    entity_observations,
    query_pattern_observation,
    tool_observations,
)
from coda_memory.core.logs import set_log_key
from coda_memory.core.model import (
    IDENTIFIER_PATTERN,
    Fact,
    FactCategory,
    FactEvent,
    FactEventKind,
    LoadedMemory,
    NewObservation,
    Observation,
    ObservationType,
)
from coda_memory.core.prompt import format_memory_section
from coda_memory.core.sanitize import ObservationRejected
from coda_memory.ports import Forgotten
from coda_memory.service import MemoryService, MemoryStats

if TYPE_CHECKING:
    from coda_memory.postgres.migrate import migrate, migrate_async

__version__ = "0.1.0"

# A library's logger has no handler of its own: the host's logging configuration decides
# where its warnings go (without one, nowhere, rather than bare lines on stderr).
logging.getLogger("coda_memory").addHandler(logging.NullHandler())


def __getattr__(name: str) -> Any:
    # The migration helpers pull in Alembic; load them only when asked for. They are
    # functions: ``coda_memory.postgres.migrate`` is the module.
    if name in ("migrate", "migrate_async"):
        from coda_memory.postgres import migrate as module

        return getattr(module, name)
    raise AttributeError(f"module 'coda_memory' has no attribute {name!r}")


def __dir__() -> list[str]:
    # (The lazy helpers are no module attribute until first asked for: dir() and
    # completion would not list them.)
    return sorted({*globals(), "migrate", "migrate_async"})


__all__ = [
    "AFFINITY_WEIGHT",
    "DEFAULT_DOMAIN_PATTERNS",
    "DEFAULT_ENTITY_EXTRACTORS",
    "IDENTIFIER_PATTERN",
    "META_TOOLS",
    "AdaptiveDecay",
    "DecayStrategy",
    "EntityExtractors",
    "EntityRef",
    "ExponentialDecay",
    "Fact",
    "FactCategory",
    "FactEvent",
    "FactEventKind",
    "Forgotten",
    "LoadedMemory",
    "MemoryService",
    "MemoryStats",
    "NewObservation",
    "Observation",
    "ObservationRejected",
    "ObservationType",
    "PowerLawDecay",
    "ToolResult",
    "ToolUse",
    "boost_tool_scores",
    "entity_observations",
    "extract_tool_affinities",
    "format_memory_section",
    "migrate",
    "migrate_async",
    "query_pattern_observation",
    "rank_tools",
    "set_log_key",
    "tool_observations",
]
