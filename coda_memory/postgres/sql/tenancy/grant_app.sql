-- The role the service runs as: it reads and writes one identity at a time (row-level
-- security, the tenant policy), and its writer inserts observations and rollup rows of
-- any identity (the writer policies). No view: the per-identity ones show every tenant.
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT SELECT, INSERT, DELETE ON {schema}.observations, {schema}.fact_events TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE
    ON {schema}.facts, {schema}.checkpoints,
        {schema}.tool_users, {schema}.entity_users, {schema}.domain_users
    TO {role};
GRANT SELECT, INSERT, UPDATE
    ON {schema}.tool_daily, {schema}.tool_durations, {schema}.entity_daily,
        {schema}.domain_daily
    TO {role};
GRANT SELECT, DELETE ON {schema}.redis_imports TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE
    ON {schema}.ingest_batches, {schema}.ingest_batches_spill, {schema}.rollup_owed
    TO {role};
GRANT SELECT ON {schema}.alembic_version TO {role};
