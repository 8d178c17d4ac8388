-- renew: idemgate_core::rules::renew on KEYS[1].
-- ARGV: 1 token, 2 lease_until, 3 pexpireat for lease_until ('0' = none).
local r = redis.call('HMGET', KEYS[1], 'st', 'tok', 'exp')
if r[1] ~= 'f' or r[2] ~= ARGV[1] then
  return 'fenced'
end
redis.call('HSET', KEYS[1], 'lease', ARGV[2])
-- The record lives at least as long as its lease.
if tonumber(ARGV[2]) > tonumber(r[3]) then
  redis.call('HSET', KEYS[1], 'exp', ARGV[2])
  if ARGV[3] ~= '0' then
    redis.call('PEXPIREAT', KEYS[1], ARGV[3])
  end
end
return 'ok'
