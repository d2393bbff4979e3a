-- Release the identity's lock if this holder still owns it.
-- KEYS[1] lock; ARGV[1] token
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
