-- ingest_record.sql, for a key claimed in the second table.
UPDATE {schema}.ingest_batches_spill
SET stored = :stored, refused = CAST(:refused AS jsonb)
WHERE key = CAST(:key AS uuid)
