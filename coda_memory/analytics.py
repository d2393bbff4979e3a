"""Cross-tenant analytics, public path (the queries: :mod:`coda_memory.postgres.analytics`)."""

from coda_memory.postgres.analytics import (
    DomainTrend,
    EntityPopularity,
    FactSummary,
    ToolEffectiveness,
    domain_trends,
    entity_popularity,
    fact_summary,
    rebuild_rollups,
    tool_effectiveness,
)

__all__ = [
    "DomainTrend",
    "EntityPopularity",
    "FactSummary",
    "ToolEffectiveness",
    "domain_trends",
    "entity_popularity",
    "fact_summary",
    "rebuild_rollups",
    "tool_effectiveness",
]
