"""Checks of a memory URL's text that every entry point makes before a store reads it
(``MemoryService.from_url`` through ``stores.checked_scheme``, ``migrate``, and
``postgres.engine.asyncpg_url`` for every Postgres URL)."""

from __future__ import annotations


def refuse_whitespace(url: str, subject: str) -> None:
    """A ValueError, not quoting ``url`` (it may hold a password), for whitespace at its
    start or end, the error's message beginning with ``subject``. (A newline from an
    environment file: Postgres took it into the database name and failed only on
    connecting.)"""
    if url != url.strip():
        raise ValueError(
            f"{subject} begins or ends with whitespace (a newline from an environment "
            "file?): strip it"
        )


def refuse_malformed(url: str, scheme: str) -> None:
    """A ValueError, not quoting ``url`` (it may hold a password), for whitespace at its
    start or end, or a ``memory:`` or ``null:`` URL (``scheme``) without its ``//``."""
    refuse_whitespace(url, "invalid memory URL: it")
    if scheme in ("memory", "null") and not url.partition(":")[2].startswith("//"):
        # ("memory", "memory:" or "null:", as a Redis URL without its "//" is.)
        raise ValueError(f"invalid memory URL: no '//' after {scheme + ':'!r}: use {scheme}://")
