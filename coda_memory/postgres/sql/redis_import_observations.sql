-- One kind of the identity's observations from Redis (the consumed ones, or the pending
-- ones), written by this transaction; returns their new ids.
INSERT INTO {schema}.observations (
    identity_id,
    type,
    content,
    metadata,
    session_id,
    created_at
)
SELECT :identity_id, o.type, o.content, o.metadata::jsonb, o.session_id, o.created_at
FROM unnest(
    :types::text[],
    :contents::text[],
    :metadata::text[],
    :session_ids::text[],
    :created_ats::timestamptz[]
) AS o(type, content, metadata, session_id, created_at)
RETURNING id
