-- Is anything committed that the stored snapshot did not see? Plus the stored snapshot
-- and the facts, in the same statement and snapshot. No lock is taken.
WITH
-- The identity's stored snapshot (no row: never consolidated).
cp AS (
    SELECT snapshot::pg_snapshot AS s, snapshot
    FROM {schema}.checkpoints
    WHERE identity_id = :identity_id
),
-- Whether an observation waits: none consolidated yet, or one the stored snapshot did
-- not consume (fragments/unconsumed.sql).
pending AS (
    SELECT EXISTS (
        SELECT 1
        FROM {schema}.observations o
        LEFT JOIN cp ON true
        WHERE o.identity_id = :identity_id
            AND (cp.s IS NULL OR {unconsumed(xid=o.xid, snapshot=cp.s)})
    ) AS p
)
SELECT
    pending.p AS pending,
    (SELECT snapshot FROM cp) AS snapshot,
    f.subject,
    f.category,
    f.content,
    f.confidence,
    f.reinforcement_count,
    f.last_reinforced_at,
    f.confidence_at,
    f.created_at,
    f.updated_at,
    f.ease_factor
FROM pending
-- Facts even when observations wait: a late load answers from them, and the locked run
-- reuses them when the checkpoint has not moved since (see the store's docstring).
LEFT JOIN {schema}.facts f
    ON f.identity_id = :identity_id
