"""The quality benchmark's data: glibc's historical ChangeLogs as author-file events.

``python -m benchmarks.quality_data`` downloads Debian's ``glibc-source`` package with
``apt-get download`` (nothing is installed), reads the ``ChangeLog*`` files of the
glibc tarball inside it, and writes one event per (author, day, file) in the replay's
event format to ``benchmarks/.cache/glibc-changelog.jsonl`` (git-ignored; later runs
reuse it).

Mapping: the author's e-mail address is the identity, a day on which the author has
entries is a session, and each file an entry names is an ``entity_access`` with the
top-level directory as entity type and the path as entity id (``malloc:malloc/malloc.c``;
files at the top are of type ``top``). Paths in the ChangeLogs of a subdirectory
(``nptl``, ``ports``, ``localedata``, …) are prefixed with it. Characters a subject may
not hold become ``_``.
"""

from __future__ import annotations

import io
import re
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from coda_memory.core.model import ObservationType
from coda_memory.replay import Event, read_events, write_events

CACHE = Path(__file__).resolve().parent / ".cache" / "glibc-changelog.jsonl"
PACKAGE = "glibc-source"

_ISO_HEADER = re.compile(r"^(\d{4}-\d{2}-\d{2})\s+(.+?)\s+<([^>\s]+)>")
_OLD_HEADER = re.compile(
    r"^([A-Z][a-z]{2}\s+[A-Z][a-z]{2}\s+\d{1,2}\s.*?\d{4})\s+(.+?)\s+<([^>\s]+)>"
)
_FILES = re.compile(r"^\t\*\s*([^:(\[]+)")
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9_.\-/@]")
_LOG_NAME = re.compile(r"(?:^|/)ChangeLog(?:\.old/ChangeLog)?(?:\.([A-Za-z0-9_-]+))?$")


def _old_date(text: str) -> datetime | None:
    words = text.split()
    for pattern, count in (("%a %b %d %H:%M:%S %Y", 5), ("%a %b %d %Y", 4)):
        candidate = [*words[:3], *words[3:][-(count - 3) :]] if len(words) >= count else None
        if candidate is None:
            continue
        try:
            return datetime.strptime(" ".join(candidate), pattern).replace(tzinfo=UTC)
        except ValueError:
            continue
    return None


def _prefix(log_path: str) -> str:
    """Where the paths of a ChangeLog are relative to."""
    directory = log_path.rsplit("/", 1)[0] if "/" in log_path else ""
    if directory and directory != "ChangeLog.old":
        return directory + "/"
    match = _LOG_NAME.search(log_path)
    suffix = match.group(1) if match else None
    if suffix is None or suffix.isdigit():
        return ""
    return suffix.split("-", 1)[0] + "/"


def parse_changelog(text: str, prefix: str = "") -> Iterator[tuple[str, datetime, str]]:
    """(author e-mail, day, file) of every file an entry names."""
    author: str | None = None
    day: datetime | None = None
    for line in text.splitlines():
        if match := _ISO_HEADER.match(line):
            try:
                day = datetime.strptime(match.group(1), "%Y-%m-%d").replace(tzinfo=UTC)
            except ValueError:
                day = None
            author = match.group(3).lower()
            continue
        if line and not line[0].isspace():
            if match := _OLD_HEADER.match(line):
                day, author = _old_date(match.group(1)), match.group(3).lower()
            continue
        if author is None or day is None:
            continue
        if match := _FILES.match(line):
            for raw in match.group(1).split(","):
                path = raw.strip().rstrip(".").strip()
                if path and " " not in path:
                    yield author, day, prefix + path


def _event(author: str, day: datetime, path: str) -> Event | None:
    path = _NOT_ALLOWED.sub("_", path.lstrip("./"))[:150]
    identity = _NOT_ALLOWED.sub("_", author)[:150]
    if not path or not identity:
        return None
    top = path.split("/", 1)[0] if "/" in path else "top"
    return Event(identity, day, ObservationType.ENTITY_ACCESS, f"{top}:{path}")


def changelog_events(source_tarball: Path) -> list[Event]:
    """Every (author, day, file) event of the ChangeLogs in a glibc source tarball."""
    seen: set[tuple[str, datetime, str]] = set()
    events: list[Event] = []
    with tarfile.open(source_tarball, mode="r|xz") as tar:
        for member in tar:
            inner = member.name.split("/", 1)[-1]
            if not member.isfile() or not _LOG_NAME.search(inner):
                continue
            file = tar.extractfile(member)
            if file is None:
                continue
            text = file.read().decode("utf-8", errors="replace")
            for author, day, path in parse_changelog(text, _prefix(inner)):
                event = _event(author, day, path)
                if event is None:
                    continue
                key = (event.identity, event.time, event.subject)
                if key not in seen:
                    seen.add(key)
                    events.append(event)
    events.sort(key=lambda e: (e.time, e.identity, e.subject))
    return events


def download() -> list[Event]:
    """Download glibc-source with apt and parse its ChangeLogs."""
    with tempfile.TemporaryDirectory() as work:
        directory = Path(work)
        subprocess.run(["apt-get", "download", PACKAGE], cwd=directory, check=True)
        (deb,) = directory.glob(f"{PACKAGE}_*.deb")
        payload = subprocess.run(
            ["dpkg-deb", "--fsys-tarfile", str(deb)], check=True, capture_output=True
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(payload)) as outer:
            for member in outer:
                if re.search(r"/usr/src/glibc/glibc-[^/]+\.tar\.xz$", member.name):
                    source = outer.extractfile(member)
                    assert source is not None
                    tarball = directory / "glibc.tar.xz"
                    tarball.write_bytes(source.read())
                    return changelog_events(tarball)
    raise RuntimeError(f"no glibc tarball in {PACKAGE}")


def glibc_events(cache: Path = CACHE) -> list[Event]:
    """The events, from the cache when it is there, else downloaded and cached."""
    if not cache.exists():
        events = download()
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(".partial")
        write_events(partial, events)
        partial.replace(cache)
    return read_events(cache)


def main() -> None:
    events = glibc_events()
    authors = {e.identity for e in events}
    first, last = events[0].time.date(), events[-1].time.date()
    print(f"{len(events):,} events by {len(authors):,} authors, {first} to {last}: {CACHE}")


if __name__ == "__main__":
    main()
