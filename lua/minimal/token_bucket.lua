-- A minimal token bucket, for comparison only (crates/tollway-core/benches/redis_scripts.sh):
-- HMGET of two fields, refill, HSET, PEXPIRE; float arithmetic, no exactness, one limit.
-- KEYS and ARGV as tollway's script with one limit (prelude.lua); reply 4 integers.
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
else
  now = tonumber(ARGV[1])
end
local cost, grace = tonumber(ARGV[2]), tonumber(ARGV[3])
local rate = tonumber(ARGV[5]) / tonumber(ARGV[6]) -- tokens per µs
local burst = tonumber(ARGV[7])
local v = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens, ts = tonumber(v[1]), tonumber(v[2])
if not tokens then tokens, ts = burst, now end
tokens = math.min(burst, tokens + math.max(now - ts, 0) * rate)
local denied, retry = 1, math.ceil((cost - tokens) / rate)
if tokens >= cost then tokens, denied, retry = tokens - cost, 0, 0 end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', now)
local reset = math.ceil((burst - tokens) / rate)
redis.call('PEXPIRE', KEYS[1], math.ceil(reset / 1000) + grace)
return { denied, math.floor(tokens), reset, retry }
