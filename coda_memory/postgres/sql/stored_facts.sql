-- The identity's facts in stored form (confidence at confidence_at).
SELECT
    subject,
    category,
    content,
    confidence,
    reinforcement_count,
    last_reinforced_at,
    confidence_at,
    created_at,
    updated_at,
    ease_factor
FROM {schema}.facts
WHERE identity_id = :identity_id
