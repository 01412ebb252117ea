-- Leaky bucket: the twin of crates/tollway-core/src/algorithm/leaky_bucket.rs.
-- Runs after token_bucket.lua and gcra.lua. KEYS[1]: state string, as theirs.
-- ARGV and reply: prelude.lua; the shaper's reply carries the delay (µs) in field 6.

-- The meter is the token bucket seen from the other side: water poured in instead of
-- tokens taken out; `a` is when the bucket is empty.
local function leaky_meter(empty_at, frac)
  return token_bucket(empty_at, frac)
end

-- The shaper queues requests and releases them every EMISSION µs: GCRA's admission,
-- with the wait until the request's slot as its delay. `a` is when the queue drains.
local function leaky_shaper(drains_at)
  local reply, new_tat = gcra(drains_at)
  if reply[1] == 0 then
    reply[6] = math.max(drains_at - NOW, 0)
  end
  return reply, new_tat
end
