"""Print the requirements of a floors install, one per line (used by scripts/test-floors).

Every dependency pyproject declares, in the core and in the extras the tests import
(cli, plot, otel, redis), pinned to its declared minimum (``name>=X`` becomes
``name==X``); then the test tools at the versions requirements.lock pins.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("cli", "plot", "otel", "redis")
#: Test tools (uvloop: the second loop of the tests marked both_loops), at their locked
#: versions; the OpenTelemetry SDK at the API's floor.
TOOLS = ("pytest", "pytest-asyncio", "hypothesis", "bpe-openai", "uvloop")


def floors() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"])
    for extra in EXTRAS:
        declared += project["optional-dependencies"][extra]
    pinned = []
    for requirement in declared:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+(?:\[[\w,]+\])?)>=([\w.]+)", requirement)
        if match is None:
            raise SystemExit(f"no floor in {requirement!r}")
        pinned.append(f"{match[1]}=={match[2]}")
        if match[1] == "opentelemetry-api":
            pinned.append(f"opentelemetry-sdk=={match[2]}")
    lock = (ROOT / "requirements.lock").read_text()
    for tool in TOOLS:
        version = re.search(rf"^{re.escape(tool)}==([\w.]+)", lock, re.M)
        assert version is not None, tool
        pinned.append(f"{tool}=={version[1]}")
    return pinned


if __name__ == "__main__":
    print("\n".join(floors()))
