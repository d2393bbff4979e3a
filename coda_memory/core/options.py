"""Checks of option types: a clear TypeError naming the option, at construction, rather
than a confusing one later (a float of seconds where a timedelta goes failed with "'>'
not supported between …" on first use)."""

from __future__ import annotations

#: "Not given": the options that take None as "no limit" accept it.
NONE = type(None)


def require_types(**options: tuple[object, type | tuple[type, ...], str]) -> None:
    """TypeError naming the first option whose value is not of its type; each option is
    ``name=(value, types, what it must be)``. A bool is no number here."""
    for name, (value, kind, example) in options.items():
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TypeError(f"{name} must be {example}, not {type(value).__name__}")
