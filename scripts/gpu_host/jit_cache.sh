#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Carry the GPU host's JIT caches from one machine to the next. A fresh host spends minutes
# compiling what an earlier host of the same kind already built: FlashInfer's kernels (a
# `ddtree_flashinfer` suite took 414 s cold on 2026-11-30) and the servers' Triton kernels (a
# V2-Lite-shaped server starts in ~170 s cold, ~60 s warm).
#
#   on the host, after a run:  scripts/gpu_host/jit_cache.sh pack $OUT/jit [flashinfer] [triton]
#   here, after the call:      scripts/gpu_host/jit_cache.sh keep <files_at>/jit .carry-jit
#   on a later host:           scripts/gpu_host/jit_cache.sh unpack .carry-jit   (carry .carry-jit)
#
# pack writes one xz archive split into parts of at most $JIT_CACHE_PART_MIB MiB (default 15:
# a file back from $OUT may hold 16 MiB) and a manifest (part count, sha256); it refuses an
# archive over $JIT_CACHE_MAX_MIB (default 56: the carry of one call is 64 MiB with the working
# tree). unpack checks the manifest, extracts into a temporary folder and only then moves the
# caches into place, so a bad or incomplete carry leaves the host's caches as they were.
# Caches (relative to $HOME): flashinfer = .cache/flashinfer + .cache/tvm-ffi, triton = .triton/cache.
set -euo pipefail
die() { echo "jit_cache.sh: $*" >&2; exit 1; }
PART_MIB=${JIT_CACHE_PART_MIB:-15}
MAX_MIB=${JIT_CACHE_MAX_MIB:-56}
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
    local dest=${1:?usage: jit_cache.sh pack DEST [flashinfer] [triton]}
    shift
    local names=("$@")
    [ ${#names[@]} -gt 0 ] || names=(flashinfer triton)
    local present=() p
    while read -r p; do
        if [ -d "$HOME/$p" ]; then present+=("$p"); else echo "jit_cache.sh: no \$HOME/$p, skipped" >&2; fi
    done < <(cache_paths "${names[@]}")
    [ ${#present[@]} -gt 0 ] || die "none of the caches (${names[*]}) exists under $HOME: nothing to pack"
    mkdir -p "$dest"
    rm -f "$dest"/jit-cache.tar.xz.* "$dest/$MANIFEST"
    tar -C "$HOME" -cf - "${present[@]}" | xz -T0 -6 >"$dest/jit-cache.tar.xz"
    local mib=$(( ($(stat -c %s "$dest/jit-cache.tar.xz") + 1048575) / 1048576 ))
    if [ "$mib" -gt "$MAX_MIB" ]; then
        rm -f "$dest/jit-cache.tar.xz"
        die "the archive is $mib MiB, over $MAX_MIB MiB (one call's carry): pack fewer caches, e.g. 'pack $dest flashinfer'"
    fi
    local sum
    sum=$(sha256sum "$dest/jit-cache.tar.xz" | cut -d' ' -f1)
    (cd "$dest" && split -b "${PART_MIB}M" -d -a 2 jit-cache.tar.xz jit-cache.tar.xz. && rm jit-cache.tar.xz)
    local n
    n=$(ls "$dest"/jit-cache.tar.xz.* | wc -l)
    printf 'parts %s\nsha256 %s\ncaches %s\n' "$n" "$sum" "${present[*]}" >"$dest/$MANIFEST"
    echo "jit_cache.sh: packed ${present[*]} into $n part(s), $mib MiB, in $dest"
}

check() {  # verify a folder of parts against its manifest
    local src=$1 want sum
    [ -f "$src/$MANIFEST" ] || die "$src has no $MANIFEST: not a folder made by 'jit_cache.sh pack'"
    want=$(awk '$1 == "parts" {print $2}' "$src/$MANIFEST")
    sum=$(awk '$1 == "sha256" {print $2}' "$src/$MANIFEST")
    [ "$(ls "$src"/jit-cache.tar.xz.* 2>/dev/null | wc -l)" = "$want" ] \
        || die "$src holds $(ls "$src"/jit-cache.tar.xz.* 2>/dev/null | wc -l) of $want parts"
    [ "$(cat "$src"/jit-cache.tar.xz.* | sha256sum | cut -d' ' -f1)" = "$sum" ] \
        || die "the parts in $src do not match their manifest's sha256: fetch them again"
}

keep() {
    local src=${1:?usage: jit_cache.sh keep SRC DEST} dest=${2:?usage: jit_cache.sh keep SRC DEST}
    check "$src"
    rm -rf "$dest" && mkdir -p "$dest"
    cp "$src/$MANIFEST" "$src"/jit-cache.tar.xz.* "$dest/"
    chmod u+w "$dest"/*
    echo "jit_cache.sh: kept $(awk '$1 == "caches" {$1 = ""; print}' "$dest/$MANIFEST") in $dest"
}

unpack() {
    local src=${1:?usage: jit_cache.sh unpack SRC}
    check "$src"
    local p
    tmp=$(mktemp -d "$HOME/.jit-cache-unpack.XXXXXX")  # global: the EXIT trap outlives this function
    trap 'rm -rf "$tmp"' EXIT
    cat "$src"/jit-cache.tar.xz.* | xz -d | tar -x -C "$tmp" || die "the archive in $src does not extract"
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
    *) sed -n '3,17p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
