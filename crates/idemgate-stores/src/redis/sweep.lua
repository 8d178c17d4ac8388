-- sweep: delete KEYS[1] if its record has expired at ARGV[1] (the caller's clock). Redis drops
-- expired keys itself (a grace period after the logical expiry); this is the explicit form.
local h = redis.call('GETRANGE', KEYS[1], 3, 22)
if #h == 20 and tonumber(ARGV[1]) >= tonumber(h) then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
