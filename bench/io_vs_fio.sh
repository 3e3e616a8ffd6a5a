#!/usr/bin/env bash
# Strata's I/O engine against fio, side by side on the same file system,
# file size, block size and queue depth (fio: ioengine=io_uring, direct=1).
# The disks we run on drift several-fold from minute to minute, so the two
# sides alternate in pairs (the order flips every pair) and only the pair
# ratios, and their median, are meaningful.
#
# Usage: bench/io_vs_fio.sh --path DIR [--strata BUILD/apps/strata] [--size 1G]
#                           [--bs 1M] [--qd 32] [--pairs 5] [--mode read|write|both]
#                           [--engine io_uring|libaio|psync|auto]
set -euo pipefail

path="" strata="" size="1G" bs="1M" qd=32 pairs=5 mode="both" engine="io_uring"
while (($#)); do
  case "$1" in
    --path) path="$2"; shift 2 ;;
    --strata) strata="$2"; shift 2 ;;
    --size) size="$2"; shift 2 ;;
    --bs) bs="$2"; shift 2 ;;
    --qd) qd="$2"; shift 2 ;;
    --pairs) pairs="$2"; shift 2 ;;
    --mode) mode="$2"; shift 2 ;;
    --engine) engine="$2"; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "io_vs_fio.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n "$path" ]] || { echo "io_vs_fio.sh: --path DIR is required" >&2; exit 2; }
[[ -d "$path" ]] || { echo "io_vs_fio.sh: --path $path is not a directory" >&2; exit 2; }
command -v fio >/dev/null || { echo "io_vs_fio.sh: fio not found (apt-get install fio)" >&2; exit 2; }
if [[ -z "$strata" ]]; then
  here="$(cd "$(dirname "$0")/.." && pwd)"
  for candidate in "$here"/build/apps/strata "$here"/build-*/apps/strata; do
    [[ -x "$candidate" ]] && { strata="$candidate"; break; }
  done
fi
[[ -x "$strata" ]] || { echo "io_vs_fio.sh: strata binary not found; pass --strata PATH" >&2; exit 2; }

size_bytes=$(numfmt --from=iec "$size")
bs_bytes=$(numfmt --from=iec "$bs")
fio_file="$path/io_vs_fio.fio.dat"
strata_file="io_vs_fio.strata.dat"
trap 'rm -f "$fio_file" "$path/$strata_file"' EXIT

modes=(read write)
[[ "$mode" == "both" ]] || modes=("$mode")

run_fio() {  # mode -> GB/s
  local rw="$1" key="$1"
  fio --name=cmp --filename="$fio_file" --ioengine=io_uring --direct=1 --rw="$rw" \
      --bs="$bs_bytes" --iodepth="$qd" --size="$size_bytes" --numjobs=1 --output-format=json \
      2>/dev/null | python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]['$key']; print(j['bw_bytes']/1e9)"
}

run_strata() {  # mode -> GB/s
  "$strata" io-bench --path "$path" --file "$strata_file" --size "$size_bytes" --block-size "$bs_bytes" \
      --queue-depth "$qd" --threads 1 --engine "$engine" --mode "$1" --json \
    | python3 -c "import json,sys; print(json.load(sys.stdin)['results'][0]['gb_per_s'])"
}

echo "io_vs_fio: $path ($(stat -f -c %T "$path")), size $size, block $bs, depth $qd, $pairs pairs, strata engine $engine"
echo "fio: ioengine=io_uring direct=1 numjobs=1; strata: io-bench --threads 1 (O_DIRECT)"
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(hostname)  cores: $(nproc)"
# Lay both files out once so every timed run overwrites or reads written blocks.
run_fio write >/dev/null
run_strata write >/dev/null

for m in "${modes[@]}"; do
  ratios=()
  printf '\n%-5s %-6s %10s %10s %8s\n' pair mode "fio GB/s" "strata" ratio
  for ((i = 1; i <= pairs; i++)); do
    if ((i % 2)); then f=$(run_fio "$m"); s=$(run_strata "$m"); else s=$(run_strata "$m"); f=$(run_fio "$m"); fi
    r=$(python3 -c "print(f'{$s/$f:.3f}')")
    ratios+=("$r")
    printf '%-5s %-6s %10.3f %10.3f %8s\n' "$i" "$m" "$f" "$s" "$r"
  done
  median=$(printf '%s\n' "${ratios[@]}" | sort -g | python3 -c "import sys; v=[float(x) for x in sys.stdin]; n=len(v); print(f'{(v[n//2] if n%2 else (v[n//2-1]+v[n//2])/2):.3f}')")
  echo "median strata/fio $m ratio: $median  (bar: >= 0.95)"
done
