-- Fixed window: the twin of crates/tollway-core/src/algorithm/fixed_window.rs.
-- State '<dd' { a = the end of the window (µs), b = units admitted in it }. Windows are
-- aligned to multiples of the period since the epoch; a stored later window is current.
-- A calendar's windows (code 9; crates/tollway-core/src/calendar.rs) are computed on the
-- gateway, which sends the window that held its now, `start` .. `period`, and the next
-- one's end, `next`: the script takes the one that holds its own now (past `next`,
-- windows of the next one's length).
-- Returns denial, remaining, reset, wait, when allowed the new state and its `a` (else
-- nil), and the window's end.

local fixed_window
if not only or only == '4' or only == '9' then
  function fixed_window(now, cost, limit, period, v, start, next)
    local window_end
    if not start then
      window_end = now / period
      window_end = (window_end - window_end % 1) * period + period
    elseif now < start then
      window_end = start
    elseif now < period then
      window_end = period
    elseif now < next then
      window_end = next
    else
      local length = next - period
      window_end = (now - next) / length
      window_end = next + (window_end - window_end % 1 + 1) * length
    end
    local count = 0
    if v then
      -- A later window than now's (a node whose clock runs ahead) is the current one.
      local stored_end, stored_count = unpack('<dd', v)
      if stored_end > window_end then window_end = stored_end end
      if stored_end == window_end then count = stored_count end
    end
    if cost <= limit and count + cost <= limit then
      count = count + cost
      -- An empty window is a fresh key: keep nothing for it.
      if count == 0 then return 0, limit, 0, 0, '', 0, window_end end
      return 0, limit - count, window_end - now, 0, pack('<dd', window_end, count), window_end, window_end
    end
    local left = limit - count
    if left < 0 then left = 0 end
    if cost <= limit then return 1, left, window_end - now, window_end - now, nil, nil, window_end end
    if count > 0 then return 2, left, window_end - now, 0, nil, nil, window_end end
    return 2, left, 0, 0, nil, nil, window_end
  end
end
