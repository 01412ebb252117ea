-- Token bucket: the twin of crates/tollway-core/src/algorithm/token_bucket.rs.
-- KEYS[1]: state string "a:b:c" { a = full_at (µs), b = frac (ticks) }. ARGV and reply: prelude.lua.
-- Tokens are counted in ticks: a token is PERIOD ticks, a microsecond refills LIMIT.

local function token_bucket(full_at, frac)
  local cap = BURST * PERIOD
  local deficit = 0
  if NOW < full_at then
    local ahead = math.min(full_at - NOW, cdiv(cap, LIMIT))
    deficit = math.min(math.max(ahead * LIMIT - frac, 0), cap)
  end
  local function remaining(d) return idiv(cap - d, PERIOD) end
  local function reset(d) return cdiv(d, LIMIT) end
  if COST > BURST then
    return refused(BURST, remaining(deficit), reset(deficit))
  end
  local after = deficit + COST * PERIOD
  if after <= cap then
    local us = cdiv(after, LIMIT)
    return allow(BURST, remaining(after), reset(after), 0), NOW + us, us * LIMIT - after
  end
  return limited(BURST, remaining(deficit), reset(deficit), cdiv(after - cap, LIMIT))
end
