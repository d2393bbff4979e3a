-- Whether this identity was already copied from this Redis source (a rerun skips it).
SELECT EXISTS (
    SELECT 1
    FROM {schema}.redis_imports
    WHERE identity_id = :identity_id
        AND source = :source
) AS done
