#!/usr/bin/env bash
# Instructions per request of each HTTP bench variant, counted by valgrind's callgrind:
# the same binary, inputs and environment give the same counts, whatever else the machine
# is doing, which wall-clock throughput on a shared 2-vCPU guest does not.
#
#   bash crates/tollway-tower/benches/instructions.sh [variant ...]
#   HTTP_BENCH_SUITE=operate bash crates/tollway-tower/benches/instructions.sh tollway tollway-shadow ...
#   INSTRUCTIONS_FEATURES=metrics HTTP_BENCH_SUITE=operate bash ... tollway-metrics
#
# INSTRUCTIONS_FEATURES builds the bench with those features of tollway-tower (metrics:
# for tollway-metrics); HTTP_BENCH_SUITE picks the suite the variants are named from.
#
# Each variant runs twice in the bench's count mode (HTTP_BENCH_COUNT: 20 warm-up requests,
# then N requests on each of 32 connections, untimed), with N = 200 and N = 1200; the
# difference of the two totals divided by 32,000 requests is the cost of one request, with
# everything a run does once (building the servers, calibrating clocks) cancelled out.
# Server and client are counted apart (--separate-threads): the client is the bench's main
# thread, the server its tokio workers.
set -euo pipefail
cd "$(dirname "$0")/../../.."

command -v valgrind >/dev/null || { echo "valgrind is not installed (apt-get install -y valgrind)" >&2; exit 1; }
variants=("$@")
if [ ${#variants[@]} -eq 0 ]; then
  variants=(axum noop headers-only governor governor-headers tollway-bare tollway tollway-outside governor-429 tollway-429)
fi

features=()
[ -n "${INSTRUCTIONS_FEATURES:-}" ] && features=(--features "$INSTRUCTIONS_FEATURES")
bin=$(cargo bench -p tollway-tower --bench http "${features[@]}" --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "http" and m.get("executable"):
        print(m["executable"])')
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# Sums the instructions of the main thread (file -01) and of every other thread.
totals() {
  python3 - "$1" <<'PY'
import glob, sys
main = other = 0
for f in glob.glob(sys.argv[1] + "-*"):
    for line in open(f):
        if line.startswith("summary:") or line.startswith("totals:"):
            n = int(line.split()[1])
            break
    else:
        n = 0
    if f.endswith("-01"):
        main += n
    else:
        other += n
print(main, other)
PY
}

printf '%-18s %10s %10s %10s\n' variant server client total
for v in "${variants[@]}"; do
  for n in 200 1200; do
    HTTP_BENCH_ONLY=$v HTTP_BENCH_COUNT=$n valgrind --tool=callgrind --separate-threads=yes \
      --callgrind-out-file="$out/$v.$n" "$bin" --bench >"$out/$v.$n.log" 2>&1 ||
      { cat "$out/$v.$n.log" >&2; exit 1; }
  done
  read -r c0 s0 < <(totals "$out/$v.200")
  read -r c1 s1 < <(totals "$out/$v.1200")
  server=$(( (s1 - s0) / 32000 ))
  client=$(( (c1 - c0) / 32000 ))
  printf '%-18s %10d %10d %10d\n' "$v" "$server" "$client" $(( server + client ))
done
