-- The earlier reinforcing events of the sessions in this run, in the order written:
-- a session reinforces a fact at most once.
SELECT
    subject,
    category,
    kind,
    session_id,
    at,
    confidence_before,
    confidence_after,
    count_before,
    count_after,
    ease_before,
    ease_after,
    quality,
    hits,
    trials
FROM {schema}.fact_events
WHERE identity_id = :identity_id
    AND session_id = ANY(:session_ids::text[])
    AND kind IN ('created', 'reinforced', 'extended')
ORDER BY id
