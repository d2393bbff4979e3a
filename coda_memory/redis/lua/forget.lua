-- Erase one identity while holding its lock, then release the lock.
-- KEYS[1] lock, KEYS[2] checkpoint map, KEYS[3] the forgotten identities' recent batch
-- keys (shared), KEYS[4] batches, KEYS[5] obs, KEYS[6] facts, KEYS[7] history,
-- KEYS[8..] the identity's other keys
-- ARGV[1] lock token, ARGV[2] identity id, ARGV[3] now (epoch ms), ARGV[4] how long a
-- batch key is kept (ms), ARGV[5] how many forgotten ones are kept at most
-- Returns what it erased: {observations, facts, fact events}.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('LOCKLOST the lock expired before forget')
end
-- A key that something else wrote with another type is erased all the same, counted as
-- holding nothing (its count failed with WRONGTYPE, and the identity could not be erased).
local function count(key, kind, command)
  if redis.call('TYPE', key)['ok'] == kind then
    return redis.call(command, key)
  end
  return 0
end
local erased = {
  count(KEYS[5], 'zset', 'ZCARD'), count(KEYS[6], 'hash', 'HLEN'), count(KEYS[7], 'list', 'LLEN')
}
-- The identity's recent batch keys outlive it, without its id: each as the SHA-1 of the
-- key and the batches key's name, scored by when its batch was stored, so that a batch
-- stored before the forget and retried after it (its reply lost) stores nothing again,
-- as on Postgres, whose batch keys carry no identity. A day, as the keys themselves.
local since = tonumber(ARGV[3]) - tonumber(ARGV[4])
local shared = redis.call('TYPE', KEYS[3])['ok']
if redis.call('TYPE', KEYS[4])['ok'] == 'zset' and (shared == 'zset' or shared == 'none') then
  local recent = redis.call('ZRANGEBYSCORE', KEYS[4], since, '+inf', 'WITHSCORES')
  for i = 1, #recent, 2 do
    redis.call('ZADD', KEYS[3], recent[i + 1], redis.sha1hex(recent[i] .. '\n' .. KEYS[4]))
  end
  if #recent > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. since)
    redis.call('ZREMRANGEBYRANK', KEYS[3], 0, -1 - tonumber(ARGV[5]))
    redis.call('PEXPIRE', KEYS[3], ARGV[4])
  end
end
-- UNLINK: the keys go at once, their memory is freed in the background (a DEL of a
-- sorted set of 500,000 members held the server 70 ms, an UNLINK 7 ms). Before the
-- checkpoint: a script is not undone by its error, and a user that may not UNLINK had
-- the checkpoint erased and the observations kept, all of them pending again.
for i = 4, #KEYS do
  redis.call('UNLINK', KEYS[i])
end
-- A checkpoint map of another type holds no checkpoint of the identity.
if redis.call('TYPE', KEYS[2])['ok'] == 'hash' then
  redis.call('HDEL', KEYS[2], ARGV[2])
end
redis.call('DEL', KEYS[1])
return erased
