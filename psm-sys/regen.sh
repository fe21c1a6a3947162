#!/usr/bin/env bash
# Regenerate psm-sys/src/bindings.rs from Debian's libpsm2-dev headers.
#
# Usage: psm-sys/regen.sh [--no-install] [OUTPUT]
#   OUTPUT        where to write (default: src/bindings.rs beside this script)
#   --no-install  do not apt-get/cargo install anything; fail if a tool is missing
#                 (the freshness test in tests/bindings_fresh.rs uses this)
#
# Without --no-install it first installs, only when missing (idempotent):
#   - Debian packages libclang-dev (libclang for bindgen) and libpsm2-dev (headers)
#   - bindgen-cli $BINDGEN_VERSION via `cargo install --locked`
#
# Every flag below is pinned so that the output is byte-for-byte reproducible
# for a given bindgen version and header set:
#   --formatter prettyplease   formatting is compiled into bindgen, so the output
#                              does not depend on the local rustfmt version
#   --rust-target 1.80         the workspace's rust-version (plain `extern "C"`
#                              blocks, valid in edition 2021)
#   --allowlist-item           only psm2_*/PSM2_* items (plus what they reference)
#   --default-enum-style newtype
#                              see the comment on `pub mod ffi` in src/lib.rs
#   --no-doc-comments          the headers' doxygen comments contain C code blocks
#                              that rustdoc would compile as Rust doctests
#   --blocklist-item ...       64-bit macros that bindgen types as i32 or u32 (the
#                              all-ones ones as `i32 = -1`); src/lib.rs defines them as u64
# Layout tests are kept (bindgen emits them as compile-time assertions).
set -euo pipefail

BINDGEN_VERSION=0.73.2

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
install=1
out=""
for arg in "$@"; do
    case "$arg" in
        --no-install) install=0 ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        -*) echo "regen.sh: unknown option $arg" >&2; exit 2 ;;
        *) out="$arg" ;;
    esac
done
out="${out:-$here/src/bindings.rs}"

export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"

have_bindgen() {
    command -v bindgen >/dev/null 2>&1 &&
        [ "$(bindgen --version 2>/dev/null)" = "bindgen $BINDGEN_VERSION" ]
}

if [ "$install" = 1 ]; then
    missing=()
    for pkg in libclang-dev libpsm2-dev; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' ||
            missing+=("$pkg")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        sudo=""
        [ "$(id -u)" = 0 ] || sudo="sudo"
        $sudo apt-get update
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends "${missing[@]}"
    fi
    have_bindgen || cargo install --locked bindgen-cli --version "$BINDGEN_VERSION"
fi

if ! have_bindgen; then
    echo "regen.sh: bindgen $BINDGEN_VERSION not found (cargo install --locked bindgen-cli --version $BINDGEN_VERSION)" >&2
    exit 1
fi

tmp="$(mktemp "${TMPDIR:-/tmp}/psm-sys-bindings.XXXXXX")"
trap 'rm -f "$tmp"' EXIT

bindgen "$here/wrapper.h" \
    --formatter prettyplease \
    --rust-target 1.80 \
    --rust-edition 2021 \
    --allowlist-item '(psm2|PSM2)_.*' \
    --blocklist-item 'PSM2_MQ_ORDERMASK_(ALL|NONE)|PSM2_EP_OPEN_PKEY_DEFAULT' \
    --default-enum-style newtype \
    --no-doc-comments \
    --output "$tmp"

cat "$tmp" > "$out"
echo "regen.sh: wrote $out"
