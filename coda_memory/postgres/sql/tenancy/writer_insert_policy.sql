-- The background writer stores batches that mix identities: in a transaction that set
-- coda_memory.writer = 'on' it may insert observations of any identity.
CREATE POLICY writer_insert ON {schema}.observations
    FOR INSERT
    WITH CHECK ((SELECT current_setting('coda_memory.writer', true)) = 'on')
