-- The owed records whose rollup was just folded, given as (identity_id, xid) pairs, in
-- the same (sub)transaction as the folding.
DELETE FROM {schema}.rollup_owed
WHERE (identity_id, xid) IN (
    SELECT identity_id, xid
    FROM unnest(CAST(:identities AS text[]), CAST(:xids AS xid8[])) AS paid (identity_id, xid)
)
