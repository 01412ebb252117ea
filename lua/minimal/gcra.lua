-- A minimal GCRA, for comparison only (crates/tollway-core/benches/redis_scripts.sh):
-- GET tat, arithmetic, SET PX; one limit.
-- KEYS and ARGV as tollway's script with one limit (prelude.lua); reply 4 integers.
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
else
  now = tonumber(ARGV[1])
end
local cost, grace = tonumber(ARGV[2]), tonumber(ARGV[3])
local burst, emission = tonumber(ARGV[7]), tonumber(ARGV[8])
local tat = math.max(tonumber(redis.call('GET', KEYS[1])) or now, now)
local window = burst * emission
local new_tat = tat + cost * emission
if new_tat - now <= window then
  redis.call('SET', KEYS[1], new_tat, 'PX', math.ceil((new_tat - now) / 1000) + grace)
  return { 0, math.floor((window - new_tat + now) / emission), new_tat - now, 0 }
end
return { 1, math.floor((window - tat + now) / emission), tat - now, new_tat - now - window }
