-- Queries and distinct users per UTC day and domain in the window, summed over shards.
CREATE VIEW {schema}.domain_trends AS
SELECT
    domain_daily.day,
    domain_daily.domain,
    sum(domain_daily.queries)::bigint AS queries,
    sum(domain_daily.users)::bigint AS users
FROM {schema}.domain_daily
WHERE domain_daily.day BETWEEN (SELECT start_day FROM {schema}.analytics_window)
    AND (SELECT end_day FROM {schema}.analytics_window)
GROUP BY domain_daily.day, domain_daily.domain;

COMMENT ON VIEW {schema}.domain_trends IS
    'Queries and distinct users per UTC day and domain in the window (analytics_window, by '
    'default the last 30 days), from the rollup (domain_daily). No k-anonymity threshold: '
    'filter on users.';
