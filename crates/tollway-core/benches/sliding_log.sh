#!/usr/bin/env bash
# What one sliding-window-log decision costs Redis with 10, 1,000 and 10,000 entries in
# the log: the script of this checkout (lua/) beside the script of an older commit
# (default d30f009, the two-key log whose denials read the whole log), on one
# redis-server of its own. Needs git, redis-server, redis-cli, redis-benchmark; no cargo.
#
#   bash crates/tollway-core/benches/sliding_log.sh      (env: BEFORE=<commit>, ROUNDS=3)
#
# For each size N and each script: a log of limit N a minute is filled with N unit
# requests at one caller time, then
#   - "denied": requests at that time, refused (the log is full): the finding's attack;
#   - "allowed": requests on a second log of limit 2N holding N entries: admitted, at
#     most N - 1 of them (the log grows from N to under 2N entries).
# Each row reports Redis's own time per call (INFO commandstats, usec_per_call of EVALSHA,
# reset before the row) and the requests/s of redis-benchmark -c 4 over loopback. The
# median of ROUNDS rounds; rounds interleave the scripts.
set -euo pipefail

BEFORE=${BEFORE:-d30f009}
ROUNDS=${ROUNDS:-3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
for tool in git redis-server redis-cli redis-benchmark; do
  command -v "$tool" >/dev/null || { echo "needs $tool" >&2; exit 1; }
done

# shellcheck source=redis_server.sh
source "$(dirname "${BASH_SOURCE[0]}")/redis_server.sh"
compose "$TMP/after.lua"
# The older commit's sliding log script: prelude, the algorithm, its entry call.
{
  git -C "$ROOT" show "$BEFORE:lua/prelude.lua"
  printf '\n'
  git -C "$ROOT" show "$BEFORE:lua/sliding_window_log.lua"
  printf '\nreturn run_log()\n'
} >"$TMP/before.lua"
AFTER_SHA=$(cli -x script load <"$TMP/after.lua")
BEFORE_SHA=$(cli -x script load <"$TMP/before.lua")
echo "redis-server $(redis-server --version | grep -o 'v=[0-9.]*' | cut -c3-) on 127.0.0.1:$PORT;" \
  "before = $BEFORE's script, after = lua/ of $(git -C "$ROOT" rev-parse --short HEAD)"

NOW=1767225600000000
PERIOD=60000000

# args SCRIPT KEY LIMIT: the EVALSHA arguments of one unit request at NOW.
args() {
  local emission=$(((PERIOD + $3 - 1) / $3))
  if [ "$1" = before ]; then
    # KEYS log, meta; ARGV now, limit, period, burst, emission, cost, extra ttl.
    echo "$BEFORE_SHA 2 $2:log $2:meta $NOW $3 $PERIOD $3 $emission 1 0"
  else
    # KEYS one a limit; ARGV now, cost, grace, then algorithm (5: the log), limit,
    # period, burst, emission.
    echo "$AFTER_SHA 1 $2 $NOW 1 0 5 $3 $PERIOD $3 $emission"
  fi
}

# run N SCRIPT KEY LIMIT: N requests, 4 connections; prints "µs-per-call requests/s".
run() {
  cli config resetstat >/dev/null
  local rps
  # shellcheck disable=SC2046
  rps=$(redis-benchmark -h 127.0.0.1 -p "$PORT" -c 4 -n "$1" --csv EVALSHA $(args "$2" "$3" "$4") |
    tail -1 | cut -d, -f2 | tr -d '"')
  local usec
  usec=$(cli info commandstats | grep '^cmdstat_evalsha:' | sed 's/.*usec_per_call=\([0-9.]*\).*/\1/')
  echo "$usec $rps"
}

# fill SCRIPT KEY LIMIT N: N admitted unit requests.
fill() {
  # shellcheck disable=SC2046
  redis-benchmark -h 127.0.0.1 -p "$PORT" -c 1 -n "$4" -q EVALSHA $(args "$1" "$2" "$3") >/dev/null
}

declare -A RESULT
for ((round = 1; round <= ROUNDS; round++)); do
  for n in 10 1000 10000; do
    # Fewer requests where a call costs more, so that every row takes seconds.
    requests=$((n >= 10000 ? 400 : (n >= 1000 ? 4000 : 40000)))
    for script in before after; do
      full="full:$script:$n:$round"
      roomy="roomy:$script:$n:$round"
      fill "$script" "$full" "$n" "$n"
      fill "$script" "$roomy" $((2 * n)) "$n"
      # Sanity: the full log refuses (1), the roomy one admits (0).
      # shellcheck disable=SC2046
      RESULT[check,$script,$n]="$(cli evalsha $(args "$script" "$full" "$n") | head -1)/$(cli evalsha $(args "$script" "$roomy" $((2 * n))) | head -1)"
      RESULT[denied,$script,$n]+=" $(run "$requests" "$script" "$full" "$n")|"
      # Admissions grow the log: at most N - 1 more keep it under 2N, all admitted.
      allowed=$((requests < n - 1 ? requests : n - 1))
      RESULT[allowed,$script,$n]+=" $(run "$allowed" "$script" "$roomy" $((2 * n)))|"
      cli flushall >/dev/null
    done
  done
  echo "round $round done"
done

median() { tr ' ' '\n' | grep . | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
field() { tr '|' '\n' | awk -v f="$1" 'NF { print $f }' | median; }
# Requests/s, but not of a row too short to time (9 admissions into a log of 10).
rate() {
  local v
  v=$(cat)
  if [ "$1" = allowed ] && [ "$2" = 10 ]; then echo "—"; else printf '%.0f' "$v"; fi
}
echo
echo "| decision | entries | before: µs in Redis a call | after: µs in Redis a call | before: requests/s | after: requests/s | sanity (denial code full/roomy) |"
echo "|---|---:|---:|---:|---:|---:|---|"
for kind in denied allowed; do
  for n in 10 1000 10000; do
    printf '| %s | %s | %s | %s | %s | %s | %s · %s |\n' "$kind" "$n" \
      "$(echo "${RESULT[$kind,before,$n]}" | field 1)" "$(echo "${RESULT[$kind,after,$n]}" | field 1)" \
      "$(echo "${RESULT[$kind,before,$n]}" | field 2 | rate "$kind" "$n")" \
      "$(echo "${RESULT[$kind,after,$n]}" | field 2 | rate "$kind" "$n")" \
      "${RESULT[check,before,$n]}" "${RESULT[check,after,$n]}"
  done
done
