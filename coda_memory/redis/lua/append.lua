-- Append a batch of one identity's observations, atomically, once per batch key.
-- Each observation takes the next number of the identity's ingest sequence as its id,
-- goes into the seed's sorted set scored by createdAt (what the original server reads),
-- and into the pending set scored by that number (what consolidation consumes).
-- A batch key already among the identity's recent ones was stored by an earlier attempt
-- whose reply was lost: nothing is stored again.
-- KEYS[1] state hash, KEYS[2] observations (seed), KEYS[3] pending, KEYS[4] the recent
-- batch keys (a sorted set scored by when each was stored)
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
