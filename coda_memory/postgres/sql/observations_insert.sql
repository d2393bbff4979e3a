-- A batch of observations as one JSON array of rows, each
-- [identity_id, type, content, metadata, session_id, created_at (ISO 8601)]:
-- a COPY is refused on a table with row-level security, and one JSON document costs
-- the writer's Python about half what one array per column did (the driver checks
-- every element of an array in Python); the server parses it about as fast.
-- jsonb_array_elements gives the rows in the document's order, so ids follow the batch.
INSERT INTO {schema}.observations
    (identity_id, type, content, metadata, session_id, created_at)
SELECT r ->> 0, r ->> 1, r ->> 2, r -> 3, r ->> 4, (r ->> 5)::timestamptz
FROM jsonb_array_elements(:rows::jsonb) AS batch (r)
