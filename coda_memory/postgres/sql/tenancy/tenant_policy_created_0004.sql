-- The tenant policy as migrations 0004 and 0006 created it, and as 0016's downgrade
-- leaves it (tenant_policy_0004.sql; tenant_policy.sql is the current one): an empty
-- setting matched the rows of the empty identity.
-- The tenant: the identity the library sets for each transaction
-- (set_config('coda_memory.identity_id', …, true)). A connection that set none sees
-- no row and writes none. The setting is read once per statement (an InitPlan), and
-- the comparison can use the identity_id indexes.
CREATE POLICY tenant ON {schema}.{table}
    USING (identity_id = (SELECT current_setting('coda_memory.identity_id', true)))
    WITH CHECK (identity_id = (SELECT current_setting('coda_memory.identity_id', true)))
