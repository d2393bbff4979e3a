-- Queries per UTC day and domain in the window; a day's domain asked about by fewer than
-- :min_users identities is left out (k-anonymity).
SELECT
    day,
    domain,
    queries,
    users
FROM {schema}.domain_trends
WHERE users >= :min_users
ORDER BY day, domain
