-- Under the lock, the consolidation's read, in pages of at most ARGV[2] members and
-- about ARGV[3] bytes: a backlog of hundreds of thousands of observations read in one
-- reply outlived redis-py's socket timeout (5 s) at every attempt, and the identity was
-- never consolidated.
-- KEYS[1] checkpoint map, KEYS[2] pending, KEYS[3] observations (seed), KEYS[4] facts,
-- KEYS[5] state
-- ARGV[1] identity id, ARGV[2] page size (members), ARGV[3] page budget (bytes: a page
-- ends with the member that reaches it)
--
-- The first read (no ARGV[4]) is atomic: the checkpoint; the highest score of the
-- pending set (the run consumes the pending observations scored at or below it: an
-- append numbers its observations after it, so one that lands between the pages is
-- neither read nor removed, and the next run consumes it); the lower bound of the
-- observations scored after the checkpoint (the original server's new ones are among
-- them); the first page of each; the stored facts; and when coda-memory last
-- consolidated the identity (an observation dated before it arrived late).
-- A later page (ARGV[4] 'pending' or 'obs') continues one of the two: ARGV[5] its lower
-- bound, ARGV[6] its upper bound (as ZRANGEBYSCORE takes them), ARGV[7] the last member
-- read and ARGV[8] its score; for 'obs', ARGV[9] the highest score of the pending set at
-- the first read ('' when it was empty).
-- A page is {more (1: a next page may hold members), last member read, its score, the
-- highest score of the members it left out as read among the pending ones, member,
-- score, ...}. A page of the observations leaves out the members of the pending set:
-- those read as pending (their score is the fourth field: the checkpoint moves past
-- them, one that does not parse included), and those appended after the first read
-- (the next run's).
-- A key that something else wrote with another type is refused by its place.
local kinds = {'hash', 'zset', 'zset', 'hash', 'hash'}
for i = 1, 5 do
  local kind = redis.call('TYPE', KEYS[i])['ok']
  if kind ~= 'none' and kind ~= kinds[i] then
    return redis.error_reply('BADTYPE ' .. i .. ' a key of the identity holds another type of value')
  end
end
local size = tonumber(ARGV[2])
local budget = tonumber(ARGV[3])

-- Whether a score (a reply's string) is past the upper bound `max`.
local function past(score, max)
  local at = tonumber(score)
  if not at then return true end  -- "inf", "nan": past any date
  if string.sub(max, 1, 1) == '(' then
    return at >= tonumber(string.sub(max, 2))
  end
  return at > tonumber(max)
end

-- A page of `key` from `min` to `max`, after `last` (scored `last_score`) when given;
-- `pending` ('' or the pending set's highest score): leave out the pending members.
local function page(key, min, max, last, last_score, pending)
  local items
  if last then
    -- After the last member read, by its rank now: members added before it since are
    -- not read (an append's are pending, and scored after the bound of the pending set).
    local rank = redis.call('ZRANK', key, last)
    if not rank or redis.call('ZSCORE', key, last) ~= last_score then
      -- Gone meanwhile (something else removed it): from the first member of its score
      -- again, the caller keeps one of each member read twice.
      rank = redis.call('ZCOUNT', key, '-inf', '(' .. last_score) - 1
    end
    items = redis.call('ZRANGE', key, rank + 1, rank + size, 'WITHSCORES')
  else
    items = redis.call('ZRANGEBYSCORE', key, min, max, 'WITHSCORES', 'LIMIT', 0, size)
  end
  local out = {0, false, false, false}
  local bound = pending and tonumber(pending)
  local bytes = 0
  for i = 1, #items, 2 do
    if past(items[i + 1], max) then
      return out
    end
    out[2], out[3] = items[i], items[i + 1]
    local seq = pending and redis.call('ZSCORE', KEYS[2], items[i])
    if not seq then
      out[#out + 1] = items[i]
      out[#out + 1] = items[i + 1]
      bytes = bytes + #items[i]
      if bytes >= budget and i + 1 < #items then
        out[1] = 1
        return out
      end
    elseif bound and tonumber(seq) <= bound then
      if not out[4] or tonumber(out[4]) < tonumber(items[i + 1]) then
        out[4] = items[i + 1]
      end
    end
  end
  if #items == 2 * size then out[1] = 1 end
  return out
end

if ARGV[4] then
  local key = ARGV[4] == 'pending' and KEYS[2] or KEYS[3]
  return page(key, ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[4] == 'obs' and ARGV[9])
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
local highest = redis.call('ZREVRANGE', KEYS[2], 0, 0, 'WITHSCORES')[2] or false
local pending = {0, false, false, false}
if highest then
  pending = page(KEYS[2], '-inf', highest, nil, nil, false)
end
return {
  checkpoint,
  highest,
  after,
  pending,
  page(KEYS[3], after, '(253402300800000', nil, nil, highest or ''),
  redis.call('HVALS', KEYS[4]),
  redis.call('HGET', KEYS[5], 'consolidatedAt'),
}
