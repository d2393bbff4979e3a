-- Keys of batches stored more than a day ago: no retry comes that late.
DELETE FROM {schema}.ingest_batches
WHERE committed_at < now() - interval '1 day'
