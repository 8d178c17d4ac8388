-- complete: idemgate_core::rules::complete on KEYS[1].
-- ARGV: 1 token, 2 now, 3 encoded response, 4 expires_at, 5 pexpireat ('0' = none),
--       6 notification channel, 7 namespaced key (the message).
local key = KEYS[1]
local r = redis.call('HMGET', key, 'st', 'tok', 'exp', 'w')
-- Gone (absent or expired) or owned by another attempt: fenced.
if not r[1] or tonumber(ARGV[2]) >= tonumber(r[3]) or r[2] ~= ARGV[1] then
  return 'fenced'
end
-- Retried after it took effect.
if r[1] == 'c' then
  return 'ok'
end
redis.call('HSET', key, 'st', 'c', 'resp', ARGV[3], 'exp', ARGV[4])
redis.call('HDEL', key, 'lease', 'w')
if ARGV[5] == '0' then
  redis.call('PERSIST', key)
else
  redis.call('PEXPIREAT', key, ARGV[5])
end
if r[4] then
  redis.call('PUBLISH', ARGV[6], ARGV[7])
end
return 'ok'
