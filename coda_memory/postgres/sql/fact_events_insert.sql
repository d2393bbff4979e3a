-- The history of a consolidation whose events are too many for one statement, sent
-- ahead of its write in slices (coda_memory.postgres.unit.EVENTS_SLICE), in the plan's
-- order: the backlog of an identity that wrote 100,000 observations with no load made
-- 100,000 events, and their one INSERT ran past the request pool's statement_timeout at
-- every try, so the identity was never consolidated.
WITH
-- The slice's rows, as consolidation_write.sql records a plan's (the fragment is the
-- INSERT both run; a data-modifying CTE runs whether or not anything reads it).
recorded AS {fact_history(events=:events)}
SELECT 1
