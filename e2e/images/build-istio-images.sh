#!/usr/bin/env bash
# The images of Istio ambient's node components on the real node, as OCI image-layout tarballs
# (oci-image.sh; no registry, no container engine):
#   - install-cni.tar (localhost/meshgate-e2e/install-cni:1): istio-cni's node agent
#     (istio.io/istio/cni/cmd/install-cni, `install-cni` on PATH as in Istio's own image), the
#     CNI plugin it installs (/opt/cni/bin/istio-cni, where its installer copies it from), and
#     the netfilter tools it runs in pods' and the node's network namespaces: Debian's
#     iptables (legacy and nft, IPv4 and IPv6, with their extensions) and nft, with the shared
#     libraries ldd resolves them to. Istio's image is Debian-based with the same tools.
#   - ztunnel-standin.tar (localhost/meshgate-e2e/ztunnel-standin:1): the static stand-in for
#     ztunnel (e2e/ztunnel-standin/main.go).
#
# Usage: build-istio-images.sh OUT_DIR INSTALL_CNI ISTIO_CNI ZTUNNEL_STANDIN
set -euo pipefail

out=${1:?usage: build-istio-images.sh OUT_DIR INSTALL_CNI ISTIO_CNI ZTUNNEL_STANDIN}
install_cni=${2:?install-cni binary}
istio_cni=${3:?istio-cni binary}
standin=${4:?ztunnel-standin binary}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/oci-image.sh"
for bin in "$install_cni" "$istio_cni" "$standin"; do
  [[ -x $bin ]] || { echo "build-istio-images: $bin is not an executable" >&2; exit 1; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

# --- istio-cni's node agent --------------------------------------------------------------------
root="$work/install-cni-root"
mkdir -p "$root/usr/local/bin" "$root/opt/cni/bin" "$root/usr/sbin" "$root/etc" "$root/tmp" "$root/run"
chmod 1777 "$root/tmp"
cp "$install_cni" "$root/usr/local/bin/install-cni"
cp "$istio_cni" "$root/opt/cni/bin/istio-cni"
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)
tools=(/usr/sbin/xtables-legacy-multi /usr/sbin/xtables-nft-multi /usr/sbin/nft)
for t in "${tools[@]}"; do
  [[ -x $t ]] || { echo "build-istio-images: $t is missing (Debian's iptables and nftables)" >&2; exit 1; }
  cp "$t" "$root/usr/sbin/"
done
for v in iptables ip6tables; do
  for suffix in "" -save -restore; do
    ln -s xtables-legacy-multi "$root/usr/sbin/$v-legacy$suffix"
    ln -s xtables-nft-multi "$root/usr/sbin/$v-nft$suffix"
    # Debian's default alternative is the nft variant.
    ln -s xtables-nft-multi "$root/usr/sbin/$v$suffix"
  done
done
ext="/usr/lib/$multiarch/xtables"
mkdir -p "$root$ext"
cp "$ext"/*.so "$root$ext/"
# Every library the tools and their extensions load, at the path the loader resolves it to.
# A library the loader cannot find would make the pod fail at its first rule: refuse to build.
if missing=$(ldd "${tools[@]}" "$ext"/*.so | grep 'not found'); then
  echo "build-istio-images: unresolved libraries: $missing" >&2
  exit 1
fi
# ldd lines: "name => /path (addr)" for libraries, "/path (addr)" for the loader, and with
# several files a "FILE:" line heading each block.
ldd "${tools[@]}" "$ext"/*.so | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// && $2 ~ /^\(/ {print $1}' | sort -u | while read -r lib; do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
cp /etc/protocols /etc/services "$root/etc/"
printf 'root:x:0:0:root:/root:/sbin/nologin\n' >"$root/etc/passwd"
printf 'root:x:0:\n' >"$root/etc/group"
oci_image "$out/install-cni.tar" "localhost/meshgate-e2e/install-cni:1" "$root" \
  '"Entrypoint":["/usr/local/bin/install-cni"],"Env":["PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]'

# --- the stand-in ztunnel ----------------------------------------------------------------------
root="$work/ztunnel-root"
mkdir -p "$root/usr/local/bin"
cp "$standin" "$root/usr/local/bin/ztunnel-standin"
oci_image "$out/ztunnel-standin.tar" "localhost/meshgate-e2e/ztunnel-standin:1" "$root" \
  '"Entrypoint":["/usr/local/bin/ztunnel-standin"]'
