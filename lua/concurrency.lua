-- Concurrency (calls in flight): the twin of crates/tollway-core/src/algorithm/concurrency.rs.
-- State: a hash with one field a gateway (ARGV: its number), '<dd' { a = when its slots
-- expire unless renewed (µs), b = slots it holds }. A field whose a <= now holds none.
-- With one gateway this is the Rust function's state. The key lives until its latest
-- field expires.

local concurrency, concurrency_write
if not only or only == '8' then
  -- Decides a request of `cost` slots for `gateway`. Returns denial, remaining, reset,
  -- wait, and the gateway's new count and expiry (0, 0 when it holds none).
  function concurrency(key, now, cost, limit, period, gateway)
    local fields = call('HGETALL', key)
    local held, own, latest = 0, 0, 0
    for f = 1, #fields, 2 do
      local a, b = unpack('<dd', fields[f + 1])
      if a > now then
        held = held + b
        if a > latest then latest = a end
        if fields[f] == gateway then own = b end
      end
    end
    local reset = 0
    if held > 0 then reset = latest - now end
    if cost > limit then
      local left = limit - held
      if left < 0 then left = 0 end
      return 2, left, reset, 0
    end
    if held + cost <= limit then
      if held + cost == 0 then return 0, limit, 0, 0, 0, 0 end
      -- This gateway's slots, renewed: the latest of all now, or a clock ahead's.
      own = own + cost
      local a = 0
      if own > 0 then
        a = now + period
        if latest < a then latest = a end
      end
      return 0, limit - held - cost, latest - now, 0, own, a
    end
    local wait = period
    if wait > 1000000 then wait = 1000000 end
    -- Under a limit cut below what is held (see Policy::state_id), nothing is left.
    local left = limit - held
    if left < 0 then left = 0 end
    return 1, left, reset, wait
  end

  -- Writes `gateway`'s `count` slots expiring at `a` (none: its field goes), drops the
  -- fields that have expired, and keeps the key until its latest field expires (+ grace).
  function concurrency_write(key, gateway, count, a, grace)
    local fields, stale, latest = call('HGETALL', key), {}, 0
    if count > 0 then latest = a end
    for f = 1, #fields, 2 do
      if fields[f] ~= gateway then
        local other = unpack('<d', fields[f + 1])
        if other <= now then
          stale[#stale + 1] = fields[f]
        elseif other > latest then
          latest = other
        end
      end
    end
    if count > 0 then
      call('HSET', key, gateway, pack('<dd', a, count))
    else
      stale[#stale + 1] = gateway
    end
    if #stale > 0 then call('HDEL', key, unpack_list(stale)) end
    if latest > now then
      local ttl = (latest - since) / 1000
      call(pexpire, key, ttl + (-ttl) % 1 + grace)
    end
  end
end
