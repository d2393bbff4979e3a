-- As in 0002, with the decay's exponent capped (migration 0012).
-- Facts still active at the window's instant, with their effective confidence, decayed
-- as the default ExponentialDecay and AdaptiveDecay do:
-- confidence * 0.95 ^ (days since confidence_at / coalesce(ease_factor, 1)) >= 0.1.
-- The instant is a scalar subquery: the planner computes it once (an InitPlan) instead of
-- parsing the settings again for every row.
CREATE OR REPLACE VIEW {schema}.active_facts AS
SELECT
    facts.identity_id,
    facts.subject,
    facts.category,
    facts.content,
    facts.confidence,
    facts.reinforcement_count,
    facts.last_reinforced_at,
    facts.confidence_at,
    facts.created_at,
    facts.updated_at,
    facts.ease_factor,
    facts.confidence * power(
        0.95::double precision,
        -- Capped: 0.95 ^ 10000 is about 1e-223, far below any threshold, where
        -- a larger exponent leaves the floats and power() fails ("underflow"). An
        -- ease below 1e-300 divides as 1e-300, where the division would overflow.
        least(
            greatest(
                0::double precision,
                date_part('epoch', (SELECT at FROM {schema}.analytics_window) - facts.confidence_at)
                    / 86400::double precision
            ) / greatest(
                coalesce(facts.ease_factor, 1::double precision), 1e-300::double precision
            ),
            10000::double precision
        )
    ) AS effective_confidence
FROM {schema}.facts
WHERE facts.confidence * power(
        0.95::double precision,
        -- Capped: 0.95 ^ 10000 is about 1e-223, far below any threshold, where
        -- a larger exponent leaves the floats and power() fails ("underflow"). An
        -- ease below 1e-300 divides as 1e-300, where the division would overflow.
        least(
            greatest(
                0::double precision,
                date_part('epoch', (SELECT at FROM {schema}.analytics_window) - facts.confidence_at)
                    / 86400::double precision
            ) / greatest(
                coalesce(facts.ease_factor, 1::double precision), 1e-300::double precision
            ),
            10000::double precision
        )
    ) >= 0.1::double precision;

COMMENT ON VIEW {schema}.active_facts IS
    'Facts whose confidence at analytics_window.at is at least 0.1, with that '
    'effective_confidence = confidence * 0.95 ^ (days since confidence_at / '
    'coalesce(ease_factor, 1)): the default ExponentialDecay and AdaptiveDecay. A service '
    'configured with another base or threshold decays differently; that is not reflected.';
