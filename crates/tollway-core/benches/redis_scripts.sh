#!/usr/bin/env bash
# Requests/s of tollway's Redis script (lua/) under redis-benchmark, beside minimal scripts
# of the same algorithm and clock mode (lua/minimal/), on its own redis-server. No cargo.
#
#   bash crates/tollway-core/benches/redis_scripts.sh     (env: ROUNDS=5 REQUESTS=200000,
#                                                          ONLY=<regex of row labels>)
#
# The script is composed exactly as crates/tollway-core/src/store/redis/mod.rs composes it:
# prelude.lua, token_bucket.lua, gcra.lua, leaky_bucket.lua, fixed_window.lua,
# sliding_window_counter.lua, sliding_window_log.lua, check.lua, joined by "\n"
# (its SHA-1 is printed; it equals RedisStore::script_sha()).
#
# Every run: redis-benchmark -c 50 -P 16 -n REQUESTS -r 10000 EVALSHA <sha> ... over 10,000
# random keys. Rounds interleave the rows (ours, minimal, ours, minimal, ...); the table
# shows each row's median requests/s and, per pair, the median of the rounds' ratios.
#
# Quota of the bucket rows: 1 per 1,000 s (period 10^9 µs, emission 10^9 µs), burst
# 10^6: no request is ever denied (a key gets a few hundred requests at most), every
# request writes state, and keys live for as long as the bench (each admission adds
# 1,000 s to the key's TTL), so requests read existing state. Window rows: 10^6 per 1,000 s.
# Caller-time rows pass a fixed now (2026-01-01T00:00:00Z); server-TIME rows pass "".
# The 2-limit rows' two keys are independent random picks (redis-benchmark draws each
# __rand_int__ apart; on one server the hash tag does not matter). The sanity lines at
# the end show one more decision per row: 0 (allowed) everywhere but the denying GCRA.
# A row indented by two spaces is compared with the row above it: "above / this" is the
# median of the rounds' ratios of the row above's requests/s to its own. The 3-limit rows
# compare a request whose limits cost each its own ('*', costs after the limits) with one
# of a single cost, on the same script. Rounds take ~25 s at the defaults (2 cores).
set -euo pipefail

ROUNDS=${ROUNDS:-5}
REQUESTS=${REQUESTS:-200000}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
LUA=$ROOT/lua
for tool in redis-server redis-cli redis-benchmark sha1sum; do
  command -v "$tool" >/dev/null || { echo "needs $tool" >&2; exit 1; }
done

# shellcheck source=redis_server.sh
source "$(dirname "${BASH_SOURCE[0]}")/redis_server.sh"
compose "$TMP/tollway.lua"

load() {
  local sha
  sha=$(cli -x script load <"$1")
  [ "$sha" = "$(sha1sum <"$1" | cut -d' ' -f1)" ] || { echo "SCRIPT LOAD of $1: $sha" >&2; exit 1; }
  echo "$sha"
}
OURS=$(load "$TMP/tollway.lua")
MIN_TB=$(load "$LUA/minimal/token_bucket.lua")
MIN_GCRA=$(load "$LUA/minimal/gcra.lua")
echo "redis-server $(redis-server --version | grep -o 'v=[0-9.]*' | cut -c3-) on 127.0.0.1:$PORT;" \
  "tollway script $OURS ($(wc -c <"$TMP/tollway.lua") bytes)"
echo "rounds $ROUNDS, $REQUESTS requests a run, redis-benchmark -c 50 -P 16 -r 10000"

NOW=1767225600000000
BUCKET="1 1000000000 1000000 1000000000"   # limit, period µs, burst, emission µs
WINDOW="1000000 1000000000 1000000 1000"

