#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Move the GPU host's JIT caches from one host to another of the same kind and wheel set. A host
# with empty caches spends minutes compiling what an earlier one already built: FlashInfer's
# kernels (a `ddtree_flashinfer` suite took 414 s cold on 2026-11-30) and the servers' Triton
# kernels (a V2-Lite-shaped server starts in ~170 s cold, ~60 s warm).
#
#   on the host that ran the servers:  scripts/gpu_host/jit_cache.sh pack DIR [options] [flashinfer] [triton]
#   on the receiving side (optional):  scripts/gpu_host/jit_cache.sh keep DIR DEST   check a copy, copy it on
#   on the other host:                 scripts/gpu_host/jit_cache.sh unpack DIR
#
# pack writes one xz archive and a manifest (part count, sha256, caches) into DIR.
#   --part-mib N   split the archive into parts of N MiB (environment: JIT_CACHE_PART_MIB)
#   --max-mib N    refuse an archive over N MiB (environment: JIT_CACHE_MAX_MIB; default: no limit)
# keep checks a copied DIR against its manifest and copies it to DEST (writable). unpack checks
# the manifest, extracts into a temporary folder and only then moves the caches into place, so a
# damaged or incomplete copy leaves the host's caches as they were.
# Caches (relative to $HOME): flashinfer = .cache/flashinfer + .cache/tvm-ffi, triton = .triton/cache.
set -euo pipefail
die() { echo "jit_cache.sh: $*" >&2; exit 1; }
PART_MIB=${JIT_CACHE_PART_MIB:-}
MAX_MIB=${JIT_CACHE_MAX_MIB:-}
MANIFEST=jit-cache.manifest

cache_paths() {  # the $HOME-relative folders of the named caches
    local name
    for name in "$@"; do
        case "$name" in
            flashinfer) echo .cache/flashinfer; echo .cache/tvm-ffi ;;
            triton) echo .triton/cache ;;
            *) die "unknown cache '$name': choose from flashinfer, triton" ;;
        esac
    done
}

