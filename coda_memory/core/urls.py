"""Checks of a memory URL's text that every entry point makes before a store reads it
(``MemoryService.from_url`` through ``stores.checked_scheme``, and ``migrate``)."""

from __future__ import annotations


def refuse_malformed(url: str, scheme: str) -> None:
    """A ValueError, not quoting ``url`` (it may hold a password), for whitespace at its
    start or end, or a ``memory:`` or ``null:`` URL (``scheme``) without its ``//``."""
    if url != url.strip():
        # (A newline from an environment file: Postgres took it into the database name
        # and failed only on connecting.)
        raise ValueError(
            "invalid memory URL: it begins or ends with whitespace (a newline from an "
            "environment file?): strip it"
        )
    if scheme in ("memory", "null") and not url.partition(":")[2].startswith("//"):
        # ("memory", "memory:" or "null:", as a Redis URL without its "//" is.)
        raise ValueError(f"invalid memory URL: no '//' after {scheme + ':'!r}: use {scheme}://")
