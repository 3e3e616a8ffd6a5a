#!/usr/bin/env bash
# Pack a CUDA build's GPU-check programs, and the shared libraries they load,
# into one archive that scripts/gpu-check.sh runs on a GPU machine without
# building there (STRATA_GPU_PACK=ARCHIVE). The GPU machine has no Debian
# development packages, and its device time is short: compiling here and
# carrying the programs costs no device time.
#
#   scripts/gpu-pack.sh [BUILD_DIR] [ARCHIVE]
#     BUILD_DIR  a build configured with CUDA (default: build)
#     ARCHIVE    the archive to write (default: .gpu-pack/strata-gpu.tar.xz)
#   STRATA_GPU_PACK_PYTHON_MODULE=FILE  strata.torch's native module to pack
#     (default: BUILD_DIR's own, python/strata/_native*.so, when it was
#     configured with STRATA_BUILD_PYTHON=ON); for the GPU machine's Python
#     3.12, the one scripts/gpu-torch-module.sh builds. It goes into python/,
#     the Strata libraries it loads into python/lib/ (its own build's).
#
# Left out of the archive: the C library and its loader, the CUDA driver, and
# NCCL and cuBLAS (hundreds of MB; gpu-check finds the GPU machine's own).
# libstdc++ and libgcc_s go into lib-fallback/, used only where the GPU
# machine's own are older than the ones these programs were linked against.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
archive="${2:-.gpu-pack/strata-gpu.tar.xz}"

source scripts/gpu-programs.sh

if ! grep -q '^STRATA_ENABLE_CUDA:BOOL=ON' "$build/CMakeCache.txt" 2> /dev/null; then
  echo "gpu-pack: $build is not a build configured with STRATA_ENABLE_CUDA=ON" >&2
  echo "  hint: configure one with scripts/build.sh (CUDA is on where the toolkit is found)" >&2
  exit 1
fi
for program in "${gpu_programs[@]}"; do
  if [[ ! -x "$build/$program" ]]; then
    echo "gpu-pack: $build/$program is missing; build it first (cmake --build $build)" >&2
    exit 1
  fi
done

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root="$stage/strata-gpu"
mkdir -p "$root/bin" "$root/lib" "$root/lib-fallback"

# Libraries the GPU machine provides itself, or must (the driver).
provided='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libcuda\.so|libnccl\.so|libcublas\.so|libcublasLt\.so)'
for program in "${gpu_programs[@]}"; do
  cp "$build/$program" "$root/bin/"
  while read -r name path; do
    [[ "$name" =~ $provided ]] && continue
    if [[ "$path" == "not" || -z "$path" ]]; then
      echo "gpu-pack: $program needs $name, which is not found here" >&2
      exit 1
    fi
    case "$name" in
      libstdc++.so.*|libgcc_s.so.*) cp -L "$path" "$root/lib-fallback/$name" ;;
      *) cp -L "$path" "$root/lib/$name" ;;
    esac
  done < <(ldd "$build/$program" | awk '/=>/ {print $1, $3}')
done
# strata.torch's native module and the Strata libraries it was linked with (issue 50 §2).
# (A build without the module, e.g. before its Python step, packs none: `|| true` keeps set -e from ending here.)
module="${STRATA_GPU_PACK_PYTHON_MODULE:-$(ls "$build"/python/strata/_native*.so 2> /dev/null | head -1 || true)}"
if [[ -n "$module" ]]; then
  if [[ ! -f "$module" ]]; then
    echo "gpu-pack: STRATA_GPU_PACK_PYTHON_MODULE=$module is not a file" >&2
    exit 1
  fi
  mkdir -p "$root/python/lib"
  cp "$module" "$root/python/"
  while read -r name path; do
    case "$name" in
      libstrata_*) [[ -n "$path" && "$path" != "not" ]] || { echo "gpu-pack: $module needs $name, not found here" >&2; exit 1; }
                   cp -L "$path" "$root/python/lib/$name" ;;
    esac
  done < <(ldd "$module" | awk '/=>/ {print $1, $3}')
  strip --strip-debug "$root"/python/_native*.so "$root"/python/lib/*.so
fi
# The stack dumper gpu-check preloads into its engine runs (scripts/hangdump.c).
${CC:-cc} -O1 -shared -fPIC -o "$root/lib/hangdump.so" scripts/hangdump.c -lpthread
# Debug information is most of these files' size and is not needed to run them.
strip --strip-debug "$root"/bin/* "$root"/lib/libstrata_*.so
git rev-parse --short HEAD > "$root/commit" 2> /dev/null || echo unknown > "$root/commit"

mkdir -p "$(dirname "$archive")"
tar -C "$stage" -cJf "$archive" strata-gpu
echo "gpu-pack: wrote $archive ($(du -h "$archive" | cut -f1), $(ls "$root/bin" | wc -l) programs, $(ls "$root/lib" | wc -l) libraries$(
  [[ -n "$module" ]] && echo ", strata.torch's module $(basename "$module")"))"
