-- Without the lock: whether observations wait, and the stored facts when none do.
-- Observations wait when the pending set is not empty, or when the seed's sorted set
-- holds one scored after the checkpoint (written by the original server, which knows no
-- pending set): every observation coda-memory consumed is scored at or before it.
-- When observations wait and the identity's lock is held (a consolidation under way, in
-- this process or another, or one whose process died holding it until the lock expires),
-- the facts come too: the consolidation that follows waits for the lock, and a load that
-- runs out of time answers with them rather than empty. Otherwise they are left out, as
-- the consolidation reads them anyway.
-- KEYS[1] checkpoint map, KEYS[2] pending, KEYS[3] observations (seed), KEYS[4] facts,
-- KEYS[5] lock
-- ARGV[1] identity id
-- As load.lua: a key that something else wrote with another type is refused by its place.
local kinds = {'hash', 'zset', 'zset', 'hash'}
for i = 1, 4 do
  local kind = redis.call('TYPE', KEYS[i])['ok']
  if kind ~= 'none' and kind ~= kinds[i] then
    return redis.error_reply('BADTYPE ' .. i .. ' a key of the identity holds another type of value')
  end
end
local function waiting()
  if redis.call('EXISTS', KEYS[5]) == 1 then
    return {1, redis.call('HVALS', KEYS[4])}
  end
  return {1}
end
if redis.call('ZCARD', KEYS[2]) > 0 then
  return waiting()
end
local checkpoint = redis.call('HGET', KEYS[1], ARGV[1])
-- Scores within the range of dates (datetime's, epoch ms): one outside it (±inf, or past
-- year 9999, that something else wrote) dates no observation, and taken as one it moved
-- the checkpoint where no later observation counted, or to "inf", which is refused.
local after = '(-62135596800000'
if checkpoint then
  -- As load.lua: anything but epoch ms written in decimal is refused.
  -- So is one outside the range of dates, as Python's checkpoint_ms refuses it: read as
  -- far in the past, every observation consumed before would count again.
  local at = string.match(checkpoint, '^%-?%d+%.?%d*$') and tonumber(checkpoint)
  if not at or at <= -62135596800000 or at >= 253402300800000 then
    return redis.error_reply('BADCHECKPOINT the identity\'s checkpoint is not epoch ms')
  end
  after = '(' .. checkpoint
end
if redis.call('ZCOUNT', KEYS[3], after, '(253402300800000') > 0 then
  return waiting()
end
return {0, redis.call('HVALS', KEYS[4])}
