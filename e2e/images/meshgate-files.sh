#!/usr/bin/env bash
# The files of meshgate's image, in one place for both ways the image is built, so they hold
# the same files:
#   - the Dockerfile runs `meshgate-files.sh /out BIN...` and copies /out over its
#     distroless/cc-debian12 base;
#   - e2e/images/build-meshgate-image.sh (the image the real-node tests and the demo import,
#     since no base image can be pulled here) runs it the same way and adds the base's part with
#     `meshgate-files.sh --base`.
#
# Usage: meshgate-files.sh [--base] OUT BIN...
#   (default) OUT/usr/local/bin/<each BIN>, and OUT/usr/lib/<each shared library the BINs load
#             that distroless/cc lacks> (today none; /usr/lib is on the loader's default
#             path on every architecture);
#   --base    what distroless/cc-debian12 itself provides and the BINs need: the C runtime
#             libraries at the paths ldd resolves them to (glibc, libm, libgcc_s, the loader),
#             /etc/passwd and /etc/group with root and nonroot (65532, which the webhook runs
#             as), /tmp, and the CA bundle.
set -euo pipefail

base=false
if [[ ${1:-} == --base ]]; then base=true; shift; fi
out=${1:?usage: meshgate-files.sh [--base] OUT BIN...}
shift
(($# > 0)) || { echo "meshgate-files: no binaries given" >&2; exit 2; }
for bin in "$@"; do
  [[ -x $bin ]] || { echo "meshgate-files: $bin is not an executable (build it first)" >&2; exit 1; }
done

# The libraries distroless/cc ships: the C runtime. Everything else a binary loads is ours.
in_distroless_cc() {
  case "$(basename "$1")" in
    libc.so.* | libm.so.* | libgcc_s.so.* | ld-linux* | libdl.so.* | libpthread.so.* | librt.so.*) return 0 ;;
    *) return 1 ;;
  esac
}

# ldd lines: "name => /path (addr)" for libraries, "/path (addr)" for the loader; with several
# binaries ldd also heads each block with "BIN:", which is an absolute path when BIN is one.
# A library the loader cannot find would make a pod crash at start: refuse to build.
if missing=$(ldd "$@" | grep 'not found'); then
  echo "meshgate-files: the binaries need libraries this machine lacks:" >&2
  echo "$missing" >&2
  exit 1
fi
libs=$(ldd "$@" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// && $1 !~ /:$/ { print $1 }' | sort -u)

if ! $base; then
  mkdir -p "$out/usr/local/bin" "$out/usr/lib"
  cp "$@" "$out/usr/local/bin/"
  for lib in $libs; do
    in_distroless_cc "$lib" || cp -L "$lib" "$out/usr/lib/"
  done
  exit 0
fi

for lib in $libs; do
  if in_distroless_cc "$lib"; then
    mkdir -p "$out$(dirname "$lib")"
    cp -L "$lib" "$out$lib"
  fi
done
mkdir -p "$out/etc/ssl/certs" "$out/tmp"
chmod 1777 "$out/tmp"
printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$out/etc/passwd"
printf 'root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n' >"$out/etc/group"
if [[ -f /etc/ssl/certs/ca-certificates.crt ]]; then
  cp /etc/ssl/certs/ca-certificates.crt "$out/etc/ssl/certs/"
fi
