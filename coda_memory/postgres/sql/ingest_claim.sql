-- Opens the writer's transaction in one round trip: claims the batch's idempotency key,
-- makes the transaction the writer's (row-level security: it stores rows of any
-- identity) and picks the rollup shard of this connection.
WITH
-- The key, with the outcome expected when every row is stored; nothing when an
-- earlier attempt of the batch committed it (one still committing is waited for).
claimed AS (
    INSERT INTO {schema}.ingest_batches (key, stored, refused)
    VALUES (CAST(:key AS uuid), :stored, CAST(:refused AS jsonb))
    ON CONFLICT (key) DO NOTHING
    RETURNING 1
)
SELECT
    (SELECT count(*) FROM claimed) AS claimed,
    set_config('coda_memory.writer', 'on', true) AS writer,
    pg_backend_pid() % :shards AS shard
