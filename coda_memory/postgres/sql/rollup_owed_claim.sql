-- The oldest owed records no other transaction is folding (SKIP LOCKED), locked until
-- this one commits: each record is folded by one transaction only. With :identity_id,
-- that identity's records only (a forget folds them before it deletes the rows they
-- count); NULL takes every identity's.
SELECT xid, identity_id, kinds
FROM {schema}.rollup_owed
WHERE CAST(:identity_id AS text) IS NULL OR identity_id = CAST(:identity_id AS text)
ORDER BY xid, identity_id
LIMIT :limit
FOR UPDATE SKIP LOCKED
