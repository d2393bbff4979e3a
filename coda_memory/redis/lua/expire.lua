-- Give a lock that has no expiry one: every coda-memory process sets its lock with one,
-- so such a key came from elsewhere (a copy or restore of the data that left the TTLs
-- behind, a PERSIST), and it held the identity's consolidations off for ever. It now
-- ends as a dead holder's lock does, after lock_ttl.
-- KEYS[1] lock; ARGV[1] lock_ttl in ms
-- Returns 1 when it gave the lock an expiry, else 0.
if redis.call('PTTL', KEYS[1]) == -1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  return 1
end
return 0
