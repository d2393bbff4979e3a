-- Extend the identity's lock while this holder still owns it: a consolidation that runs
-- longer than lock_ttl (a backlog of hundreds of thousands of observations) keeps it.
-- KEYS[1] lock; ARGV[1] token, ARGV[2] lock_ttl in ms
-- Returns 1 when extended, 0 when another holder (or none) has it.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
