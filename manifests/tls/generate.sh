#!/usr/bin/env bash
# Makes the webhook's TLS material for the default install (manifests/kustomization.yaml):
# a self-signed CA and a serving certificate for meshgate-webhook.meshgate-system.svc signed by
# it. Needs only openssl. Run it before `kubectl apply -k manifests/`, and again to renew.
#
#   manifests/tls/generate.sh [--new-ca] [--days N] [DIR]
#
# In: DIR (default: this script's directory); an existing DIR/ca.crt + DIR/ca.key are reused,
# so renewing the serving certificate keeps the caBundle the apiserver trusts unchanged and
# the rollout is seamless. --new-ca makes a new CA (see docs/operations.md, "Rotate the CA").
# Out: DIR/ca.crt, DIR/ca.key (keep it secret, or delete it and use --new-ca next time),
# DIR/tls.crt, DIR/tls.key. Exit 0 on success; the certificate's subject and expiry on stderr.
set -euo pipefail

new_ca=0
days=365
dir=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --new-ca) new_ca=1 ;;
    --days) days="${2:?--days needs a number}"; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    -*) echo "generate.sh: unknown option $1" >&2; exit 2 ;;
    *) dir="$1" ;;
  esac
  shift
done
dir="${dir:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"
command -v openssl >/dev/null || { echo "generate.sh: openssl is required" >&2; exit 2; }
mkdir -p "$dir"
umask 077

service=meshgate-webhook
namespace=meshgate-system
cn="$service.$namespace.svc"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if [[ $new_ca -eq 1 || ! -s "$dir/ca.crt" || ! -s "$dir/ca.key" ]]; then
  # ECDSA P-256: small, fast, and supported by the apiserver and rustls alike.
  openssl req -x509 -new -nodes -sha256 -days 3650 \
    -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
    -keyout "$work/ca.key" -out "$work/ca.crt" \
    -subj "/CN=meshgate-webhook-ca" \
    -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  mv "$work/ca.key" "$dir/ca.key"
  chmod 0644 "$work/ca.crt"
  mv "$work/ca.crt" "$dir/ca.crt"
  echo "generate.sh: new CA in $dir/ca.crt" >&2
fi

openssl req -new -nodes -sha256 \
  -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
  -keyout "$work/tls.key" -out "$work/tls.csr" -subj "/CN=$cn" 2>/dev/null
cat >"$work/ext.cnf" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth
subjectAltName=DNS:$cn,DNS:$cn.cluster.local,DNS:$service.$namespace
EXT
openssl x509 -req -sha256 -days "$days" \
  -in "$work/tls.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
  -set_serial "0x$(openssl rand -hex 16)" \
  -extfile "$work/ext.cnf" -out "$work/tls.crt" 2>/dev/null
openssl verify -CAfile "$dir/ca.crt" "$work/tls.crt" >/dev/null
# Secret files are read by the webhook (uid 65532) through the volume's own modes, not these.
chmod 0644 "$work/tls.crt"
mv "$work/tls.key" "$dir/tls.key"
mv "$work/tls.crt" "$dir/tls.crt"
echo "generate.sh: $(openssl x509 -in "$dir/tls.crt" -noout -subject -enddate | tr '\n' ' ')" >&2
