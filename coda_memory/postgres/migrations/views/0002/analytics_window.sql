-- The instant and the window every analytics view uses. A view takes no parameters, so
-- they come from two settings that a transaction may set (coda_memory.postgres.analytics
-- does), with defaults: now() and 30 days.
CREATE VIEW {schema}.analytics_window AS
SELECT
    setting.at,
    setting.since,
    timezone('UTC', setting.at - setting.since)::date AS start_day,
    timezone('UTC', setting.at)::date AS end_day
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
) AS setting;

COMMENT ON VIEW {schema}.analytics_window IS
    'The instant and the window the analytics views use: at = now(), since = 30 days, '
    'start_day and end_day the UTC days of at - since and at (both included). A '
    'transaction may move them with SET LOCAL coda_memory.analytics_now = ''<timestamptz>'' '
    'and SET LOCAL coda_memory.analytics_window = ''<interval>'' '
    '(coda_memory.postgres.analytics does).';
