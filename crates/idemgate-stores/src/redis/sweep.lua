-- sweep: delete KEYS[1] if its record has expired at ARGV[1] (the caller's clock). Redis drops
-- expired keys itself (a grace period after the logical expiry); this is the explicit form.
local e = redis.call('HGET', KEYS[1], 'exp')
if e and tonumber(ARGV[1]) >= tonumber(e) then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
