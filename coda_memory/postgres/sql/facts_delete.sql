-- Facts a consolidation deletes, sent ahead of its write when they are too many for one
-- statement: a cap that drops tens of thousands of facts sends their subjects in slices
-- (coda_memory.postgres.unit.DELETE_SLICE), so that no one statement's arguments hold
-- the event loop while the driver encodes them.
DELETE FROM {schema}.facts
WHERE identity_id = :identity_id
    AND subject = ANY(:subjects::text[])
