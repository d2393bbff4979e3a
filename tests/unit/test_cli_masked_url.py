"""A URL in an error line shows no part of its password, whatever the password holds."""

from __future__ import annotations

import pytest

from coda_memory.core.logs import masked_url


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql://app:secret@db:5432/app", "postgresql://app:***@db:5432/app"),
        ("redis://admin:hunter2/x@127.0.0.1:6379/14", "redis://admin:***@127.0.0.1:6379/14"),
        ("redis://u:s3c:r@et@127.0.0.1:1/0", "redis://u:***@127.0.0.1:1/0"),
        ("redis://:only-a-password@host/0", "redis://:***@host/0"),
        ("postgresql://app@db/app", "postgresql://app@db/app"),
        ("memory://", "memory://"),
        # libpq's query parameters.
        ("postgresql://u@h:5439/db?password=s3cr3t", "postgresql://u@h:5439/db?password=***"),
        (
            "postgresql://h/db?sslmode=require&PASSWORD=s3cr3t&sslpassword=k3y#x",
            "postgresql://h/db?sslmode=require&PASSWORD=***&sslpassword=***#x",
        ),
    ],
)
def test_a_masked_url_shows_no_part_of_the_password(url: str, masked: str) -> None:
    assert masked_url(url) == masked
