-- wrk script for bench/run.sh.
--
-- usage: wrk -t1 -c32 -d10s -s bench/idem.lua URL -- MODE KEYPREFIX [POOL]
--
--   MODE       passthrough | miss | replay | mixed
--   KEYPREFIX  miss:   a per-run nonce; every request gets a fresh key
--                      KEYPREFIX-<thread>-<random>-<counter>
--              replay: the pool prefix; requests cycle through KEYPREFIX0 ..
--                      KEYPREFIX<POOL-1> (the keys bench/run.sh primed)
--              mixed:  like miss, but 10% of the requests reuse a key this
--                      thread first sent 64 to 1023 requests earlier (a
--                      client retry of a completed request)
--   POOL       replay pool size (default 1000)
--
-- Every key matches ^[A-Za-z0-9._~-]{1,255}$ and never starts with "t-"
-- (bench/run.sh passes prefixes starting with "m" / "r").
--
-- All modes go through request() and response() so the load generator does
-- the same amount of Lua work per request for every target in a scenario.
-- Requests are formatted once in init(): the passthrough's one request, the
-- replay pool's, and for miss and mixed a template the key is joined into.
--
-- done() prints one parseable line:
--   RESULT rps=... p50_us=... p99_us=... requests=... non2xx=... replayed=...
--          unexpected=... sock_errors=... errors=...
-- where non2xx counts every response outside 200..299, replayed counts
-- responses carrying "Idempotent-Replayed: true", unexpected counts replay
-- markers that contradict the mode (a replay during passthrough/miss, a fresh
-- execution during replay), and errors = non2xx + unexpected + sock_errors.

local threads = {}
local next_id = 1

function setup(thread)
   thread:set("id", next_id)
   next_id = next_id + 1
   table.insert(threads, thread)
end

local PATH = "/api/v1/orders"
local BODY = '{"amount":100,"currency":"eur"}'

local mode, key_prefix, pool, n, static_req, pool_reqs, req_head, req_tail
-- stands for the key in the miss and mixed template; nothing else in a formatted request
-- (method, path, Host, Content-Type, body) contains it
local KEY_MARK = "@KEY@"
local headers

-- globals: read back from done() with thread:get()
responses, non2xx, replayed, unexpected, retries = 0, 0, 0, 0, 0
local RING, LAG = 1024, 64
local ring = {}

function init(args)
   mode = args[1] or "passthrough"
   pool = tonumber(args[3] or "1000")
   headers = { ["Content-Type"] = "application/json" }
   if mode == "passthrough" then
      static_req = wrk.format("POST", PATH, headers, BODY)
   elseif mode == "miss" or mode == "mixed" then
      -- per-thread random part so two threads (or two runs sharing a nonce)
      -- never collide; the nonce from run.sh already differs per run.
      math.randomseed(os.time() * 1000 + (id or 0) * 7919)
      key_prefix = (args[2] or "m") .. "-" .. tostring(id or 0) .. "-"
         .. tostring(math.random(1, 2000000000)) .. "-"
      n = 0
      -- Formatted once around a marker, so a request is three strings joined: wrk.format per
      -- request cost the load generator's core about 1 us of its 11-13 per miss.
      headers["Idempotency-Key"] = KEY_MARK
      local whole = wrk.format("POST", PATH, headers, BODY)
      local at = string.find(whole, KEY_MARK, 1, true)
      req_head = string.sub(whole, 1, at - 1)
      req_tail = string.sub(whole, at + #KEY_MARK)
   elseif mode == "replay" then
      key_prefix = args[2] or "r"
      -- start each thread at a different point of the pool
      math.randomseed(os.time() * 1000 + (id or 0) * 7919)
      n = math.random(0, pool - 1)
      -- The pool's requests are formatted once: formatting each one again kept wrk at 97-100%
      -- of its core at 96k replays a second.
      pool_reqs = {}
      for i = 0, pool - 1 do
         headers["Idempotency-Key"] = key_prefix .. i
         pool_reqs[i] = wrk.format("POST", PATH, headers, BODY)
      end
   else
      error("unknown mode " .. tostring(mode))
   end
end

function request()
   if static_req then
      return static_req
   end
   if mode == "miss" then
      n = n + 1
      return req_head .. key_prefix .. n .. req_tail
   elseif mode == "mixed" then
      n = n + 1
      local key
      if n > LAG + 1 and math.random() < 0.1 then
         local back = math.random(LAG, math.min(n - 1, RING - 1))
         key = ring[(n - back) % RING]
         retries = retries + 1
      else
         key = key_prefix .. n
      end
      ring[n % RING] = key
      return req_head .. key .. req_tail
   else
      n = (n + 1) % pool
      return pool_reqs[n]
   end
end

function response(status, hdrs, body)
   responses = responses + 1
   if status < 200 or status > 299 then
      non2xx = non2xx + 1
   end
   -- Two lookups, not a loop lowercasing every header: at 60k responses a second the loop
   -- alone kept the load generator's core busy. The peers send the header as
   -- "idempotent-replayed" (idemgate, HTTP/1.1 lowercase) or "Idempotent-Replayed" (the Node
   -- middlewares); another spelling would show up as "unexpected", not pass silently.
   local v = hdrs["idempotent-replayed"] or hdrs["Idempotent-Replayed"]
   if v == "true" or v == "True" then
      replayed = replayed + 1
      if mode ~= "replay" and mode ~= "mixed" then unexpected = unexpected + 1 end
   elseif mode == "replay" then
      unexpected = unexpected + 1
   end
end

function done(summary, latency, requests)
   local nx, rp, un, rt = 0, 0, 0, 0
   for _, t in ipairs(threads) do
      nx = nx + (t:get("non2xx") or 0)
      rp = rp + (t:get("replayed") or 0)
      un = un + (t:get("unexpected") or 0)
      rt = rt + (t:get("retries") or 0)
   end
   if mode == "mixed" then
      -- responses are not matched to requests one by one: the replay count
      -- must equal the retry count, up to the requests still in flight at the end
      local diff = math.abs(rp - rt)
      if diff > summary.requests * 0.01 + 64 then un = un + diff end
   end
   local e = summary.errors
   local sock = e.connect + e.read + e.write + e.timeout
   local secs = summary.duration / 1e6
   local rps = 0
   if secs > 0 then rps = summary.requests / secs end
   io.write(string.format(
      "RESULT rps=%.1f p50_us=%d p99_us=%d requests=%d non2xx=%d replayed=%d retries=%d unexpected=%d sock_errors=%d errors=%d\n",
      rps, latency:percentile(50.0), latency:percentile(99.0), summary.requests,
      nx, rp, rt, un, sock, nx + un + sock))
end
