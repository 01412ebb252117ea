-- The entry of the second script: charges, refunds or resets each limit of KEYS on its
-- own (corrections after the fact: nothing is refused), then replies what a request of
-- cost 0 gets from each, four integers a limit as check.lua replies. The twin of the
-- memory store's Table::apply (crates/tollway-core/src/store/memory/mod.rs) and of each
-- algorithm's `refund` in crates/tollway-core/src/algorithm/.
-- ARGV as prelude.lua describes, with [2] the units, and one more after the limits:
-- [4 + 5N] the operation, 'charge', 'refund', 'reset' or 'drain' (take what is left over
-- the units: at most that many remain), or 'lend' (see below), with [5 + 5N] its cost, or
-- 'giveback' (see below), with [5 + 5N] .. [4 + 6N] the windows' ends.
-- Not on the request path, so it is written for reading: helper functions, one loop.

local units, grace, op = argv[2] + 0, argv[3] + 0, argv[4 + 5 * n]

-- Limit i's algorithm code and numbers.
local function limit_of(i)
  local j = 5 * i
  return argv[j - 1], argv[j] + 0, argv[j + 1] + 0, argv[j + 2] + 0, argv[j + 3] + 0
end

-- Decides limit i at `cost` from its stored value `v` (the log reads its own key).
local function decide(i, cost, v)
  local code, limit, period, burst, emission = limit_of(i)
  if code == '7' then
    return gcra(now, cost, burst, emission, v)
  elseif code == '1' or code == '2' then
    return token_bucket(now, cost, limit, period, burst, v)
  elseif code == '3' then
    return leaky_shaper(now, cost, burst, emission, v)
  elseif code == '4' then
    return fixed_window(now, cost, limit, period, v)
  elseif code == '9' then
    -- A calendar's window: its start, end and the next end in period, burst, emission.
    return fixed_window(now, cost, limit, burst, v, period, emission)
  elseif code == '6' then
    return sliding_window_counter(now, cost, limit, period, v)
  elseif code == '5' then
    return sliding_window_log(keys[i], now, cost, limit, period)
  elseif code == '8' then
    return concurrency(keys[i], now, cost, limit, period, argv[5 * i + 2])
  end
  return error('tollway: unknown algorithm code ' .. tostring(code))
end

-- Concurrency: this gateway's live slots, less the units; their expiry stays.
local function concurrency_refund(i)
  local key, gateway = keys[i], argv[5 * i + 2]
  local own = call('HGET', key, gateway)
  if not own then return end
  local a, count = unpack('<dd', own)
  if a <= now then count = 0 end
  count = count - units
  if count < 0 then count = 0 end
  concurrency_write(key, gateway, count, a, grace)
end

-- Concurrency: a charge takes the free slots up to the units (a drain, those over the
-- units), and renews the gateway's slots, as a check of that cost does.
local function concurrency_charge(i, drain)
  local _, limit, period = limit_of(i)
  local key, gateway = keys[i], argv[5 * i + 2]
  local _, left = concurrency(key, now, 0, limit, period, gateway)
  local c = units
  if drain then
    c = left - units
    if c < 0 then c = 0 end
  elseif left < c then
    c = left
  end
  local denial, _, _, _, x, a = concurrency(key, now, c, limit, period, gateway)
  if denial ~= 0 then return error('tollway: a charge of what is left was refused') end
  if x > 0 then concurrency_write(key, gateway, x, a, grace) end
end

-- Writes a fixed-size state `x`, fresh from `a` on, as check.lua does; returns what the
-- key now holds (false: nothing).
local function store(key, v, x, a)
  if a > now then
    if x ~= v then
      local ttl = (a - since) / 1000
      call('SET', key, x, px, ttl + (-ttl) % 1 + grace)
    end
    return x
  end
  if v then call('DEL', key) end
  return false
end

-- The most units a bucket may owe, `per_unit` being one unit in the algorithm's measure
-- (the period in ticks for the token bucket, the emission interval in µs for GCRA): its
-- state runs at most 2^52 past full (the twin of `most_owed` in
-- crates/tollway-core/src/quota.rs).
local MOST = 4503599627370496
local function most_owed(per_unit)
  local q = MOST / per_unit
  return q - q % 1