# label | sha | keys of the run (-r) | numkeys, keys, ARGV (__rand_int__: a random key)
ROWS=(
  "token bucket, server TIME|$OURS|10000|1 tb:s:{__rand_int__} '' 1 0 1 $BUCKET"
  "  minimal token bucket|$MIN_TB|10000|1 mtb:s:{__rand_int__} '' 1 0 1 $BUCKET"
  "token bucket, caller time|$OURS|10000|1 tb:c:{__rand_int__} $NOW 1 0 1 $BUCKET"
  "  minimal token bucket|$MIN_TB|10000|1 mtb:c:{__rand_int__} $NOW 1 0 1 $BUCKET"
  "GCRA, server TIME|$OURS|10000|1 g:s:{__rand_int__} '' 1 0 7 $BUCKET"
  "  minimal GCRA|$MIN_GCRA|10000|1 mg:s:{__rand_int__} '' 1 0 7 $BUCKET"
  "GCRA, caller time|$OURS|10000|1 g:c:{__rand_int__} $NOW 1 0 7 $BUCKET"
  "  minimal GCRA|$MIN_GCRA|10000|1 mg:c:{__rand_int__} $NOW 1 0 7 $BUCKET"
  "leaky bucket meter, server TIME|$OURS|10000|1 lm:{__rand_int__} '' 1 0 2 $BUCKET"
  "leaky bucket shaper, server TIME|$OURS|10000|1 ls:{__rand_int__} '' 1 0 3 $BUCKET"
  "fixed window, server TIME|$OURS|10000|1 fw:{__rand_int__} '' 1 0 4 $WINDOW"
  "sliding window counter, server TIME|$OURS|10000|1 sc:{__rand_int__} '' 1 0 6 $WINDOW"
  "sliding window log, server TIME|$OURS|10000|1 sl:{__rand_int__} '' 1 0 5 $WINDOW"
  "sliding window log, 20 keys (10^4+ entries)|$OURS|20|1 sl20:{__rand_int__} '' 1 0 5 $WINDOW"
  "2 limits (token bucket + GCRA), server TIME|$OURS|10000|2 m2:{__rand_int__}:tb m2:{__rand_int__}:g '' 1 0 1 $BUCKET 7 $BUCKET"
  "2 limits, the GCRA one denies, server TIME|$OURS|10000|2 d2:{__rand_int__}:tb d2:{__rand_int__}:g '' 1 0 1 $BUCKET 7 1 1000000000 1 1000000000"
  "3 limits, a cost each (1, 8, 3), server TIME|$OURS|10000|3 e3:{__rand_int__}:tb e3:{__rand_int__}:g e3:{__rand_int__}:fw '' '*' 0 1 $BUCKET 7 $BUCKET 4 $WINDOW 1 8 3"
  "  3 limits, one cost (1), server TIME|$OURS|10000|3 s3:{__rand_int__}:tb s3:{__rand_int__}:g s3:{__rand_int__}:fw '' 1 0 1 $BUCKET 7 $BUCKET 4 $WINDOW"
)

if [ -n "${ONLY:-}" ]; then
  kept=()
  for row in "${ROWS[@]}"; do [[ ${row%%|*} =~ $ONLY ]] && kept+=("$row"); done
  ROWS=("${kept[@]}")
fi

declare -A RPS
for ((round = 1; round <= ROUNDS; round++)); do
  for i in "${!ROWS[@]}"; do
    IFS='|' read -r label sha keys rest <<<"${ROWS[$i]}"
    eval "args=($rest)"
    rps=$(redis-benchmark -h 127.0.0.1 -p "$PORT" -c 50 -P 16 -n "$REQUESTS" -r "$keys" --csv \
      EVALSHA "$sha" "${args[@]}" | tail -1 | cut -d, -f2 | tr -d '"')
    RPS[$i]="${RPS[$i]:-} $rps"
  done
  echo "round $round done"
done

median() { tr ' ' '\n' | grep . | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
echo
printf '| %-44s | %9s | %-40s | %s |\n' "row" "median/s" "requests/s by round" "above / this"
printf '|%s|%s|%s|%s|\n' "$(printf -- '-%.0s' {1..46})" "-----------" "$(printf -- '-%.0s' {1..42})" "----------------"
for i in "${!ROWS[@]}"; do
  IFS='|' read -r label _ <<<"${ROWS[$i]}"
  ratio=""
  if [[ $label == "  "* ]] && ((i > 0)); then
    read -ra ours <<<"${RPS[$((i - 1))]}"
    read -ra mine <<<"${RPS[$i]}"
    ratio=$(for r in "${!ours[@]}"; do awk -v a="${ours[$r]}" -v b="${mine[$r]}" 'BEGIN { print a / b }'; done | median)
    ratio=$(printf '%.3f (by round:%s)' "$ratio" "$(for r in "${!ours[@]}"; do awk -v a="${ours[$r]}" -v b="${mine[$r]}" 'BEGIN { printf " %.2f", a / b }'; done)")
  fi
  rounds=$(for v in ${RPS[$i]}; do printf '%.0f ' "$v"; done)
  printf '| %-44s | %9.0f | %-40s | %s |\n' "$label" "$(echo "${RPS[$i]}" | median)" "$rounds" "$ratio"
done

# Sanity: one more request on a key of each bucket row, at cost 1: every one allowed (0).
echo
echo "sanity (denial codes of one more request on a bench key; expect 0 but for the denying row):"
for i in "${!ROWS[@]}"; do
  IFS='|' read -r label sha keys rest <<<"${ROWS[$i]}"
  eval "args=($rest)"
  n=${args[0]}
  for ((k = 1; k <= n; k++)); do args[$k]=${args[$k]//__rand_int__/000000000001}; done
  printf '  %-46s %s\n' "$label" "$(cli evalsha "$sha" "${args[@]}" | tr '\n' ' ')"
done
