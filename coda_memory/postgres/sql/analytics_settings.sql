-- The instant and the window the analytics views read, for this transaction only
-- (no instant: the views use now()); and every identity's facts, which row-level
-- security grants the owner only when asked (the views give other roles aggregates).
SELECT set_config('coda_memory.analytics_now', coalesce(:now::timestamptz::text, ''), true),
    set_config('coda_memory.analytics_window', :since::interval::text, true),
    set_config('coda_memory.all_identities', 'on', true)
