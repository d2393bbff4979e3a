-- The batch's outcome, when refused rows made it differ from the one claimed.
UPDATE {schema}.ingest_batches
SET stored = :stored, refused = CAST(:refused AS jsonb)
WHERE key = CAST(:key AS uuid)
