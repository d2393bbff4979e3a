-- The instant and the window the analytics views read, for this transaction only
-- (no instant: the views use now()); every identity's facts, which row-level
-- security grants the owner only when asked (the views give other roles aggregates);
-- and no JIT compilation: on a server built with it, the plan of fact_summary over a
-- million facts costs enough to be compiled, which took longer than it saved (806 ms
-- against 513 ms on Postgres 15). The instant goes in as ISO 8601 in UTC: its text in
-- the session's DateStyle may name its zone by an abbreviation that reads back as another
-- zone (IST: India's written, Israel's read), which moved the window by hours.
SELECT set_config(
        'coda_memory.analytics_now',
        coalesce(to_char(:now::timestamptz AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'), ''),
        true
    ),
    set_config('coda_memory.analytics_window', :since::interval::text, true),
    set_config('coda_memory.all_identities', 'on', true),
    set_config('jit', 'off', true)
