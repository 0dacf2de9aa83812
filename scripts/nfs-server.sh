#!/usr/bin/env bash
# A real NFS server on loopback for tests and benchmarks: nfs-ganesha (VFS FSAL) exporting
# STATE_DIR/export as nfs://127.0.0.1/export, NFSv3 (and v4) over TCP on 127.0.0.1:2049, mountd
# on 20048. Clients are libnfs (nfs-ls, nfs-cp, nfs-cat, or kvtier's NFS backend); nothing is
# mounted in the kernel. KVTIER_NFS_ADDR (default 127.0.0.1) binds it to another local address
# instead, e.g. that of a network namespace standing in for a file server (the two-host test,
# python/tests/test_two_hosts.py, runs it in one with a private /run for its own rpcbind).
#
#   scripts/nfs-server.sh start   [STATE_DIR]   # start (or find already running); prints the URL
#   scripts/nfs-server.sh stop    [STATE_DIR]   # SIGTERM, wait up to 10 s, then SIGKILL
#   scripts/nfs-server.sh restart [STATE_DIR]   # stop then start; the export's files are kept
#   scripts/nfs-server.sh kill    [STATE_DIR]   # SIGKILL ganesha only (a server crash)
#   scripts/nfs-server.sh pause   [STATE_DIR]   # SIGSTOP ganesha (a hung server); resume: SIGCONT
#   scripts/nfs-server.sh status  [STATE_DIR]   # exit 0 if up and answering
#   scripts/nfs-server.sh env     [STATE_DIR]   # shell lines exporting KVTIER_TEST_NFS_*
#
# STATE_DIR (default /tmp/kvtier-nfs) holds export/ (the exported files, kept across stops and
# starts), recov/ (NFSv4 recovery state), ganesha.conf, ganesha.log, ganesha.pid and, when this
# script had to start it, rpcbind.pid. Needs root (ganesha's VFS FSAL uses open_by_handle_at);
# installs nfs-ganesha, nfs-ganesha-vfs, rpcbind and libnfs from Debian's archive when missing.
#
# Only processes this script started are ever signalled, by the PIDs it recorded, and only after
# checking /proc/PID/cmdline still names that program (and, for ganesha, this STATE_DIR's config):
# a recycled PID or somebody else's server is left alone.
#
# The skeleton (command line, STATE_DIR lock, launching, waiting, signalling) is
# scripts/lib/test-server.sh, shared with scripts/s3-server.sh; what is here is ganesha's.
# shellcheck disable=SC2154  # state and launched_pid are set by lib/test-server.sh
set -euo pipefail
# shellcheck source=lib/test-server.sh disable=SC1091  # followed with shellcheck -x
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/lib/test-server.sh"

readonly ADDR=${KVTIER_NFS_ADDR:-127.0.0.1}
readonly URL=nfs://$ADDR/export
readonly READY_TIMEOUT_S=20
readonly PACKAGES=(nfs-ganesha nfs-ganesha-vfs rpcbind libnfs-dev libnfs-utils)
# shellcheck disable=SC2034  # read by lib/test-server.sh
readonly PROG=nfs-server DEFAULT_STATE_DIR=/tmp/kvtier-nfs SERVER=ganesha \
  SERVER_PID_FILE=ganesha.pid ROOT_REASON="ganesha's VFS FSAL needs it" EXTRA_COMMANDS=() \
  WAKE_PAUSED_ON_STOP=0
[[ $ADDR =~ ^[0-9]{1,3}(\.[0-9]{1,3}){3}$ ]] ||
  die "KVTIER_NFS_ADDR must be an IPv4 address, not '$ADDR'"

