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


def require_flags(**flags: object) -> None:
    """TypeError naming the first option that is not True or False: a string from the
    environment ("false", "0") would otherwise count as True."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, not {type(value).__name__}")


def require_callables(**functions: object) -> None:
    """TypeError naming the first option that is neither None nor callable."""
    for name, value in functions.items():
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be a function (or None), not {type(value).__name__}")


def seconds_or_none(name: str, value: object) -> float | None:
    """``value`` as a timeout in seconds: None (no limit) or a number that is finite and
    not negative; TypeError or ValueError naming ``name`` otherwise (a string from the
    environment, a timedelta, NaN)."""
    if value is None:
        return None
    require_types(**{name: (value, (int, float), "a number of seconds (or None)")})
    assert isinstance(value, int | float)
    try:
        seconds = float(value)
    except OverflowError:  # an int past the floats
        seconds = float("inf")
    if not 0 <= seconds < float("inf"):  # NaN fails too
        raise ValueError(f"{name} must be a finite number of seconds, not negative")
    return seconds
