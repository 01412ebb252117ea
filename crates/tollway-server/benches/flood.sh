#!/usr/bin/env bash
# A CPU flood of tollway-server (release, its own process) against a healthy
# redis-server of its own: the stalls the server declared, and what a victim key of 100
# a minute was admitted (see flood.rs). Run it twice to compare builds:
#
#   bash crates/tollway-server/benches/flood.sh    (env: SECONDS=26 CALLERS=64 STALL_AFTER_MS=20)
#
# PIN=1 gives redis-server the second CPU alone, and the server and the flood the first:
# Redis is never short of CPU, so every stall declared is a false one.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
command -v redis-server >/dev/null || { echo "needs redis-server (apt-get install -y redis-server)" >&2; exit 1; }
# shellcheck source=../../tollway-core/benches/redis_server.sh
source "$ROOT/crates/tollway-core/benches/redis_server.sh"
cd "$ROOT"
server=${SERVER_BIN:-target/release/tollway-server}   # SERVER_BIN: another build's, to compare
[ -n "${SERVER_BIN:-}" ] || cargo build -q --release -p tollway-server --bin tollway-server
cargo bench -q -p tollway-server --bench flood --no-run
bench=$(ls -t target/release/deps/flood-* | grep -v '\.d$' | head -1)
cat >"$TMP/limits.toml" <<TOML
[store]
kind = "redis"
url = "redis://127.0.0.1:$PORT"
stall_after_ms = ${STALL_AFTER_MS:-20}

[layer]
default = "per_key"

[policies.per_key]
algorithm = "token_bucket"
limit = 100
period = "1m"

[policies.flood]
algorithm = "token_bucket"
limit = 1_000_000
period = "1m"

[[descriptors]]
domain = "edge"
entries = [{ key = "api_key", value = "victim" }]
policy = "per_key"

[[descriptors]]
domain = "edge"
entries = [{ key = "api_key" }]
policy = "flood"
TOML
on_first=()
if [ "${PIN:-0}" = 1 ]; then
  taskset -pc 1 "$SERVER" >/dev/null
  on_first=(taskset -c 0)
fi
GRPC=127.0.0.1:$(free_port)
HTTP=127.0.0.1:$(free_port)
${on_first[@]+"${on_first[@]}"} "$server" --config "$TMP/limits.toml" --grpc "$GRPC" --http "$HTTP" \
  --log text >"$TMP/server.log" 2>&1 &
SERVER_PID=$!
trap 'kill "$SERVER_PID" 2>/dev/null || true; kill "$SERVER" 2>/dev/null || true; rm -rf "$TMP"' EXIT
for _ in $(seq 100); do curl -sf "http://$HTTP/ready" >/dev/null && break; sleep 0.1; done
cpu() { cli info cpu | awk -F: '/used_cpu_(sys|user):/ {s += $2} END {printf "%.2f", s}'; }
stalls() { curl -s "http://$HTTP/metrics" | awk '/^tollway_store_stalls_total/ {print $2}' | grep . || echo 0; }
# Redis's own pauses of 10 ms or more (an expiry cycle, a slow script): a stall declared
# then is Redis's, not the watch's mistake.
cli config set latency-monitor-threshold 10 >/dev/null
before=$(cpu)
start=$SECONDS
GRPC=$GRPC ${on_first[@]+"${on_first[@]}"} "$bench"
took=$((SECONDS - start))
echo "stalls declared: $(stalls)"
echo "redis CPU: $(awk -v a="$(cpu)" -v b="$before" 'BEGIN {printf "%.2f", a - b}') s in ${took} s"
echo "breaker opened: $(grep -c 'breaker open' "$TMP/server.log" || true) times"
echo "redis paused itself (LATENCY LATEST: event, last ms, max ms):"
cli --no-raw latency latest | paste - - - - | awk '{print "  " $0}'
cli info stats | grep -E '^(expired_keys|expired_time_cap_reached_count):' | tr -d '\r'
# With RUST_LOG=tollway_core=debug, why the store failed.
sed 's/\x1b\[[0-9;]*m//g' "$TMP/server.log" | grep -o 'error=.*' | sort | uniq -c | sort -rn | head -5
