-- swap: the write of a `begin` that found a record, decided in Rust by
-- idemgate_core::rules::begin on the value `SET NX GET` returned, applied only if the record is
-- still the one it decided on: its header (layout.rs) is unchanged, and every change to a
-- record (complete, renew, a waiter's mark, a new owner) changes the header.
-- ARGV: 1 the header decided on, 2 'wait' (mark that someone waits) or 'put' (a new owner),
--       3 the new record (put), 4 its pexpireat ('0' = none).
-- Returns 1 when applied, 0 when the record changed (the caller asks again).
local key = KEYS[1]
if redis.call('GETRANGE', key, 0, 130) ~= ARGV[1] then
  return 0
end
if ARGV[2] == 'wait' then
  redis.call('SETRANGE', key, 2, '1')
elseif ARGV[4] == '0' then
  redis.call('SET', key, ARGV[3])
else
  redis.call('SET', key, ARGV[3], 'PXAT', ARGV[4])
end
return 1
