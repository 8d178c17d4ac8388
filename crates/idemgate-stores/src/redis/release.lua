-- release: idemgate_core::rules::release on KEYS[1].
-- ARGV: 1 token, 2 notification channel, 3 namespaced key (the message).
local r = redis.call('HMGET', KEYS[1], 'st', 'tok', 'w')
-- Nothing left to release (retried after it took effect, or swept).
if not r[1] then
  return 'ok'
end
if r[1] == 'f' and r[2] == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if r[3] then
    redis.call('PUBLISH', ARGV[2], ARGV[3])
  end
  return 'ok'
end
return 'fenced'
