-- As in 0002, with the k-anonymity floor of analytics_reader_floor (migration 0013).
-- A security barrier: no function in a reader's WHERE clause (its own, or one that fails
-- on a value, as a division by zero does) runs before the floor has left rows out, so none
-- sees a hidden row (leakproof operators, such as comparisons, still reach the indexes).
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
    >= (SELECT min_users FROM {schema}.analytics_reader_floor);

COMMENT ON VIEW {schema}.domain_trends IS
    'Queries and distinct users per UTC day and domain in the window (analytics_window, by '
    'default the last 30 days), from the rollup (domain_daily). k-anonymity: for a role '
    'that may not read the facts table (an analyst), a day''s domain asked about by fewer '
    'users than analytics_floor.min_users (default 5) is left out.';
