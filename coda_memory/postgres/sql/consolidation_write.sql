-- Every write of a consolidation plan, in one statement: fact upserts and deletes, the
-- history, the checkpoint and the prune. Returns the checkpoint row's new version.
-- The facts and the events come as JSON arrays of rows (coda_memory.postgres.documents):
-- the driver encodes an array parameter element by element, 6 ms for the arrays of a
-- plan of 600 rows, holding the event loop, where the documents take 1 ms to build.
-- A fact's row: subject, category, content, confidence, reinforcement_count,
-- last_reinforced_at, confidence_at, created_at, updated_at, ease_factor. An event's:
-- subject, category, kind, session_id, at, confidence_before, confidence_after,
-- count_before, count_after, ease_before, ease_after, quality, hits, trials.
WITH
-- Facts the plan created or reinforced, in stored form.
upserted AS (
    INSERT INTO {schema}.facts (
        identity_id,
        subject,
        category,
        content,
        confidence,
        reinforcement_count,
        last_reinforced_at,
        confidence_at,
        created_at,
        updated_at,
        ease_factor
    )
    SELECT
        :identity_id,
        f.r ->> 0,
        f.r ->> 1,
        f.r ->> 2,
        (f.r ->> 3)::float8,
        (f.r ->> 4)::int,
        (f.r ->> 5)::timestamptz,
        (f.r ->> 6)::timestamptz,
        (f.r ->> 7)::timestamptz,
        (f.r ->> 8)::timestamptz,
        (f.r ->> 9)::float8
    FROM jsonb_array_elements(:facts::jsonb) AS f (r)
    ON CONFLICT (identity_id, subject) DO UPDATE SET
        category = EXCLUDED.category,
        content = EXCLUDED.content,
        confidence = EXCLUDED.confidence,
        reinforcement_count = EXCLUDED.reinforcement_count,
        last_reinforced_at = EXCLUDED.last_reinforced_at,
        confidence_at = EXCLUDED.confidence_at,
        created_at = EXCLUDED.created_at,
        updated_at = EXCLUDED.updated_at,
        ease_factor = EXCLUDED.ease_factor
),
-- Facts that expired or that the cap evicted (never among the upserts).
deleted AS (
    DELETE FROM {schema}.facts
    WHERE identity_id = :identity_id
        AND subject = ANY(:deleted_subjects::text[])
),
-- The history, in the plan's order: ids follow ORDER BY ord (the document's order).
recorded AS {fact_history(events=:events)},
-- The cursor moves to this run's snapshot; the row's new version is that of the facts
-- this statement leaves (coda_memory.postgres.known). The instant of the last
-- consolidation never moves back (a clock set back): no fact was deleted after it, so an
-- observation dated before it that arrives late may resume a deleted fact's last life
-- (ended_lives.sql), as facts_cap.sql keeps it too.
advanced AS (
    UPDATE {schema}.checkpoints
    SET snapshot = :snapshot,
        consolidated_at = greatest(consolidated_at, CAST(:now AS timestamptz)),
        runs = runs + 1,
        observations_consumed = observations_consumed + :consumed
    WHERE identity_id = :identity_id
    RETURNING {checkpoint_version(snapshot=snapshot, xmin=xmin)} AS version
),
-- Retention: only rows this run's snapshot saw, and none whose rollup an append still
-- owes (coda_memory.postgres.rollup_owed): the folding reads them back, as
-- `coda-memory prune` leaves them for it.
pruned AS (
    DELETE FROM {schema}.observations AS o
    WHERE o.identity_id = :identity_id
        AND o.created_at < :prune_before
        AND pg_visible_in_snapshot(o.xid, :snapshot::text::pg_snapshot)
        AND NOT EXISTS (
            SELECT 1
            FROM {schema}.rollup_owed AS r
            WHERE r.identity_id = o.identity_id AND r.xid = o.xid
        )
)
-- Every data-modifying CTE runs whether or not it is read; the caller needs the version.
SELECT (SELECT version FROM advanced) AS version
