-- release: idemgate_core::rules::release on the record string KEYS[1] (layout.rs).
-- ARGV: 1 token, 2 notification channel, 3 namespaced key (the message).
local h = redis.call('GETRANGE', KEYS[1], 0, 130)
-- Nothing left to release (retried after it took effect, or swept).
if #h < 131 then
  return 'ok'
end
if string.sub(h, 2, 2) == 'f' and string.sub(h, 44, 59) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if string.sub(h, 3, 3) == '1' then
    redis.call('PUBLISH', ARGV[2], ARGV[3])
  end
  return 'ok'
end
return 'fenced'
