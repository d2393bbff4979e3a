-- As in 0014, and sorted on a count before its first row (migration 0017): a plan that
-- streamed its rows stopped, under a reader's LIMIT, after the n-th row kept, and EXPLAIN
-- ANALYZE's counts then told where the groups the floor left out sort among the names
-- shown, and how many identities they hold. The sort takes every row first.
-- As in 0013, but for a reader the floor binds, a tool not used by as many identities in
-- the window is left out even when as many hold facts about it (migration 0014): kept
-- with its usage at 0 when nobody used it, and left out when a few did, it told on
-- which days those few used it.
-- As in 0012, with the k-anonymity floor of analytics_reader_floor (migration 0013).
-- No condition of a reader's reaches the rows before the floor has left some out: the
-- view is a security barrier (no function of the reader's own, and none that may fail on
-- a value, as a division by zero does, runs below it), and its OFFSET 0 keeps even the
-- built-in comparisons out (the planner pushes those below a barrier, and EXPLAIN ANALYZE
-- would then show which values the floor hid, or a failing comparison tell them).
-- One row per tool used in the window or with an active affinity or avoidance fact.
CREATE OR REPLACE VIEW {schema}.tool_effectiveness WITH (security_barrier) AS
WITH
-- Calls and latest-day users in the window, summed over days and shards.
usage AS (
    SELECT
        tool_daily.tool_name,
        sum(tool_daily.latest_users)::bigint AS users,
        sum(tool_daily.successes)::bigint AS successes,
        sum(tool_daily.failures)::bigint AS failures
    FROM {schema}.tool_daily
    WHERE tool_daily.day BETWEEN (SELECT start_day FROM {schema}.analytics_window)
        AND (SELECT end_day FROM {schema}.analytics_window)
    GROUP BY tool_daily.tool_name
),
-- Active affinity and avoidance facts, one row per tool (subject = category:tool).
opinions AS (
    SELECT
        substr(subjects.subject, length(subjects.category) + 2) AS tool_name,
        -- Each (category, tool) has one row in subjects, so max() just picks it.
        max(subjects.users) FILTER (WHERE subjects.category = 'tool_affinity') AS affinity_users,
        max(subjects.users) FILTER (WHERE subjects.category = 'tool_avoidance') AS avoidance_users,
        max(subjects.confidence) FILTER (WHERE subjects.category = 'tool_affinity') AS affinity,
        max(subjects.confidence) FILTER (WHERE subjects.category = 'tool_avoidance') AS avoidance
    FROM (
        -- Active facts per (category, subject): how many identities, how confident.
        SELECT
            graded.category,
            graded.subject,
            count(*) AS users,
            avg(graded.confidence) AS confidence
        FROM (
            -- Each fact's effective confidence, computed once: aggregating active_facts
            -- would compute it for its filter and again for every aggregate that reads it
            -- (about 0.1 us each, a second over a million facts). OFFSET 0 keeps the
            -- planner from merging this subquery into the query; the ORDER BY is the
            -- index's, so it costs no sort and the aggregates above it stream.
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
            WHERE facts.category IN ('tool_affinity', 'tool_avoidance')
            ORDER BY facts.category, facts.subject
            OFFSET 0
        ) AS graded
        WHERE graded.confidence >= 0.1::double precision
        GROUP BY graded.category, graded.subject
    ) AS subjects
    GROUP BY substr(subjects.subject, length(subjects.category) + 2)
),
-- The p50 and p95 duration buckets of each tool's calls in the window.
percentiles AS (
    SELECT
        running.tool_name,
        min(running.bucket) FILTER (WHERE running.calls >= 0.5 * running.total) AS p50,
        min(running.bucket) FILTER (WHERE running.calls >= 0.95 * running.total) AS p95
    FROM (
        -- Calls up to and including each bucket: a percentile is the first bucket whose
        -- running count reaches its share of the calls.
        SELECT
            histogram.tool_name,
            histogram.bucket,
            sum(histogram.calls) OVER (
                PARTITION BY histogram.tool_name ORDER BY histogram.bucket
            ) AS calls,
            sum(histogram.calls) OVER (PARTITION BY histogram.tool_name) AS total
        FROM (
            -- The window's duration histogram per tool, merged over days and shards.
            SELECT
                tool_durations.tool_name,
                tool_durations.bucket,
                sum(tool_durations.calls) AS calls
            FROM {schema}.tool_durations
            WHERE tool_durations.day BETWEEN (SELECT start_day FROM {schema}.analytics_window)
                AND (SELECT end_day FROM {schema}.analytics_window)
            GROUP BY tool_durations.tool_name, tool_durations.bucket
        ) AS histogram
    ) AS running
    GROUP BY running.tool_name
)
SELECT
    coalesce(usage.tool_name, opinions.tool_name) AS tool_name,
    coalesce(usage.users, 0) AS users,
    coalesce(usage.successes, 0) AS successes,
    coalesce(usage.failures, 0) AS failures,
    coalesce(usage.successes, 0)::double precision
        / nullif(coalesce(usage.successes, 0) + coalesce(usage.failures, 0), 0)::double precision
        AS success_rate,
    -- A bucket stands for its geometric middle (4 buckets per doubling; 0.5 ms below 1 ms).
    CASE
        WHEN percentiles.p50 = 0 THEN 0.5::double precision
        ELSE power(
            2::double precision,
            (percentiles.p50::double precision - 0.5::double precision) / 4::double precision
        )
    END AS p50_duration_ms,
    CASE
        WHEN percentiles.p95 = 0 THEN 0.5::double precision
        ELSE power(
            2::double precision,
            (percentiles.p95::double precision - 0.5::double precision) / 4::double precision
        )
    END AS p95_duration_ms,
    -- A count of fewer identities than the floor is withheld (NULL; none stays 0), and
    -- so is the mean over them.
    CASE
        WHEN opinions.affinity_users IS NULL THEN 0
        WHEN opinions.affinity_users >= reader.min_users THEN opinions.affinity_users
    END AS affinity_users,
    CASE
        WHEN opinions.avoidance_users IS NULL THEN 0
        WHEN opinions.avoidance_users >= reader.min_users THEN opinions.avoidance_users
    END AS avoidance_users,
    -- Means rounded to 2 places for a reader the floor binds (above 1): the exact means
    -- of two days, one fact apart, would give that one fact's confidence.
    CASE
        WHEN opinions.affinity_users < reader.min_users THEN NULL
        WHEN reader.min_users > 1 THEN round(opinions.affinity::numeric, 2)::double precision
        ELSE opinions.affinity
    END AS mean_affinity_confidence,
    CASE
        WHEN opinions.avoidance_users < reader.min_users THEN NULL
        WHEN reader.min_users > 1 THEN round(opinions.avoidance::numeric, 2)::double precision
        ELSE opinions.avoidance
    END AS mean_avoidance_confidence
