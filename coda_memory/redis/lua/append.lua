-- Append a batch of one identity's observations, atomically, once per batch key.
-- Each observation takes the next number of the identity's ingest sequence as its id,
-- goes into the seed's sorted set scored by createdAt (what the original server reads),
-- and into the pending set scored by that number (what consolidation consumes).
-- A batch key already among the identity's recent ones was stored by an earlier attempt
-- whose reply was lost: nothing is stored again.
-- So is it when the batch key is among those of a forgotten identity's recent batches
-- (forget.lua keeps them, as the SHA-1 of the batch key and KEYS[4]'s name): a retry
-- after a forget stored the erased observations again.
-- KEYS[1] state hash, KEYS[2] observations (seed), KEYS[3] pending, KEYS[4] the recent
-- batch keys (a sorted set scored by when each was stored), KEYS[5] the forgotten
-- identities' recent batch keys (shared; another type of value there is not read)
-- ARGV[1] batch key, ARGV[2] now (epoch ms), ARGV[3] how long a key is kept (ms),
-- ARGV[4] how many keys are kept at most, ARGV[5] count; then per observation:
-- createdAt (epoch ms), JSON after its "id" field
-- Returns the identity's last sequence number; 0 for a batch stored before; -i when
-- KEYS[i] holds a key of another type (written by something else), and -5 when the
-- state's seq is not a whole number of at most 15 digits, before anything is written: a script
-- that fails half-way keeps what it wrote.
local kinds = {'hash', 'zset', 'zset', 'zset'}
for i = 1, 4 do
  local kind = redis.call('TYPE', KEYS[i])['ok']
  if kind ~= 'none' and kind ~= kinds[i] then
    return -i
  end
end
-- Up to 15 digits: the ids below count from it in Lua's numbers, doubles, which are
-- whole numbers exactly up to 2^53 (16 digits); past that, ids of one batch came out
-- the same.
local seq = redis.call('HGET', KEYS[1], 'seq')
local digits = seq and string.match(seq, '^%-?([1-9]%d*)$')
if seq and seq ~= '0' and not (digits and #digits <= 15) then
  return -5
end
if redis.call('ZSCORE', KEYS[4], ARGV[1]) then
  return 0
end
if redis.call('TYPE', KEYS[5])['ok'] == 'zset' then
  local at = redis.call('ZSCORE', KEYS[5], redis.sha1hex(ARGV[1] .. '\n' .. KEYS[4]))
  if at and tonumber(at) >= tonumber(ARGV[2]) - tonumber(ARGV[3]) then
    return 0
  end
end
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. (tonumber(ARGV[2]) - tonumber(ARGV[3])))
redis.call('ZREMRANGEBYRANK', KEYS[4], 0, -1 - tonumber(ARGV[4]))
redis.call('PEXPIRE', KEYS[4], ARGV[3])
local count = tonumber(ARGV[5])
local last = redis.call('HINCRBY', KEYS[1], 'seq', count)
for i = 1, count do
  local seq = last - count + i
  local member = '{"id":"' .. string.format('%d', seq) .. '",' .. ARGV[2 * i + 5]
  redis.call('ZADD', KEYS[2], ARGV[2 * i + 4], member)
  redis.call('ZADD', KEYS[3], seq, member)
end
return last
