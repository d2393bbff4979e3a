"""Moving memory between stores: from the original Redis layout into Postgres.

This layer sits above the stores, which never import each other: it reads with the Redis
adapter and writes with the Postgres one.
"""

from __future__ import annotations

from coda_memory.migration.redis_to_postgres import (
    IMPORT_SOCKET_TIMEOUT,
    ImportSummary,
    import_redis,
)

__all__ = ["IMPORT_SOCKET_TIMEOUT", "ImportSummary", "import_redis"]
