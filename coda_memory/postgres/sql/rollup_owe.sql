-- The rollup of this transaction's rows is owed (a rollup table was locked): one record
-- per identity of the batch, with this transaction's id and the rollups it owes, which
-- commit with the rows and the batch's key.
INSERT INTO {schema}.rollup_owed (identity_id, xid, kinds)
SELECT identity_id, pg_current_xact_id(), :kinds
FROM unnest(CAST(:identities AS text[])) AS identity_id
