-- Lock the identity's checkpoint row until the transaction ends: consolidations and
-- forget of one identity are serialised on it. No row: the caller creates it first.
SELECT snapshot
FROM {schema}.checkpoints
WHERE identity_id = :identity_id
FOR UPDATE
