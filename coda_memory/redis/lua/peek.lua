-- Without the lock: whether observations wait, and the stored facts when none do.
-- Observations wait when the pending set is not empty, or when the seed's sorted set
-- holds one scored after the checkpoint (written by the original server, which knows no
-- pending set): every observation coda-memory consumed is scored at or before it.
-- KEYS[1] checkpoint map, KEYS[2] pending, KEYS[3] observations (seed), KEYS[4] facts
-- ARGV[1] identity id
if redis.call('ZCARD', KEYS[2]) > 0 then
  return {1}
end
local checkpoint = redis.call('HGET', KEYS[1], ARGV[1])
local after = '-inf'
if checkpoint and tonumber(checkpoint) then
  after = '(' .. checkpoint
end
if redis.call('ZCOUNT', KEYS[3], after, '+inf') > 0 then
  return {1}
end
return {0, redis.call('HVALS', KEYS[4])}
