#!/usr/bin/env bash
# Run the k6 profile blast-vs-otp against the local stack.
#   bash k6/run.sh              # the dual-lane design: thresholds pass
#   bash k6/run.sh --baseline   # the naive single FIFO lane: thresholds fail
# Extra k6 settings through the environment: DURATION (30s), OTP_RATE (4/s), OTP_BUDGET_MS (1000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/pip install -q -e '.[dev,load]'
.venv/bin/streams dev up >/dev/null
.venv/bin/streams topics apply >/dev/null
envfile=$(mktemp)
.venv/bin/streams fleet up "$@" --env-file "$envfile" > "$envfile.log" 2>&1 &
fleet=$!
trap 'kill -TERM $fleet 2>/dev/null; wait $fleet 2>/dev/null; rm -f "$envfile" "$envfile.log"' EXIT
until [ -s "$envfile" ]; do
  kill -0 "$fleet" 2>/dev/null || { cat "$envfile.log"; exit 1; }
  sleep 0.5
done
set -a; . "$envfile"; set +a
.venv/bin/k6 run --quiet k6/blast-vs-otp.js
