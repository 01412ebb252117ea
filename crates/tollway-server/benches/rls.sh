#!/usr/bin/env bash
# ShouldRateLimit calls a second and latency: tollway-server on memory and on a
# redis-server of its own, beside a tonic service that answers OK (the floor).
#
#   bash crates/tollway-server/benches/rls.sh     (env: ROUNDS=3 SECONDS=5 CALLERS=64)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
command -v redis-server >/dev/null || { echo "needs redis-server (apt-get install -y redis-server)" >&2; exit 1; }
# shellcheck source=../../tollway-core/benches/redis_server.sh
source "$ROOT/crates/tollway-core/benches/redis_server.sh"
cd "$ROOT"
REDIS_URL="redis://127.0.0.1:$PORT" cargo bench -p tollway-server --bench rls
