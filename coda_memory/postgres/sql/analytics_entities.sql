-- The :limit entities accessed by the most identities in the window (then by accesses),
-- among those accessed by at least :min_users, with the active facts about them; a mean
-- confidence over fewer than :min_users identities is withheld (k-anonymity).
SELECT
    top.entity_type,
    top.entity_id,
    top.users,
    top.accesses,
    held.fact_users,
    CASE WHEN held.fact_users >= :min_users THEN held.mean_confidence END AS mean_confidence
FROM (
    -- The top entities first, from the view's usage columns alone (the planner then
    -- leaves its fact aggregation out), and their facts afterwards: :limit index lookups
    -- instead of aggregating every entity fact.
    SELECT
        entity_popularity.entity_type,
        entity_popularity.entity_id,
        entity_popularity.users,
        entity_popularity.accesses
    FROM {schema}.entity_popularity
    WHERE entity_popularity.users >= :min_users
    ORDER BY
        entity_popularity.users DESC,
        entity_popularity.accesses DESC,
        entity_popularity.entity_type,
        entity_popularity.entity_id
    LIMIT :limit
) AS top
JOIN LATERAL (
    -- The active facts about one top entity.
    SELECT
        count(*) AS fact_users,
        avg(active_facts.effective_confidence) AS mean_confidence
    FROM {schema}.active_facts
    WHERE active_facts.category = 'entity_frequency'
        AND active_facts.subject = 'entity_frequency:' || top.entity_type || ':' || top.entity_id
) AS held ON true
ORDER BY top.users DESC, top.accesses DESC, top.entity_type, top.entity_id
