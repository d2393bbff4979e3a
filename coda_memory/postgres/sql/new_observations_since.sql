-- The identity's observations that this run consumes: visible in the run's snapshot and
-- not in the stored one. The first row carries the snapshot (also when there is no
-- observation: LEFT JOIN).
WITH
-- The statement's own snapshot: taken after the row lock was granted (the lock was a
-- statement of its own), and the same one this statement reads rows with.
snap AS (
    SELECT pg_current_snapshot() AS s
)
SELECT
    snap.s::text AS snapshot,
    o.id,
    o.type,
    o.content,
    o.metadata::text AS metadata,
    o.session_id,
    o.created_at,
    -- Whether the session reinforced a fact in an earlier run: only such sessions need
    -- their earlier events read (a round trip saved for a new session).
    EXISTS (
        SELECT 1
        FROM {schema}.fact_events e
        WHERE e.identity_id = :identity_id
            AND e.session_id = o.session_id
            AND e.kind IN ('created', 'reinforced', 'extended')
    ) AS session_seen
FROM snap
LEFT JOIN {schema}.observations o
    ON o.identity_id = :identity_id
    AND o.xid < pg_snapshot_xmax(snap.s)
    AND pg_visible_in_snapshot(o.xid, snap.s)
    -- Not consumed by the stored snapshot (fragments/unconsumed.sql).
    AND {unconsumed(xid=o.xid, snapshot=:stored_snapshot::text::pg_snapshot)}
ORDER BY o.id
