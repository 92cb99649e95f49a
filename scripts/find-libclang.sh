#!/usr/bin/env bash
# Prints the path of the libclang shared library that bindgen (clang-sys, runtime loading)
# would load, or exits 1 when there is none. It follows clang-sys's rules:
#  - file names: libclang.so, libclang-<ver>.so, libclang.so.<n>, libclang-<ver>.so.<n>,
#    never libclang-cpp (a different library that Debian ships with LLVM);
#  - LIBCLANG_PATH, when set, is the only place looked at (a file or a directory);
#  - otherwise `llvm-config --prefix`/{bin,lib,lib64}, LD_LIBRARY_PATH, LIBRARY_PATH, then
#    /usr/local/llvm*/lib*, /usr/local/lib*/*/*, /usr/local/lib*/*, /usr/local/lib*,
#    /usr/lib*/*/*, /usr/lib*/*, /usr/lib*.
# Directories given as arguments replace that default list (used by the tests).
set -uo pipefail
shopt -s nullglob

# Prints the first libclang in directory $1, if any.
libclang_in() {
    local dir=$1 file name
    [[ -d $dir ]] || return 1
    for file in "$dir"/libclang.so "$dir"/libclang-*.so "$dir"/libclang.so.* "$dir"/libclang-*.so.*; do
        name=${file##*/}
        [[ $name == *-cpp.* ]] && continue
        [[ -e $file ]] || continue
        printf '%s\n' "$file"
        return 0
    done
    return 1
}

# Prints the first libclang in any of the directories given.
first_in() {
    local dir
    for dir in "$@"; do
        libclang_in "$dir" && return 0
    done
    return 1
}

if [[ -n ${LIBCLANG_PATH:-} ]]; then
    if [[ -f $LIBCLANG_PATH ]]; then
        # The file itself must be one that the patterns above accept.
        for file in "$(dirname "$LIBCLANG_PATH")"/libclang*; do
            name=${file##*/}
            if [[ $file -ef $LIBCLANG_PATH && $name != *-cpp.* ]] && [[ $name == libclang.so || $name == libclang-*.so || $name == libclang.so.* || $name == libclang-*.so.* ]]; then
                printf '%s\n' "$LIBCLANG_PATH"
                exit 0
            fi
        done
        exit 1
    fi
    first_in "$LIBCLANG_PATH"
    exit
fi

if (($# > 0)); then
    first_in "$@"
    exit
fi

dirs=()
if prefix=$(llvm-config --prefix 2>/dev/null); then
    dirs+=("$prefix/bin" "$prefix/lib" "$prefix/lib64")
fi
IFS=: read -r -a from_env <<<"${LD_LIBRARY_PATH:-}:${LIBRARY_PATH:-}"
for dir in "${from_env[@]}"; do
    [[ -n $dir ]] && dirs+=("$dir")
done
dirs+=(/usr/local/llvm*/lib* /usr/local/lib*/*/* /usr/local/lib*/* /usr/local/lib* /usr/lib*/*/* /usr/lib*/* /usr/lib*)
first_in "${dirs[@]}"
