-- What an earlier attempt of a batch stored, recorded in the transaction that stored it,
-- in either table of keys. The main table's record comes first: a retry may have written
-- a spill row for a key the main table holds already, and which row answers must not
-- depend on the order in which the plan happens to read the two tables.
SELECT stored, refused
FROM (
    SELECT 0 AS place, stored, refused::text AS refused
    FROM {schema}.ingest_batches
    WHERE key = CAST(:key AS uuid)
    UNION ALL
    SELECT 1 AS place, stored, refused::text AS refused
    FROM {schema}.ingest_batches_spill
    WHERE key = CAST(:key AS uuid)
) AS recorded
ORDER BY place
LIMIT 1
