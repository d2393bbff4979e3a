-- The instant and the window the analytics views read, for this transaction only
-- (no instant: the views use now()).
SELECT set_config('coda_memory.analytics_now', coalesce(:now::timestamptz::text, ''), true),
    set_config('coda_memory.analytics_window', :since::interval::text, true)
