-- Mark observations as consumed: transaction id 3 precedes every snapshot's xmin, so it
-- is visible in every checkpoint snapshot (the cursor of store.py treats it as read).
UPDATE {schema}.observations
SET xid = '3'
WHERE identity_id = :identity_id
    AND id = ANY(:ids::bigint[])
