-- purge: remove KEYS[1] whatever its state and wake its waiters.
-- ARGV: 1 notification channel, 2 namespaced key (the message).
local n = redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[1], ARGV[2])
return n
