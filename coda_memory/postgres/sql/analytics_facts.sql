-- Active facts per category; a category held by fewer than :min_users identities is left
-- out (k-anonymity).
SELECT
    category,
    facts,
    users,
    mean_confidence,
    histogram
FROM {schema}.fact_summary
WHERE users >= :min_users
ORDER BY category
