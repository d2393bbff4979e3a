-- Whether this identity was already copied from this Redis source (a rerun skips it),
-- and, if not, the first other source it was copied from: two deployments' identities
-- of one name would become one identity here, so such a copy is refused.
SELECT
    coalesce(bool_or(source = :source), false) AS done,
    min(source) FILTER (WHERE source <> :source) AS other
FROM {schema}.redis_imports
WHERE identity_id = :identity_id