pack() {
    local dest=${1:?usage: jit_cache.sh pack DEST [--part-mib N] [--max-mib N] [flashinfer] [triton]}
    shift
    local names=()
    while [ $# -gt 0 ]; do
        case "$1" in
            --part-mib) PART_MIB=${2:?--part-mib needs a size in MiB}; shift 2 ;;
            --max-mib) MAX_MIB=${2:?--max-mib needs a size in MiB}; shift 2 ;;
            *) names+=("$1"); shift ;;
        esac
    done
    [ -z "$PART_MIB" ] || [[ "$PART_MIB" =~ ^[1-9][0-9]*$ ]] || die "--part-mib takes a whole number of MiB, got '$PART_MIB'"
    [ -z "$MAX_MIB" ] || [[ "$MAX_MIB" =~ ^[1-9][0-9]*$ ]] || die "--max-mib takes a whole number of MiB, got '$MAX_MIB'"
    [ ${#names[@]} -gt 0 ] || names=(flashinfer triton)
    local present=() p
    while read -r p; do
        if [ -d "$HOME/$p" ]; then present+=("$p"); else echo "jit_cache.sh: no \$HOME/$p, skipped" >&2; fi
    done < <(cache_paths "${names[@]}")
    [ ${#present[@]} -gt 0 ] || die "none of the caches (${names[*]}) exists under $HOME: nothing to pack"
    mkdir -p "$dest"
    rm -f "$dest"/jit-cache.tar.xz "$dest"/jit-cache.tar.xz.* "$dest/$MANIFEST"
    tar -C "$HOME" -cf - "${present[@]}" | xz -T0 -6 >"$dest/jit-cache.tar.xz"
    local mib=$(( ($(stat -c %s "$dest/jit-cache.tar.xz") + 1048575) / 1048576 ))
    if [ -n "$MAX_MIB" ] && [ "$mib" -gt "$MAX_MIB" ]; then
        rm -f "$dest/jit-cache.tar.xz"
        die "the archive is $mib MiB, over the limit of $MAX_MIB MiB (--max-mib): pack fewer caches, e.g. 'pack $dest flashinfer'"
    fi
    local sum
    sum=$(sha256sum "$dest/jit-cache.tar.xz" | cut -d' ' -f1)
    if [ -n "$PART_MIB" ]; then
        (cd "$dest" && split -b "${PART_MIB}M" -d -a 2 jit-cache.tar.xz jit-cache.tar.xz. && rm jit-cache.tar.xz)
    fi
    local n
    n=$(archive_files "$dest" | wc -l)
    printf 'parts %s\nsha256 %s\ncaches %s\n' "$n" "$sum" "${present[*]}" >"$dest/$MANIFEST"
    echo "jit_cache.sh: packed ${present[*]} into $n part(s), $mib MiB, in $dest"
}

archive_files() {  # the archive in DIR, whole or as its parts, in order
    if [ -f "$1/jit-cache.tar.xz" ]; then echo "$1/jit-cache.tar.xz"; else ls "$1"/jit-cache.tar.xz.* 2>/dev/null || true; fi
}

check() {  # verify a folder of parts against its manifest
    local src=$1 want sum
    [ -f "$src/$MANIFEST" ] || die "$src has no $MANIFEST: not a folder made by 'jit_cache.sh pack'"
    want=$(awk '$1 == "parts" {print $2}' "$src/$MANIFEST")
    sum=$(awk '$1 == "sha256" {print $2}' "$src/$MANIFEST")
    local files
    mapfile -t files < <(archive_files "$src")
    [ "${#files[@]}" = "$want" ] || die "$src holds ${#files[@]} of $want parts"
    [ "$(cat "${files[@]}" | sha256sum | cut -d' ' -f1)" = "$sum" ] \
        || die "the parts in $src do not match their manifest's sha256: copy them again"
}

keep() {
    local src=${1:?usage: jit_cache.sh keep SRC DEST} dest=${2:?usage: jit_cache.sh keep SRC DEST}
    check "$src"
    rm -rf "$dest" && mkdir -p "$dest"
    local files
    mapfile -t files < <(archive_files "$src")
    cp "$src/$MANIFEST" "${files[@]}" "$dest/"
    chmod u+w "$dest"/*
    echo "jit_cache.sh: kept $(awk '$1 == "caches" {$1 = ""; print}' "$dest/$MANIFEST") in $dest"
}

unpack() {
    local src=${1:?usage: jit_cache.sh unpack SRC}
    check "$src"
    local p
    tmp=$(mktemp -d "$HOME/.jit-cache-unpack.XXXXXX")  # global: the EXIT trap outlives this function
    trap 'rm -rf "$tmp"' EXIT
    local files
    mapfile -t files < <(archive_files "$src")
    cat "${files[@]}" | xz -d | tar -x -C "$tmp" || die "the archive in $src does not extract"
    for p in $(awk '$1 == "caches" {$1 = ""; print}' "$src/$MANIFEST"); do
        [ -d "$tmp/$p" ] || die "the archive lacks $p, which its manifest lists"
    done
    for p in $(awk '$1 == "caches" {$1 = ""; print}' "$src/$MANIFEST"); do
        mkdir -p "$HOME/$(dirname "$p")"
        rm -rf "$HOME/$p"
        mv "$tmp/$p" "$HOME/$p"
    done
    echo "jit_cache.sh: restored$(awk '$1 == "caches" {$1 = ""; print}' "$src/$MANIFEST") under $HOME"
}

case "${1:-}" in
    pack) shift; pack "$@" ;;
    keep) shift; keep "$@" ;;
    unpack) shift; unpack "$@" ;;
    -h|--help) sed -n '3,18p' "$0" | sed 's/^# \{0,1\}//' ;;
    *) sed -n '3,18p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
