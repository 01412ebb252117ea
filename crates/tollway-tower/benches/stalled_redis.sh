#!/usr/bin/env bash
# The axum example on a Redis that stalls: wrk -c32 for 6 s with `CLIENT PAUSE 5000 ALL`
# sent 0.5 s in, then the same load with no pause, then 32 connections of
# stalled_redis_client.py (every request timed) for 8 s with the pause 1 s in. At the
# defaults (timeout, stall detection, breaker, fallback); the stalls the store declared,
# and how many in the healthy run (false trips). Starts its own redis-server on a free loopback port and stops what it
# started. Usage: [STALL_AFTER_MS=N] bash crates/tollway-tower/benches/stalled_redis.sh [BINARY]
# (STALL_AFTER_MS=0: without stall detection, as before it existed)
# (default: target/release/examples/axum_server, built first).
set -euo pipefail
cd "$(dirname "$0")/../../.."
bin=${1:-}
if [ -z "$bin" ]; then
  cargo build --release --example axum_server
  bin=target/release/examples/axum_server
fi
free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
out=$(mktemp -d)
rp=$(free_port); hp=$(free_port)
redis-server --port "$rp" --bind 127.0.0.1 --save '' --appendonly no >"$out/redis.log" 2>&1 &
rpid=$!
spid=
trap 'kill $spid $rpid 2>/dev/null || true' EXIT
# Each start waits for what it needs, at most 10 s.
ready() { for _ in $(seq 100); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done; return 1; }
ready redis-cli -p "$rp" ping || { echo "redis-server did not start" >&2; exit 1; }
if [ -n "${STALL_AFTER_MS:-}" ]; then
  # The example's limits with a [store] of our own: stall_after_ms = 0 is the store
  # without stall detection (each call waits its timeout).
  { printf '[store]\nkind = "redis"\nurl = "redis://127.0.0.1:%s"\nstall_after_ms = %s\n\n' \
      "$rp" "$STALL_AFTER_MS"; cat examples/tollway.toml; } >"$out/limits.toml"
  TOLLWAY_CONFIG=$out/limits.toml PORT=$hp timeout 40 "$bin" >"$out/server.log" 2>&1 &
else
  REDIS_URL=redis://127.0.0.1:$rp PORT=$hp timeout 40 "$bin" >"$out/server.log" 2>&1 &
fi
spid=$!
ready curl -s -o /dev/null "http://127.0.0.1:$hp/" || { cat "$out/server.log" >&2; exit 1; }
(sleep 0.5; redis-cli -p "$rp" CLIENT PAUSE 5000 ALL >/dev/null) &
echo "== 5 s pause inside a 6 s run"
timeout 20 wrk -t2 -c32 -d6s --latency -H 'X-API-Key: demo-pro-key' "http://127.0.0.1:$hp/"
# A paused server answers PING only when the pause is over.
redis-cli -p "$rp" ping >/dev/null
stalls() { curl -s "http://127.0.0.1:$hp/metrics" | awk '/^tollway_store_stalls_total/ {print $2}' | grep . || echo 0; }
echo "== stalls declared so far: $(stalls)"
before=$(stalls)
echo "== no pause"
timeout 20 wrk -t2 -c32 -d6s --latency -H 'X-API-Key: demo-pro-key' "http://127.0.0.1:$hp/"
echo "== stalls declared in the healthy run (false trips): $(( $(stalls) - before ))"
echo "== breaker log lines: $(grep -c 'breaker\|store failing\|answering again' "$out/server.log" || true)"
redis-cli -p "$rp" ping >/dev/null
# The same pause, each request timed by a client of our own (wrk gives percentiles only).
(sleep 1; redis-cli -p "$rp" CLIENT PAUSE 5000 ALL >/dev/null) &
echo "== 5 s pause inside an 8 s run, every request timed"
python3 crates/tollway-tower/benches/stalled_redis_client.py "$hp" 8 32
