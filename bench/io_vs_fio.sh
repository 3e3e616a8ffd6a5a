#!/usr/bin/env bash
# Strata's I/O against fio's best, side by side on the same file system, file
# size, block size, queue depth and thread count (issue 9).
#
#  - fio runs twice per measurement, plain (ioengine=io_uring direct=1) and
#    with --fixedbufs=1 --registerfiles=1 (registered buffers and files, as
#    Strata registers its buffers); the faster of the two is "fio best".
#    numjobs = Strata's --threads, each job streaming its own 1/numjobs of
#    the same file (offset_increment), reported as one group.
#  - Both sides write over an already-written file (each file is laid out
#    once before the first timed run) and both read it back with O_DIRECT.
#  - Strata runs `io-bench` on the raw engine and, with --swap, `io-bench
#    --swap`: tensors through the SwapStore (checksums on, verified reads,
#    verify_writes on and off) from a SlotPool registered with io_uring.
#  - The disks we run on drift several-fold from minute to minute, so fio and
#    Strata alternate in ABBA order (fio first in odd pairs, Strata first in
#    even ones); only pair ratios and their medians are meaningful. The load
#    average is printed before and after: other jobs share the machine.
#
# Usage: bench/io_vs_fio.sh --path DIR [--strata BUILD/apps/strata] [--size 1G]
#                           [--bs 1M] [--qd 32] [--threads 1] [--pairs 4]
#                           [--mode read|write|both] [--engine io_uring|libaio|psync|auto]
#                           [--swap] [--tensor-size 64M] [--huge-pages on|off]
#
# Strata backs its I/O buffers with 2 MiB pages by default (io-bench
# --huge-pages on; Note [Huge pages for I/O buffers] in apps/cmd_io_bench.cpp);
# fio's buffers are 4 KiB pages (fio cannot ask for transparent huge pages).
# --huge-pages off compares page size for page size.
set -euo pipefail

path="" strata="" size="1G" bs="1M" qd=32 threads=1 pairs=4 mode="both" engine="io_uring" swap=0 tensor="64M" huge="on"
while (($#)); do
  case "$1" in
    --path) path="$2"; shift 2 ;;
    --strata) strata="$2"; shift 2 ;;
    --size) size="$2"; shift 2 ;;
    --bs) bs="$2"; shift 2 ;;
    --qd) qd="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --pairs) pairs="$2"; shift 2 ;;
    --mode) mode="$2"; shift 2 ;;
    --engine) engine="$2"; shift 2 ;;
    --swap) swap=1; shift ;;
    --tensor-size) tensor="$2"; shift 2 ;;
    --huge-pages) huge="$2"; shift 2 ;;
    -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
    *) echo "io_vs_fio.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n "$path" ]] || { echo "io_vs_fio.sh: --path DIR is required" >&2; exit 2; }
[[ -d "$path" ]] || { echo "io_vs_fio.sh: --path $path is not a directory" >&2; exit 2; }
for n in qd threads pairs; do
  [[ "${!n}" =~ ^[0-9]+$ ]] && (( ${!n} >= 1 && ${!n} <= 4096 )) ||
    { echo "io_vs_fio.sh: --${n} ${!n}: a whole number between 1 and 4096" >&2; exit 2; }
done
[[ "$huge" =~ ^(on|off)$ ]] || { echo "io_vs_fio.sh: --huge-pages $huge: on or off" >&2; exit 2; }
[[ "$mode" =~ ^(read|write|both)$ ]] || { echo "io_vs_fio.sh: --mode $mode: read, write or both" >&2; exit 2; }
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
tensor_bytes=$(numfmt --from=iec "$tensor")
job_bytes=$(( size_bytes / threads / bs_bytes * bs_bytes ))
(( job_bytes >= bs_bytes )) || { echo "io_vs_fio.sh: --size $size is too small for $threads threads of $bs blocks" >&2; exit 2; }
fio_file="$path/io_vs_fio.fio.dat"
strata_file="io_vs_fio.strata.dat"
trap 'rm -f "$fio_file" "$path/$strata_file" "$path/.$strata_file.io-bench"' EXIT

modes=(read write)
[[ "$mode" == "both" ]] || modes=("$mode")

run_fio() {  # rw plain|fixed -> GB/s (all jobs together)
  local rw="$1" extra=()
  [[ "$2" == fixed ]] && extra=(--fixedbufs=1 --registerfiles=1)
  fio --name=cmp --filename="$fio_file" --ioengine=io_uring --direct=1 --rw="$rw" --bs="$bs_bytes" \
      --iodepth="$qd" --numjobs="$threads" --size="$job_bytes" --offset_increment="$job_bytes" --group_reporting \
      "${extra[@]}" --output-format=json 2>/dev/null |
    python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]['$rw']; print(j['bw_bytes']/1e9)"
}

