-- The records of one owed transaction whose rollup was just folded, in the same
-- (sub)transaction as the folding.
DELETE FROM {schema}.rollup_owed
WHERE xid = CAST(:xid AS xid8)
    AND identity_id = ANY(CAST(:identities AS text[]))
