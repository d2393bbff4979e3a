-- What an earlier attempt of a batch stored, recorded in the transaction that stored it.
SELECT stored, refused::text AS refused
FROM {schema}.ingest_batches
WHERE key = CAST(:key AS uuid)
