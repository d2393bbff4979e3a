-- The one "pending observation" predicate: true for an observation whose transaction
-- {xid} the consolidation snapshot {snapshot} did not see, so no committed consolidation
-- consumed it (the docstring of coda_memory.postgres.store argues why). Every transaction
-- below the snapshot's xmin is visible in it, which bounds the range scan of the
-- observations' (identity_id, xid) index. An identity with no snapshot yet has consumed
-- nothing: the statements that include this say so on their own.
{xid} >= pg_snapshot_xmin({snapshot})
AND NOT pg_visible_in_snapshot({xid}, {snapshot})
