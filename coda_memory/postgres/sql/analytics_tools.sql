-- Tools used by at least :min_users identities in the window, most used first; a mean
-- confidence over fewer than :min_users identities is withheld (k-anonymity).
SELECT
    tool_name,
    users,
    successes,
    failures,
    success_rate,
    p50_duration_ms,
    p95_duration_ms,
    affinity_users,
    avoidance_users,
    CASE WHEN affinity_users >= :min_users THEN mean_affinity_confidence END
        AS mean_affinity_confidence,
    CASE WHEN avoidance_users >= :min_users THEN mean_avoidance_confidence END
        AS mean_avoidance_confidence
FROM {schema}.tool_effectiveness
WHERE users >= :min_users
ORDER BY users DESC, tool_name
