-- As in 0002, with the instant of a reader bound by the k-anonymity floor
-- (analytics_reader_floor, migration 0013) moved back to the start of its UTC day.
-- The instant and the window every analytics view uses. A view takes no parameters, so
-- they come from two settings that a transaction may set (coda_memory.postgres.analytics
-- does), with defaults: now() and 30 days. The fact columns decay facts to the instant:
-- stepping it by microseconds, a reader would find the instant one user's fact expires
-- (where a count turns NULL under the floor); whole days give the day only, as the usage
-- columns do (the floored views round their means for the same reason). A role the
-- floor does not bind (the owner), or a floor of 1 (which hides nothing), keeps the
-- instant as set.
CREATE OR REPLACE VIEW {schema}.analytics_window AS
SELECT
    setting.at,
    setting.since,
    -- In UTC (a session's time zone, across a change of daylight saving time, made the
    -- window a day longer or shorter).
    (timezone('UTC', setting.at) - setting.since)::date AS start_day,
    timezone('UTC', setting.at)::date AS end_day
FROM (
    SELECT
        CASE
            WHEN (SELECT min_users FROM {schema}.analytics_reader_floor) > 1
                THEN timezone('UTC', date_trunc('day', timezone('UTC', chosen.at)))
            ELSE chosen.at
        END AS at,
        chosen.since
    FROM (
        SELECT
            coalesce(
                nullif(current_setting('coda_memory.analytics_now', true), '')::timestamptz,
                now()
            ) AS at,
            coalesce(
                nullif(current_setting('coda_memory.analytics_window', true), '')::interval,
                '30 days'::interval
            ) AS since
    ) AS chosen
) AS setting;

COMMENT ON VIEW {schema}.analytics_window IS
    'The instant and the window the analytics views use: at = now(), since = 30 days, '
    'start_day and end_day the UTC days of at - since and at (both included). A '
    'transaction may move them with SET LOCAL coda_memory.analytics_now = ''<timestamptz>'' '
    'and SET LOCAL coda_memory.analytics_window = ''<interval>'' '
    '(coda_memory.postgres.analytics does). For a role bound by a k-anonymity floor above 1 '
    '(an analyst), at is the start of its UTC day.';
