#!/usr/bin/env bash
# Starts `tm-cli serve` with the default model on a free port, runs test_openai_client.py
# against it, stops the server (SIGTERM; it must exit 0) and exits with the test's status.
# Usage: tests/python/run_openai_test.sh [path/to/tm-cli]   (default: target/release/tm-cli)
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN="${1:-target/release/tm-cli}"
LOG="$(mktemp)"
"$BIN" serve --port 0 --max-len 2048 --num-blocks 256 2>"$LOG" &
PID=$!
cleanup() { kill "$PID" 2>/dev/null || true; rm -f "$LOG"; }
trap cleanup EXIT
ADDR=""
for _ in $(seq 1 600); do
  ADDR="$(grep -o 'http://[0-9.:]*' "$LOG" | head -n1 || true)"
  [ -n "$ADDR" ] && break
  kill -0 "$PID" 2>/dev/null || { cat "$LOG"; echo "tm-cli serve exited early" >&2; exit 1; }
  sleep 0.5
done
[ -n "$ADDR" ] || { cat "$LOG"; echo "tm-cli serve did not start" >&2; exit 1; }
echo "server at $ADDR"
status=0
TM_BASE_URL="$ADDR/v1" python3 tests/python/test_openai_client.py || status=$?
kill -TERM "$PID"
server_status=0
wait "$PID" || server_status=$?
trap - EXIT
rm -f "$LOG"
if [ "$server_status" -ne 0 ]; then
  echo "tm-cli serve exited with status $server_status after SIGTERM" >&2
  exit 1
fi
exit "$status"
