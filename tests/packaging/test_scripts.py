"""scripts/demo and scripts/test, as a new checkout meets them: their virtualenv script
(scripts/_venv.sh) needs nothing but bash, the POSIX utilities and Python 3.11+."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
#: What every Unix has, macOS included (which has no sha256sum).
_UTILITIES = ("bash", "cat", "cksum", "dirname")


def test_the_venv_script_needs_only_posix_utilities_before_python(tmp_path: Path) -> None:
    """On macOS it stopped with 'sha256sum: command not found', before it looked for
    Python: here an interpreter that is too old must be what it names."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in _UTILITIES:
        found = shutil.which(name)
        assert found is not None, name
        (tools / name).symlink_to(found)
    too_old = tools / "python3"
    too_old.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "Python 3.10.14"\nexit 1\n')
    too_old.chmod(0o755)

    result = subprocess.run(
        [tools / "bash", "-c", 'source "$1"', "bash", REPOSITORY / "scripts" / "_venv.sh"],
        env={"PATH": str(tools), "CODA_MEMORY_VENV": str(tmp_path / "venv")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        f"coda-memory: preparing {tmp_path / 'venv'} from requirements.lock",
        "coda-memory needs Python 3.11 or newer (found Python 3.10.14)",
    ]
    assert not (tmp_path / "venv").exists()
