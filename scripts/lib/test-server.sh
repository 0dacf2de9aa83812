# shellcheck shell=bash
# The skeleton shared by the loopback test servers' scripts (scripts/nfs-server.sh,
# scripts/s3-server.sh): the command line, the STATE_DIR and its lock, launching a server
# detached from the caller, waiting for it to answer, and signalling only the processes the
# script itself started, by the PIDs it recorded, after checking /proc/PID still names them.
# Sourced, never run; the sourcing script has set -euo pipefail.
#
# The sourcing script sets, before it calls test_server_main "$@":
#   PROG               prefix of error messages ("nfs-server"); the lock message names PROG.sh
#   DEFAULT_STATE_DIR  STATE_DIR when none is given
#   SERVER             the server's name in kill, pause and resume messages ("ganesha")
#   SERVER_PID_FILE    the file in STATE_DIR that holds the server's PID
#   ROOT_REASON        if not empty, every command but status, env and EXTRA_COMMANDS needs
#                      root, and the refusal gives this reason
#   EXTRA_COMMANDS     commands of its own, run as command_NAME without the lock (may be empty)
#   WAKE_PAUSED_ON_STOP  1: SIGTERM is followed by SIGCONT, so a paused server acts on it at
#                      once; 0: a paused server is left to the SIGKILL after STOP_TIMEOUT_S
# and defines these functions:
#   usage              the help text, on stdout
#   is_server PID      true if PID is this STATE_DIR's server (its command line, environment)
#   do_start, do_stop, do_status (returns 1 when not up), do_env
# The library sets the globals cmd (the command) and state (STATE_DIR, absolute), and
# launched_pid (in launch). test_server_main runs status and env (and EXTRA_COMMANDS) at once;
# start, stop, restart (do_stop, then do_start), kill, pause and resume run one at a time per
# STATE_DIR, under a lock on STATE_DIR/.lock. kill, pause and resume are the library's own.

readonly STOP_TIMEOUT_S=10

warn() { echo "$PROG: $*" >&2; }

die() { warn "$@"; exit 1; }

now() { echo "${EPOCHREALTIME/,/.}"; }

# Seconds since T0 (from now), to a tenth.
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }  # T0

# The offset, for log_since, of what is appended to LOG from now on.
log_mark() { echo $(( $(stat -c %s "$1" 2>/dev/null || echo 0) + 1 )); }  # LOG

# Prints what was appended to LOG since MARK (from log_mark).
log_since() { tail -c "+$2" "$1" 2>/dev/null; }  # LOG MARK

# --- processes -----------------------------------------------------------------------------

