#!/usr/bin/env bash
# A PD deployment started by hand, one command per process, the way it runs on two hosts:
#   host A: the router and the prefill instance; host B: the decode instance.
# On one machine (the default below) every address is 127.0.0.1. On two hosts, set
#   ROUTER_HOST / PREFILL_HOST / DECODE_HOST to each host's address and run each block on its host.
# KV goes over tcp here (any host); on one host, ipc (shared memory) is faster: --cache-transfer-protocol ipc,tcp
# Every member shares PDSERVE_CLUSTER_SECRET (export the same value on both hosts): the router takes
# registrations only signed with it, and P and D use it to authenticate each other.
set -euo pipefail
export PDSERVE_CLUSTER_SECRET=${PDSERVE_CLUSTER_SECRET:-$(python3 -c 'import secrets; print(secrets.token_hex(16))')}
ROUTER_HOST=${ROUTER_HOST:-127.0.0.1}
PREFILL_HOST=${PREFILL_HOST:-127.0.0.1}
DECODE_HOST=${DECODE_HOST:-127.0.0.1}
PDSERVE=${PDSERVE:-pdserve}
COMMON=(--kv-cache-memory 2G --max-model-len 4096 --cache-transfer-protocol tcp --router "http://$ROUTER_HOST:8000")

trap 'kill 0' EXIT INT TERM

# host A
$PDSERVE router --host "$ROUTER_HOST" --port 8000 &
$PDSERVE serve --splitwise-role prefill --host "$PREFILL_HOST" --port 8001 --pd-comm-port 8101 "${COMMON[@]}" &

# host B
$PDSERVE serve --splitwise-role decode --host "$DECODE_HOST" --port 8002 "${COMMON[@]}" &

until curl -sf "http://$ROUTER_HOST:8000/health" >/dev/null; do sleep 1; done
echo "ready: OpenAI API on http://$ROUTER_HOST:8000/v1 (Ctrl-C stops all three)"
wait
