-- renew: idemgate_core::rules::renew on the record string KEYS[1] (layout.rs).
-- ARGV: 1 token, 2 lease_until (20 digits), 3 pexpireat for lease_until ('0' = none).
local h = redis.call('GETRANGE', KEYS[1], 0, 130)
if string.sub(h, 2, 2) ~= 'f' or string.sub(h, 44, 59) ~= ARGV[1] then
  return 'fenced'
end
-- The record lives at least as long as its lease: expiry and lease are adjacent.
if tonumber(ARGV[2]) > tonumber(string.sub(h, 4, 23)) then
  redis.call('SETRANGE', KEYS[1], 3, ARGV[2] .. ARGV[2])
  if ARGV[3] ~= '0' then
    redis.call('PEXPIREAT', KEYS[1], ARGV[3])
  end
elseif tonumber(ARGV[2]) > tonumber(string.sub(h, 24, 43)) then
  -- Never shortened: renewals may overlap or land late (rules::renew).
  redis.call('SETRANGE', KEYS[1], 23, ARGV[2])
end
return 'ok'
