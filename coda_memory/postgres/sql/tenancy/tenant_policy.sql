-- The tenant: the identity the library sets for each transaction
-- (set_config('coda_memory.identity_id', …, true)). A connection that set none, or
-- whose setting is empty (RESET leaves it empty, not missing), sees no row and writes
-- none: the expression that migration 0016 gave the existing tables
-- (tenant_policy_given.sql). The setting is read once per statement (an InitPlan), and
-- the comparison can use the identity_id indexes. Migrations 0004 and 0006 created
-- 0004's expression (tenant_policy_created_0004.sql).
CREATE POLICY tenant ON {schema}.{table}
    USING (identity_id = (SELECT nullif(current_setting('coda_memory.identity_id', true), '')))
    WITH CHECK (
        identity_id = (SELECT nullif(current_setting('coda_memory.identity_id', true), ''))
    )
