-- Fixed window: the twin of crates/tollway-core/src/algorithm/fixed_window.rs.
-- KEYS[1]: state string "a:b:c" { a = end of the window (µs), b = units admitted in it }.
-- ARGV and reply: prelude.lua. Windows are aligned to multiples of PERIOD since the epoch.

local function fixed_window(stored_end, stored_count)
  local window_end = NOW - (NOW - idiv(NOW, PERIOD) * PERIOD) + PERIOD
  local count = 0
  if stored_end == window_end then count = stored_count end
  local function reset(n) if n > 0 then return window_end - NOW end return 0 end
  if COST > LIMIT then
    return refused(LIMIT, math.max(LIMIT - count, 0), reset(count))
  end
  if count + COST <= LIMIT then
    count = count + COST
    -- An empty window is a fresh key: keep nothing for it.
    if count == 0 then window_end = 0 end
    return allow(LIMIT, LIMIT - count, reset(count), 0), window_end, count
  end
  return limited(LIMIT, math.max(LIMIT - count, 0), window_end - NOW, window_end - NOW)
end
