-- GCRA: the twin of crates/tollway-core/src/algorithm/gcra.rs.
-- State '<dd' { a = the theoretical arrival time (µs), the emission interval it was
-- written at }. A state written at another interval (a changed quota: see
-- Policy::state_id) is carried to this one: the units still ahead, a part of one counted
-- whole, at most 2^52 µs (the twin of `carry`). The leaky bucket shaper runs this.
-- Returns denial, remaining, reset, wait, and the new state and its `a`: when allowed,
-- and when refused after a carry (the carried state, kept so).

local gcra
if not only or only == '7' or only == '3' then
  function gcra(now, cost, burst, emission, v)
    local window, ahead, moved = burst * emission, 0, false
    if v then
      local tat, rate = unpack('<dd', v)
      ahead = tat - now
      if ahead < 0 then
        ahead = 0
      elseif rate ~= emission then
        if ahead > 4503599627370496 then ahead = 4503599627370496 end
        local units, most = ahead / rate, 4503599627370496 / emission
        units, most = units + (-units) % 1, most - most % 1
        if units > most then units = most end
        ahead, moved = units * emission, true
      end
    end
    local after = ahead + cost * emission
    if cost <= burst and after <= window then
      local left = (window - after) / emission
      return 0, left - left % 1, after, 0, pack('<dd', now + after, emission), now + after
    end
    local left = window - ahead
    if left < 0 then left = 0 end
    left = left / emission
    local x, a
    if moved then x, a = pack('<dd', now + ahead, emission), now + ahead end
    if cost > burst then return 2, left - left % 1, ahead, 0, x, a end
    return 1, left - left % 1, ahead, after - window, x, a
  end
end
