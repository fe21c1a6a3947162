#!/usr/bin/env bash
# Regenerates ibvx-sys/src/bindings/ARCH.rs (x86_64 and aarch64) from
# Debian's rdma-core headers (<infiniband/verbs.h>, package libibverbs-dev)
# with the bindgen CLI, one file per target architecture: the layouts differ
# (pthread_mutex_t and pthread_cond_t inside ibv_context and friends).
#
# Usage: ibvx-sys/regen.sh [--no-install] [--arch ARCH] [--out FILE]
#   --no-install  never install anything; exit 3 with a message on stderr if
#                 bindgen, libclang or the headers are missing (used by the
#                 crate's regen_matches_checked_in test)
#   --arch ARCH   x86_64 or aarch64 (default: both)
#   --out FILE    write the bindings to FILE instead of src/bindings/ARCH.rs
#                 (needs --arch)
#
# Without --no-install the script installs what it needs, idempotently:
# libibverbs-dev, libclang-dev and (for aarch64) libc6-dev-arm64-cross through
# apt-get (only when missing), and bindgen-cli $BINDGEN_VERSION through
# `cargo install` (only when the bindgen on PATH is not that version).
#
# Cross generation: clang parses for --target=ARCH-linux-gnu on any host. The
# rdma-core headers are architecture-independent and come from the host's
# /usr/include/infiniband (made visible alone, through a directory holding a
# symlink to it); the C library and kernel headers of aarch64 come from
# /usr/aarch64-linux-gnu/include (libc6-dev-arm64-cross), which clang finds
# for that target by itself.
#
# The output is deterministic for a given (bindgen, libclang, rdma-core
# headers, glibc headers) set: every flag is pinned below, and libclang is
# Debian 12's /usr/lib/llvm-14/lib when present (LIBCLANG_PATH overrides).
# The checked-in files were made with bindgen 0.73.2, Debian 12's libclang 14,
# rdma-core 44.0 and glibc 2.36 (native for x86_64, the -cross package for
# aarch64), on an x86_64 host.
set -euo pipefail

BINDGEN_VERSION=0.73.2
APT_PACKAGES=(libibverbs-dev libclang-dev)
ARCHES=(x86_64 aarch64)

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=
arches=()
install=1

while [ $# -gt 0 ]; do
    case "$1" in
    --no-install) install=0 ;;
    --out)
        out=${2:?--out needs a file}
        shift
        ;;
    --arch)
        case "${2:-}" in
        x86_64 | aarch64) arches+=("$2") ;;
        *)
            echo "regen.sh: --arch takes x86_64 or aarch64" >&2
            exit 2
            ;;
        esac
        shift
        ;;
    -h | --help)
        sed -n '2,33p' "$0"
        exit 0
        ;;
    *)
        echo "regen.sh: unknown argument: $1" >&2
        exit 2
        ;;
    esac
    shift
done

export PATH="$HOME/.cargo/bin:$PATH"

missing() {
    echo "regen.sh: $*" >&2
    exit 3
}

