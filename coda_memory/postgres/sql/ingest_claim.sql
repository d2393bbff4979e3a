-- Opens the writer's transaction in one round trip: claims the batch's idempotency key,
-- makes the transaction the writer's (row-level security: it stores rows of any
-- identity), picks the rollup shard of this connection, and puts back the writer's lock
-- timeout when a first attempt shortened it for the claim (batch_keys.py).
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
    pg_backend_pid() % :shards AS shard,
    set_config(
        'lock_timeout',
        coalesce(
            nullif(current_setting('coda_memory.saved_lock_timeout', true), ''),
            current_setting('lock_timeout')
        ),
        true
    ) AS lock_timeout
