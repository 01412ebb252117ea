-- Sliding window counter: the twin of crates/tollway-core/src/algorithm/sliding_counter.rs.
-- State '<ddd' { a = when both counts have slid out (µs), b = the previous window's count,
-- c = the current window's count }; the window start follows from a (a − 2P while c > 0,
-- else a − P). The test prev × (P − e) + (cur + cost) × P <= limit × P has no division.
-- Exact while start + 2P < 2^53: periods up to (2^53 − now) / 2, 114 years today.
-- Returns denial, remaining, reset, wait, and when allowed the new state and its `a`.

local sliding_window_counter
if not only or only == '6' then
  function sliding_window_counter(now, cost, limit, period, v)
    local start = now / period
    start = (start - start % 1) * period
    local prev, curr = 0, 0
    if v then
      local expires_at, stored_prev, stored_curr = unpack('<ddd', v)
      local own_start = -1
      if stored_curr > 0 then
        own_start = expires_at - 2 * period
        if own_start < 0 then own_start = 0 end
      elseif stored_prev > 0 then
        own_start = expires_at - period
        if own_start < 0 then own_start = 0 end
      end
      -- A later window than now's (a node whose clock runs ahead) is the current one,
      -- at its very start.
      if own_start > start then start = own_start end
      if own_start == start then
        prev, curr = stored_prev, stored_curr
      elseif own_start >= 0 and own_start + period == start then
        prev = stored_curr
      end
    end
    local elapsed = now - start
    if elapsed < 0 then elapsed = 0 end
    local weighted, full = prev * (period - elapsed), limit * period
    if cost <= limit and weighted + (curr + cost) * period <= full then
      curr = curr + cost
      local left = (full - weighted - curr * period) / period
      left = left - left % 1
      if curr > 0 then
        local a = start + 2 * period
        return 0, left, a - now, 0, pack('<ddd', a, prev, curr), a
      elseif prev > 0 then
        local a = start + period
        return 0, left, a - now, 0, pack('<ddd', a, prev, 0), a
      end
      return 0, left, 0, 0, '', 0
    end
    local left = full - weighted - curr * period
    if left < 0 then left = 0 end
    left = left / period
    left = left - left % 1
    local reset = 0
    if curr > 0 then reset = start + 2 * period - now elseif prev > 0 then reset = start + period - now end
    if cost > limit then return 2, left, reset, 0 end
    -- The first instant at which `cost` more units fit: later in this window as the
    -- previous window's weight shrinks, else in the next, where this window's count is weighed.
    if prev > 0 and curr + cost <= limit then
      local fits = (limit - curr - cost) * period / prev
      local e = period - (fits - fits % 1)
      if e < period then return 1, left, reset, start + e - now end
    end
    local e = 0
    if curr > 0 then
      local fits = (limit - cost) * period / curr
      fits = fits - fits % 1
      if fits < period then e = period - fits end
    end
    return 1, left, reset, start + period + e - now
  end
end
