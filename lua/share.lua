-- A shared policy's ledger: its holders' shares and the pool that pays for new buckets.
-- A ledger whose shares all ended keeps its pool until the reserve alone refilled it.
-- The twin of crates/tollway-core/src/store/share.rs (`decide`), which says the rule.
--
-- KEYS[1]  the ledger: a hash of `pool`, `at` and `h:<holder>` = rate:size:demand:until
-- ARGV     now (ms, or '' for TIME), limit, period (ms), burst, holder, demand, hold (ms;
--          0 gives the share back), then the reserve, size, holders and change parts
--          and the smallest size
-- Reply    { rate, size, new (1 or 0), until (ms) }

local key = KEYS[1]
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
else
  now = tonumber(ARGV[1])
end
local limit, period, burst = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local holder, demand, hold = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local reserve_part, size_part = tonumber(ARGV[8]), tonumber(ARGV[9])
local max_holders, change_part = tonumber(ARGV[10]), tonumber(ARGV[11])
local min_size = tonumber(ARGV[12])

-- floor(a / b) and ceil(a / b) of integers below 2^53, exactly.
local function floor_div(a, b)
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 end
  if (q + 1) * b <= a then q = q + 1 end
  return q
end
local function ceil_div(a, b)
  local q = floor_div(a, b)
  if q * b < a then q = q + 1 end
  return q
end
-- Byte order, whatever the server's locale.
local function before(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end
local function int(x)
  return string.format('%.0f', x)
end

local flat = redis.call('HGETALL', key)
local pool, at = nil, nil
local holdings, names = {}, {}
for i = 1, #flat, 2 do
  local f, v = flat[i], flat[i + 1]
  if f == 'pool' then
    pool = tonumber(v)
  elseif f == 'at' then
    at = tonumber(v)
  elseif string.sub(f, 1, 2) == 'h:' then
    local r, s, d, u = string.match(v, '^(%d+):(%d+):(%d+):(%d+)$')
    if r then
      local name = string.sub(f, 3)
      holdings[name] = { tonumber(r), tonumber(s), tonumber(d), tonumber(u) }
      names[#names + 1] = name
    end
  end
end

-- The pool refills at the rate no holder holds, up to what the sizes leave.
local rates, sizes = 0, 0
for _, name in ipairs(names) do
  rates = rates + holdings[name][1]
  sizes = sizes + holdings[name][2]
end
local cap = math.max(0, burst - sizes) * period
if at == nil then
  pool = cap
else
  local gained = math.max(0, now - at) * math.max(0, limit - rates)
  if gained >= math.max(0, cap - pool) then
    pool = cap
  else
    pool = pool + gained
  end
  pool = math.min(pool, cap)
end
if at == nil or now > at then at = now end

-- Ended shares go.
local kept = {}
for _, name in ipairs(names) do
  if holdings[name][4] > now then
    kept[#kept + 1] = name
  else
    redis.call('HDEL', key, 'h:' .. name)
    holdings[name] = nil
  end
end
names = kept

-- Kept until it surely decides as a fresh one: its last share's end, then the time the
-- reserve alone takes to refill the whole pool. Deleted at once when it already does.
local function save(longest)
  if #names == 0 and pool == burst * period then
    redis.call('DEL', key)
    return
  end
  local refill = ceil_div(burst * period, ceil_div(limit, reserve_part))
  redis.call('HSET', key, 'pool', int(pool), 'at', int(at))
  redis.call('PEXPIRE', key, math.max(1, math.max(longest, at) + refill - now))
end

if hold == 0 then
  if holdings[holder] then
    redis.call('HDEL', key, 'h:' .. holder)
    holdings[holder] = nil
    local rest = {}
    for _, name in ipairs(names) do
      if name ~= holder then rest[#rest + 1] = name end
    end
    names = rest
  end
  local longest = 0
  for _, name in ipairs(names) do longest = math.max(longest, holdings[name][4]) end
  save(longest)
  return { 0, 0, 0, now }
end

local till = now + hold
local held = holdings[holder]
if held == nil and #names >= max_holders then
  local longest = 0
  for _, name in ipairs(names) do longest = math.max(longest, holdings[name][4]) end
  save(longest)
  return { 0, 0, 0, till }
end
local rate, size = 0, 0
if held then rate, size = held[1], held[2] end

local others, by_others, sized_by_others = {}, 0, 0
for _, name in ipairs(names) do
  if name ~= holder then
    local h = holdings[name]
    others[#others + 1] = { h[3], name }
    by_others = by_others + h[1]
    sized_by_others = sized_by_others + h[2]
  end
end
local capacity = limit - ceil_div(limit, reserve_part)
local free = math.max(0, capacity - by_others)

-- The max-min fair part of the capacity: the smallest demands first, ties by holder;
-- what no demand takes is divided evenly.
others[#others + 1] = { demand, holder }
table.sort(others, function(a, b)
  if a[1] ~= b[1] then return a[1] < b[1] end
  return before(a[2], b[2])
end)
local count = #others
local left, n, target = capacity, count, 0
for _, o in ipairs(others) do
  local part = math.min(o[1], floor_div(left, n))
  if o[2] == holder then target = part end
  left = left - part
  n = n - 1
end
target = target + floor_div(left, count)
target = math.min(target, free)
local room = math.max(0, burst - (sized_by_others + size)) * period
local low = pool * 2 < room
if low and rate > 0 and target > 0 and rate <= free and math.abs(rate - target) * change_part <= rate then
  target = rate
end

local wanted = 0
if target > 0 then
  wanted = math.max(min_size, ceil_div(target * burst, limit * size_part))
end
local cost = wanted * period
local fits = sized_by_others + wanted <= burst
local paid = target == 0 or pool >= cost or rate > free
local new = 0
if target == rate and wanted == size then
  -- kept
elseif fits and paid then
  pool = math.max(0, pool - cost)
  rate, size, new = target, wanted, 1
end
redis.call('HSET', key, 'h:' .. holder, int(rate) .. ':' .. int(size) .. ':' .. int(demand) .. ':' .. int(till))
if held == nil then names[#names + 1] = holder end
pool = math.min(pool, math.max(0, burst - (sized_by_others + size)) * period)
local longest = 0
for _, name in ipairs(names) do
  local u = holdings[name] and holdings[name][4] or till
  if name == holder then u = till end
  longest = math.max(longest, u)
end
save(longest)
return { rate, size, new, till }
