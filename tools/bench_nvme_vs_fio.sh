#!/usr/bin/env bash
# Side by side: strata's NVMe path vs fio's best io_uring setting on the same disk, same run.
#
#   tools/bench_nvme_vs_fio.sh DIR [SIZE]        (SIZE default 2G; REPEAT=n runs each n times)
#
# fio: --ioengine=io_uring --direct=1 --bs=1m --iodepth=32, sequential write then read, with and
# without --fixedbufs; the better of the two is the reference. strata:
# `offloadctl bench nvme --path DIR --block-size 1M --queue-depth 32 --size SIZE --json`.
# Prints every figure and strata/fio ratios (target >= 0.95). Scratch files are removed.
# Figures on a shared or virtual machine are noisy: compare only within one run.
set -euo pipefail
dir=${1:?usage: tools/bench_nvme_vs_fio.sh DIR [SIZE]}
size=${2:-2G}
repeat=${REPEAT:-1}
here=$(cd "$(dirname "$0")/.." && pwd)
offloadctl=${OFFLOADCTL:-$here/build/tools/offloadctl}
command -v fio >/dev/null || { echo "fio not found (Debian package fio)" >&2; exit 1; }
[[ -x $offloadctl ]] || { echo "offloadctl not found at $offloadctl (build it, or set OFFLOADCTL)" >&2; exit 1; }
[[ -d $dir ]] || { echo "not a directory: $dir" >&2; exit 1; }
file="$dir/strata-fio-$$.dat"
trap 'rm -f "$file"' EXIT

# fio_bw RW EXTRA...: bytes/s of one sequential fio job on $file.
fio_bw() {
  local rw=$1; shift
  fio --name=strata-ref --filename="$file" --size="$size" --rw="$rw" --bs=1m --iodepth=32 \
      --ioengine=io_uring --direct=1 --output-format=json "$@" |
    python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; print(j['$( [[ $rw == read ]] && echo read || echo write )']['bw_bytes'])"
}

best() { python3 -c "import sys; print(max(float(x) for x in sys.argv[1:]))" "$@"; }

fw=(); fr=(); fwf=(); frf=(); sw=(); sr=(); nw=(); nr=()
for ((i = 0; i < repeat; ++i)); do
  echo "run $((i + 1))/$repeat: fio plain..." >&2
  fw+=("$(fio_bw write)"); fr+=("$(fio_bw read)")
  echo "run $((i + 1))/$repeat: fio --fixedbufs..." >&2
  fwf+=("$(fio_bw write --fixedbufs)"); frf+=("$(fio_bw read --fixedbufs)")
  rm -f "$file"
  echo "run $((i + 1))/$repeat: strata..." >&2
  out=$("$offloadctl" bench nvme --path "$dir" --block-size 1M --queue-depth 32 --size "$size" --json)
  sw+=("$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['write_bytes_per_s'])" "$out")")
  sr+=("$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['read_bytes_per_s'])" "$out")")
  # Same, with IO buffers on 4 KiB pages like fio's: shows what huge pages buy.
  out=$("$offloadctl" bench nvme --path "$dir" --block-size 1M --queue-depth 32 --size "$size" --json --no-huge-pages)
  nw+=("$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['write_bytes_per_s'])" "$out")")
  nr+=("$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['read_bytes_per_s'])" "$out")")
done

python3 - "$(best "${fw[@]}")" "$(best "${fr[@]}")" "$(best "${fwf[@]}")" "$(best "${frf[@]}")" \
  "$(best "${sw[@]}")" "$(best "${sr[@]}")" "$(best "${nw[@]}")" "$(best "${nr[@]}")" "$size" <<'PY'
import sys
fw, fr, fwf, frf, sw, sr, nw, nr = map(float, sys.argv[1:9])
size = sys.argv[9]
g = lambda x: f"{x / 1e9:6.2f} GB/s"
print(f"1 MiB sequential O_DIRECT, queue depth 32, {size} per pass (best of runs)")
print(f"{'':28}{'write':>12}{'read':>12}")
print(f"{'fio io_uring':28}{g(fw):>12}{g(fr):>12}")
print(f"{'fio io_uring --fixedbufs':28}{g(fwf):>12}{g(frf):>12}")
print(f"{'strata offloadctl':28}{g(sw):>12}{g(sr):>12}")
print(f"{'strata, 4 KiB-page buffers':28}{g(nw):>12}{g(nr):>12}")
rw, rr = sw / max(fw, fwf), sr / max(fr, frf)
print(f"{'strata / best fio':28}{rw:>12.3f}{rr:>12.3f}")
print(f"{'strata 4K pages / best fio':28}{nw / max(fw, fwf):>12.3f}{nr / max(fr, frf):>12.3f}")
print("target >= 0.95:", "met" if min(rw, rr) >= 0.95 else "NOT met")
PY