end

-- A token bucket's deficit at now, read as token_bucket.lua reads it.
local function token_bucket_deficit(limit, full_at, frac)
  if now >= full_at then return 0 end
  local ahead, fill = full_at - now, MOST / limit
  fill = fill + (-fill) % 1
  if ahead > fill then ahead = fill end
  local deficit = ahead * limit - frac
  if deficit < 0 then deficit = 0 elseif deficit > MOST then deficit = MOST end
  return deficit
end

-- Limit i's value `v`, a bucket's or GCRA's written at another limit carried to this one
-- first, and kept so, as a request would (token_bucket.lua, gcra.lua); what its key now
-- holds.
local function carried(i, v)
  local code = argv[5 * i - 1]
  if not v or (code ~= '1' and code ~= '2' and code ~= '3' and code ~= '7') then return v end
  local _, _, _, _, x, a = decide(i, 0, v)
  if x and x ~= v then return store(keys[i], v, x, a) end
  return v
end

-- The refunds of the fixed-size states: each returns the new state and its `a` (false, 0
-- for a fresh one).

-- Token bucket (and the meter): the deficit read as token_bucket reads it, less the units.
local function token_bucket_refund(limit, period, v)
  if not v then return false, 0 end
  local full_at, frac = unpack('<ddd', v)
  if now >= full_at then return false, 0 end
  local u, most = units, most_owed(period)
  if u > most then u = most end
  local deficit = token_bucket_deficit(limit, full_at, frac) - u * period
  if deficit <= 0 then return false, 0 end
  local us = deficit / limit
  us = us + (-us) % 1
  return pack('<ddd', now + us, us * limit - deficit, limit), now + us
end

-- GCRA (and the shaper): the arrival time back by the units' intervals, not before now.
local function gcra_refund(emission, v)
  if not v then return false, 0 end
  local u, most = units, most_owed(emission)
  if u > most then u = most end
  local tat = unpack('<dd', v) - u * emission
  if tat <= now then return false, 0 end
  return pack('<dd', tat, emission), tat
end

-- A fixed window's current end (a calendar's too): what `decide` says it is.
local function window_end_of(i, v)
  return select(7, decide(i, 0, v))
end

-- Fixed window: the current window's count, less the units.
local function fixed_window_refund(window_end, v)
  if not v then return false, 0 end
  local stored_end, count = unpack('<dd', v)
  count = count - units
  if stored_end ~= window_end or count <= 0 then return false, 0 end
  return pack('<dd', window_end, count), window_end
end

-- The sliding window counter's current window and its counts, read from `v` as
-- sliding_window_counter.lua reads them: start, prev, curr.
local function sliding_window_counter_counts(period, v)
  local start = now / period
  start = (start - start % 1) * period
  local expires_at, stored_prev, stored_curr = unpack('<ddd', v)
  local own_start, prev, curr = -1, 0, 0
  if stored_curr > 0 then
    own_start = expires_at - 2 * period
    if own_start < 0 then own_start = 0 end
  elseif stored_prev > 0 then
    own_start = expires_at - period
    if own_start < 0 then own_start = 0 end
  end
  if own_start > start then start = own_start end
  if own_start == start then
    prev, curr = stored_prev, stored_curr
  elseif own_start >= 0 and own_start + period == start then
    prev = stored_curr
  end
  return start, prev, curr
end

-- The state of a sliding window counter whose current window starts at `start`, and its
-- `a` (false, 0 for a fresh one).
local function sliding_window_counter_state(period, start, prev, curr)
  if curr > 0 then
    return pack('<ddd', start + 2 * period, prev, curr), start + 2 * period
  elseif prev > 0 then
    return pack('<ddd', start + period, prev, 0), start + period
  end
  return false, 0
end

-- Sliding window counter: from the current window's count first, then the previous's.
local function sliding_window_counter_refund(period, v)
  if not v then return false, 0 end
  local start, prev, curr = sliding_window_counter_counts(period, v)
  local from_prev = units - curr
  if from_prev < 0 then from_prev = 0 end
  curr, prev = curr - units, prev - from_prev
  if curr < 0 then curr = 0 end
  if prev < 0 then prev = 0 end
  return sliding_window_counter_state(period, start, prev, curr)
