-- ingest_claim.sql for the second table of keys: where a first attempt records its key
-- when ingest_batches is locked, and where a retry also looks (batch_keys.py).
WITH
-- The key, with the outcome expected when every row is stored; nothing when an
-- earlier attempt of the batch committed it here (one still committing is waited for).
claimed AS (
    INSERT INTO {schema}.ingest_batches_spill (key, stored, refused)
    VALUES (CAST(:key AS uuid), :stored, CAST(:refused AS jsonb))
    ON CONFLICT (key) DO NOTHING
    RETURNING 1
)
SELECT
    (SELECT count(*) FROM claimed) AS claimed,
    set_config('coda_memory.writer', 'on', true) AS writer,
    pg_backend_pid() % :shards AS shard
