-- As in 0013, and sorted on a count before its first row (migration 0017): a plan that
-- streamed its rows stopped, under a reader's LIMIT, after the n-th row kept, and EXPLAIN
-- ANALYZE's counts then told where the groups the floor left out sort among the names
-- shown, and how many identities they hold. The sort takes every row first.
-- As in 0012, with the k-anonymity floor of analytics_reader_floor (migration 0013).
-- No condition of a reader's reaches the rows before the floor has left some out: the
-- view is a security barrier (no function of the reader's own, and none that may fail on
-- a value, as a division by zero does, runs below it), and its OFFSET 0 keeps even the
-- built-in comparisons out (the planner pushes those below a barrier, and EXPLAIN ANALYZE
-- would then show which values the floor hid, or a failing comparison tell them).
-- Entities accessed in the window, with the active facts about them.
CREATE OR REPLACE VIEW {schema}.entity_popularity WITH (security_barrier) AS
WITH
-- Accesses and latest-day users in the window, per entity.
usage AS (
    SELECT
        entity_daily.entity_type,
        entity_daily.entity_id,
        sum(entity_daily.latest_users)::bigint AS users,
        sum(entity_daily.accesses)::bigint AS accesses
    FROM {schema}.entity_daily
    WHERE entity_daily.day BETWEEN (SELECT start_day FROM {schema}.analytics_window)
        AND (SELECT end_day FROM {schema}.analytics_window)
    GROUP BY entity_daily.entity_type, entity_daily.entity_id
),
-- Active entity facts per subject (entity_frequency:type:id).
opinions AS (
    SELECT
        graded.subject,
        count(*) AS fact_users,
        avg(graded.confidence) AS mean_confidence
    FROM (
        -- Each fact's effective confidence, computed once: aggregating active_facts would
        -- compute it for its filter and again for every aggregate that reads it. OFFSET 0
        -- keeps the planner from merging this subquery into the query; the ORDER BY is
        -- the index's, so it costs no sort and the aggregates above it stream.
        SELECT
            facts.category,
            facts.subject,
            facts.confidence * power(
                0.95::double precision,
                -- Capped: 0.95 ^ 10000 is about 1e-223, far below any threshold, where
                -- a larger exponent leaves the floats and power() fails ("underflow"). An
                -- ease below 1e-300 divides as 1e-300, where the division would overflow.
                least(
                    greatest(
                        0::double precision,
                        date_part(
                            'epoch',
                            (SELECT at FROM {schema}.analytics_window) - facts.confidence_at
                        ) / 86400::double precision
                    ) / greatest(
                        coalesce(facts.ease_factor, 1::double precision), 1e-300::double precision
                    ),
                    10000::double precision
                )
            ) AS confidence
        FROM {schema}.facts
        WHERE facts.category = 'entity_frequency'
        ORDER BY facts.category, facts.subject
        OFFSET 0
    ) AS graded
    WHERE graded.confidence >= 0.1::double precision
    GROUP BY graded.subject
)
SELECT
    usage.entity_type,
    usage.entity_id,
    usage.users,
    usage.accesses,
    -- A count of fewer identities than the floor is withheld (NULL; none stays 0), and
    -- so is the mean over them.
    CASE
        WHEN opinions.fact_users IS NULL THEN 0
        WHEN opinions.fact_users >= reader.min_users THEN opinions.fact_users
    END AS fact_users,
    -- Rounded to 2 places for a reader the floor binds (above 1): the exact means of two
    -- days, one fact apart, would give that one fact's confidence.
    CASE
        WHEN opinions.fact_users < reader.min_users THEN NULL
        WHEN reader.min_users > 1
            THEN round(opinions.mean_confidence::numeric, 2)::double precision
        ELSE opinions.mean_confidence
    END AS mean_confidence
FROM usage
LEFT JOIN opinions
    ON opinions.subject = 'entity_frequency:' || usage.entity_type || ':' || usage.entity_id
CROSS JOIN {schema}.analytics_reader_floor AS reader
-- An entity accessed by fewer identities than the floor is left out.
WHERE usage.users >= reader.min_users
ORDER BY users DESC, entity_type, entity_id
OFFSET 0;

COMMENT ON VIEW {schema}.entity_popularity IS
    'Entities accessed in the window (analytics_window, by default the last 30 days), from '
    'the rollup (entity_daily): users = identities whose latest access falls in the window, '
    'accesses = accesses in it; fact_users and mean_confidence: active entity_frequency '
    'facts (active_facts). k-anonymity: for a role that may not read the facts table (an '
    'analyst), an entity with fewer users than analytics_floor.min_users (default 5) is '
    'left out, a count of fewer identities (fact_users) and the mean over them are NULL, '
    'means are rounded to 2 places, and facts are as at the start of the UTC day '
    '(analytics_window.at).';
