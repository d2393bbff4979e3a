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
    -- instead of aggregating every entity fact. Each one's subject is built here: under
    -- row-level security (the facts are the owner's, who is not a superuser) a condition
    -- that calls a function that is not leakproof, as || is, cannot be an index
    -- condition, so a subject built in the lookup read every entity fact per entity.
    SELECT
        entity_popularity.entity_type,
        entity_popularity.entity_id,
        entity_popularity.users,
        entity_popularity.accesses,
        'entity_frequency:' || entity_popularity.entity_type || ':' || entity_popularity.entity_id
            AS subject
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
    -- The active facts about one top entity, by the (category, subject) index.
    SELECT
        count(*) AS fact_users,
        avg(active_facts.effective_confidence) AS mean_confidence
    FROM {schema}.active_facts
    WHERE active_facts.category = 'entity_frequency' AND active_facts.subject = top.subject
) AS held ON true
ORDER BY top.users DESC, top.accesses DESC, top.entity_type, top.entity_id
