-- Erase one identity while holding its lock, then release the lock.
-- KEYS[1] lock, KEYS[2] checkpoint map, KEYS[3..] the identity's own keys
-- ARGV[1] lock token, ARGV[2] identity id
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('LOCKLOST the lock expired before forget')
end
redis.call('HDEL', KEYS[2], ARGV[2])
for i = 3, #KEYS do
  redis.call('DEL', KEYS[i])
end
redis.call('DEL', KEYS[1])
return 1
