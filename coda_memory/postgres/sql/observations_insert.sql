-- A batch of observations, one array per column: a COPY is refused on a table with
-- row-level security, and one statement of arrays costs about what the COPY did.
INSERT INTO {schema}.observations
    (identity_id, type, content, metadata, session_id, created_at)
SELECT *
FROM unnest(
    :identity_ids::text[],
    :types::text[],
    :contents::text[],
    :metadata::text[]::jsonb[],
    :session_ids::text[],
    :created_ats::timestamptz[]
)
