-- begin: idemgate_core::rules::begin, atomically, on the record hash KEYS[1].
-- ARGV: 1 now, 2 token, 3 fingerprint, 4 route, 5 operation id, 6 lease_until, 7 expires_at,
--       8 pexpireat (physical expiry, '0' = none), 9 takeover ('1' / '0').
-- Every number is computed by the caller and only compared here, never formatted, so values
-- beyond 2^53 (a record that never expires) cannot lose precision on their way back.
local key = KEYS[1]
local now = tonumber(ARGV[1])
local r = redis.call('HMGET', key, 'st', 'tok', 'lease', 'fp', 'route', 'op', 'exp', 'gen', 'created')
local st, tok, lease, fp, route, op, exp, gen = r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8]

local function acquire(generation, took_over)
  -- A new record replaces whatever was there (an expired one, or a dead owner's).
  redis.call('DEL', key)
  redis.call('HSET', key, 'st', 'f', 'tok', ARGV[2], 'lease', ARGV[6], 'fp', ARGV[3],
    'route', ARGV[4], 'op', ARGV[5], 'created', ARGV[1], 'exp', ARGV[7], 'gen', generation)
  if ARGV[8] ~= '0' then
    redis.call('PEXPIREAT', key, ARGV[8])
  end
  return {'acquired', ARGV[5], generation, took_over}
end

-- Absent, or expired and so gone whether or not Redis has dropped the key yet.
if not st or now >= tonumber(exp) then
  return acquire('1', '0')
end
-- The same attempt, retried after its first begin took effect.
if st == 'f' and tok == ARGV[2] then
  local took = '0'
  if gen ~= '1' then took = '1' end
  return {'acquired', op, gen, took}
end
if fp ~= ARGV[3] or route ~= ARGV[4] then
  return {'mismatch', op}
end
if st == 'c' then
  return {'replay', tok, op, r[9], exp, gen, redis.call('HGET', key, 'resp') or ''}
end
if now < tonumber(lease) then
  -- Someone waits: complete and release will publish.
  redis.call('HSET', key, 'w', '1')
  return {'inflight', op, lease}
end
if ARGV[9] == '1' then
  return acquire(tostring(tonumber(gen) + 1), '1')
end
return {'expired', op}
