-- An analyst reads the aggregate views only: none has an identity_id column, and every
-- row counts users. No table and no per-identity view (active_facts) is granted.
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT SELECT
    ON {schema}.analytics_window, {schema}.tool_effectiveness, {schema}.entity_popularity,
        {schema}.domain_trends, {schema}.fact_summary
    TO {role};