end

-- 'giveback': a loan's unspent units back to the windows they came from, ARGV[4 + 5N + i]
-- being where limit i's window ends (µs). The twins of `give_back` in
-- crates/tollway-core/src/algorithm/fixed_window.rs and sliding_counter.rs; the buckets,
-- GCRA and the log keep their state. Each returns the new state and its `a`, or `v` as it
-- was.

-- Fixed window: off the count while the window is still the current one.
local function fixed_window_give_back(window_end, v, stop)
  local stored_end, count = unpack('<dd', v)
  if stored_end ~= stop or window_end ~= stop then return v, 0 end
  count = count - units
  if count <= 0 then return false, 0 end
  return pack('<dd', stop, count), stop
end

-- Sliding window counter: off the current count while that window counts them, off the
-- previous count once it has just ended.
local function sliding_window_counter_give_back(period, v, stop)
  local start, prev, curr = sliding_window_counter_counts(period, v)
  if start + period == stop then
    curr = curr - units
    if curr < 0 then curr = 0 end
  elseif start == stop then
    prev = prev - units
    if prev < 0 then prev = 0 end
  else
    return v, 0
  end
  return sliding_window_counter_state(period, start, prev, curr)
end

-- Gives limit i's units back to the window ending at its ARGV; returns what its key holds.
local function give_back(i, v)
  local code, _, period = limit_of(i)
  if not v or (code ~= '4' and code ~= '6' and code ~= '9') then return v end
  local stop, x, a = argv[4 + 5 * n + i] + 0, v, 0
  if code == '4' or code == '9' then
    x, a = fixed_window_give_back(window_end_of(i, v), v, stop)
  else
    x, a = sliding_window_counter_give_back(period, v, stop)
  end
  if x == v then return v end
  return store(keys[i], v, x, a)
end

-- Gives the units back to limit i; returns what its key now holds.
local function refund(i, v)
  local key = keys[i]
  local code, limit, period, _, emission = limit_of(i)
  local x, a
  if code == '5' then
    -- The log: what slid out, then the newest units.
    if now >= period then call('ZREMRANGEBYSCORE', key, '-inf', now - period) end
    if units > 0 then call('ZPOPMAX', key, units) end
    return false
  elseif code == '8' then
    concurrency_refund(i)
    return false
  elseif code == '1' or code == '2' then
    x, a = token_bucket_refund(limit, period, v)
  elseif code == '7' or code == '3' then
    x, a = gcra_refund(emission, v)
  elseif code == '4' or code == '9' then
    x, a = fixed_window_refund(window_end_of(i, v), v)
  elseif code == '6' then
    x, a = sliding_window_counter_refund(period, v)
  else
    return error('tollway: unknown algorithm code ' .. tostring(code))
  end
  return store(key, v, x, a)
end

-- The overdrafts of the buckets and GCRA: `owed` units past what fits in the state `x`
-- (which is not fresh: the units that fit were just taken), kept as a debt up to 2^52;
-- each returns the new state and its `a`.

-- Token bucket (and the meter): the deficit grows by the units' ticks.
local function token_bucket_overdraw(limit, period, x, owed)
  local full_at, frac = unpack('<ddd', x)
  local most = most_owed(period)
  if owed > most then owed = most end
  local deficit = token_bucket_deficit(limit, full_at, frac) + owed * period
  if deficit > MOST then deficit = MOST end
  local us = deficit / limit
  us = us + (-us) % 1
  return pack('<ddd', now + us, us * limit - deficit, limit), now + us
end

-- GCRA (and the shaper): the arrival time on by the units' intervals.
local function gcra_overdraw(emission, x, owed)
  local ahead = unpack('<dd', x) - now
  if ahead < 0 then ahead = 0 elseif ahead > MOST then ahead = MOST end
  local most = most_owed(emission)
  if owed > most then owed = most end
  ahead = ahead + owed * emission
  if ahead > MOST then ahead = MOST end
  return pack('<dd', now + ahead, emission), now + ahead
end

