-- What an earlier attempt of a batch stored, recorded in the transaction that stored it,
-- in either table of keys.
SELECT stored, refused::text AS refused
FROM {schema}.ingest_batches
WHERE key = CAST(:key AS uuid)
UNION ALL
SELECT stored, refused::text AS refused
FROM {schema}.ingest_batches_spill
WHERE key = CAST(:key AS uuid)
LIMIT 1
