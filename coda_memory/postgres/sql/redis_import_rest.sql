-- The rest of one identity's copy from Redis, in one statement: facts as they were,
-- their history, the checkpoint, and the ledger row that makes a rerun skip it.
-- The facts and the events come as JSON arrays of rows, as consolidation_write.sql takes
-- them (coda_memory.postgres.documents: fact_row, event_row).
WITH
-- Facts with their confidence, anchor, counts and times; a fact Postgres already has
-- (written by a live server since) is newer and stays.
copied_facts AS (
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
    ON CONFLICT (identity_id, subject) DO NOTHING
    RETURNING 1
),
-- The history coda-memory kept in Redis, in its order (the original server kept none),
-- recorded at the instant it happened.
copied_events AS (
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
        (e.r ->> 4)::timestamptz,
        e.r ->> 0,
        e.r ->> 1,
        e.r ->> 2,
        e.r ->> 3,
        (e.r ->> 4)::timestamptz,
        (e.r ->> 5)::float8,
        (e.r ->> 6)::float8,
        (e.r ->> 7)::int,
        (e.r ->> 8)::int,
        (e.r ->> 9)::float8,
        (e.r ->> 10)::float8,
        (e.r ->> 11)::float8,
        (e.r ->> 12)::int,
        (e.r ->> 13)::int
    FROM jsonb_array_elements(:events::jsonb) WITH ORDINALITY AS e (r, ord)
    ORDER BY e.ord
    RETURNING 1
),
-- An identity never consolidated here gets a snapshot in which only transaction ids
-- below 4 are visible: the consumed copies (id 3) are read as consumed, and every other
-- observation (this copy's pending ones, and any a live server stored) stays new. Here
-- and below, consolidated_at is at least the latest expiry copied: an observation dated
-- before it that arrives late may resume a deleted fact's last life (ended_lives.sql).
cursor_set AS (
    UPDATE {schema}.checkpoints
    SET snapshot = '4:4:',
        consolidated_at = greatest(consolidated_at, CAST(:last_expiry AS timestamptz))
    WHERE identity_id = :identity_id
        AND snapshot IS NULL
        AND :has_consumed::boolean
    RETURNING 1
),
-- Every other checkpoint row of the identity gets a new row version, since its facts
-- changed: a process that knows the facts of the earlier version reads them again
-- (coda_memory.postgres.known). Disjoint from cursor_set, so no row is updated twice.
versioned AS (
    UPDATE {schema}.checkpoints
    SET snapshot = snapshot,
        consolidated_at = greatest(consolidated_at, CAST(:last_expiry AS timestamptz))
    WHERE identity_id = :identity_id
        AND NOT (snapshot IS NULL AND :has_consumed::boolean)
    RETURNING 1
),
-- The ledger: committed with the copy, so a rerun (or a resumed run) skips the identity.
ledger AS (
    INSERT INTO {schema}.redis_imports (
        identity_id,
        source,
        imported_at,
        observations,
        consumed_observations,
        facts,
        fact_events,
        checkpoint_at,
        bad_records
    )
    VALUES (
        :identity_id,
        :source,
        :imported_at,
        :observation_count,
        :consumed_count,
        (SELECT count(*) FROM copied_facts),
        (SELECT count(*) FROM copied_events),
        :checkpoint_at,
        :bad_records
    )
    RETURNING 1
)
SELECT
    (SELECT count(*) FROM copied_facts) AS facts,
    (SELECT count(*) FROM copied_events) AS fact_events,
    (SELECT count(*) FROM cursor_set) AS checkpoints,
    (SELECT count(*) FROM ledger) AS ledger
