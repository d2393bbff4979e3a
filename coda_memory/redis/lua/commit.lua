-- Commit one consolidation of one identity, atomically, only while this run holds the
-- identity's lock (a run whose lock expired and was taken over commits nothing).
-- KEYS[1] lock, KEYS[2] facts, KEYS[3] history, KEYS[4] pending, KEYS[5] observations,
-- KEYS[6] checkpoint map, KEYS[7] state, KEYS[8] sessions, KEYS[9] session times
-- ARGV[1] lock token, ARGV[2] identity id, ARGV[3] the plan as JSON (see unit.py),
-- ARGV[4] the highest number of the pending set at the load's first read ('' when it was
-- empty), ARGV[5] how many pending members the run read (all those numbered up to it),
-- ARGV[6..] those members, when a first attempt found the pending set numbered up to
-- ARGV[4] holding others (something reset the identity's sequence): sent whole, a
-- backlog's members made a request of hundreds of megabytes.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('LOCKLOST the consolidation lock expired before the commit')
end
-- A key that something else wrote with another type is refused before anything is
-- written: a script that fails half-way keeps what it wrote (the facts, without the
-- pending observations consumed, which every later run applied again).
local kinds = {'hash', 'list', 'zset', 'zset', 'hash', 'hash', 'hash', 'zset'}
for i = 2, 9 do
  local kind = redis.call('TYPE', KEYS[i])['ok']
  if kind ~= 'none' and kind ~= kinds[i - 1] then
    return redis.error_reply('BADTYPE ' .. i .. ' a key of the identity holds another type of value')
  end
end
-- Nothing but a commit removes a pending member, and an append numbers its members after
-- the highest one read: as many numbered up to it as the run read are those it read.
-- Others (an append numbered from a sequence that something reset) and this run's
-- members are sent by the caller instead, before anything is written.
local by_number = #ARGV == 5 and ARGV[4] ~= ''
if by_number and redis.call('ZCOUNT', KEYS[4], '-inf', ARGV[4]) ~= tonumber(ARGV[5]) then
  return redis.error_reply('PENDINGMOVED the pending set holds members the run did not read')
end
local plan = cjson.decode(ARGV[3])

-- Commands with many arguments, a thousand at a time (Lua's unpack has a limit).
local function each_chunk(command, key, items, first, last, step)
  for i = first, last, step do
    local stop = math.min(i + step - 1, last)
    redis.call(command, key, unpack(items, i, stop))
  end
end

if #plan.upserts > 0 then each_chunk('HSET', KEYS[2], plan.upserts, 1, #plan.upserts, 1000) end
if #plan.deletes > 0 then each_chunk('HDEL', KEYS[2], plan.deletes, 1, #plan.deletes, 1000) end
if #plan.events > 0 then
  each_chunk('RPUSH', KEYS[3], plan.events, 1, #plan.events, 1000)
  if plan.historyLimit > 0 then
    redis.call('LTRIM', KEYS[3], -plan.historyLimit, -1)
  end
end
-- The newest reinforcement recorded before this run (its score), nil when none is.
local newest = redis.call('ZREVRANGE', KEYS[9], 0, 0, 'WITHSCORES')[2]
if #plan.sessions > 0 then
  each_chunk('HSET', KEYS[8], plan.sessions, 1, #plan.sessions, 1000)
  each_chunk('ZADD', KEYS[9], plan.sessionTimes, 1, #plan.sessionTimes, 1000)
end
-- Sessions past the horizon can no longer send observations that matter: past it by this
-- run's now and by the newest reinforcement recorded before this run, both. A clock that
-- jumped forward alone prunes nothing (its now is past every record, but the records
-- are not past each other), so a session it would have forgotten still reinforces a fact
-- once when the clock is back.
if newest then
  local floor = tonumber(newest) - plan.sessionHorizon
  local past = redis.call('ZRANGEBYSCORE', KEYS[9], '-inf', '(' .. plan.sessionsBefore, 'WITHSCORES')
  local stale = {}
  for i = 1, #past, 2 do
    if tonumber(past[i + 1]) < floor then stale[#stale + 1] = past[i] end
  end
  if #stale > 0 then
    each_chunk('HDEL', KEYS[8], stale, 1, #stale, 1000)
    each_chunk('ZREM', KEYS[9], stale, 1, #stale, 1000)
  end
end
if by_number then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[4])
elseif #ARGV > 5 then
  each_chunk('ZREM', KEYS[4], ARGV, 6, #ARGV, 1000)
end

-- The checkpoint only moves forward: every consumed observation is scored at or before
-- it, which is what the original server reads too.
local checkpoint = redis.call('HGET', KEYS[6], ARGV[2])
if plan.checkpoint ~= cjson.null then
  if not (checkpoint and tonumber(checkpoint)) or tonumber(checkpoint) < tonumber(plan.checkpoint) then
    checkpoint = plan.checkpoint
    redis.call('HSET', KEYS[6], ARGV[2], checkpoint)
  end
end

-- Retention: consumed observations older than the bound (never a pending one, never one
-- scored after the checkpoint, which the original server may still have to consume).
local pruned = 0
if checkpoint and tonumber(checkpoint) then
  local limit = tonumber(checkpoint)
  local old = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', '(' .. plan.pruneBefore, 'WITHSCORES')
  for i = 1, #old, 2 do
    local member = old[i]
    if tonumber(old[i + 1]) <= limit and not redis.call('ZSCORE', KEYS[4], member) then
      redis.call('ZREM', KEYS[5], member)
      pruned = pruned + 1
    end
  end
end

-- The counters (nothing reads them back) count anew from one that HINCRBY cannot take,
-- which something else wrote: failing here, last, the run had written everything else
-- and still raised, at every consolidation of the identity.
local function count_up(field, by)
  local held = redis.call('HGET', KEYS[7], field)
  if held and held ~= '0' and not (string.match(held, '^%-?[1-9]%d*$') and #held <= 18) then
    redis.call('HDEL', KEYS[7], field)
  end
  redis.call('HINCRBY', KEYS[7], field, by)
end
count_up('runs', 1)
count_up('consumed', plan.consumed)
-- The instant of the last consolidation never goes back, as on Postgres: a run by a
-- clock set back took it back, and a late observation dated from when a deleted fact
-- was alive then restarted the fact instead of resuming its last life. (A value that is
-- no instant, which something else wrote, is replaced.)
local last = tonumber(redis.call('HGET', KEYS[7], 'consolidatedAt'))
if not (last and last > tonumber(plan.now) and last <= 253402300799999) then
  redis.call('HSET', KEYS[7], 'consolidatedAt', plan.now)
end
return pruned
