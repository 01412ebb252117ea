-- Sliding window log: the twin of crates/tollway-core/src/algorithm/sliding_log.rs.
-- KEYS[1]: sorted set of admitted requests, score = time (µs), member = "<seq>:<units>"
--          (a sequence number keeps members unique when times are equal).
-- KEYS[2]: hash { total = units in KEYS[1], seq = last sequence number }.
-- Both share one hash tag, so the script never crosses slots. ARGV and reply: prelude.lua.

local function units(member) return tonumber(string.match(member, ':(%d+)$')) end

local function run_log()
  local log, meta = KEYS[1], KEYS[2]
  local total = num(redis.call('HGET', meta, 'total'))
  local changed = false
  -- Entries at or before NOW − PERIOD have slid out.
  local cutoff = NOW - PERIOD
  if cutoff >= 0 then
    local old = redis.call('ZRANGEBYSCORE', log, '-inf', str(cutoff))
    if #old > 0 then
      for _, member in ipairs(old) do total = total - units(member) end
      redis.call('ZREMRANGEBYSCORE', log, '-inf', str(cutoff))
      changed = true
    end
  end
  local function reset()
    local newest = redis.call('ZRANGE', log, -1, -1, 'WITHSCORES')
    if #newest == 0 then return 0 end
    return math.max(tonumber(newest[2]) + PERIOD - NOW, 0)
  end
  local function keep()
    local newest = redis.call('ZRANGE', log, -1, -1, 'WITHSCORES')
    if #newest == 0 then
      redis.call('DEL', log, meta)
      return
    end
    redis.call('HSET', meta, 'total', str(total))
    expire({ log, meta }, tonumber(newest[2]) + PERIOD)
  end
  local reply
  if COST > LIMIT then
    reply = refused(LIMIT, math.max(LIMIT - total, 0), reset())
  elseif total + COST <= LIMIT then
    if COST > 0 then
      local seq = redis.call('HINCRBY', meta, 'seq', 1)
      redis.call('ZADD', log, str(NOW), seq .. ':' .. str(COST))
      total = total + COST
      changed = true
    end
    reply = allow(LIMIT, LIMIT - total, reset(), 0)
  else
    -- Wait until enough of the oldest entries have slid out.
    local left, retry = total, 0
    local entries = redis.call('ZRANGE', log, 0, -1, 'WITHSCORES')
    for i = 1, #entries, 2 do
      left = left - units(entries[i])
      if left + COST <= LIMIT then
        retry = tonumber(entries[i + 1]) + PERIOD - NOW
        break
      end
    end
    reply = limited(LIMIT, math.max(LIMIT - total, 0), reset(), retry)
  end
  if changed then keep() end
  return reply
end
