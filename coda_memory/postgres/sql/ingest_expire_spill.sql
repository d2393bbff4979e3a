-- ingest_expire.sql, for the second table of keys.
DELETE FROM {schema}.ingest_batches_spill
WHERE committed_at < now() - interval '1 day'
