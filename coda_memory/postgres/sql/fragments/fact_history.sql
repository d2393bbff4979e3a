-- A consolidation's history: the events of the JSON document {events}, one row each
-- (coda_memory.postgres.documents.event_row: subject, category, kind, session_id, at,
-- confidence_before, confidence_after, count_before, count_after, ease_before,
-- ease_after, quality, hits, trials), recorded at :now for :identity_id, in the
-- document's order (ids follow ORDER BY ord). Written once for the write of a plan and
-- for the slices a backlog's history goes ahead in.
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
FROM jsonb_array_elements({events}::jsonb) WITH ORDINALITY AS e (r, ord)
ORDER BY e.ord
