-- The tenant policy as migrations 0004 and 0006 created it
-- (tenant_policy_created_0004.sql): what a downgrade from 0016 puts back.
ALTER POLICY tenant ON {schema}.{table}
    USING (identity_id = (SELECT current_setting('coda_memory.identity_id', true)))
    WITH CHECK (identity_id = (SELECT current_setting('coda_memory.identity_id', true)))
