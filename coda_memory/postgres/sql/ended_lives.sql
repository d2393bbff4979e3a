-- The last life of each fact given (by subject) that a consolidation deleted on its
-- expiry: a late observation, dated from before that expiry, resumes it. Asked only for
-- subjects with no stored fact that observations dated before the last consolidation
-- reach (core.consolidation.lives_asked), so most runs never send it.
WITH latest AS (
    -- Each subject's latest event (the index on identity_id, subject, id): an expiry
    -- when its fact was deleted, and nothing reinforced it since.
    SELECT DISTINCT ON (subject) id, subject, kind
    FROM {schema}.fact_events
    WHERE identity_id = :identity_id
        AND subject = ANY(:subjects::text[])
    ORDER BY subject, id DESC
)
SELECT
    life.subject,
    life.category,
    life.kind,
    life.session_id,
    life.at,
    life.confidence_before,
    life.confidence_after,
    life.count_before,
    life.count_after,
    life.ease_before,
    life.ease_after,
    life.quality,
    life.hits,
    life.trials
FROM latest
CROSS JOIN LATERAL (
    -- That expiry, and the reinforcing event before it: the state the life ended in.
    (
        SELECT events.*
        FROM {schema}.fact_events AS events
        WHERE events.identity_id = :identity_id
            AND events.subject = latest.subject
            AND events.id < latest.id
            AND events.kind IN ('created', 'reinforced', 'extended')
        ORDER BY events.id DESC
        LIMIT 1
    )
    UNION ALL
    SELECT events.*
    FROM {schema}.fact_events AS events
    WHERE events.id = latest.id
) AS life
WHERE latest.kind = 'expired'
