-- The tenant must be given (migration 0016): an empty setting matches no row. RESET
-- coda_memory.identity_id leaves the setting empty rather than missing, and the policy
-- of 0004 then gave such a connection the rows of the empty identity, which stores wrote
-- before they refused it. Still read once per statement (an InitPlan), and still a
-- comparison the identity_id indexes serve.
ALTER POLICY tenant ON {schema}.{table}
    USING (identity_id = (SELECT nullif(current_setting('coda_memory.identity_id', true), '')))
    WITH CHECK (
        identity_id = (SELECT nullif(current_setting('coda_memory.identity_id', true), ''))
    )
