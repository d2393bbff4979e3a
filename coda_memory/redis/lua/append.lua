-- Append a batch of one identity's observations, atomically.
-- Each observation takes the next number of the identity's ingest sequence as its id,
-- goes into the seed's sorted set scored by createdAt (what the original server reads),
-- and into the pending set scored by that number (what consolidation consumes).
-- KEYS[1] state hash, KEYS[2] observations (seed), KEYS[3] pending
-- ARGV[1] count; then per observation: createdAt (epoch ms), JSON after its "id" field
local count = tonumber(ARGV[1])
local last = redis.call('HINCRBY', KEYS[1], 'seq', count)
for i = 1, count do
  local seq = last - count + i
  local member = '{"id":"' .. string.format('%d', seq) .. '",' .. ARGV[2 * i + 1]
  redis.call('ZADD', KEYS[2], ARGV[2 * i], member)
  redis.call('ZADD', KEYS[3], seq, member)
end
return last