FROM usage
FULL JOIN opinions ON usage.tool_name = opinions.tool_name
LEFT JOIN percentiles ON percentiles.tool_name = coalesce(usage.tool_name, opinions.tool_name)
CROSS JOIN {schema}.analytics_reader_floor AS reader
-- A tool used by fewer identities than the floor in the window is left out, used by a
-- few or by none alike. For a reader the floor does not bind, a tool not used in the
-- window at all stays if facts are about it.
WHERE coalesce(usage.users, 0) >= reader.min_users
    OR (
        reader.min_users <= 1
        AND usage.tool_name IS NULL
        AND greatest(opinions.affinity_users, opinions.avoidance_users) >= 1
    )
ORDER BY users DESC, tool_name
OFFSET 0;

COMMENT ON VIEW {schema}.tool_effectiveness IS
    'One row per tool used in the window (analytics_window, by default the last 30 days) '
    'or with an active affinity or avoidance fact. Usage comes from the rollup (tool_daily, '
    'tool_durations), which outlives raw observations: users = identities whose latest '
    'call falls in the window (the distinct users of a window ending today); success_rate '
    '= successes / calls; p50 and p95 durations are nearest-rank percentiles over calls '
    'with a durationMs, reported as the geometric middle of their log-scale bucket (four '
    'per doubling: within 9.1 %; 0.5 ms below 1 ms). affinity/avoidance columns: active '
    'facts now (active_facts), one per identity. k-anonymity: for a role that may not read '
    'the facts table (an analyst), a tool with fewer users than analytics_floor.min_users '
    '(default 5) is left out (for other roles, one not used in the window stays if facts '
    'are about it), a count of fewer identities (affinity_users, avoidance_users) and the '
    'mean over them are NULL, means are rounded to 2 places, and facts are as at the start '
    'of the UTC day (analytics_window.at); filter on users for a higher threshold.';
