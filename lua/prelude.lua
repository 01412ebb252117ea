-- tollway prelude: shared by every script. The Redis store runs each algorithm as
--   prelude.lua .. <the files it needs> .. "return run(<algorithm>)"   (or run_log)
-- so a script is one atomic EVALSHA and the arithmetic lives once.
--
-- ARGV (every script):
--   [1] now in microseconds, or "" to read the server's clock (redis TIME)
--   [2] limit   [3] period (µs)   [4] burst   [5] emission interval (µs, ceil(period/limit))
--   [6] cost    [7] extra time-to-live in ms added to every key (0 with server time)
-- Reply (every script), integers:
--   { denial, limit, remaining, reset_after_us, retry_after_us, delay_us }
--   denial: 0 allowed, 1 limited (retry_after_us > 0), 2 cost exceeds capacity.
--
-- Lua numbers are doubles: every quantity here is an integer below 2^53 (the Rust side
-- validates quotas so), and division goes through idiv, which corrects the float quotient,
-- so the decisions equal the Rust functions' bit for bit.

if redis.replicate_commands then pcall(redis.replicate_commands) end

-- floor(a / b) for integers 0 <= a < 2^53, 0 < b.
local function idiv(a, b)
  local q = math.floor(a / b)
  while q * b > a do q = q - 1 end
  while (q + 1) * b <= a do q = q + 1 end
  return q
end

-- ceil(a / b) for integers 0 <= a, 0 < b.
local function cdiv(a, b)
  if a == 0 then return 0 end
  return idiv(a - 1, b) + 1
end

local function num(s) return tonumber(s) or 0 end

local NOW
if ARGV[1] == '' then
  local t = redis.call('TIME')
  NOW = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  NOW = tonumber(ARGV[1])
end
local LIMIT, PERIOD, BURST = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local EMISSION, COST, GRACE_MS = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])

local function allow(limit, remaining, reset, delay) return { 0, limit, remaining, reset, 0, delay } end
local function limited(limit, remaining, reset, retry) return { 1, limit, remaining, reset, retry, 0 } end
local function refused(limit, remaining, reset) return { 2, limit, remaining, reset, 0, 0 } end

-- Integers as Redis strings: tostring would print 1.7e+15.
local function str(n) return string.format('%.0f', n) end

-- Keeps `keys` until the state they hold is equivalent to a fresh key's (expires_at, µs),
-- or deletes them if it already is.
local function expire(keys, expires_at)
  local ttl = expires_at - NOW
  for _, key in ipairs(keys) do
    if ttl <= 0 then
      redis.call('DEL', key)
    else
      redis.call('PEXPIRE', key, cdiv(ttl, 1000) + GRACE_MS)
    end
  end
end

-- The fixed-size algorithms keep their state in one string, KEYS[1] = "a:b:c", written
-- with its expiry in the same SET; `a` is always the instant the state becomes
-- equivalent to a fresh key. An algorithm is a function (a, b, c) -> reply [, new a,
-- new b, new c]; no new state means no change.
local function run(algorithm)
  local key = KEYS[1]
  local a, b, c = 0, 0, 0
  local v = redis.call('GET', key)
  if v then
    local x, y, z = string.match(v, '^(%d+):(%d+):(%d+)$')
    a, b, c = num(x), num(y), num(z)
  end
  local reply, na, nb, nc = algorithm(a, b, c)
  if na then
    if na > NOW then
      local state = str(na) .. ':' .. str(nb or 0) .. ':' .. str(nc or 0)
      redis.call('SET', key, state, 'PX', cdiv(na - NOW, 1000) + GRACE_MS)
    elseif v then
      redis.call('DEL', key)
    end
  end
  return reply
end
