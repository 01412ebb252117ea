# Sourced by the Redis bench scripts beside it: a redis-server of their own on a free
# loopback port, stopped (and its directory removed) when the script exits, `cli` to talk
# to it, and `compose` to write tollway's script as src/store/redis/mod.rs composes it.
#
# Sets TMP (a scratch directory), PORT and SERVER (its pid); needs ROOT (the checkout).

free_port() {
  if command -v python3 >/dev/null; then
    python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
    return
  fi
  local p
  while :; do
    p=$((20000 + RANDOM % 40000))
    (: </dev/tcp/127.0.0.1/$p) 2>/dev/null || { echo "$p"; return; }
  done
}

TMP=$(mktemp -d)
PORT=$(free_port)
mkfifo "$TMP/log"
redis-server --port "$PORT" --bind 127.0.0.1 --save "" --appendonly no --daemonize no \
  --dir "$TMP" >"$TMP/log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; rm -rf "$TMP"' EXIT
cli() { redis-cli -h 127.0.0.1 -p "$PORT" "$@"; }
# The server says when it is ready: read its log up to that line (20 s at most), then
# keep the log draining into a file.
exec {LOG}<"$TMP/log"
ready=0
while IFS= read -r -t 20 line <&"$LOG"; do
  echo "$line" >>"$TMP/redis.log"
  if [[ $line == *"Ready to accept connections"* ]]; then ready=1; break; fi
done
[ $ready = 1 ] || { echo "redis-server did not start: $(cat "$TMP/redis.log")" >&2; exit 1; }
cat <&"$LOG" >>"$TMP/redis.log" &
cli ping >/dev/null

# compose FILE: the files of lua/ joined by "\n", nothing after the last (Rust's concat!
# of include_str!s); its SHA-1 equals RedisStore::script_sha().
compose() {
  local first=1 f
  for f in prelude token_bucket gcra leaky_bucket fixed_window sliding_window_counter \
    sliding_window_log concurrency check; do
    if [ $first = 0 ]; then printf '\n'; fi
    cat "$ROOT/lua/$f.lua"
    first=0
  done >"$1"
}