declare -A fio_plain fio_fixed fio_best raw swap_on swap_off
run_fio_side() {  # pair
  for m in "${modes[@]}"; do
    fio_plain[$1,$m]=$(run_fio "$m" plain)
    fio_fixed[$1,$m]=$(run_fio "$m" fixed)
    fio_best[$1,$m]=$(python3 -c "print(max(${fio_plain[$1,$m]}, ${fio_fixed[$1,$m]}))")
  done
}
strata_rows() {  # json -> "variant mode verify_writes gb/s io" lines
  python3 -c "
import json,sys
for r in json.load(sys.stdin)['results']:
    vw = {None: '-', True: 'on', False: 'off'}[r['verify_writes']]
    print(r['variant'], r['mode'], vw, r['gb_per_s'], r['io'])"
}
run_strata_side() {  # pair
  local rows
  rows=$("$strata" io-bench --path "$path" --file "$strata_file" --size "$size_bytes" --block-size "$bs_bytes" \
          --queue-depth "$qd" --threads "$threads" --engine "$engine" --mode "$mode" --huge-pages "$huge" --json | strata_rows)
  while read -r variant m vw gbs io; do
    raw[$1,$m]=$gbs
    [[ "$io" == direct ]] || echo "warning: strata raw $m went $io (page cache): not comparable" >&2
  done <<<"$rows"
  if ((swap)); then
    rows=$("$strata" io-bench --path "$path" --swap --tensor-size "$tensor_bytes" --size "$size_bytes" \
            --block-size "$bs_bytes" --queue-depth "$qd" --threads "$threads" --engine "$engine" --mode both \
            --swap-verify-writes both --huge-pages "$huge" --json | strata_rows)
    while read -r variant m vw gbs io; do
      if [[ "$m" == write && "$vw" == on ]]; then swap_on[$1,$m]=$gbs
      elif [[ "$m" == write ]]; then swap_off[$1,$m]=$gbs
      elif [[ "$vw" == on ]]; then swap_on[$1,$m]=$gbs   # reads: verified either way; one per store
      else swap_off[$1,$m]=$gbs; fi
    done <<<"$rows"
  fi
}

echo "io_vs_fio: $path ($(stat -f -c %T "$path")), size $size, block $bs, depth $qd, threads/numjobs $threads," \
     "$pairs pairs (ABBA), strata engine $engine, huge pages $huge$( ((swap)) && echo ", swap tensors $tensor")"
echo "fio: ioengine=io_uring direct=1, best of plain and --fixedbufs=1 --registerfiles=1"
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(hostname)  cores: $(nproc)  load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "strata: $("$strata" --version 2>/dev/null || echo "$strata")"
# Lay both files out once so every timed run overwrites or reads written blocks.
fio --name=layout --filename="$fio_file" --ioengine=psync --direct=1 --rw=write --bs="$bs_bytes" \
    --size="$(( job_bytes * threads ))" >/dev/null 2>&1
"$strata" io-bench --path "$path" --file "$strata_file" --size "$size_bytes" --block-size "$bs_bytes" \
    --mode write --json >/dev/null

for ((i = 1; i <= pairs; i++)); do
  if ((i % 2)); then run_fio_side "$i"; run_strata_side "$i"; else run_strata_side "$i"; run_fio_side "$i"; fi
done

median() { sort -g | python3 -c "import sys; v=[float(x) for x in sys.stdin]; n=len(v); print(f'{(v[n//2] if n%2 else (v[n//2-1]+v[n//2])/2):.3f}')"; }
for m in "${modes[@]}"; do
  printf '\n%-4s %-5s %9s %9s %9s | %9s %6s' pair mode "fio plain" "fio fixed" "fio best" "raw" ratio
  ((swap)) && printf ' | %9s %6s %9s %6s' "swap vw=on" ratio "vw=off" ratio
  printf '\n'
  r_raw=() r_on=() r_off=()
  for ((i = 1; i <= pairs; i++)); do
    best=${fio_best[$i,$m]}
    rr=$(python3 -c "print(f'{${raw[$i,$m]}/$best:.3f}')"); r_raw+=("$rr")
    printf '%-4s %-5s %9.3f %9.3f %9.3f | %9.3f %6s' "$i" "$m" "${fio_plain[$i,$m]}" "${fio_fixed[$i,$m]}" "$best" \
      "${raw[$i,$m]}" "$rr"
    if ((swap)); then
      ro=$(python3 -c "print(f'{${swap_on[$i,$m]}/$best:.3f}')"); r_on+=("$ro")
      rf=$(python3 -c "print(f'{${swap_off[$i,$m]}/$best:.3f}')"); r_off+=("$rf")
      printf ' | %9.3f %6s %9.3f %6s' "${swap_on[$i,$m]}" "$ro" "${swap_off[$i,$m]}" "$rf"
    fi
    printf '\n'
  done
  echo "median raw/fio-best $m: $(printf '%s\n' "${r_raw[@]}" | median)  (bar: >= 0.95)"
  if ((swap)); then
    echo "median swap/fio-best $m, verify_writes on: $(printf '%s\n' "${r_on[@]}" | median)," \
         "off: $(printf '%s\n' "${r_off[@]}" | median)  (bar: >= 0.90)"
  fi
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
