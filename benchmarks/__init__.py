"""coda-memory benchmarks: each figure next to a baseline taken in the same run.

Run ``python -m benchmarks [--quick] [--url URL] [--out DIR]``; benchmarks/README.md says
what each figure means. ``--profile`` runs the profiling pass instead (round trips and
time per statement, where Python spends its time).

The server is an embedded Postgres in ``benchmarks/.pgdata`` unless ``--url`` (or
``CODA_MEMORY_BENCH_URL``) names one; every run works in databases of its own, created,
migrated and dropped by the run.
"""
