-- The version of an identity's facts: the checkpoint row's stored snapshot and the id of
-- the transaction that wrote the row. Every write of the identity's facts writes the row
-- too, so equal versions mean equal facts (coda_memory.postgres.known argues why).
concat({snapshot}, '/', {xmin})
