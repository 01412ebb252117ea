#!/usr/bin/env bash
# Instructions, and first-level and last-level data-cache misses, per memory store
# check, counted by valgrind's callgrind (a simulated cache: 32 KiB first level, 512 KiB
# last level): the same binary and inputs give the same counts, whatever else the
# machine is doing, which wall-clock rounds on a shared 2-vCPU guest do not.
#
#   bash crates/tollway-core/benches/check_instructions.sh [contender:keys ...]
#
# A contender is gcra or token_bucket (tollway's MemoryStore) or governor (its keyed
# limiter); keys, how many keys the store holds (checked in a random order). The bench
# `key_count` in count mode fills the contender (untimed, uncounted) and makes 9,000
# checks, every one allowed, in one function, the only one callgrind counts.
set -euo pipefail
cd "$(dirname "$0")/../../.."

command -v valgrind >/dev/null || { echo "valgrind is not installed (apt-get install -y valgrind)" >&2; exit 1; }
cases=("$@")
if [ ${#cases[@]} -eq 0 ]; then
  cases=(gcra:1 governor:1 token_bucket:1 gcra:10000 governor:10000 token_bucket:10000
    gcra:100000 governor:100000 token_bucket:100000)
fi

bin=$(cargo bench -p tollway-core --bench key_count --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "key_count" and m.get("executable"):
        print(m["executable"])')
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

printf '%-22s %14s %14s %14s\n' case instructions 'L1 misses' 'LL misses'
for c in "${cases[@]}"; do
  KEY_COUNT_COUNT="$c" valgrind --tool=callgrind --cache-sim=yes \
    --D1=32768,8,64 --LL=524288,8,64 --toggle-collect='key_count::counted*' \
    --callgrind-out-file="$out/cg" "$bin" --bench >/dev/null 2>&1
  python3 - "$out/cg" "$c" <<'PY'
import sys
events = totals = None
for line in open(sys.argv[1]):
    if line.startswith("events:"):
        events = line.split()[1:]
    if line.startswith("summary:") or line.startswith("totals:"):
        totals = [int(x) for x in line.split()[1:]]
n = dict(zip(events, totals))
per = lambda *keys: sum(n.get(k, 0) for k in keys) / 9000
print(f"{sys.argv[2]:<22} {per('Ir'):>14.1f} {per('D1mr', 'D1mw'):>14.2f} {per('DLmr', 'DLmw'):>14.2f}")
PY
done
