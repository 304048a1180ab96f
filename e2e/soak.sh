#!/usr/bin/env bash
# make soak: the long variants of the fault suite and of the fuzzers. Not part of make test.
#
# In: root, the Kubernetes binaries (MESHGATE_K8S_BIN_DIR, else e2e/install-deps.sh's cache).
# Out: pass/fail, and every figure the suite prints ([faults] and fuzz lines) on stderr.
#
# - The fault suite (e2e/tests/e2e/faults/) with MESHGATE_SOAK=1, against release binaries
#   (the webhook load is offered at 5,000 reviews/s for 60 s, which a debug build cannot
#   serve): 200 agent kills, 60 s of config flapping at 1,000 rewrites a minute, longer
#   vanishing-namespace churn; and the pods part of its abuse half
#   (e2e/tests/e2e/abuse_pods.rs) with the issue's 1,000 fat pending pods. One test at a time, so CPU and memory figures are the test's own.
# - The fuzz targets for MESHGATE_FUZZ_SECONDS each (default 120), in the debug profile so
#   integer overflow panics too.
# MESHGATE_FAULT_SEED / MESHGATE_FUZZ_SEED repeat a run's random choices.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${MESHGATE_K8S_BIN_DIR:-}" ]]; then
  MESHGATE_K8S_BIN_DIR="$(bash e2e/install-deps.sh | tail -n 1)"
fi
export MESHGATE_K8S_BIN_DIR
CARGO=${CARGO:-cargo}

echo "==> release build (the e2e tests run the real agent and webhook binaries)"
$CARGO build --release --workspace --bins --locked

echo "==> fault suite, soak variants (MESHGATE_SOAK=1)"
MESHGATE_SOAK=1 $CARGO test --release --locked -p meshgate-e2e --test e2e faults:: -- --include-ignored --test-threads=1 --nocapture
MESHGATE_SOAK=1 $CARGO test --release --locked -p meshgate-e2e --test e2e abuse_pods:: -- --include-ignored --test-threads=1 --nocapture

echo "==> fuzzing, ${MESHGATE_FUZZ_SECONDS:-120} s per target"
MESHGATE_FUZZ_SECONDS=${MESHGATE_FUZZ_SECONDS:-120} MESHGATE_FUZZ_ITERATIONS=${MESHGATE_FUZZ_ITERATIONS:-1000000000} \
  $CARGO test --locked -p meshgate-fuzz --test fuzz -- --nocapture
