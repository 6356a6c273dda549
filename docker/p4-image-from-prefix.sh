#!/bin/sh
# Packages an already built bmv2 install prefix (simple_switch_grpc with PI, as docs/BMV2.md's
# /opt/p4) into a local Docker image shaped like the public p4lang/behavioral-model image:
# programs in /usr/local/bin, libraries in /usr/local/lib, bmv2's Python modules (for
# simple_switch_CLI) importable by python3. For machines that reach no image registry; elsewhere
# the docker testbed uses the public image (P4_IMAGE).
#
#   docker/p4-image-from-prefix.sh [PREFIX [IMAGE]]     defaults: /opt/p4 switchagg-p4:local
#
# It builds nothing: it copies the prefix's programs, shared libraries and Python modules, and
# apt-installs the Debian packages that own the system libraries they link (found here with ldd
# and dpkg -S, so the prefix must have been built on Debian 12, the base image's release). Static
# libraries, libtool files and headers are left out. The base image comes from
# `docker/testbed.py base` (debootstrap).
set -eu

prefix=${1:-/opt/p4}
image=${2:-switchagg-p4:local}
base=${BASE_IMAGE:-switchagg-base:bookworm}
[ -x "$prefix/bin/simple_switch_grpc" ] || { echo "no $prefix/bin/simple_switch_grpc" >&2; exit 1; }
docker image inspect "$base" >/dev/null 2>&1 || { echo "no base image $base: run docker/testbed.py base" >&2; exit 1; }

ctx=$(mktemp -d "${TMPDIR:-/tmp}/switchagg-p4-image.XXXXXX")
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/usr/local/bin" "$ctx/usr/local/lib/python3/dist-packages"
cp -a "$prefix/bin/." "$ctx/usr/local/bin/"
find "$prefix/lib" -maxdepth 1 -name '*.so*' -exec cp -a {} "$ctx/usr/local/lib/" \;
for site in "$prefix"/lib/python3*/site-packages; do
  [ -d "$site" ] && cp -a "$site/." "$ctx/usr/local/lib/python3/dist-packages/"
done

# The Debian packages of every system library a program or library of the prefix links.
packages=$(
  for f in "$ctx"/usr/local/bin/* "$ctx"/usr/local/lib/*.so*; do
    LD_LIBRARY_PATH="$prefix/lib" ldd "$f" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// { print $3 }'
  done | grep -v "^$prefix/" | sort -u | while read -r lib; do
    real=$(readlink -f "$lib")
    for path in "$lib" "$real" "/usr$real" "${real#/usr}"; do
      owner=$(dpkg -S "$path" 2>/dev/null | head -1 | cut -d: -f1) && [ -n "$owner" ] && { echo "$owner"; break; }
    done
  done | sort -u | tr '\n' ' '
)
echo "system packages: $packages"

cat >"$ctx/Dockerfile" <<DOCKERFILE
FROM $base
LABEL org.switchagg.testbed=1
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -qq \\
 && apt-get install -y -qq --no-install-recommends $packages python3 python3-thrift python3-six >/dev/null \\
 && rm -rf /var/lib/apt/lists/*
COPY usr/ /usr/
RUN echo /usr/local/lib/python3/dist-packages >/usr/lib/python3/dist-packages/bmv2-local.pth \\
 && ldconfig && simple_switch_grpc --help >/dev/null
DOCKERFILE
docker build -q --network host -t "$image" "$ctx" >/dev/null
echo "$image: $(docker image inspect -f '{{.Size}}' "$image" | awk '{ printf "%.0f MB", $1 / 1e6 }')"