# True if PID is alive (not a zombie). Alone, for a child this script has just launched: until
# the child has exec'd its program (launch closes its descriptors first), its command line is
# still this script's, and a loaded machine has been seen to lose server starts to that window.
# An unreaped child keeps its PID, so it cannot have been reused meanwhile.
running() {
  [[ $1 =~ ^[0-9]+$ ]] || return 1
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  # Field 3, after the parenthesised command name (which may itself contain spaces).
  [[ ${stat##*) } != Z* ]]
}

# True if PID runs and its command line contains every further argument.
pid_is() {
  local pid=$1; shift
  running "$pid" || return 1
  local cmdline want
  cmdline=$({ tr '\0' ' ' < "/proc/$pid/cmdline"; } 2>/dev/null) || return 1
  for want in "$@"; do [[ " $cmdline " == *" $want "* ]] || return 1; done
}

# The PID of this STATE_DIR's server, or nothing.
our_server() {
  local pid
  pid=$(cat "$state/$SERVER_PID_FILE" 2>/dev/null) || return 0
  if is_server "$pid"; then echo "$pid"; fi
}

# Runs "$@" in the background in a session of its own, with stdin from /dev/null, stdout and
# stderr appended to LOG and no other file descriptor of ours (a test that calls this script
# must not find its pipes or sockets held open by the server). Sets launched_pid. In a shell
# without job control the background child is not a process-group leader, so setsid execs in
# place: the PID is the server's own.
launch() {  # LOG COMMAND...
  local log=$1; shift
  (
    local fd
    for fd in /proc/self/fd/*; do
      fd=${fd##*/}
      if ((fd > 2)); then exec {fd}>&- 2>/dev/null || true; fi
    done
    exec setsid "$@" </dev/null >>"$log" 2>&1
  ) &
  # shellcheck disable=SC2034  # read by the sourcing script
  launched_pid=$!
}

# Runs CHECK... every 0.05 s until it succeeds, for up to SECS while PID runs. Returns 0 once it
# succeeded, 1 if PID exited first, 2 if SECS passed.
await_ready() {  # SECS PID CHECK...
  local secs=$1 pid=$2; shift 2
  local deadline=$((SECONDS + secs))
  until "$@"; do
    running "$pid" || return 1
    ((SECONDS < deadline)) || return 2
    sleep 0.05
  done
}

# Runs CHECK... every 0.2 s until it succeeds, for up to SECS. Returns 1 if it never did.
retry_for() {  # SECS CHECK...
  local deadline=$((SECONDS + $1)); shift
  until "$@"; do
    ((SECONDS < deadline)) || return 1
    sleep 0.2
  done
}

# Sends SIG to PID if CHECK PID ARGS... (pid_is, is_server) still holds, and waits up to SECS
# for it to stop holding. Returns 1 if it still holds.
signal_and_wait() {  # SIG SECS PID CHECK [ARGS...]
  local sig=$1 secs=$2 pid=$3 check=$4; shift 4
  "$check" "$pid" "$@" || return 0
  kill "-$sig" "$pid" 2>/dev/null || true
  if [ "$sig" = TERM ] && [ "$WAKE_PAUSED_ON_STOP" = 1 ]; then
    kill -CONT "$pid" 2>/dev/null || true
  fi
  local deadline=$((SECONDS + secs))
  while "$check" "$pid" "$@"; do
    ((SECONDS < deadline)) || return 1
    sleep 0.1
  done
}

# SIGTERM, then SIGKILL after STOP_TIMEOUT_S; says how long it took. NAME is for the messages;
# CHECK [ARGS...] as for signal_and_wait.
terminate() {  # PID NAME CHECK [ARGS...]
  local pid=$1 name=$2; shift 2
  local t0; t0=$(now)
  if ! signal_and_wait TERM "$STOP_TIMEOUT_S" "$pid" "$@"; then
    echo "$name (pid $pid) still running ${STOP_TIMEOUT_S} s after SIGTERM; sending SIGKILL"
    signal_and_wait KILL 5 "$pid" "$@" || die "$name (pid $pid) survived SIGKILL"
  fi
  echo "stopped $name (pid $pid) in $(since "$t0") s"
}

# --- commands ------------------------------------------------------------------------------

do_kill() {
  local pid
  pid=$(our_server)
  [ -n "$pid" ] || { echo "no $SERVER running from $state"; return 0; }
  signal_and_wait KILL 5 "$pid" is_server || die "$SERVER (pid $pid) survived SIGKILL"
  echo "killed $SERVER (pid $pid) with SIGKILL"
}

do_signal() {  # SIGNAL WHAT: stop or continue our server
  local pid
  pid=$(our_server)
  [ -n "$pid" ] || die "no $SERVER running from $state"
  kill -s "$1" "$pid"
  echo "$2 $SERVER (pid $pid)"
}

need_root() {
  [ "$(id -u)" = 0 ] || die "'$cmd' must run as root ($ROOT_REASON); try: sudo $0 $cmd"
}

# --- main ----------------------------------------------------------------------------------

test_server_main() {  # COMMAND [STATE_DIR]
  cmd=${1:-}
  local extra=0 c
  for c in "${EXTRA_COMMANDS[@]}"; do [ "$cmd" != "$c" ] || extra=1; done
  case "$cmd" in
    -h|--help|help) usage; exit 0 ;;
    start|stop|restart|kill|pause|resume|status|env) ;;
    "") usage >&2; exit 2 ;;
    *) [ "$extra" = 1 ] || { echo "$PROG: unknown command '$cmd'" >&2; usage >&2; exit 2; } ;;
  esac
  [ $# -le 2 ] || { usage >&2; exit 2; }
  state=$(realpath -m "${2:-$DEFAULT_STATE_DIR}")
  [[ $state != *[[:space:]\"]* ]] || die "STATE_DIR must not contain spaces or quotes: '$state'"

  if [ "$extra" = 1 ]; then "command_$cmd"; exit 0; fi
  case "$cmd" in
    env) do_env; exit 0 ;;
    status) do_status; exit $? ;;
  esac

  [ -z "$ROOT_REASON" ] || need_root
  # One start/stop/kill at a time per STATE_DIR. The servers that start launches do not
  # inherit fd 9, so they do not hold this lock after the script exits.
  mkdir -p "$state"
  exec 9>"$state/.lock"
  flock -w 60 9 || die "another $PROG.sh is still working on $state"

  case "$cmd" in
    start) do_start ;;
    stop) do_stop ;;
    restart) do_stop; do_start ;;
    kill) do_kill ;;
    pause) do_signal STOP paused ;;
    resume) do_signal CONT resumed ;;
  esac
}
