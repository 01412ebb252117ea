-- GCRA: the twin of crates/tollway-core/src/algorithm/gcra.rs.
-- State '<d' { a = the theoretical arrival time (µs) }. The leaky bucket shaper runs this.
-- Returns denial, remaining, reset, wait, and when allowed the new state and its `a`.

local gcra
if not only or only == '7' or only == '3' then
  function gcra(now, cost, burst, emission, v)
    local window, ahead = burst * emission, 0
    if v then
      ahead = unpack('<d', v) - now
      if ahead < 0 then ahead = 0 end
    end
    local after = ahead + cost * emission
    if cost <= burst and after <= window then
      local left = (window - after) / emission
      return 0, left - left % 1, after, 0, pack('<d', now + after), now + after
    end
    local left = window - ahead
    if left < 0 then left = 0 end
    left = left / emission
    if cost > burst then return 2, left - left % 1, ahead, 0 end
    return 1, left - left % 1, ahead, after - window
  end
end
