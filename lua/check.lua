-- The entry: decides the request of ARGV against the limits of KEYS, all or nothing, and
-- replies four integers per limit (see prelude.lua). operate.lua writes states alike.

-- ARGV[3] 'peek': decide as usual and write nothing.
-- ARGV[2] '*': each limit has a cost of its own, ARGV[3 + 5N + i] for limit i.
local each, cost, grace = argv[2] == '*', 0, argv[3]
local commit = grace ~= 'peek'
if commit then grace = grace + 0 end
if n == 0 then return {} end
if not each then
  cost = argv[2] + 0
elseif n == 1 then
  cost = argv[9] + 0
end

-- One limit (most requests): the loop below without its bookkeeping, measured 5% faster
-- end to end. The two dispatch on the code and write alike: keep them in step. (Shared
-- as local functions instead, they cost a closure each on every call: measured, GCRA
-- fell from 1.02x to 0.88x of the minimal script.)
if n == 1 then
  local key, code, v = keys[1], argv[4], false
  if code ~= '5' and code ~= '8' then v = call('GET', key) end
  local denial, remaining, reset, wait, x, y
  if code == '7' then
    denial, remaining, reset, wait, x, y = gcra(now, cost, argv[7] + 0, argv[8] + 0, v)
  elseif code == '1' or code == '2' then
    denial, remaining, reset, wait, x, y = token_bucket(now, cost, argv[5] + 0, argv[6] + 0, argv[7] + 0, v)
  elseif code == '3' then
    denial, remaining, reset, wait, x, y = leaky_shaper(now, cost, argv[7] + 0, argv[8] + 0, v)
  elseif code == '4' then
    denial, remaining, reset, wait, x, y = fixed_window(now, cost, argv[5] + 0, argv[6] + 0, v)
  elseif code == '9' then
    denial, remaining, reset, wait, x, y =
      fixed_window(now, cost, argv[5] + 0, argv[7] + 0, v, argv[6] + 0, argv[8] + 0)
  elseif code == '6' then
    denial, remaining, reset, wait, x, y = sliding_window_counter(now, cost, argv[5] + 0, argv[6] + 0, v)
  elseif code == '5' then
    denial, remaining, reset, wait, x, y = sliding_window_log(key, now, cost, argv[5] + 0, argv[6] + 0)
  elseif code == '8' then
    denial, remaining, reset, wait, x, y = concurrency(key, now, cost, argv[5] + 0, argv[6] + 0, argv[7])
  else
    return error('tollway: unknown algorithm code ' .. tostring(code))
  end
  -- A refusal writes only a state carried to a changed limit (token_bucket.lua, gcra.lua).
  if commit and (denial == 0 or x) then
    if code == '5' then
      if cost > 0 then sliding_window_log_admit(key, now, cost, argv[6] + 0, grace, x, y) end
    elseif code == '8' then
      if x > 0 then
        concurrency_write(key, argv[7], x, y, grace)
      elseif reset == 0 then
        -- No slot held by anyone: a fresh key.
        call('DEL', key)
      end
    elseif y > now then
      if x ~= v then
        local ttl = (y - since) / 1000
        call('SET', key, x, px, ttl + (-ttl) % 1 + grace)
      end
    elseif v then
      call('DEL', key)
    end
  end
  return { denial, remaining, reset, wait, told }
end

-- Several limits. `held`, per limit: the value it read (false if none), and its new state
-- and `a` (the log: its newest number and time). Both tables are sized for two limits.
local reply, held, c, denied = { 0, 0, 0, 0, 0, 0, 0, 0 }, { 0, 0, 0, 0, 0, 0 }, cost, false

-- Pass 1 decides every limit at the cost; pass 2, only when one denied, decides the others
-- again at cost 0 from the values pass 1 read.
for pass = 1, 2 do
  for i = 1, n do
    local r, j = 4 * i, 5 * i
    if pass == 1 or reply[r - 3] == 0 then
      local key, code, v, c = keys[i], argv[j - 1], false, c
      if each and pass == 1 then c = argv[3 + 5 * n + i] + 0 end
      if pass == 2 then
        v = held[3 * i - 2]
      elseif code ~= '5' and code ~= '8' then
        v = call('GET', key)
      end
      local denial, remaining, reset, wait, x, y
      if code == '7' then
        denial, remaining, reset, wait, x, y = gcra(now, c, argv[j + 2] + 0, argv[j + 3] + 0, v)
      elseif code == '1' or code == '2' then
        denial, remaining, reset, wait, x, y =
          token_bucket(now, c, argv[j] + 0, argv[j + 1] + 0, argv[j + 2] + 0, v)
      elseif code == '3' then
        denial, remaining, reset, wait, x, y = leaky_shaper(now, c, argv[j + 2] + 0, argv[j + 3] + 0, v)
      elseif code == '4' then
        denial, remaining, reset, wait, x, y = fixed_window(now, c, argv[j] + 0, argv[j + 1] + 0, v)
      elseif code == '9' then
        denial, remaining, reset, wait, x, y =
          fixed_window(now, c, argv[j] + 0, argv[j + 2] + 0, v, argv[j + 1] + 0, argv[j + 3] + 0)
      elseif code == '6' then
        denial, remaining, reset, wait, x, y =
          sliding_window_counter(now, c, argv[j] + 0, argv[j + 1] + 0, v)
      elseif code == '5' then
        denial, remaining, reset, wait, x, y =
          sliding_window_log(key, now, c, argv[j] + 0, argv[j + 1] + 0)
      elseif code == '8' then
        denial, remaining, reset, wait, x, y =
          concurrency(key, now, c, argv[j] + 0, argv[j + 1] + 0, argv[j + 2])
      else
        return error('tollway: unknown algorithm code ' .. tostring(code))
      end
      reply[r - 3], reply[r - 2], reply[r - 1], reply[r] = denial, remaining, reset, wait
      if pass == 1 then
        if denial ~= 0 then denied = true end
        held[3 * i - 2] = v
      end
      held[3 * i - 1], held[3 * i] = x, y
    end
  end
  if not denied then break end
  c = 0
end

-- When one denied, only the buckets' and GCRA's states carried to a changed limit are
-- written (the others' states read at cost 0 in pass 2 are as they were).
if commit then
  for i = 1, n do
    local key, code, r = keys[i], argv[5 * i - 1], 3 * i
    local v, x, y = held[r - 2], held[r - 1], held[r]
    if denied and (not x or code == '4' or code == '5' or code == '6' or code == '8' or code == '9') then
      -- Nothing carried: nothing to write.
    elseif code == '5' then
      local c = cost
      if each then c = argv[3 + 5 * n + i] + 0 end
      if c > 0 then sliding_window_log_admit(key, now, c, argv[5 * i + 1] + 0, grace, x, y) end
    elseif code == '8' then
      if x > 0 then
        concurrency_write(key, argv[5 * i + 2], x, y, grace)
      elseif reply[4 * i - 1] == 0 then
        call('DEL', key)
      end
    elseif y > now then
      if x ~= v then
        local ttl = (y - since) / 1000
        call('SET', key, x, px, ttl + (-ttl) % 1 + grace)
      end
    elseif v then
      call('DEL', key)
    end
  end
end
reply[4 * n + 1] = told
return reply
