-- analytics_entities.sql for a role that may read the aggregate views but not
-- active_facts (an analyst): the same rows, with the facts about each entity from the
-- view's own columns, which aggregate every entity fact rather than the top entities'
-- only. A mean confidence over fewer than :min_users identities is withheld
-- (k-anonymity).
SELECT
    entity_popularity.entity_type,
    entity_popularity.entity_id,
    entity_popularity.users,
    entity_popularity.accesses,
    entity_popularity.fact_users,
    CASE
        WHEN entity_popularity.fact_users >= :min_users
            THEN entity_popularity.mean_confidence
    END AS mean_confidence
FROM {schema}.entity_popularity
WHERE entity_popularity.users >= :min_users
ORDER BY
    entity_popularity.users DESC,
    entity_popularity.accesses DESC,
    entity_popularity.entity_type,
    entity_popularity.entity_id
LIMIT :limit
