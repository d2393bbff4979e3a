-- Is anything committed that the stored snapshot did not see? Plus the version of the
-- identity's facts and, unless the caller already knows that version or the identity has
-- more than :read_limit facts, the facts, in the same statement and snapshot. No lock is
-- taken.
WITH
-- The identity's stored snapshot and facts' version (no row: never consolidated).
cp AS (
    SELECT
        snapshot::pg_snapshot AS s,
        {checkpoint_version(snapshot=snapshot, xmin=xmin)} AS version
    FROM {schema}.checkpoints
    WHERE identity_id = :identity_id
),
-- Whether an observation waits: any at all when nothing was consolidated yet, else one
-- the stored snapshot did not consume (fragments/unconsumed.sql). Two branches, not one
-- predicate with OR: the snapshot then reaches the (identity_id, xid) index as a bound,
-- and the check reads the unconsumed tail instead of the identity's whole history.
pending AS (
    SELECT CASE
        WHEN (SELECT s FROM cp) IS NULL THEN EXISTS (
            SELECT 1
            FROM {schema}.observations o
            WHERE o.identity_id = :identity_id
        )
        ELSE EXISTS (
            SELECT 1
            FROM cp
            JOIN {schema}.observations o
                ON o.identity_id = :identity_id
                AND {unconsumed(xid=o.xid, snapshot=cp.s)}
        )
    END AS p
),
-- Whether the facts, to be read, are more than the caller reads before it applies its cap
-- (coda_memory.core.caps.FactCap; no limit when NULL): then none are sent. Counted up to
-- one past the limit only, and only when the facts are to be read.
over AS (
    SELECT CASE
        WHEN CAST(:read_limit AS bigint) IS NULL
            OR (SELECT version FROM cp) IS NOT DISTINCT FROM CAST(:known_version AS text)
            THEN false
        ELSE (
            SELECT count(*)
            FROM (
                SELECT 1
                FROM {schema}.facts
                WHERE identity_id = :identity_id
                LIMIT CAST(:read_limit AS bigint) + 1
            ) AS counted
        ) > CAST(:read_limit AS bigint)
    END AS o
)
SELECT
    pending.p AS pending,
    over.o AS over,
    (SELECT version FROM cp) AS version,
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
CROSS JOIN over
-- Facts even when observations wait: a late load answers from them, and the locked run
-- reuses them when the checkpoint has not moved since (see the store's docstring). None
-- when the caller knows this version's facts already (coda_memory.postgres.known), or
-- when they are over the limit. Those two conditions are in the subquery's WHERE, not
-- in the join's ON, and OFFSET 0 keeps the planner from pulling the subquery up into the
-- join: so they gate the scan (a one-time filter, evaluated before it), where as a join
-- filter the scan would run and its rows be thrown away after.
LEFT JOIN (
    SELECT *
    FROM {schema}.facts
    WHERE identity_id = :identity_id
        AND (SELECT version FROM cp) IS DISTINCT FROM CAST(:known_version AS text)
        AND NOT (SELECT o FROM over)
    OFFSET 0
) AS f ON true
