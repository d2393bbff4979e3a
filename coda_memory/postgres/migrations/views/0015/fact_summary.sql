-- As in 0014, but for a reader the floor binds, only the facts of a subject held by as
-- many identities as the floor are counted (migration 0015): the views that show one
-- subject's count (tool_effectiveness's avoidance_users and affinity_users,
-- entity_popularity's fact_users) withhold a smaller one, and a category's facts less the
-- counts they show gave it back ("exactly one identity avoids this tool"). What a reader
-- can now subtract is made of subjects that could be shown.
-- As in 0013, but a histogram with a bucket of fewer facts than the floor is withheld
-- whole (migration 0014): facts less the buckets shown gave the withheld ones back, so
-- one withheld bucket's count (one user's fact, in its tenth of the scale) could be read
-- off the row; and withholding more buckets is not enough (two withheld under a floor of
-- 2, or five under 5 that hold five facts in all, hold one each).
-- As in 0012, with the k-anonymity floor of analytics_reader_floor (migration 0013).
-- No condition of a reader's reaches the rows before the floor has left some out: the
-- view is a security barrier (no function of the reader's own, and none that may fail on
-- a value, as a division by zero does, runs below it), and its OFFSET 0 keeps even the
-- built-in comparisons out (the planner pushes those below a barrier, and EXPLAIN ANALYZE
-- would then show which values the floor hid, or a failing comparison tell them).
-- Active facts per category: how many, held by how many identities, how confident.
CREATE OR REPLACE VIEW {schema}.fact_summary WITH (security_barrier) AS
-- Each active fact's effective confidence, computed once per branch that reads it (not
-- materialized: only one of the two branches below runs, and the other reads nothing).
WITH graded AS NOT MATERIALIZED (
    SELECT decayed.category, decayed.subject, decayed.identity_id, decayed.confidence
    FROM (
        -- Aggregating active_facts would compute the confidence for its filter and again
        -- for every aggregate that reads it. OFFSET 0 keeps the planner from merging this
        -- subquery into the query. In (category, identity_id) order, the index's: one
        -- pass, and the distinct count needs no sort.
        SELECT
            facts.category,
            facts.subject,
            facts.identity_id,
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
        ORDER BY facts.category, facts.identity_id
        OFFSET 0
    ) AS decayed
    WHERE decayed.confidence >= 0.1::double precision
),
-- The facts counted, by one of two branches; a one-time filter ends the other before it
-- reads a row. For a reader the floor does not bind (0: the owner, an app role), every
-- active fact, as before 0015 (from the index alone: no subject is read). For a reader it
-- binds, only the facts of a subject held by at least the floor's number of identities
-- (one fact per identity and subject, so a subject's facts are its holders). Each branch
-- keeps the order above, so the aggregate below needs no sort.
counted AS NOT MATERIALIZED (
    SELECT every.category, every.identity_id, every.confidence
    FROM (
        SELECT graded.category, graded.identity_id, graded.confidence
        FROM graded
        WHERE (SELECT reader.min_users FROM {schema}.analytics_reader_floor AS reader) <= 1
        ORDER BY graded.category, graded.identity_id
    ) AS every
    UNION ALL
    SELECT held.category, held.identity_id, held.confidence
    FROM (
        SELECT graded.category, graded.identity_id, graded.confidence
        FROM graded
        JOIN (
            SELECT graded.category, graded.subject
            FROM graded
            GROUP BY graded.category, graded.subject
            HAVING count(*) >= (
                SELECT reader.min_users FROM {schema}.analytics_reader_floor AS reader
            )
        ) AS subjects
            ON subjects.category = graded.category AND subjects.subject = graded.subject
        WHERE (SELECT reader.min_users FROM {schema}.analytics_reader_floor AS reader) > 1
        ORDER BY graded.category, graded.identity_id
    ) AS held
)
SELECT
    summary.category,
    summary.facts,
    summary.users,
    -- Rounded to 2 places for a reader the floor binds (above 1): the exact means of two
    -- days, one fact apart, would give that one fact's confidence, and so its instant.
    CASE
        WHEN reader.min_users > 1
            THEN round(summary.mean_confidence::numeric, 2)::double precision
        ELSE summary.mean_confidence
    END AS mean_confidence,
    -- A histogram with a bucket of fewer facts than the floor (none is not fewer) is
    -- withheld whole, every bucket NULL: watching a bucket of one from day to day traces
    -- one user's fact, and the row's facts less the buckets shown would give it back.
    ARRAY(
        SELECT CASE WHEN small.buckets = 0 THEN bucket.facts END
        FROM unnest(summary.histogram) WITH ORDINALITY AS bucket (facts, position)
        ORDER BY bucket.position
    ) AS histogram
FROM (
    SELECT
        counted.category,
        count(*) AS facts,
        count(DISTINCT counted.identity_id) AS users,
        avg(counted.confidence) AS mean_confidence,
        -- Effective confidences in 10 buckets [i/10, (i+1)/10), the last one including 1.0.
        ARRAY[
            count(*) FILTER (WHERE counted.confidence >= 0.0 AND counted.confidence < 0.1),
            count(*) FILTER (WHERE counted.confidence >= 0.1 AND counted.confidence < 0.2),
            count(*) FILTER (WHERE counted.confidence >= 0.2 AND counted.confidence < 0.3),
            count(*) FILTER (WHERE counted.confidence >= 0.3 AND counted.confidence < 0.4),
            count(*) FILTER (WHERE counted.confidence >= 0.4 AND counted.confidence < 0.5),
            count(*) FILTER (WHERE counted.confidence >= 0.5 AND counted.confidence < 0.6),
            count(*) FILTER (WHERE counted.confidence >= 0.6 AND counted.confidence < 0.7),
            count(*) FILTER (WHERE counted.confidence >= 0.7 AND counted.confidence < 0.8),
            count(*) FILTER (WHERE counted.confidence >= 0.8 AND counted.confidence < 0.9),
            count(*) FILTER (WHERE counted.confidence >= 0.9)
        ] AS histogram
    FROM counted
    GROUP BY counted.category
) AS summary
CROSS JOIN {schema}.analytics_reader_floor AS reader
-- The buckets of fewer facts than the floor (none is not fewer).
CROSS JOIN LATERAL (
    SELECT count(*) AS buckets
    FROM unnest(summary.histogram) AS held (facts)
    WHERE held.facts > 0 AND held.facts < reader.min_users
) AS small
-- A category held by fewer identities than the floor is left out.
WHERE summary.users >= reader.min_users
OFFSET 0;

COMMENT ON VIEW {schema}.fact_summary IS
    'Active facts (active_facts) per category: facts, users (distinct identities), '
    'mean effective confidence and a histogram of it in 10 buckets [0, 0.1) ... [0.9, 1] '
    '(the first is empty: facts below 0.1 are expired). k-anonymity: for a role that may '
    'not read the facts table (an analyst), only the facts of a subject held by at least '
    'analytics_floor.min_users (default 5) users count, a category held by fewer users '
    'than that is left out, a histogram with a bucket of 1 to '
    'min_users - 1 facts is NULL whole, the mean is rounded to 2 places, and facts are as '
    'at the start of the UTC day (analytics_window.at).';
