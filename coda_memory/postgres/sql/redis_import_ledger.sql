-- Identities already copied from this Redis source: a rerun or a resumed run skips them
-- without reading them from Redis again.
SELECT identity_id
FROM {schema}.redis_imports
WHERE source = :source
