-- ... and read back the rows it inserted in the same transaction (for the rollup),
-- never another transaction's. pg_current_xact_id_if_assigned() assigns no xid.
CREATE POLICY writer_read ON {schema}.observations
    FOR SELECT
    USING (
        (SELECT current_setting('coda_memory.writer', true)) = 'on'
        AND xid = (SELECT pg_current_xact_id_if_assigned())
    )
