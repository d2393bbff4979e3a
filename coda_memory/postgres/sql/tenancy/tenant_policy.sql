-- The tenant: the identity the library sets for each transaction
-- (set_config('coda_memory.identity_id', …, true)). A connection that set none sees
-- no row and writes none. The setting is read once per statement (an InitPlan), and
-- the comparison can use the identity_id indexes.
CREATE POLICY tenant ON {schema}.{table}
    USING (identity_id = (SELECT current_setting('coda_memory.identity_id', true)))
    WITH CHECK (identity_id = (SELECT current_setting('coda_memory.identity_id', true)))