[ ${#arches[@]} -gt 0 ] || arches=("${ARCHES[@]}")
if [ -n "$out" ] && [ ${#arches[@]} -ne 1 ]; then
    echo "regen.sh: --out needs exactly one --arch" >&2
    exit 2
fi
for a in "${arches[@]}"; do
    [ "$a" = aarch64 ] && APT_PACKAGES+=(libc6-dev-arm64-cross)
done
if [ "$(uname -m)" != x86_64 ]; then
    # The cross set-up below (native headers for x86_64, the -cross package
    # for aarch64) is Debian's on an x86_64 host; elsewhere the system headers
    # would be another architecture's and the output would silently change.
    missing "the bindings are generated on an x86_64 host, this is $(uname -m)"
fi

have_pkg() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'
}

have_bindgen() {
    command -v bindgen >/dev/null 2>&1 &&
        [ "$(bindgen --version 2>/dev/null | head -n1)" = "bindgen $BINDGEN_VERSION" ]
}

if [ "$install" = 1 ]; then
    need=()
    for p in "${APT_PACKAGES[@]}"; do
        have_pkg "$p" || need+=("$p")
    done
    if [ ${#need[@]} -gt 0 ]; then
        sudo=()
        [ "$(id -u)" = 0 ] || sudo=(sudo)
        "${sudo[@]}" apt-get update
        DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y --no-install-recommends "${need[@]}"
    fi
    if ! have_bindgen; then
        cargo install bindgen-cli --version "=$BINDGEN_VERSION" --locked
    fi
else
    for p in "${APT_PACKAGES[@]}"; do
        have_pkg "$p" || missing "Debian package $p is not installed"
    done
    have_bindgen || missing "bindgen $BINDGEN_VERSION is not on PATH (have: $(bindgen --version 2>/dev/null | head -n1 || echo none))"
fi

header=/usr/include/infiniband/verbs.h
[ -f "$header" ] || missing "$header not found"
rdma_version=$(dpkg-query -W -f='${Version}' libibverbs-dev)

# Prefer Debian 12's libclang (the one the checked-in file was made with)
# when several are installed; bindgen would otherwise take the newest.
if [ -z "${LIBCLANG_PATH:-}" ] && [ -d /usr/lib/llvm-14/lib ]; then
    export LIBCLANG_PATH=/usr/lib/llvm-14/lib
fi
# bindgen loads libclang only when it parses: probe it on an empty header.
probe_dir=$(mktemp -d "${TMPDIR:-/tmp}/ibvx-regen.XXXXXX")
trap 'rm -rf "$probe_dir"' EXIT
: >"$probe_dir/probe.h"
if ! bindgen "$probe_dir/probe.h" -o "$probe_dir/probe.rs" 2>"$probe_dir/err"; then
    if grep -q 'Unable to find libclang' "$probe_dir/err"; then
        missing "bindgen cannot load libclang (install libclang-dev)"
    fi
    cat "$probe_dir/err" >&2
    exit 1
fi

# bindgen flags, all pinned (changing any of them changes the checked-in file):
#
# --default-enum-style consts --no-prepend-enum-name
#     C enums become `pub type ibv_x = c_uint;` plus `pub const IBV_X_Y: ibv_x`
#     with the C constant names. Not Rust enums: many verbs "enums" are bit
#     sets that C code ORs together (ibv_access_flags, ibv_qp_attr_mask,
#     ibv_send_flags, ...), and values written by the kernel or a newer provider
#     (an unknown ibv_wc_status, ibv_event_type, port state, ...) would be
#     undefined behaviour in a Rust enum. Constants keep every value
#     representable and read like the C API.
# --with-derive-default (plus bindgen's default Debug/Copy/Clone)
#     Attribute structs (ibv_qp_attr, ibv_qp_init_attr, ibv_send_wr, ...) are
#     meant to be zero-initialised and filled field by field, as in C.
# layout tests on (the default; they are compile-time asserts in this
#     bindgen version), so a wrong size/offset fails the build.
# --no-doc-comments
#     verbs.h comments are not Rust docs (indented text would become doctests).
# --wrap-unsafe-ops
#     generated unsafe fns wrap their unsafe operations in unsafe blocks
#     (the workspace denies unsafe_op_in_unsafe_fn).
# --rust-target 1.80 --rust-edition 2021
#     the workspace's rust-version and edition.
# allowlists
#     ibv_* types and IBV_* constants, plus: verbs_context (needed to mirror the
#     static inline ibv_query_port), _compat_ibv_* (argument of the exported
#     ibv_query_port), pfn_* (function-pointer typedefs declared in wrapper.h),
#     and the ib_uverbs_* enums that IBV_ACCESS_OPTIONAL_RANGE and
#     IBV_QPF_GRH_REQUIRED alias (src/lib.rs re-exports them under the IBV_
#     names). No function declarations are generated: this crate never links
#     libibverbs, every entry point is loaded at run time.
# Only rdma-core's headers from the host's /usr/include: the C library's and
# the kernel's come from the target's own include directory.
mkdir -p "$probe_dir/inc"
ln -s /usr/include/infiniband "$probe_dir/inc/infiniband"

generate() { # ARCH OUT
    local arch=$1 dest=$2 tmp="$probe_dir/bindings-$1.rs"
    # x86_64 is the host: clang's native parse, as the file was always made.
    local clang_args=()
    if [ "$arch" = aarch64 ]; then
        [ -d /usr/aarch64-linux-gnu/include ] ||
            missing "/usr/aarch64-linux-gnu/include not found (Debian package libc6-dev-arm64-cross)"
        clang_args=(--target=aarch64-linux-gnu -nostdlibinc -isystem /usr/aarch64-linux-gnu/include
            -I"$probe_dir/inc")
    fi
    bindgen "$here/wrapper.h" \
        --rust-target 1.80 \
        --rust-edition 2021 \
        --default-enum-style consts \
        --no-prepend-enum-name \
        --with-derive-default \
        --no-doc-comments \
        --wrap-unsafe-ops \
        --formatter rustfmt \
        --allowlist-type 'ibv_.*' \
        --allowlist-type '_compat_ibv_.*' \
        --allowlist-type 'verbs_context' \
        --allowlist-type 'pfn_.*' \
        --allowlist-type 'ib_uverbs_access_flags' \
        --allowlist-type 'ib_uverbs_query_port_flags' \
        --allowlist-var 'IBV_.*' \
        --raw-line "// @generated by ibvx-sys/regen.sh from <infiniband/verbs.h> (rdma-core $rdma_version) and ibvx-sys/wrapper.h." \
        --raw-line "// Do not edit by hand. Valid for $arch Linux only." \
        -o "$tmp" \
        -- ${clang_args[@]+"${clang_args[@]}"}
    mkdir -p "$(dirname "$dest")"
    cp "$tmp" "$dest"
    echo "regen.sh: wrote $dest" >&2
}

for a in "${arches[@]}"; do
    generate "$a" "${out:-$here/src/bindings/$a.rs}"
done
