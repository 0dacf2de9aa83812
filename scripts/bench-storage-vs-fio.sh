#!/usr/bin/env bash
# Runs `kvtier bench storage` and fio side by side on the same directory, with the same file size,
# block size, reader counts and direct I/O, and prints both figures with their ratio: the check
# that the probe measures what the raw device path delivers.
#
#   scripts/bench-storage-vs-fio.sh DIR [REPEATS]     (needs a built kvtier: $KVTIER or build/release)
#   FILES_PER_READER=2 CONTROL_FILES=16 scripts/bench-storage-vs-fio.sh DIR 5   (more data per phase)
#   FIO=/path/to/fio TIME_LIMIT=240 scripts/bench-storage-vs-fio.sh DIR 20   (a fio not on PATH;
#       start no repeat that would end after 240 s: as many repeats as fit, at most 20)
# Reader counts must divide max(readers) x FILES_PER_READER (each reader reads the same count).
#
# Both sides follow the probe's access pattern on files of their own: one write phase lays out a
# pool (max(readers) x FILES_PER_READER files) and CONTROL_FILES control files, preallocated
# (fallocate) and written with O_DIRECT and a sync per file, WRITERS in parallel; every reader
# count then re-reads that same pool (reader r takes files r, r+R, r+2R, ...; psync, queue depth
# 1); then one stream reads the control files, which nothing read before. So neither side reads
# fresh files where the other re-reads (a cache below the page cache would favour the re-reads).
#
# A last fio row, "deep", is a reference with no kvtier counterpart: the same pool read with
# io_uring at queue depth DEEP_IODEPTH (16) on DEEP_JOBS (1) jobs: what the storage delivers
# beyond the probe's one-request-per-reader pattern.
#
# Each repeat runs the probe once and fio once per workload, alternating which goes first, so
# drift on a shared machine hits both alike; the table shows the medians and every run. Every
# figure is also printed to stderr as it is measured.
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
deep_iodepth=${DEEP_IODEPTH:-16}
deep_jobs=${DEEP_JOBS:-1}
fio=${FIO:-fio}
time_limit=${TIME_LIMIT:-0}  # seconds; 0: run every repeat
command -v "$fio" >/dev/null ||
  { echo "no fio at \"$fio\" (scripts/install-deps.sh installs it; or set FIO=...)"; exit 1; }
[ -x "$kvtier" ] || { echo "no kvtier binary at $kvtier (set KVTIER=...)"; exit 1; }
[ -d "$dir" ] || { echo "$dir is not a directory"; exit 1; }

work=$(mktemp -d "$dir/.fio-compare-XXXXXX")
trap 'rm -rf "$work"' EXIT INT TERM
IFS=, read -r -a reader_counts <<< "$readers"
max_readers=0
for r in "${reader_counts[@]}"; do (( r > max_readers )) && max_readers=$r; done
results="$work/results.txt"
record() { tee -a "$results" | sed "s/^/  repeat $i: /" >&2; }  # a figure to the table and stderr

fio_json_bw() {  # fio_json_bw <read|write>: GB/s of the last fio run (all jobs together)
  python3 -c "import json,sys; j=json.load(open(sys.argv[1]))['jobs'][0]; \
print(f\"{j[sys.argv[2]]['bw_bytes']/1e9:.3f}\")" "$work/fio.json" "$1"
}

fio_common=(--bs="$block" --direct=1 --filesize="$file_size" --file_service_type=sequential
            --thread --group_reporting --output-format=json)

fio_layout() {  # writes pool and control files, as the probe's write phase does: prints GB/s
  rm -rf "$work/fio"
  mkdir -p "$work/fio"
  "$fio" --name=cmp --directory="$work/fio" --rw=write --ioengine=psync --numjobs="$writers" \
      --nrfiles=$((total_files / writers)) --fsync_on_close=1 --fallocate=native \
      "${fio_common[@]}" > "$work/fio.json"
  fio_json_bw write
  # Pool and control files, in a fixed order: the first pool_files form the pool.
  find "$work/fio" -type f | sort > "$work/fio-files"
}

fio_read() {  # fio_read <jobs> <first file> <files> <ioengine> <iodepth>: prints GB/s
  local jobs=$1 first=$2 count=$3 engine=$4 depth=$5 j args=()
  mapfile -t all < "$work/fio-files"
  local files=("${all[@]:first:count}")
  for ((j = 0; j < jobs; j++)); do  # job j reads files j, j+jobs, ... like the probe's readers
    local mine=() k
    for ((k = j; k < count; k += jobs)); do mine+=("${files[k]//:/\\:}"); done
    args+=(--name="r$j" --filename="$(IFS=:; echo "${mine[*]}")")
  done
  "$fio" --rw=read --ioengine="$engine" --iodepth="$depth" "${fio_common[@]}" "${args[@]}" \
      > "$work/fio.json"
  fio_json_bw read
}

run_kvtier() {
  echo "repeat $i/$repeats: kvtier bench storage" >&2
  "$kvtier" bench storage "$work" --json --file-size "${file_size}iB" --block-size "${block}iB" \
      --readers "$readers" --control-files "$control_files" --writers "$writers" \
      --files-per-reader "$files_per_reader" 2>/dev/null \
      > "$work/kvtier.json"
  python3 - "$work/kvtier.json" <<'PY' | record
import json, sys
j = json.load(open(sys.argv[1]))
for r in j["readers"]:
    print(f"kvtier read{r['readers']} {r['read_GBps']:.3f}")
print(f"kvtier control {j['control_GBps']:.3f}")
print(f"kvtier write {j['write_GBps']:.3f}")
PY
}

pool_files=$((max_readers * files_per_reader))
total_files=$((pool_files + control_files))
((total_files % writers == 0)) || { echo "WRITERS must divide pool plus control files ($total_files)"; exit 1; }

run_fio() {
  echo "repeat $i/$repeats: fio" >&2
  echo "fio write $(fio_layout)" | record
  for r in "${reader_counts[@]}"; do
    echo "fio read$r $(fio_read "$r" 0 "$pool_files" psync 1)" | record
  done
  echo "fio control $(fio_read 1 "$pool_files" "$control_files" psync 1)" | record
  echo "fio deep $(fio_read "$deep_jobs" 0 "$pool_files" io_uring "$deep_iodepth")" | record
  rm -rf "$work/fio"
}

# Alternate which tool goes first, so drift on a shared machine hits both alike. With a time
# limit, a repeat starts only if one more of the longest so far would still end inside it.
start=$SECONDS
longest=0
done_repeats=0
for ((i = 1; i <= repeats; i++)); do
  if ((time_limit > 0 && i > 1 && SECONDS - start + longest > time_limit)); then
    echo "time limit of ${time_limit} s: stopping after $done_repeats of $repeats repeats" >&2
    break
  fi
  t=$SECONDS
  if ((i % 2)); then run_kvtier; run_fio; else run_fio; run_kvtier; fi
  ((SECONDS - t > longest)) && longest=$((SECONDS - t))
  done_repeats=$i
done
echo "$done_repeats repeats in $((SECONDS - start)) s"

python3 - "$results" "$readers" "$deep_jobs" "$deep_iodepth" <<'PY'
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
d = rows["deep"]["fio"]
print(f"{'deep':<10} {'-':>12} {statistics.median(d):>10.3f} {'-':>11} {'-':>7}   "
      f"| {' '.join(f'{v:.2f}' for v in d)}   (fio reference: the pool with io_uring, "
      f"{sys.argv[3]} job(s) x queue depth {sys.argv[4]}; no kvtier counterpart)")
PY
