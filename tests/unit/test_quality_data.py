"""The ChangeLog parser of the quality benchmark, on entries written here."""

from __future__ import annotations

from datetime import UTC, datetime

from benchmarks.quality_data import _event, _prefix, parse_changelog

CHANGELOG = """2001-08-15  Ulrich Drepper  <Drepper@redhat.com>

\t* libio/iofwide.c (_IO_fwide): Don't reset file position.
\t* locale/Makefile, locale/xlocale.c: New file.

2001-08-14  Andreas Jaeger  <aj@suse.de>

\t* inet/inet_ntoa.c (free_mem): Remove, it's not used anymore.
\tCloses PR libc/2477.

Tue Jun  4 18:00:00 1996  Roland McGrath  <roland@gnu.ai.mit.edu>

\t* Makefile (subdirs): Add nss.
"""


def test_entries_become_author_day_file_events() -> None:
    events = list(parse_changelog(CHANGELOG))
    day = datetime(2001, 8, 15, tzinfo=UTC)
    assert events == [
        ("drepper@redhat.com", day, "libio/iofwide.c"),
        ("drepper@redhat.com", day, "locale/Makefile"),
        ("drepper@redhat.com", day, "locale/xlocale.c"),
        ("aj@suse.de", datetime(2001, 8, 14, tzinfo=UTC), "inet/inet_ntoa.c"),
        ("roland@gnu.ai.mit.edu", datetime(1996, 6, 4, 18, tzinfo=UTC), "Makefile"),
    ]


def test_files_map_to_entities_by_top_level_directory() -> None:
    day = datetime(2001, 8, 15, tzinfo=UTC)
    event = _event("a@b.org", day, "sysdeps/x86/cpu+features.c")
    assert event is not None
    assert (event.identity, event.subject) == ("a@b.org", "sysdeps:sysdeps/x86/cpu_features.c")
    top = _event("a@b.org", day, "Makefile")
    assert top is not None and top.subject == "top:Makefile"
    assert _prefix("ChangeLog.old/ChangeLog.nptl") == "nptl/"
    assert _prefix("ChangeLog.old/ChangeLog.ports-arm") == "ports/"
    assert _prefix("ChangeLog.old/ChangeLog.12") == ""
    assert _prefix("fbtl/ChangeLog") == "fbtl/"
