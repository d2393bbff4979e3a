-- ... and, when it folds the rollup an earlier append owed, read that transaction's rows:
-- coda_memory.rollup_xid names it, for the folding's own subtransaction only. Unset
-- (NULL or ''), it matches no row.
CREATE POLICY writer_owed_read ON {schema}.{table}
    FOR SELECT
    USING (
        (SELECT current_setting('coda_memory.writer', true)) = 'on'
        AND xid = (SELECT CAST(nullif(current_setting('coda_memory.rollup_xid', true), '') AS xid8))
    )
