"""How the command line writes numbers."""

from __future__ import annotations

import pytest

from coda_memory.cli.output import fmt_percent


@pytest.mark.parametrize(
    ("share", "shown"),
    [
        (None, "-"),
        (0.0, "0%"),
        (1.0, "100%"),
        (0.8, "80%"),
        (0.994, "99%"),
        # 1 failure in 2,000 calls: it said 100 %, as if none had failed.
        (0.9995, "99.9%"),
        (0.995, "99.5%"),
        (0.00004, "0.1%"),  # and 0 % as if none had succeeded
        (0.003, "0.3%"),
        (0.005, "0.5%"),  # 1 in 200: "0%", Python rounding 0.5 to an even 0
        (0.007, "0.7%"),
    ],
)
def test_a_share_is_never_rounded_to_all_or_none(share: float | None, shown: str) -> None:
    assert fmt_percent(share) == shown
