-- A page of one of an identity's sorted sets, for a read of all of it (the store's
-- `observations`): at most ARGV[1] members, ending with the one whose bytes reach ARGV[2].
-- Read in one reply, a sorted set of hundreds of thousands of observations outlived
-- redis-py's socket timeout (5 s) at every attempt, and made a reply of hundreds of
-- megabytes.
-- KEYS[1] the sorted set
-- ARGV[1] page size (members), ARGV[2] page budget (bytes), ARGV[3] the last member read
-- and ARGV[4] its score (none: the first page)
-- Returns {more (1: a next page may hold members), member, score, member, score, ...}.
-- A later page starts after the last member read, by its rank now: a member added before
-- it since is not read, and one removed before it moves no other out of the read. When it
-- is gone itself (something else removed it), from the first member of its score again:
-- the caller keeps one of each member read twice.
-- A key that something else wrote with another type is refused by its place.
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'none' and kind ~= 'zset' then
  return redis.error_reply('BADTYPE 1 a key of the identity holds another type of value')
end
local size = tonumber(ARGV[1])
local budget = tonumber(ARGV[2])
local first = 0
if ARGV[3] then
  local rank = redis.call('ZRANK', KEYS[1], ARGV[3])
  if not rank or redis.call('ZSCORE', KEYS[1], ARGV[3]) ~= ARGV[4] then
    rank = redis.call('ZCOUNT', KEYS[1], '-inf', '(' .. ARGV[4]) - 1
  end
  first = rank + 1
end
local items = redis.call('ZRANGE', KEYS[1], first, first + size - 1, 'WITHSCORES')
local out = {0}
local bytes = 0
for i = 1, #items, 2 do
  out[#out + 1] = items[i]
  out[#out + 1] = items[i + 1]
  bytes = bytes + #items[i]
  if bytes >= budget and i + 1 < #items then
    out[1] = 1
    return out
  end
end
if #items == 2 * size then out[1] = 1 end
return out
