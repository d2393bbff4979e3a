-- The rollup's per-identity rows (the latest day an identity used a tool or entity, its
-- domains per day) are upserted by the writer for every identity of a batch.
CREATE POLICY writer ON {schema}.{table}
    USING ((SELECT current_setting('coda_memory.writer', true)) = 'on')
    WITH CHECK ((SELECT current_setting('coda_memory.writer', true)) = 'on')
