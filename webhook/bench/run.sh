#!/usr/bin/env bash
# Benchmarks meshgate-webhook on loopback: latency percentiles and throughput per scenario,
# measured by a load generator in a second process (the e2e harness's review_load, as the
# example e2e/examples/webhook_load.rs), and the webhook's RSS with an empty node cache and
# with 5,000 Nodes in it.
#
# In: a built Kubernetes (MESHGATE_K8S_BIN_DIR, default the install-deps.sh cache), root.
# Out: one JSON line per scenario on stdout, RSS figures and the server-side histogram on
# stderr. Everything it starts (control plane, webhook) is stopped on exit.
#
# Usage: webhook/bench/run.sh [NODES_VERIFIED=4500] [NODES_UNVERIFIED=500] [DURATION=10] [CONNECTIONS=8]
set -euo pipefail
cd "$(dirname "$0")/../.."

VERIFIED=${1:-4500}
UNVERIFIED=${2:-500}
DURATION=${3:-10}
CONNECTIONS=${4:-8}
# The version pinned in Cargo.toml, in the cache install-deps.sh builds it into.
k8s_version=$(sed -n 's/^kubernetes-version *= *"\(v[0-9.]*\)".*/\1/p' Cargo.toml)
[[ -n "$k8s_version" ]] || { echo "no kubernetes-version in Cargo.toml" >&2; exit 1; }
cache_root=${MESHGATE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/meshgate}
export MESHGATE_K8S_BIN_DIR=${MESHGATE_K8S_BIN_DIR:-$cache_root/kubernetes/$k8s_version/bin}

cargo build --release --locked -p meshgate-webhook --bin meshgate-webhook >&2
cargo build --release --locked -p meshgate-e2e --example webhook_load >&2
# The control-plane launcher only starts processes: a debug build is enough.
cargo build --locked -p meshgate-e2e --bin meshgate-e2e >&2
WEBHOOK=target/release/meshgate-webhook
LOADGEN=target/release/examples/webhook_load
E2E=target/debug/meshgate-e2e

work=$(mktemp -d /tmp/meshgate-bench.XXXXXX)
webhook_pid=""
cleanup() {
  [[ -n "$webhook_pid" ]] && kill "$webhook_pid" 2>/dev/null && wait "$webhook_pid" 2>/dev/null || true
  "$E2E" down --dir "$work/cp" >&2 || true
  rm -rf "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
rss_kb() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
hwm_kb() { awk '/^VmHWM/ {print $2}' "/proc/$1/status"; }

kubeconfig=$("$E2E" up --dir "$work/cp" | tail -n 1)
"$LOADGEN" certs --dir "$work/pki"

start_webhook() {
  port=$(free_port); admin=$(free_port)
  RUST_LOG=${RUST_LOG:-warn,meshgate_webhook::cache=info} "$WEBHOOK" \
    --listen "127.0.0.1:$port" --tls-cert "$work/pki/tls.crt" --tls-key "$work/pki/tls.key" \
    --kubeconfig "$kubeconfig" --admin-addr "127.0.0.1:$admin" \
    --shutdown-delay 0s 2>>"$work/webhook.log" &
  webhook_pid=$!
  for _ in $(seq 1 300); do
    curl -fsS "http://127.0.0.1:$admin/ready" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "webhook not ready; log:" >&2; cat "$work/webhook.log" >&2; return 1
}
# --shutdown-delay 0s above: no Service endpoints to leave here, so a stop drains at once
# instead of serving on for the default 5 s.
stop_webhook() { kill "$webhook_pid"; wait "$webhook_pid" || true; webhook_pid=""; }

# RSS with an empty cache.
start_webhook
sleep 1
echo "rss_empty_cache_kb=$(rss_kb "$webhook_pid")" >&2
stop_webhook

"$LOADGEN" nodes --kubeconfig "$kubeconfig" --count "$VERIFIED" --unverified "$UNVERIFIED" >&2

start_webhook
sleep 2
grep "caches synced" "$work/webhook.log" | tail -n 1 >&2
echo "rss_${VERIFIED}+${UNVERIFIED}_nodes_idle_kb=$(rss_kb "$webhook_pid")" >&2

# Server-side percentiles of one scenario, from the difference of two scrapes of the
# meshgate_admission_duration_seconds histogram: the upper bound of the bucket holding p50/p99.
histogram() { curl -fsS "http://127.0.0.1:$admin/metrics" | grep '^meshgate_admission_duration_seconds_bucket' > "$1"; }
server_pct() {
  python3 - "$1" "$2" "$3" <<'PY'
import re, sys
def read(p):
    return [(float('inf') if m.group(1) == '+Inf' else float(m.group(1)), int(m.group(2)))
            for m in (re.search(r'le="([^"]+)"\} (\d+)', l) for l in open(p)) if m]
a, b = read(sys.argv[1]), read(sys.argv[2])
d = [(le, nb - na) for (le, na), (_, nb) in zip(a, b)]
total = d[-1][1]
def q(p):
    return next(le for le, c in d if c >= p * total)
fmt = lambda s: "inf" if s == float('inf') else f"{s * 1000:.3f}"
print(f'{{"scenario":"{sys.argv[3]}","server_reviews":{total},"server_p50_ms_le":{fmt(q(0.5))},"server_p99_ms_le":{fmt(q(0.99))}}}')
PY
}

for scenario in allowed plain refused binding-allowed binding-refused; do
  nodes=$VERIFIED
  [[ $scenario == plain || $scenario == refused || $scenario == binding-refused ]] && nodes=$UNVERIFIED
  histogram "$work/before"
  "$LOADGEN" load --url "https://127.0.0.1:$port/validate" --ca "$work/pki/ca.crt" \
    --scenario "$scenario" --connections "$CONNECTIONS" --duration "$DURATION" --nodes "$nodes"
  histogram "$work/after"
  server_pct "$work/before" "$work/after" "$scenario"
done
echo "rss_after_load_kb=$(rss_kb "$webhook_pid") hwm_kb=$(hwm_kb "$webhook_pid")" >&2
curl -fsS "http://127.0.0.1:$admin/metrics" | grep -E '^meshgate_admission_reviews' >&2
