-- The cap on an identity's facts, applied where they are (coda_memory.core.caps.FactCap):
-- deletes the identity's live facts that rank beyond :kept at :now, the lowest ranked
-- first and a bounded number of them (see lowest), so that an identity far over the cap
-- is brought down without sending its facts to the application, by statements of
-- bounded size (the caller runs it again while some remain beyond the cap). The facts
-- expired at :now go too, as many a statement by the same rule, each with the event the
-- consolidation would record for it. Runs in a transaction that holds the identity's
-- checkpoint row (no consolidation of it runs meanwhile). The facts of :spared (those
-- the observations waiting for the next consolidation may change) are neither ranked,
-- expired nor deleted: that consolidation takes them. Returns how many facts it
-- deleted as ranked beyond the cap and as expired, and how many of each there were
-- before it did.
WITH
-- The subjects spared, as a relation: anti-joined by hash below, where a
-- subject <> ALL (array) would compare every fact with every spared subject.
spared AS (
    SELECT s.subject
    FROM unnest(CAST(:spared AS text[])) AS s (subject)
),
-- Each fact's days since its anchor (0 for an anchor ahead of :now: a clock behind the
-- one that reinforced it), and the ease that divides them: the fact's own, or the
-- formula's default (none: 1), as coda_memory.core.decay computes them.
seen AS (
    SELECT
        subject,
        confidence,
        reinforcement_count,
        greatest(
            0,
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
-- with an ease the formula cannot divide by is left out, for the consolidation. Read
-- three times below (the live, the expired, their count), so computed once.
decayed AS MATERIALIZED (
    SELECT
        subject,
        reinforcement_count,
        ease,
        -- (The exponent capped where the power is still a float far below any
        -- threshold: past it, power() fails with "underflow". An ease below 1e-300
        -- divides as 1e-300, where days / ease would fail with "overflow"; Python's
        -- power of such a fact is 0.0 either way.)
        confidence * power(
            CAST(:base AS float8),
            least(days / greatest(ease, 1e-300), CAST(:max_exponent AS float8))
        ) AS confidence
    FROM seen
    WHERE ease > 0
),
-- How many have expired (below the threshold at :now).
expirable AS (
    SELECT count(*) AS facts
    FROM decayed
    WHERE confidence < CAST(:expiry_threshold AS float8)
),
-- The expired ones, :chunk of them or a quarter when that is more (as for the ranked,
-- below), in subject order, with what their events need of the stored row (read by its
-- key for those only), as the consolidation expires them
-- (coda_memory.core.consolidation, _Run.expire and expired_at): the event's instant is
-- when the confidence crossed the threshold, from the curve through the anchor and one
-- day later, never after :now.
expiring AS (
    SELECT
        f.subject,
        f.category,
        f.reinforcement_count,
        f.ease_factor,
        d.confidence AS confidence_now,
        f.confidence_at,
        f.confidence,
        -- (Capped as in decayed.)
        f.confidence * power(
            CAST(:base AS float8),
            least(1 / greatest(d.ease, 1e-300), CAST(:max_exponent AS float8))
        ) AS one_day
    FROM (
        SELECT subject, ease, confidence
        FROM decayed
        WHERE confidence < CAST(:expiry_threshold AS float8)
        ORDER BY subject COLLATE "C"
        LIMIT (SELECT greatest(CAST(:chunk AS bigint), facts / 4) FROM expirable)
    ) AS d
    JOIN {schema}.facts f
        ON f.identity_id = :identity_id
        AND f.subject = d.subject
),
-- Deleted, as the consolidation deletes an expired fact.
expired AS (
    DELETE FROM {schema}.facts f
    USING expiring e
    WHERE f.identity_id = :identity_id
        AND f.subject = e.subject
    RETURNING f.subject
),
-- Their history, in subject order as the consolidation writes it.
expiry_recorded AS (
    INSERT INTO {schema}.fact_events (
        identity_id,
        recorded_at,
        subject,
        category,
        kind,
        at,
        confidence_before,
        count_before,
        ease_before,
        hits,
        trials
    )
    SELECT
        :identity_id,
        CAST(:now AS timestamptz),
        e.subject,
        e.category,
        'expired',
        CASE
            WHEN NOT (0 < e.one_day AND e.one_day < e.confidence)
                OR CAST(:expiry_threshold AS float8) <= 0
                THEN CAST(:now AS timestamptz)
            ELSE least(
                CAST(:now AS timestamptz),
                e.confidence_at + make_interval(
                    secs => greatest(
                        0,
                        ln(CAST(:expiry_threshold AS float8) / e.confidence)
                            / ln(e.one_day / e.confidence)
                    ) * 86400
                )
            )
        END,
        e.confidence_now,
        e.reinforcement_count,
        e.ease_factor,
        0,
        0
    FROM expiring e
    ORDER BY e.subject COLLATE "C"
),
-- The live ones with their score (coda_memory.core.rank: confidence * count, highest
-- first, then subject by code point); the expired ones are not ranked.
live AS (
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
-- checkpoint row written again, its cursor unchanged; when expired ones went, its
-- consolidated_at moved to :now as a consolidation's deletes move it (an observation
-- dated before it that arrives late resumes a deleted fact's last life, see
-- ended_lives.sql). (A data-modifying CTE runs whether or not the query reads it.)
touched AS (
    UPDATE {schema}.checkpoints
    SET snapshot = snapshot,
        consolidated_at = CASE
            WHEN EXISTS (SELECT 1 FROM expired)
                THEN greatest(consolidated_at, CAST(:now AS timestamptz))
            ELSE consolidated_at
        END
    WHERE identity_id = :identity_id
        AND (EXISTS (SELECT 1 FROM dropped) OR EXISTS (SELECT 1 FROM expired))
)
SELECT
    (SELECT count(*) FROM dropped) AS dropped,
    (SELECT facts FROM beyond) AS beyond,
    (SELECT count(*) FROM expired) AS expired,
    (SELECT facts FROM expirable) AS expirable
