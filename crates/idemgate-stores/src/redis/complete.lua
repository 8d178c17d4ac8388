-- complete: idemgate_core::rules::complete on the record string KEYS[1] (layout.rs).
-- ARGV: 1 token, 2 now, 3 encoded response, 4 expires_at (20 digits), 5 pexpireat ('0' = none),
--       6 notification channel, 7 namespaced key (the message).
local key = KEYS[1]
-- An in-flight record is small (no response yet); a completed one is read whole only when a
-- complete is retried after it took effect.
local v = redis.call('GET', key)
-- Gone (absent or expired) or owned by another attempt: fenced.
if not v or #v < 141 or tonumber(ARGV[2]) >= tonumber(string.sub(v, 4, 23)) or string.sub(v, 44, 59) ~= ARGV[1] then
  return 'fenced'
end
-- Retried after it took effect.
if string.sub(v, 2, 2) == 'c' then
  return 'ok'
end
-- Completed, nobody marked as waiting any more, the new expiry, the rest as it was, then the
-- response: written whole, so Redis keeps it at its size (APPEND would leave room to grow).
local done = string.sub(v, 1, 1) .. 'c0' .. ARGV[4] .. string.sub(v, 24) .. ARGV[3]
if ARGV[5] == '0' then
  redis.call('SET', key, done)
else
  redis.call('SET', key, done, 'PXAT', ARGV[5])
end
if string.sub(v, 3, 3) == '1' then
  redis.call('PUBLISH', ARGV[6], ARGV[7])
end
return 'ok'
