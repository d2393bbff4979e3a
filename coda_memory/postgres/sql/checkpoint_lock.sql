-- Lock the identity's checkpoint row until the transaction ends: consolidations, the cap
-- applied on the server and forget of one identity are serialised on it. No row: the caller creates it first.
-- The version tells whether facts known beforehand are still those stored; the instant
-- of the last consolidation, whether an observation arrived after it late.
SELECT
    snapshot,
    {checkpoint_version(snapshot=snapshot, xmin=xmin)} AS version,
    consolidated_at
FROM {schema}.checkpoints
WHERE identity_id = :identity_id
FOR UPDATE
