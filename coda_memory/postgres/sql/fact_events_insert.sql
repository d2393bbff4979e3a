-- The history of a consolidation whose events are too many for one statement, sent
-- ahead of its write in slices (coda_memory.postgres.unit.EVENTS_SLICE), in the plan's
-- order: the backlog of an identity that wrote 100,000 observations with no load made
-- 100,000 events, and their one INSERT ran past the request pool's statement_timeout at
-- every try, so the identity was never consolidated. Each row as in
-- consolidation_write.sql's recorded (ids follow ORDER BY ord, the document's order).
INSERT INTO {schema}.fact_events (
    identity_id,
    recorded_at,
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
)
SELECT
    :identity_id,
    :now,
    e.r ->> 0,
    e.r ->> 1,
    e.r ->> 2,
    e.r ->> 3,
    (e.r ->> 4)::timestamptz,
    (e.r ->> 5)::float8,
    (e.r ->> 6)::float8,
    (e.r ->> 7)::int,
    (e.r ->> 8)::int,
    (e.r ->> 9)::float8,
    (e.r ->> 10)::float8,
    (e.r ->> 11)::float8,
    (e.r ->> 12)::int,
    (e.r ->> 13)::int
FROM jsonb_array_elements(:events::jsonb) WITH ORDINALITY AS e (r, ord)
ORDER BY e.ord
