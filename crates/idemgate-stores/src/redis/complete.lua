-- complete: idemgate_core::rules::complete on the record string KEYS[1] (layout.rs).
-- ARGV: 1 token, 2 now, 3 encoded response, 4 expires_at (20 digits), 5 pexpireat ('0' = none),
--       6 notification channel, 7 namespaced key (the message).
local key = KEYS[1]
local h = redis.call('GETRANGE', key, 0, 130)
-- Gone (absent or expired) or owned by another attempt: fenced.
if #h < 131 or tonumber(ARGV[2]) >= tonumber(string.sub(h, 4, 23)) or string.sub(h, 44, 59) ~= ARGV[1] then
  return 'fenced'
end
-- Retried after it took effect.
if string.sub(h, 2, 2) == 'c' then
  return 'ok'
end
-- Completed, nobody marked as waiting any more, new expiry (three adjacent fields); the
-- response goes last.
redis.call('SETRANGE', key, 1, 'c0' .. ARGV[4])
redis.call('APPEND', key, ARGV[3])
if ARGV[5] == '0' then
  redis.call('PERSIST', key)
else
  redis.call('PEXPIREAT', key, ARGV[5])
end
if string.sub(h, 3, 3) == '1' then
  redis.call('PUBLISH', ARGV[6], ARGV[7])
end
return 'ok'
