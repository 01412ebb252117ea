-- Leaky bucket: the twin of crates/tollway-core/src/algorithm/leaky_bucket.rs.
-- The meter is token_bucket itself (same decisions, same state): check.lua calls it.
-- The shaper is GCRA's admission with the wait until the request's slot as its delay:
-- state '<dd' { a = when the queue drains (µs), the emission interval it was written at }.

local leaky_shaper
if not only or only == '3' then
  function leaky_shaper(now, cost, burst, emission, v)
    local denial, remaining, reset, wait, state, a = gcra(now, cost, burst, emission, v)
    if denial == 0 then wait = reset - cost * emission end
    return denial, remaining, reset, wait, state, a
  end
end