usage() {
  cat <<EOF
Usage: $(basename "$0") COMMAND [STATE_DIR]

Runs nfs-ganesha (VFS FSAL, NFSv3 over TCP) on $ADDR (\$KVTIER_NFS_ADDR, default 127.0.0.1),
exporting STATE_DIR/export as $URL, for kvtier's tests and benchmarks. STATE_DIR defaults
to /tmp/kvtier-nfs.

Commands:
  start    start rpcbind (if not running) and ganesha; wait until the export answers.
           Exits 0 at once if this STATE_DIR's server is already up; fails if another
           NFS server already answers on $ADDR:2049.
  stop     SIGTERM ganesha (and rpcbind if this script started it), SIGKILL after
           ${STOP_TIMEOUT_S} s. Exits 0 when nothing was running.
  restart  stop, then start; the files in STATE_DIR/export are kept.
  kill     SIGKILL ganesha only, as in a server crash; rpcbind is left running.
  pause    SIGSTOP ganesha: a server that hangs, connections open, nothing answered.
  resume   SIGCONT ganesha after pause.
  status   exit 0 if this STATE_DIR's server is running and answering, 1 otherwise.
  env      print shell lines that export KVTIER_TEST_NFS_URL and KVTIER_TEST_NFS_EXPORT_DIR:
             eval "\$($(basename "$0") env)"
  -h, --help  this text.

start, stop, restart and kill need root. start installs the Debian packages it needs
when missing: ${PACKAGES[*]}.
EOF
}

# --- processes -----------------------------------------------------------------------------

is_server() { pid_is "$1" ganesha.nfsd -f "$state/ganesha.conf"; }  # PID

# The PID of the rpcbind this script started for this STATE_DIR, or nothing.
our_rpcbind() {
  local pid
  pid=$(cat "$state/rpcbind.pid" 2>/dev/null) || return 0
  if pid_is "$pid" rpcbind -f; then echo "$pid"; fi
}

# True if any ganesha.nfsd process is alive in this network namespace (zombies, which an init
# that does not reap leaves behind, do not count; one in another namespace registers with that
# namespace's rpcbind). Only looks; never signals it.
other_ganesha_alive() {
  local p ours
  ours=$(readlink /proc/self/ns/net 2>/dev/null) || ours=""
  for p in $(pgrep -x ganesha.nfsd 2>/dev/null); do
    [ "$(readlink "/proc/$p/ns/net" 2>/dev/null)" = "$ours" ] || continue
    if pid_is "$p"; then return 0; fi
  done
  return 1
}

answering() { timeout 5 nfs-ls "$URL" >/dev/null 2>&1; }

rpcbind_answering() { rpcinfo -p "$ADDR" >/dev/null 2>&1; }

# --- setup ---------------------------------------------------------------------------------

install_packages() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # Installing nfs-ganesha on a machine with an init system starts the packaged service, which
  # would take port 2049 on every address with /etc/ganesha/ganesha.conf. Forbid service starts
  # for the install, unless the machine already has a policy (containers usually do).
  local policy=/usr/sbin/policy-rc.d made_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
  fi
  local rc=0
  apt-get install -y -qq "${missing[@]}" || {
    apt-get update -qq && apt-get install -y -qq "${missing[@]}"
  } || rc=$?
  [ "$made_policy" = 1 ] && rm -f "$policy"
  [ "$rc" = 0 ] || die "could not install ${missing[*]}"
}

write_config() {
  cat > "$state/ganesha.conf" <<EOF
# Written by scripts/nfs-server.sh; rewritten on every start.
NFS_CORE_PARAM {
  Bind_addr = $ADDR;
  NFS_Port = 2049;
  MNT_Port = 20048;
  Protocols = 3, 4;
  Enable_UDP = false;
  Enable_NLM = false;
  Enable_RQUOTA = false;
  # NFSv3 clients mount the Pseudo path (/export), as NFSv4 clients do, not the local Path.
  mount_path_pseudo = true;
}
MDCACHE {
  # ganesha keeps a file's descriptor open while it is cached, and reaps descriptors only above
  # this share of its limit: a file deleted in the export directory (not through NFS) would hold
  # its disk space until ganesha exits. Reap idle descriptors on every LRU pass instead.
  FD_LWMark_Percent = 0;
  LRU_Run_Interval = 5;
}
NFS_KRB5 {
  Active_krb5 = false;
}
NFSv4 {
  # Without it every start opens a 90 s grace period in which opens block.
  Graceless = true;
  RecoveryRoot = "$state/recov";
  Only_Numeric_Owners = true;
}
EXPORT {
  Export_Id = 1;
  Path = "$state/export";
  Pseudo = /export;
  Protocols = 3, 4;
  Transports = TCP;
  Access_Type = RW;
  Squash = No_Root_Squash;
  SecType = sys;
  # Revalidate attributes and names on every access instead of trusting the 60 s cache: tests
  # change, truncate and delete files in the export directory directly, behind ganesha's back.
  Attr_Expiration_Time = 0;
  FSAL {
    Name = VFS;
  }
}
EOF
}

