#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Build a minimal Debian base image with debootstrap and `docker import` it.
#
# Why: the CPU build hosts reach Debian's package mirror and PyPI but no image registry,
# so the image test cannot pull nvidia/cuda. The base only has to provide what
# docker/Dockerfile expects from any base: python3 with venv and pip, a C/C++ compiler and
# the Python headers (Triton and FlashInfer compile small host stubs at run time).
#
# Usage: scripts/make_base_image.sh [--tag TAG] [--suite bookworm] [--mirror URL] [--force]
set -euo pipefail

TAG=ddtree-base:bookworm
SUITE=bookworm
MIRROR=http://deb.debian.org/debian
FORCE=0
DOCKER=${DOCKER:-docker}
PACKAGES=python3,python3-venv,python3-pip,python3-dev,gcc,g++,make,libc6-dev,ca-certificates,libnuma1

usage() { sed -n '3,10p' "$0" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
    case "$1" in
        --tag) TAG=$2; shift 2 ;;
        --suite) SUITE=$2; shift 2 ;;
        --mirror) MIRROR=$2; shift 2 ;;
        --force) FORCE=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "make_base_image.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done

if [ "$(id -u)" != 0 ]; then
    echo "make_base_image.sh: debootstrap needs root" >&2; exit 1
fi
if [ "$FORCE" = 0 ] && "$DOCKER" image inspect "$TAG" >/dev/null 2>&1; then
    echo "base image $TAG already exists (use --force to rebuild)"
    exit 0
fi
command -v debootstrap >/dev/null || {
    echo "make_base_image.sh: debootstrap not found (apt-get install -y debootstrap)" >&2; exit 1; }

ROOTFS=$(mktemp -d /var/tmp/ddtree-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT

echo "debootstrap $SUITE ($PACKAGES) -> $ROOTFS"
nice -n 15 ionice -c3 debootstrap --variant=minbase --include="$PACKAGES" \
    "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 || {
    tail -30 "$ROOTFS.log" >&2; rm -f "$ROOTFS.log"; exit 1; }
rm -f "$ROOTFS.log"

# Keep the image small and reproducible: no package lists, caches or logs.
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin \
    "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/log/*.log "$ROOTFS"/tmp/*

nice -n 15 ionice -c3 tar --numeric-owner -C "$ROOTFS" -c . \
    | "$DOCKER" import \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' \
        - "$TAG" >/dev/null
echo "imported $TAG ($("$DOCKER" image inspect -f '{{.Size}}' "$TAG") bytes)"
