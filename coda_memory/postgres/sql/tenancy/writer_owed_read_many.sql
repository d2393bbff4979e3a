-- The writer's read of owed transactions' rows (writer_owed_read_policy.sql), for
-- several at once: coda_memory.rollup_xid lists them, comma-separated, so that one
-- folding reads the rows of every owed transaction it claimed. A single xid is a list of
-- one; unset (NULL or ''), it matches no row. The list is read once per statement (the
-- subquery); coalesce makes it an array expression rather than a subquery for ANY.
ALTER POLICY writer_owed_read ON {schema}.{table}
    USING (
        (SELECT current_setting('coda_memory.writer', true)) = 'on'
        AND xid = ANY (coalesce(
            (SELECT CAST(
                string_to_array(nullif(current_setting('coda_memory.rollup_xid', true), ''), ',')
                AS xid8[]
            )),
            CAST('{}' AS xid8[])
        ))
    )