# rpcbind reports its start-up errors only to syslog, which a container often lacks; -d sends them
# (and a line per request) to rpcbind.log instead. A start that dies is retried before giving up.
readonly RPCBIND_ATTEMPTS=3
start_rpcbind() {
  if rpcbind_answering; then
    [ -n "$(our_rpcbind)" ] || rm -f "$state/rpcbind.pid"
    return 0
  fi
  local attempt mark
  for ((attempt = 1; attempt <= RPCBIND_ATTEMPTS; attempt++)); do
    mark=$(log_mark "$state/rpcbind.log")
    if launch_rpcbind; then return 0; fi
    warn "rpcbind attempt $attempt of $RPCBIND_ATTEMPTS failed: $rpcbind_failure;" \
         "from $state/rpcbind.log:"
    log_since "$state/rpcbind.log" "$mark" | tail -n 5 >&2 || true
    sleep 1
    # One that did start (under another PID, or another caller's) is as good as ours.
    if rpcbind_answering; then
      warn "an rpcbind answers on $ADDR now; using it"
      return 0
    fi
  done
  die "rpcbind would not start; see $state/rpcbind.log"
}

# One try at starting rpcbind; on failure sets rpcbind_failure and leaves nothing running.
launch_rpcbind() {
  # Not `-h 127.0.0.1`: Debian 12's rpcbind aborts with a double free on it.
  launch "$state/rpcbind.log" rpcbind -f -d
  local pid=$launched_pid
  echo "$pid" > "$state/rpcbind.pid"
  local ready=0
  await_ready 5 "$pid" rpcbind_answering || ready=$?
  if [ "$ready" = 1 ]; then
    rpcbind_failure="exited at start"
    rm -f "$state/rpcbind.pid"
    return 1
  fi
  if [ "$ready" = 2 ]; then
    rpcbind_failure="pid $pid not answering after 5 s"
    terminate "$pid" rpcbind pid_is rpcbind -f >&2 || true
    rm -f "$state/rpcbind.pid"
    return 1
  fi
  rpcbind_started_now=$pid
  echo "started rpcbind (pid $pid)"
}

# A start that fails does not leave behind the rpcbind it started.
rpcbind_started_now=""
undo_failed_start() {
  local rc=$?
  if [ "$rc" != 0 ]; then stop_rpcbind_started_now; fi
}

stop_rpcbind_started_now() {
  [ -n "$rpcbind_started_now" ] || return 0
  terminate "$rpcbind_started_now" rpcbind pid_is rpcbind -f >&2 || true
  rm -f "$state/rpcbind.pid"
  rpcbind_started_now=""
}

# --- commands ------------------------------------------------------------------------------

do_start() {
  trap undo_failed_start EXIT
  install_packages
  mkdir -p "$state/export" "$state/recov"
  chmod 1777 "$state/export"  # non-root test processes may create files in it too

  local pid
  pid=$(our_server)
  if [ -n "$pid" ]; then
    retry_for "$READY_TIMEOUT_S" answering ||
      die "ganesha (pid $pid) from $state is running but not answering at $URL;" \
          "see $state/ganesha.log, or try: $0 restart $state"
    echo "NFS already up: $URL -> $state/export (ganesha pid $pid)"
    return 0
  fi
  if answering; then
    warn "$URL is already served by another NFS server, not one started from $state:"
    ss -ltnp 'sport = :2049' 2>/dev/null | tail -n +2 >&2 || true
    exit 1
  fi

  write_config
  local attempt
  for ((attempt = 1; ; attempt++)); do
    start_rpcbind
    launch_ganesha && return 0
    # ganesha that could not register with rpcbind (seen once on a machine's first start, with
    # rpcbind answering) gets one more try with a fresh rpcbind, when that rpcbind is ours.
    ((attempt < 2)) && [ -n "$rpcbind_started_now" ] &&
      grep -q "Cannot register" <<<"$ganesha_errors" || exit 1
    warn "retrying with a new rpcbind"
    stop_rpcbind_started_now
  done
}

