#!/usr/bin/env bash
# Builds Kuadrant's Limitador (limitador-server, the Envoy rate limit service the `rls` and `peers`
# sections measure Turnstile's against) from its repository, once, and prints the binary's path
# last. Later runs print the cached binary at once.
#
# Usage: bench/limitador.sh [--print-only]
#   --print-only   print the cached binary's path if it is built, or exit 1; never build.
#
# Where the source comes from (the first that is set or works):
#   LIMITADOR_SRC  a clone of the repository: a work tree or a bare/mirror git directory
#   otherwise      `git clone https://github.com/Kuadrant/limitador` into the cache (needs a
#                  network that reaches it)
# LIMITADOR_REV    the commit built (default 2981b2b, v2.4.0-dev: the one docs/benchmarks.md's
#                  figures used); `git archive` of it is unpacked into the cache, so the source
#                  repository is only read and nothing of Limitador enters this repository.
# LIMITADOR_CACHE  where the source, its cargo target directory and the binary are kept (default
#                  ${XDG_CACHE_HOME:-~/.cache}/turnstile-bench/limitador); the binary is
#                  $LIMITADOR_CACHE/bin/limitador-server-<rev>.
#
# The build is Limitador's own: `cargo build --release -p limitador-server` with its release profile
# (LTO, one codegen unit) and its default features (RocksDB's disk store included, compiled from
# C++: the longest part). It needs cargo, a C++ compiler, `protoc` (Debian protobuf-compiler) and
# libclang (libclang-dev); the missing ones are installed with apt-get when run as root, as
# test.sh installs the bench tools. About 30-60 minutes of CPU on 2 cores. `nice -n 10` keeps it
# behind other work.
set -euo pipefail

REV=${LIMITADOR_REV:-2981b2b}
CACHE=${LIMITADOR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/turnstile-bench/limitador}
PRINT_ONLY=0
[[ "${1:-}" == --print-only ]] && PRINT_ONLY=1

mkdir -p "$CACHE/bin"
# A cached binary is named by the full commit, resolved once and remembered beside it.
if [[ -e "$CACHE/rev-$REV" ]]; then
    FULL=$(cat "$CACHE/rev-$REV")
    if [[ -x "$CACHE/bin/limitador-server-$FULL" ]]; then
        echo "$CACHE/bin/limitador-server-$FULL"
        exit 0
    fi
fi
if (( PRINT_ONLY )); then
    echo "limitador: not built yet (run bench/limitador.sh)" >&2
    exit 1
fi

# ---- the source ----------------------------------------------------------------------------------
GIT_DIR_SRC=""
if [[ -n "${LIMITADOR_SRC:-}" ]]; then
    if git --git-dir="$LIMITADOR_SRC" rev-parse --git-dir >/dev/null 2>&1; then
        GIT_DIR_SRC=$LIMITADOR_SRC
    elif git -C "$LIMITADOR_SRC" rev-parse --git-dir >/dev/null 2>&1; then
        GIT_DIR_SRC=$(git -C "$LIMITADOR_SRC" rev-parse --absolute-git-dir)
    else
        echo "error: LIMITADOR_SRC=$LIMITADOR_SRC is not a git repository of Limitador" >&2
        exit 2
    fi
else
    if [[ ! -d "$CACHE/clone" ]]; then
        echo "limitador: no LIMITADOR_SRC; cloning the repository into $CACHE/clone..." >&2
        if ! timeout 300 git clone --quiet --bare https://github.com/Kuadrant/limitador \
            "$CACHE/clone.tmp" >&2; then
            rm -rf "$CACHE/clone.tmp"
            echo "error: cannot clone Limitador (no network to its repository?). Set" \
                "LIMITADOR_SRC to a local clone or mirror of Kuadrant/limitador." >&2
            exit 2
        fi
        mv "$CACHE/clone.tmp" "$CACHE/clone"
    fi
    GIT_DIR_SRC="$CACHE/clone"
fi
if ! FULL=$(git --git-dir="$GIT_DIR_SRC" rev-parse --verify --quiet "$REV^{commit}"); then
    echo "error: commit $REV is not in $GIT_DIR_SRC (set LIMITADOR_REV, or update the clone)" >&2
    exit 2
fi
echo "$FULL" >"$CACHE/rev-$REV"
BIN="$CACHE/bin/limitador-server-$FULL"
if [[ -x "$BIN" ]]; then echo "$BIN"; exit 0; fi

SRC="$CACHE/src-$FULL"
if [[ ! -e "$SRC/Cargo.toml" ]]; then
    rm -rf "$SRC.tmp"; mkdir -p "$SRC.tmp"
    # A mirror may hold a tree without some large blobs (the repository carries a profiling
    # file, default.profraw, the build does not read): those are left out, by name.
    excludes=()
    while IFS=$'\t' read -r meta path; do
        git --git-dir="$GIT_DIR_SRC" cat-file -e "${meta##* }" 2>/dev/null \
            || excludes+=(":(exclude)$path")
    done < <(git --git-dir="$GIT_DIR_SRC" ls-tree -r "$FULL")
    (( ${#excludes[@]} )) && echo "limitador: not in the mirror, left out: ${excludes[*]}" >&2
    git --git-dir="$GIT_DIR_SRC" archive "$FULL" -- . "${excludes[@]}" | tar -x -C "$SRC.tmp"
    mv "$SRC.tmp" "$SRC"
fi

# ---- the tools -----------------------------------------------------------------------------------
missing=()
command -v protoc >/dev/null || missing+=(protobuf-compiler)
compgen -G '/usr/lib/llvm-*/lib/libclang*.so*' >/dev/null \
    || compgen -G '/usr/lib/*/libclang*.so*' >/dev/null || missing+=(libclang-dev)
command -v c++ >/dev/null || missing+=(g++)
if (( ${#missing[@]} )); then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        echo "limitador: installing ${missing[*]}" >&2
        apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >&2
    else
        echo "error: Limitador's build needs ${missing[*]}; install them" >&2
        exit 2
    fi
fi
command -v cargo >/dev/null || { echo "error: cargo not found" >&2; exit 2; }

# ---- the build -----------------------------------------------------------------------------------
echo "limitador: building $FULL in $SRC (cargo build --release -p limitador-server)..." >&2
(cd "$SRC" && CARGO_TARGET_DIR="$CACHE/target" nice -n 10 \
    cargo build --release --locked -p limitador-server >&2)
cp "$CACHE/target/release/limitador-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
echo "$BIN"
