-- The oldest owed records no other transaction is folding (SKIP LOCKED), locked until
-- this one commits: each record is folded by one transaction only.
SELECT xid, identity_id, kinds
FROM {schema}.rollup_owed
ORDER BY xid, identity_id
LIMIT :limit
FOR UPDATE SKIP LOCKED
