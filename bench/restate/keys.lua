-- wrk script for bench/restate/run.sh: POST a JSON body with an idempotency key.
--   wrk -s keys.lua URL -- <miss|replay> <header> <key prefix> [pool]
-- miss: every request a fresh key; replay: keys cycle through a pool of `pool` keys (the
-- warm-up pass executes each once, the measured pass replays them).
local threads = 0

function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end

local mode, header, prefix, pool
local counter = 0

function init(args)
  mode, header, prefix = args[1], args[2], args[3]
  pool = tonumber(args[4] or "500")
end

function request()
  counter = counter + 1
  local key
  if mode == "miss" then
    key = prefix .. "-" .. tid .. "-" .. counter
  else
    key = prefix .. "-" .. (counter % pool)
  end
  return wrk.format("POST", nil, { [header] = key, ["Content-Type"] = "application/json" },
    '{"name":"bench"}')
end