-- Takes the units from limit i: what it has left, as a request (whole units, which always
-- fit), and the buckets and GCRA owe the rest (see Operation::Charge); with `drain`, what
-- it has left over the units instead. Returns what its key now holds.
local function charge(i, v, drain)
  if argv[5 * i - 1] == '8' then
    concurrency_charge(i, drain)
    return false
  end
  local _, left = decide(i, 0, v)
  local c = units
  if drain then
    c = left - units
    if c <= 0 then return v end
  elseif left < c then
    c = left
  end
  -- A sliding log takes at most what one request may (MAX_SLIDING_LOG_COST).
  if argv[5 * i - 1] == '5' and c > 1000 then c = 1000 end
  local x, a = v, 0
  if c > 0 then
    local denial
    denial, _, _, _, x, a = decide(i, c, v)
    if denial ~= 0 then return error('tollway: a charge of what is left was refused') end
    if argv[5 * i - 1] == '5' then
      sliding_window_log_admit(keys[i], now, c, argv[5 * i + 1] + 0, grace, x, a)
      return false
    end
  end
  local code, limit, period, _, emission = limit_of(i)
  if not drain and units > c and x then
    if code == '1' or code == '2' then
      x, a = token_bucket_overdraw(limit, period, x, units - c)
    elseif code == '7' or code == '3' then
      x, a = gcra_overdraw(emission, x, units - c)
    end
  end
  if c == 0 and x == v then return v end
  return store(keys[i], v, x, a)
end

-- 'lend': a request of ARGV[5 + 5N] units (its cost) and up to ARGV[2] units in all: at
-- most half of what the fullest-spent limit has left (rounded up), and at least the cost.
-- All or nothing, decided as check.lua decides a request of the units taken. Replies check.lua's
-- four integers a limit, then the units taken (0 when refused), then the time it decided at
-- (the caller's or the server's). The
-- twin of `grant_size` in crates/tollway-core/src/store/lend.rs. The log and the shaper
-- do not lend: a unit spent later would need its own instant there.
if op == 'lend' then
  local cost, values, least = argv[5 + 5 * n] + 0, {}, -1
  for i = 1, n do
    local code = argv[5 * i - 1]
    if code == '3' or code == '5' or code == '8' then
      return error('tollway: the shaper, the sliding window log and concurrency do not lend')
    end
    local v = carried(i, call('GET', keys[i]))
    local _, left = decide(i, 0, v)
    values[i] = v
    if least < 0 or left < least then least = left end
  end
  local take = least / 2
  take = take + (-take) % 1
  if take > units then take = units end
  if take < cost then take = cost end
  local reply, held, denied = {}, {}, false
  for i = 1, n do
    local denial, remaining, reset, wait, x, a = decide(i, take, values[i])
    reply[4 * i - 3], reply[4 * i - 2], reply[4 * i - 1], reply[4 * i] = denial, remaining, reset, wait
    held[2 * i - 1], held[2 * i] = x, a
    if denial ~= 0 then denied = true end
  end
  if denied then
    -- As check.lua: the limits that allowed reply what a request of 0 gets.
    for i = 1, n do
      if reply[4 * i - 3] == 0 then
        local denial, remaining, reset, wait = decide(i, 0, values[i])
        reply[4 * i - 3], reply[4 * i - 2], reply[4 * i - 1], reply[4 * i] = denial, remaining, reset, wait
      end
    end
    take = 0
  else
    for i = 1, n do store(keys[i], values[i], held[2 * i - 1], held[2 * i]) end
  end
  reply[4 * n + 1] = take
  reply[4 * n + 2] = now
  return reply
end

local reply = {}
for i = 1, n do
  local key, v = keys[i], false
  local code = argv[5 * i - 1]
  if code ~= '5' and code ~= '8' then v = carried(i, call('GET', key)) end
  if op == 'reset' then
    call('DEL', key)
    v = false
  elseif op == 'refund' then
    v = refund(i, v)
  elseif op == 'charge' then
    v = charge(i, v, false)
  elseif op == 'drain' then
    v = charge(i, v, true)
  elseif op == 'giveback' then
    v = give_back(i, v)
  else
    return error('tollway: unknown operation ' .. tostring(op))
  end
  local denial, remaining, reset, wait = decide(i, 0, v)
  reply[4 * i - 3], reply[4 * i - 2], reply[4 * i - 1], reply[4 * i] = denial, remaining, reset, wait
end
reply[4 * n + 1] = told
return reply
