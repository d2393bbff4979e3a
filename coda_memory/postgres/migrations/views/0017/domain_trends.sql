-- As in 0013, and sorted on a count before its first row (migration 0017): a plan that
-- streamed its rows stopped, under a reader's LIMIT, after the n-th row kept, and EXPLAIN
-- ANALYZE's counts then told where the groups the floor left out sort among the names
-- shown, and how many identities they hold. The sort takes every row first.
-- As in 0002, with the k-anonymity floor of analytics_reader_floor (migration 0013).
-- No condition of a reader's reaches the rows before the floor has left some out: the
-- view is a security barrier (no function of the reader's own, and none that may fail on
-- a value, as a division by zero does, runs below it), and its OFFSET 0 keeps even the
-- built-in comparisons out (the planner pushes those below a barrier, and EXPLAIN ANALYZE
-- would then show which values the floor hid, or a failing comparison tell them).
-- Queries and distinct users per UTC day and domain in the window, summed over shards.
CREATE OR REPLACE VIEW {schema}.domain_trends WITH (security_barrier) AS
SELECT
    domain_daily.day,
    domain_daily.domain,
    sum(domain_daily.queries)::bigint AS queries,
    sum(domain_daily.users)::bigint AS users
FROM {schema}.domain_daily
WHERE domain_daily.day BETWEEN (SELECT start_day FROM {schema}.analytics_window)
    AND (SELECT end_day FROM {schema}.analytics_window)
GROUP BY domain_daily.day, domain_daily.domain
-- A day's domain asked about by fewer identities than the floor is left out.
HAVING sum(domain_daily.users)
    >= (SELECT min_users FROM {schema}.analytics_reader_floor)
ORDER BY users DESC, day, domain
OFFSET 0;

COMMENT ON VIEW {schema}.domain_trends IS
    'Queries and distinct users per UTC day and domain in the window (analytics_window, by '
    'default the last 30 days), from the rollup (domain_daily). k-anonymity: for a role '
    'that may not read the facts table (an analyst), a day''s domain asked about by fewer '
    'users than analytics_floor.min_users (default 5) is left out.';
