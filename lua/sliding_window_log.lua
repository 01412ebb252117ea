-- Sliding window log: the twin of crates/tollway-core/src/algorithm/sliding_log.rs.
-- State: a sorted set with one member per admitted unit, score = admission time (µs),
-- member = a sequence number above 10^15 (16 digits, so that members of equal score sort
-- by number). The last member in the set's order (newest time) always has the highest
-- number, so the next numbers follow from it alone. Every command is O(log n) (the
-- admission: O(cost × log n)); the log is never read whole. `a` = the newest time + period.

local sliding_window_log, sliding_window_log_admit
if not only or only == '5' then
  -- Drops what slid out, then decides. Returns denial, remaining, reset, wait, and the
  -- newest entry's number and time (nil for an empty log) for sliding_window_log_admit.
  function sliding_window_log(key, now, cost, limit, period)
    if now >= period then call('ZREMRANGEBYSCORE', key, '-inf', now - period) end
    local total, reset, seq, newest = call('ZCARD', key), 0, nil, nil
    if total > 0 then
      local last = call('ZRANGE', key, -1, -1, 'WITHSCORES')
      seq, newest = last[1] + 0, last[2] + 0
      reset = newest + period - now
    end
    if cost <= limit and cost <= 1000 and total + cost <= limit then
      -- Admitted now, the newest entry is now's, unless the request is free (or a clock
      -- behind wrote a newer one).
      if cost > 0 and reset < period then reset = period end
      return 0, limit - total - cost, reset, 0, seq, newest
    end
    local left = limit - total
    if left < 0 then left = 0 end
    -- MAX_SLIDING_LOG_COST: one call writes at most 1,000 members.
    if cost > limit or cost > 1000 then return 2, left, reset, 0 end
    -- Wait until enough of the oldest units have slid out: the (total + cost − limit)th.
    local rank = total + cost - limit - 1
    local at = call('ZRANGE', key, rank, rank, 'WITHSCORES')
    return 1, left, reset, at[2] + period - now
  end

  -- Records `cost` (> 0) units at `now` that sliding_window_log allowed.
  function sliding_window_log_admit(key, now, cost, period, grace, seq, newest)
    seq = seq or 1e15
    if cost == 1 then
      call('ZADD', key, now, seq + 1)
    else
      -- At most 1,000 units a ZADD.
      local args, m = { 'ZADD', key }, 2
      for j = 1, cost do
        args[m + 1], args[m + 2], m = now, seq + j, m + 2
        if m >= 2002 or j == cost then
          call(unpack_list(args, 1, m))
          m = 2
        end
      end
    end
    local a = now + period
    if newest and newest > now then
      -- A caller's clock behind the newest entry: renumber that entry past the new ones.
      call('ZREM', key, seq)
      call('ZADD', key, newest, seq + cost + 1)
      a = newest + period
    end
    local ttl = (a - since) / 1000
    call(pexpire, key, ttl + (-ttl) % 1 + grace)
  end
end
