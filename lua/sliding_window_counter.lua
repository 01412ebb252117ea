-- Sliding window counter: the twin of crates/tollway-core/src/algorithm/sliding_counter.rs.
-- KEYS[1]: state string "a:b:c" { a = when both counts have slid out (µs), b = previous window's
-- count, c = current window's count }. ARGV and reply: prelude.lua.
-- The test prev × (P − e) + (cur + cost) × P ≤ limit × P compares integers: no division.

local function sliding_window_counter(expires_at, stored_prev, stored_curr)
  local start = NOW - (NOW - idiv(NOW, PERIOD) * PERIOD)
  local elapsed = NOW - start
  local own_start = nil
  if stored_curr > 0 then
    own_start = math.max(expires_at - 2 * PERIOD, 0)
  elseif stored_prev > 0 then
    own_start = math.max(expires_at - PERIOD, 0)
  end
  local prev, curr = 0, 0
  if own_start == start then
    prev, curr = stored_prev, stored_curr
  elseif own_start and own_start + PERIOD == start then
    prev = stored_curr
  end
  local function used(c) return prev * (PERIOD - elapsed) + c * PERIOD end
  local function remaining(c) return idiv(math.max(LIMIT * PERIOD - used(c), 0), PERIOD) end
  local function reset(c)
    if c > 0 then return start + 2 * PERIOD - NOW end
    if prev > 0 then return start + PERIOD - NOW end
    return 0
  end
  if COST > LIMIT then
    return refused(LIMIT, remaining(curr), reset(curr))
  end
  if used(curr + COST) <= LIMIT * PERIOD then
    curr = curr + COST
    local state_expires = 0
    if curr > 0 then state_expires = start + 2 * PERIOD elseif prev > 0 then state_expires = start + PERIOD end
    return allow(LIMIT, remaining(curr), reset(curr), 0), state_expires, prev, curr
  end
  -- The first instant at which COST more units fit: later in this window as the previous
  -- window's weight shrinks, else in the next, where this window's count is weighed.
  local retry_at = nil
  if prev > 0 and curr + COST <= LIMIT then
    local e = PERIOD - idiv((LIMIT - curr - COST) * PERIOD, prev)
    if e < PERIOD then retry_at = start + e end
  end
  if not retry_at then
    local e = 0
    if curr > 0 then e = PERIOD - math.min(idiv((LIMIT - COST) * PERIOD, curr), PERIOD) end
    retry_at = start + PERIOD + e
  end
  return limited(LIMIT, remaining(curr), reset(curr), retry_at - NOW)
end
