#!/usr/bin/env bash
# Runs `kvtier bench storage` and fio side by side on the same directory, with the same file size,
# block size, reader counts and direct I/O, and prints both figures with their ratio: the check
# that the probe measures what the raw device path delivers.
#
#   scripts/bench-storage-vs-fio.sh DIR [REPEATS]     (needs a built kvtier: $KVTIER or build/release)
#   FILES_PER_READER=2 CONTROL_FILES=16 scripts/bench-storage-vs-fio.sh DIR 5   (more data per phase)
# Reader counts must divide max(readers) x FILES_PER_READER (fio gives each job the same count).
#
# Each repeat runs the probe once and fio once per workload, alternating which goes first, so
# drift on a shared machine hits both alike; the table shows the medians and every run.
set -euo pipefail
dir=${1:?usage: $0 DIR [REPEATS]}
repeats=${2:-3}
kvtier=${KVTIER:-$(dirname "$0")/../build/release/kvtier}
file_size=${FILE_SIZE:-36M}   # fio size syntax; 36M = 36 MiB
block=${BLOCK:-1M}
readers=${READERS:-1,16,32}
control_files=${CONTROL_FILES:-8}
files_per_reader=${FILES_PER_READER:-1}
writers=${WRITERS:-4}
command -v fio >/dev/null || { echo "fio is not installed (scripts/install-deps.sh installs it)"; exit 1; }
[ -x "$kvtier" ] || { echo "no kvtier binary at $kvtier (set KVTIER=...)"; exit 1; }
[ -d "$dir" ] || { echo "$dir is not a directory"; exit 1; }

work=$(mktemp -d "$dir/.fio-compare-XXXXXX")
trap 'rm -rf "$work"' EXIT INT TERM
IFS=, read -r -a reader_counts <<< "$readers"
max_readers=0
for r in "${reader_counts[@]}"; do (( r > max_readers )) && max_readers=$r; done
results="$work/results.txt"

fio_bw() {  # fio_bw <rw> <jobs> <files per job> <subdir>: prints GB/s
  local rw=$1 jobs=$2 nrfiles=$3 sub=$4
  mkdir -p "$work/$sub"
  fio --name=cmp --directory="$work/$sub" --rw="$rw" --bs="$block" --direct=1 --ioengine=psync \
      --filesize="$file_size" --nrfiles="$nrfiles" --numjobs="$jobs" --file_service_type=sequential \
      --fsync_on_close=1 --fallocate=none --thread --group_reporting --output-format=json \
      > "$work/fio.json"
  python3 -c "import json,sys; j=json.load(open(sys.argv[1]))['jobs'][0]; \
print(f\"{j[sys.argv[2]]['bw_bytes']/1e9:.3f}\")" "$work/fio.json" "${rw/#rw/}"
}

run_kvtier() {
  echo "repeat $i/$repeats: kvtier bench storage" >&2
  "$kvtier" bench storage "$work" --json --file-size "${file_size}iB" --block-size "${block}iB" \
      --readers "$readers" --control-files "$control_files" --writers "$writers" \
      --files-per-reader "$files_per_reader" 2>/dev/null \
      > "$work/kvtier.json"
  python3 - "$work/kvtier.json" >> "$results" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
for r in j["readers"]:
    print(f"kvtier read{r['readers']} {r['read_GBps']:.3f}")
print(f"kvtier control {j['control_GBps']:.3f}")
print(f"kvtier write {j['write_GBps']:.3f}")
PY
}

run_fio() {
  echo "repeat $i/$repeats: fio" >&2
  # Like the probe's pool, reader r reads its own files, and every reader count reads
  # max_readers x files_per_reader files in all; fio lays the files out (untimed) in a fresh directory each time, so both tools
  # read files written moments before.
  for r in "${reader_counts[@]}"; do
    rm -rf "$work/pool"
    echo "fio read$r $(fio_bw read "$r" $((max_readers * files_per_reader / r)) pool)" >> "$results"
  done
  rm -rf "$work/pool" "$work/control"
  echo "fio control $(fio_bw read 1 "$control_files" control)" >> "$results"
  rm -rf "$work/control" "$work/write"
  total_files=$((max_readers * files_per_reader + control_files))
  echo "fio write $(fio_bw write "$writers" $((total_files / writers)) write)" >> "$results"
  rm -rf "$work/write"
}

# Alternate which tool goes first, so drift on a shared machine hits both alike.
for ((i = 1; i <= repeats; i++)); do
  if ((i % 2)); then run_kvtier; run_fio; else run_fio; run_kvtier; fi
done

python3 - "$results" "$readers" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    tool, name, value = line.split()
    rows.setdefault(name, {}).setdefault(tool, []).append(float(value))
names = [f"read{r}" for r in sys.argv[2].split(",")] + ["control", "write"]
print(f"{'workload':<10} {'kvtier GB/s':>12} {'fio GB/s':>10} {'kvtier/fio':>11} {'paired':>7}"
      "   all runs (kvtier | fio)")
for n in names:
    k = statistics.median(rows[n]["kvtier"]); f = statistics.median(rows[n]["fio"])
    # Median of the ratios within each repeat (both tools ran back to back).
    paired = statistics.median(a / b for a, b in zip(rows[n]["kvtier"], rows[n]["fio"]))
    runs = " ".join(f"{v:.2f}" for v in rows[n]["kvtier"]) + " | " + \
           " ".join(f"{v:.2f}" for v in rows[n]["fio"])
    print(f"{n:<10} {k:>12.3f} {f:>10.3f} {k / f:>11.2f} {paired:>7.2f}   {runs}")
PY
