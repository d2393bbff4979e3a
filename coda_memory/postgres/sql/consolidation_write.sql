-- Every write of a consolidation plan, in one statement: fact upserts and deletes, the
-- history, the checkpoint and the prune. Returns the checkpoint row's new version.
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
    SELECT :identity_id, *
    FROM unnest(
        :fact_subjects::text[],
        :fact_categories::text[],
        :fact_contents::text[],
        :fact_confidences::float8[],
        :fact_reinforcement_counts::int[],
        :fact_last_reinforced_ats::timestamptz[],
        :fact_confidence_ats::timestamptz[],
        :fact_created_ats::timestamptz[],
        :fact_updated_ats::timestamptz[],
        :fact_ease_factors::float8[]
    )
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
-- The history, in the plan's order: ids follow ORDER BY ord.
recorded AS (
    INSERT INTO {schema}.fact_events (
        identity_id,
        recorded_at,
        subject,
        category,
        kind,
        session_id,
        at,
        confidence_before,
        confidence_after,
        count_before,
        count_after,
        ease_before,
        ease_after,
        quality,
        hits,
        trials
    )
    SELECT
        :identity_id,
        :now,
        e.subject,
        e.category,
        e.kind,
        e.session_id,
        e.at,
        e.confidence_before,
        e.confidence_after,
        e.count_before,
        e.count_after,
        e.ease_before,
        e.ease_after,
        e.quality,
        e.hits,
        e.trials
    FROM unnest(
        :event_subjects::text[],
        :event_categories::text[],
        :event_kinds::text[],
        :event_session_ids::text[],
        :event_ats::timestamptz[],
        :event_confidences_before::float8[],
        :event_confidences_after::float8[],
        :event_counts_before::int[],
        :event_counts_after::int[],
        :event_eases_before::float8[],
        :event_eases_after::float8[],
        :event_qualities::float8[],
        :event_hits::int[],
        :event_trials::int[]
    ) WITH ORDINALITY AS e(
        subject,
        category,
        kind,
        session_id,
        at,
        confidence_before,
        confidence_after,
        count_before,
        count_after,
        ease_before,
        ease_after,
        quality,
        hits,
        trials,
        ord
    )
    ORDER BY e.ord
),
-- The cursor moves to this run's snapshot; the row's new version is that of the facts
-- this statement leaves (coda_memory.postgres.known).
advanced AS (
    UPDATE {schema}.checkpoints
    SET snapshot = :snapshot,
        consolidated_at = :now,
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