# One try at starting ganesha and waiting until the export answers. On failure prints why,
# leaves ganesha's log lines in ganesha_errors and returns 1 with nothing of ganesha running.
ganesha_errors=""
launch_ganesha() {
  rm -f "$state/ganesha.pid"
  local log=$state/ganesha.log mark t0 pid ready=0
  mark=$(log_mark "$log")
  t0=$(now)
  launch "$state/ganesha.stdout" \
    ganesha.nfsd -F -L "$log" -f "$state/ganesha.conf" -p "$state/ganesha.pid"
  pid=$launched_pid
  await_ready "$READY_TIMEOUT_S" "$pid" answering || ready=$?
  if [ "$ready" = 1 ]; then
    warn "ganesha exited at start; from $log:"
    ganesha_errors=$(log_since "$log" "$mark" | grep -E ':(FATAL|MAJ) ' || true)
    [ -n "$ganesha_errors" ] || ganesha_errors=$(log_since "$log" "$mark" | tail -n 20)
    echo "$ganesha_errors" >&2
    tail -n 5 "$state/ganesha.stdout" >&2 2>/dev/null || true
    return 1
  fi
  if [ "$ready" = 2 ]; then
    warn "ganesha (pid $pid) not answering at $URL after ${READY_TIMEOUT_S} s;" \
         "stopping it. From $log:"
    ganesha_errors=$(log_since "$log" "$mark" | tail -n 20)
    echo "$ganesha_errors" >&2
    terminate "$pid" ganesha.nfsd is_server >&2
    return 1
  fi
  # ganesha's own pid file is the record stop/kill/status trust; write it if ganesha has not.
  [ -s "$state/ganesha.pid" ] || echo "$pid" > "$state/ganesha.pid"
  echo "NFS up: $URL -> $state/export (ganesha pid $pid, ready in $(since "$t0") s)"
}

do_stop() {
  local pid stopped=0
  pid=$(our_server)
  if [ -n "$pid" ]; then
    terminate "$pid" ganesha.nfsd is_server
    stopped=1
  fi
  rm -f "$state/ganesha.pid"
  pid=$(our_rpcbind)
  if [ -n "$pid" ]; then
    # Another ganesha (another STATE_DIR's, or not ours) may still be registered with this
    # rpcbind; stopping it would break that server's mounts, so leave it to the last one.
    if other_ganesha_alive; then
      echo "leaving rpcbind (pid $pid) running: another ganesha.nfsd still uses it"
    else
      terminate "$pid" rpcbind pid_is rpcbind -f
      rm -f "$state/rpcbind.pid"
      stopped=1
    fi
  else
    rm -f "$state/rpcbind.pid"
  fi
  [ "$stopped" = 1 ] || echo "nothing running from $state"
}

do_status() {
  local pid
  pid=$(our_server)
  if [ -z "$pid" ]; then
    if answering; then
      echo "not running from $state ($URL is served by another NFS server)"
    else
      echo "not running from $state"
    fi
    return 1
  fi
  if answering; then
    echo "up: $URL -> $state/export (ganesha pid $pid)"
  else
    echo "ganesha (pid $pid) running from $state but not answering at $URL"
    return 1
  fi
}

do_env() {
  echo "export KVTIER_TEST_NFS_URL=$URL"
  echo "export KVTIER_TEST_NFS_EXPORT_DIR=$state/export"
}

test_server_main "$@"
