-- Token bucket: the twin of crates/tollway-core/src/algorithm/token_bucket.rs.
-- State '<ddd' { a = full_at (µs), b = frac (ticks), the limit it was written at }. Tokens
-- are counted in ticks: a token is `period` ticks and a microsecond refills `limit`. A
-- state written at another limit (a changed quota: see Policy::state_id) is read at that
-- limit and carried to this one (the twin of `carry`). The leaky bucket meter is this.
-- Returns denial, remaining, reset, wait, and the new state and its `a`: when allowed,
-- and when refused after a carry (the carried state, kept so).

local token_bucket
if not only or only == '1' or only == '2' then
  function token_bucket(now, cost, limit, period, burst, v)
    local cap, deficit, moved = burst * period, 0, false
    if v then
      local full_at, frac, rate = unpack('<ddd', v)
      if now < full_at then
        -- At most 2^52 ticks missing, a debt included (charges that did not fit: see
        -- `most_owed` in crates/tollway-core/src/quota.rs), refilled within
        -- ceil(2^52 / rate) µs. Inline: a function costs a closure.
        local ahead, fill = full_at - now, 4503599627370496 / rate
        fill = fill + (-fill) % 1
        if ahead > fill then ahead = fill end
        deficit = ahead * rate - frac
        if deficit < 0 then deficit = 0 elseif deficit > 4503599627370496 then deficit = 4503599627370496 end
        moved = rate ~= limit
      end
    end
    local after = deficit + cost * period
    if cost <= burst and after <= cap then
      local us, left = after / limit, (cap - after) / period
      us = us + (-us) % 1
      return 0, left - left % 1, us, 0, pack('<ddd', now + us, us * limit - after, limit), now + us
    end
    local left, reset = (cap - deficit) / period, deficit / limit
    if left < 0 then left = 0 end
    left, reset = left - left % 1, reset + (-reset) % 1
    local x, a
    if moved then x, a = pack('<ddd', now + reset, reset * limit - deficit, limit), now + reset end
    if cost > burst then return 2, left, reset, 0, x, a end
    local retry = (after - cap) / limit
    return 1, left, reset, retry + (-retry) % 1, x, a
  end
end
