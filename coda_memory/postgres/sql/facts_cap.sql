-- The cap on an identity's facts, applied where they are (coda_memory.core.caps.FactCap):
-- deletes the identity's live facts that rank beyond :kept at :now, the lowest ranked
-- first and a bounded number of them (see lowest), so that an identity far over the cap
-- is brought down without sending its facts to the application, by statements of
-- bounded size (the caller runs it again while some remain beyond the cap). Runs in a
-- transaction that holds the identity's checkpoint row (no consolidation of it runs
-- meanwhile). The facts of :spared (those the observations waiting for the next
-- consolidation may change) are neither ranked nor deleted: that consolidation ranks
-- them. Returns how many facts it deleted, and how many ranked beyond the cap before it
-- did.
WITH
-- The subjects spared, as a relation: anti-joined by hash below, where a
-- subject <> ALL (array) would compare every fact with every spared subject.
spared AS (
    SELECT s.subject
    FROM unnest(CAST(:spared AS text[])) AS s (subject)
),
-- Each fact's distance in days from its anchor, and the ease that divides it: the
-- fact's own, or the formula's default (none: 1), as coda_memory.core.decay computes them.
seen AS (
    SELECT
        subject,
        confidence,
        reinforcement_count,
        abs(
            extract(epoch FROM CAST(:now AS timestamptz)) - extract(epoch FROM confidence_at)
        )::float8 / 86400 AS days,
        CASE
            WHEN CAST(:with_ease AS boolean)
                THEN coalesce(ease_factor, CAST(:default_ease AS float8))
            ELSE 1
        END AS ease
    FROM {schema}.facts f
    WHERE f.identity_id = :identity_id
        AND NOT EXISTS (SELECT 1 FROM spared WHERE spared.subject = f.subject)
),
-- Each fact's confidence at :now (decayed from its anchor, never compounded). A fact
-- with an ease the formula cannot divide by is left out, for the consolidation.
decayed AS (
    SELECT
        subject,
        reinforcement_count,
        confidence * power(CAST(:base AS float8), days / ease) AS confidence
    FROM seen
    WHERE ease > 0
),
-- The live ones with their score (coda_memory.core.rank: confidence * count, highest
-- first, then subject by code point). An expired fact is left out: the consolidation
-- deletes it and records its expiry. Read twice below, so computed once.
live AS MATERIALIZED (
    SELECT
        subject,
        confidence * reinforcement_count AS score
    FROM decayed
    WHERE confidence >= CAST(:expiry_threshold AS float8)
),
-- How many rank beyond the cap.
beyond AS (
    SELECT greatest(count(*) - CAST(:kept AS bigint), 0) AS facts
    FROM live
),
-- The lowest ranked of those: :chunk of them, or a quarter when that is more (every
-- statement reads all the identity's facts, so an identity with very many is brought
-- down in a few statements, not in thousands). The rank's order reversed, whose LIMIT
-- makes a bounded sort (the lowest are kept while reading), not a sort of all.
lowest AS (
    SELECT subject
    FROM live
    ORDER BY score ASC, subject COLLATE "C" DESC
    LIMIT (
        SELECT least(facts, greatest(CAST(:chunk AS bigint), facts / 4))
        FROM beyond
    )
),
-- Deleted with no history event (as when a consolidation drops them).
dropped AS (
    DELETE FROM {schema}.facts f
    USING lowest l
    WHERE f.identity_id = :identity_id
        AND f.subject = l.subject
    RETURNING 1
),
-- A new version of the identity's facts (coda_memory.postgres.known) when any went: the
-- checkpoint row written again, its cursor unchanged. (A data-modifying CTE runs whether
-- or not the query reads it.)
touched AS (
    UPDATE {schema}.checkpoints
    SET snapshot = snapshot
    WHERE identity_id = :identity_id
        AND EXISTS (SELECT 1 FROM dropped)
)
SELECT
    (SELECT count(*) FROM dropped) AS dropped,
    (SELECT facts FROM beyond) AS beyond
