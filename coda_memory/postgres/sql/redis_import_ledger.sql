-- Identities already copied from this Redis source, with the records each copy left
-- out: a rerun or a resumed run skips them without reading them from Redis again, and
-- says how many records earlier runs left out.
SELECT identity_id, bad_records
FROM {schema}.redis_imports
WHERE source = :source
