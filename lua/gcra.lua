-- GCRA: the twin of crates/tollway-core/src/algorithm/gcra.rs.
-- KEYS[1]: state string "a:b:c" { a = theoretical arrival time (µs) }. ARGV and reply: prelude.lua.

local function gcra(tat)
  local window = BURST * EMISSION
  local start = math.max(tat, NOW)
  local function remaining(ahead) return idiv(math.max(window - ahead, 0), EMISSION) end
  local ahead = start - NOW
  if COST > BURST then
    return refused(BURST, remaining(ahead), ahead)
  end
  local new_tat = start + COST * EMISSION
  local after = new_tat - NOW
  if after <= window then
    return allow(BURST, remaining(after), after, 0), new_tat
  end
  return limited(BURST, remaining(ahead), ahead, after - window)
end
