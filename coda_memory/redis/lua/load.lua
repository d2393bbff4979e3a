-- Under the lock, in one atomic read: the checkpoint, the pending observations, the
-- observations scored after the checkpoint (the original server's new ones are among
-- them), the stored facts, and when coda-memory last consolidated the identity (an
-- observation dated before it arrived late). An append lands wholly before or wholly
-- after this read.
-- KEYS[1] checkpoint map, KEYS[2] pending, KEYS[3] observations (seed), KEYS[4] facts,
-- KEYS[5] state
-- ARGV[1] identity id
-- A key that something else wrote with another type is refused by its place.
local kinds = {'hash', 'zset', 'zset', 'hash', 'hash'}
for i = 1, 5 do
  local kind = redis.call('TYPE', KEYS[i])['ok']
  if kind ~= 'none' and kind ~= kinds[i] then
    return redis.error_reply('BADTYPE ' .. i .. ' a key of the identity holds another type of value')
  end
end
local checkpoint = redis.call('HGET', KEYS[1], ARGV[1])
-- Scores within the range of dates (datetime's, epoch ms): one outside it (±inf, or past
-- year 9999, that something else wrote) dates no observation, and taken as one it moved
-- the checkpoint where no later observation counted, or to "inf", which is refused.
local after = '(-62135596800000'
if checkpoint then
  -- Anything but epoch ms written in decimal is refused: read as no checkpoint, every
  -- observation consumed before would count again.
  -- So is one outside the range of dates, as Python's checkpoint_ms refuses it: read as
  -- far in the past, every observation consumed before would count again.
  local at = string.match(checkpoint, '^%-?%d+%.?%d*$') and tonumber(checkpoint)
  if not at or at <= -62135596800000 or at >= 253402300800000 then
    return redis.error_reply('BADCHECKPOINT the identity\'s checkpoint is not epoch ms')
  end
  after = '(' .. checkpoint
end
return {
  checkpoint,
  redis.call('ZRANGE', KEYS[2], 0, -1),
  redis.call('ZRANGEBYSCORE', KEYS[3], after, '(253402300800000', 'WITHSCORES'),
  redis.call('HVALS', KEYS[4]),
  redis.call('HGET', KEYS[5], 'consolidatedAt'),
}
