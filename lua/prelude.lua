-- tollway: ONE script decides all of a request's limits, all or nothing, in one EVALSHA.
-- Composed, joined by "\n", in this order (crates/tollway-core/src/store/redis/mod.rs and
-- crates/tollway-core/benches/redis_scripts.sh must agree):
--   prelude.lua, token_bucket.lua, gcra.lua, leaky_bucket.lua, fixed_window.lua,
--   sliding_window_counter.lua, sliding_window_log.lua, concurrency.lua, check.lua
-- A second script, the same with operate.lua in place of check.lua, charges, refunds
-- and resets (see operate.lua).
--
-- KEYS[i], i = 1..N (N >= 1): limit i's state, all of it in that one key (one hash tag).
-- ARGV:
--   [1] now in µs, or "" to read the server's clock (TIME), or "TIME" to read it and
--       reply the time read after the decisions (tests compare it with the Rust functions)
--   [2] cost in units, the same for every limit (may be 0); or '*': each limit's own,
--       in [3 + 5N + i] after the limits (check.lua)
--   [3] grace in ms, added to every time-to-live (0 normally); or "peek": decide as
--       usual and write nothing
--   then five per limit; limit i's are [b+1] .. [b+5] with b = 3 + 5 × (i − 1):
--   [b+1] algorithm: 1 token bucket, 2 leaky bucket meter, 3 leaky bucket shaper,
--         4 fixed window, 5 sliding window log, 6 sliding window counter, 7 GCRA,
--         8 concurrency, 9 fixed window of a calendar
--   [b+2] limit   [b+3] period (µs)   [b+4] burst   [b+5] emission interval (µs) = ceil(period / limit)
--   (concurrency: [b+4] the gateway's number, its field in the key's hash; a calendar's
--   fixed window: [b+3] its start, [b+4] its end, [b+5] the next one's end, in µs, as
--   the gateway's clock puts them)
-- Reply: four integers per limit, in KEYS order: { denial, remaining, reset_after_us, wait_us }
--   (then the time read, when ARGV[1] is "TIME")
--   denial 0: allowed, wait_us = the shaper's delay (0 for the others)
--   denial 1: limited, wait_us = retry after (> 0)
--   denial 2: the cost exceeds the limit's capacity, wait_us = 0
-- All or nothing: every limit is decided at the cost first, writing nothing. If all allow,
-- every new state is written; if one denies, no state changes (only entries that have
-- slid out of a log are dropped), the denying limits reply their denials and the others
-- what a request of cost 0 gets from their unchanged state.
--
-- A state's first number `a` is the instant it becomes equivalent to a fresh key's: a
-- state with a <= now is deleted (or never written), any other is written with a TTL of
-- ceil((a − now) / 1000) + grace ms in the same SET (on the server's clock, the instant
-- ceil(a / 1000) + grace ms: see `px` below). States are struct.pack'ed doubles
-- ('<d', '<dd', '<ddd'): exact for integers below 2^53, nothing to format or parse.
--
-- Arithmetic: every quantity is an integer below 2^53 (the Rust side validates quotas so,
-- and now is about 2^50.6 µs today; but see sliding_window_counter.lua for its periods).
-- Divisions are written q = a / b; q - q % 1 (floor) or q + (-q) % 1 (ceil), without a
-- function call: for integers 0 <= a < 2^53 and b > 0 the double quotient is exact or
-- off by less than a / b × 2^-53 < 1 / b, so it never crosses the integer that a / b is
-- at least 1 / b away from, and % 1 takes its fraction exactly.
-- ARGV numbers are read with `+ 0` (strtod, exact), cheaper than tonumber. Numbers given
-- to redis.call are sent as %.17g: exact below 1e17 (tostring's %.14g is not).

local call, pack, unpack, unpack_list = redis.call, struct.pack, struct.unpack, unpack
local argv, keys = ARGV, KEYS
local n = #keys

-- `told`: the time read, replied after the decisions when ARGV[1] asks for it; nil (and
-- so no reply entry) otherwise.
-- A state's time-to-live is written as `px` (SET) or `pexpire` (the log's PEXPIRE),
-- (a − since) / 1000 ms rounded up, + grace. On the server's clock, the instant itself
-- (PXAT, PEXPIREAT; Redis 6.2 or later), so that the key's expiry counts from the TIME
-- this script read: a relative TTL counts from the server's own millisecond when the
-- command ran (from 7.2, when the EVALSHA started, before TIME was read), which can be
-- a millisecond or more before `now`, and the key would go while its state still counts.
-- On a caller's clock, a time from `now` (that clock's origin is not the server's).
local now, told = argv[1], nil
local px, pexpire, since = 'PXAT', 'PEXPIREAT', 0
if now == '' then
  local t = call('TIME')
  now = t[1] * 1000000 + t[2]
elseif now == 'TIME' then
  local t = call('TIME')
  now = t[1] * 1000000 + t[2]
  told = now
else
  now = now + 0
  px, pexpire, since = 'PX', 'PEXPIRE', now
end

-- A function definition makes a new closure on every call (measured: ~500 instructions
-- each, 7% of a request with all of them), so with one limit each algorithm file defines
-- its function only if the limit uses it; with several, every file does.
local only = n == 1 and argv[4]
