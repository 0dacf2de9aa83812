#!/usr/bin/env bash
# A real S3-compatible server on loopback for tests and benchmarks: moto's standalone server on
# http://127.0.0.1:9000 with SigV4 signatures and IAM permissions enforced, one bucket
# (s3://kvtier-test), an IAM user's access key and a role's session credentials. Clients are
# kvtier's S3 backend, boto3 (scripts/s3-reference.py) or anything else that speaks S3.
#
#   scripts/s3-server.sh install               # install moto into its virtual environment only
#   scripts/s3-server.sh start   [STATE_DIR]   # start (or find already running); prints the URL
#   scripts/s3-server.sh stop    [STATE_DIR]   # SIGTERM, wait up to 10 s, then SIGKILL
#   scripts/s3-server.sh restart [STATE_DIR]   # stop then start; every object is lost
#   scripts/s3-server.sh kill    [STATE_DIR]   # SIGKILL moto (a server crash)
#   scripts/s3-server.sh pause   [STATE_DIR]   # SIGSTOP moto (a hung server); resume: SIGCONT
#   scripts/s3-server.sh status  [STATE_DIR]   # exit 0 if up and answering
#   scripts/s3-server.sh env     [STATE_DIR]   # shell lines exporting AWS_* and KVTIER_TEST_S3_*
#
# STATE_DIR (default /tmp/kvtier-s3) holds moto.log, moto.pid, credentials.env (mode 0600) and
# spool/. moto keeps its state in its process: a stop, kill or restart loses every bucket, object
# and credential, so credentials.env is rewritten on every start. moto lives in a virtual
# environment of its own, $KVTIER_S3_VENV (default /opt/kvtier-s3-venv), that start (or install)
# creates with pip from PyPI when missing. The port is $KVTIER_S3_PORT (default 9000), the address
# $KVTIER_S3_HOST (default 127.0.0.1; another local address, e.g. a network namespace's).
#
# Only processes this script started are ever signalled, by the PID it recorded, and only after
# checking /proc/PID/cmdline still names moto_server and /proc/PID/environ this STATE_DIR: a
# recycled PID or somebody else's server is left alone.
#
# The skeleton (command line, STATE_DIR lock, launching, waiting, signalling) is
# scripts/lib/test-server.sh, shared with scripts/nfs-server.sh; what is here is moto's.
# shellcheck disable=SC2154  # state and launched_pid are set by lib/test-server.sh
set -euo pipefail
# shellcheck source=lib/test-server.sh disable=SC1091  # followed with shellcheck -x
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/lib/test-server.sh"

readonly HOST=${KVTIER_S3_HOST:-127.0.0.1}
readonly REGION=us-east-1
readonly BUCKET=kvtier-test
readonly READY_TIMEOUT_S=30
# Signature checking and its 3 free requests were verified against moto 5; another major version
# may change them.
readonly PIP_PACKAGES=("moto[server]>=5,<6" boto3)
venv=${KVTIER_S3_VENV:-/opt/kvtier-s3-venv}
want_port=${KVTIER_S3_PORT:-9000}
# shellcheck disable=SC2034  # read by lib/test-server.sh
readonly PROG=s3-server DEFAULT_STATE_DIR=/tmp/kvtier-s3 SERVER=moto SERVER_PID_FILE=moto.pid \
  ROOT_REASON="" EXTRA_COMMANDS=(install) WAKE_PAUSED_ON_STOP=1
[[ $HOST =~ ^[0-9]{1,3}(\.[0-9]{1,3}){3}$ ]] ||
  die "KVTIER_S3_HOST must be an IPv4 address, not '$HOST'"

usage() {
  cat <<EOF
Usage: $(basename "$0") COMMAND [STATE_DIR]

Runs moto's S3 server on http://$HOST:PORT (PORT: \$KVTIER_S3_PORT, default 9000; the address:
\$KVTIER_S3_HOST, default 127.0.0.1) for
kvtier's tests and benchmarks, with bucket s3://$BUCKET. STATE_DIR defaults to /tmp/kvtier-s3.

Commands:
  install  create the virtual environment \$KVTIER_S3_VENV (default /opt/kvtier-s3-venv)
           with ${PIP_PACKAGES[*]} from PyPI, if missing; nothing else.
  start    install if needed, start moto, wait until it answers, create an IAM user with an
           access key, a role with session credentials and the bucket; write them to
           STATE_DIR/credentials.env (mode 0600). Exits 0 at once if this STATE_DIR's server
           is already up; fails if something else listens on the port.
  stop     SIGTERM moto, SIGKILL after ${STOP_TIMEOUT_S} s. Exits 0 when nothing was running.
  restart  stop, then start. Every object is lost, and the credentials change.
  kill     SIGKILL moto, as in a server crash.
  pause    SIGSTOP moto: a server that hangs, connections open, nothing answered.
  resume   SIGCONT moto after pause.
  status   exit 0 if this STATE_DIR's server is running and answering, 1 otherwise.
  env      print shell lines that export AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION,
           AWS_DEFAULT_REGION, AWS_ENDPOINT_URL, KVTIER_TEST_S3_URL, the session credentials
           as KVTIER_TEST_S3_SESSION_{ACCESS_KEY_ID,SECRET_ACCESS_KEY,TOKEN}, KVTIER_TEST_S3_PID
           (moto's pid, to signal it) and KVTIER_TEST_S3_STATE_DIR, and unset AWS_SESSION_TOKEN,
           AWS_SECURITY_TOKEN, AWS_PROFILE and AWS_ENDPOINT_URL_S3, which would override them:
             eval "\$($(basename "$0") env)"
  -h, --help  this text.

What the server checks: every S3 request must carry a SigV4 Authorization header from a
known key (unknown key: 403 InvalidAccessKeyId; wrong secret, or a method, path, query or
signed header changed after signing: 403 SignatureDoesNotMatch); a session key needs its
X-Amz-Security-Token (missing: 403 InvalidAccessKeyId; wrong: 400 InvalidToken); the
caller's IAM policy must allow the action. Missing keys and buckets: 404 NoSuchKey and
NoSuchBucket.

What it does NOT check or do: no clock skew check (a request signed days ago passes, never
RequestTimeTooSkewed); no expiry of session credentials; the body is not checked against
x-amz-content-sha256, Content-MD5 or x-amz-checksum-*; no throttling (never 503 SlowDown).
A request without an Authorization header (anonymous, or a presigned URL's query-string
signature) gets 403 or, from a moto bug, 500. Nothing persists: objects are kept in the
moto process (those over ~5 MiB in unlinked temporary files in STATE_DIR/spool) and are
gone after stop, kill or restart. Its /moto-api/ endpoints take no signature.
EOF
}

# --- processes -----------------------------------------------------------------------------

# True if PID is a moto_server (from any virtual environment: KVTIER_S3_VENV may differ between
# start and stop) that this script started for this STATE_DIR. moto takes no argument that could
# name the STATE_DIR, so start puts it in moto's environment.
is_server() {
  local pid=$1
  pid_is "$pid" -H "$HOST" || return 1
  tr '\0' '\n' < "/proc/$pid/cmdline" 2>/dev/null | grep -q '/moto_server$' || return 1
  tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qxF "KVTIER_S3_STATE_DIR=$state"
}

# The port PID (one of ours) listens on: the argument after -p on its command line.
moto_port() {
  local args i
  mapfile -d '' args < "/proc/$1/cmdline" 2>/dev/null || return 0
  for ((i = 0; i + 1 < ${#args[@]}; i++)); do
    if [ "${args[i]}" = -p ]; then echo "${args[i + 1]}"; return 0; fi
  done
}

# moto's own API answers without a signature and, unlike an S3 request, does not use up one of
# the unauthenticated requests start needs for its setup.
answering() {  # PORT
  local code
  code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "http://$HOST:$1/moto-api/config") ||
    return 1
  [[ $code == 2?? ]]
}

# Prints what listens on HOST:PORT (or on every address at PORT), nothing if nothing does.
listener() {  # PORT
  ss -Hltnp "sport = :$1" 2>/dev/null | awk -v p=":$1" -v h="$HOST" '
    $4 == h p || $4 == "0.0.0.0" p || $4 == "*" p || $4 == "[::]" p ||
    $4 == "[::ffff:" h "]" p' || true
}

# --- setup ---------------------------------------------------------------------------------

venv_ok() {
  [ -x "$venv/bin/moto_server" ] && "$venv/bin/python" -c 'import moto, boto3' 2>/dev/null
}

do_install() {
  venv_ok && return 0
  mkdir -p "$venv" || die "cannot create $venv (set KVTIER_S3_VENV to a writable place)"
  # Two starts from different STATE_DIRs share the virtual environment; one installs.
  exec 8>"$venv/.install.lock"
  flock -w 600 8 || die "another install into $venv is still running"
  if ! venv_ok; then
    echo "installing ${PIP_PACKAGES[*]} from PyPI into $venv"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv" ||
      die "python3 -m venv $venv failed (Debian: apt-get install python3-venv)"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "${PIP_PACKAGES[@]}" ||
      die "pip install ${PIP_PACKAGES[*]} into $venv failed"
    venv_ok || die "$venv has no working moto after pip install"
    echo "installed: $("$venv/bin/python" -m pip list --disable-pip-version-check 2>/dev/null |
      awk '$1 == "moto" || $1 == "boto3" {printf "%s%s %s", sep, $1, $2; sep = ", "}')"
  fi
  exec 8>&-
}

# Creates the user, its access key, the role, the session credentials and the bucket, and
# writes credentials.env. moto was started with INITIAL_NO_AUTH_ACTION_COUNT=3: its first three
# requests (create the user, allow it everything, create its key) need no signature, every
# later one is checked. So retries are off: a retried request would use up a free one.
setup_server() {  # PORT PID
  "$venv/bin/python" - "$HOST" "$1" "$REGION" "$BUCKET" "$state/credentials.env" "$2" <<'EOF'
import json, os, re, sys

import boto3
from botocore.config import Config

host, port, region, bucket, path, pid = sys.argv[1:]
endpoint = f"http://{host}:{port}"
config = Config(retries={"max_attempts": 1, "mode": "standard"})
allow_all = json.dumps({"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Action": "*", "Resource": "*"}]})


def client(service, key_id, secret, token=None):
    return boto3.client(service, endpoint_url=endpoint, region_name=region, config=config,
                        aws_access_key_id=key_id, aws_secret_access_key=secret,
                        aws_session_token=token)


# The three unauthenticated requests; the key they are signed with is never looked at.
iam = client("iam", "unchecked", "unchecked")
user = iam.create_user(UserName="kvtier-test")["User"]
iam.put_user_policy(UserName="kvtier-test", PolicyName="allow-all", PolicyDocument=allow_all)
key = iam.create_access_key(UserName="kvtier-test")["AccessKey"]
key_id, secret = key["AccessKeyId"], key["SecretAccessKey"]

# Everything from here on is signed and checked, so it also proves the key works.
iam = client("iam", key_id, secret)
trust = json.dumps({"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"AWS": user["Arn"]}, "Action": "sts:AssumeRole"}]})
role = iam.create_role(RoleName="kvtier-test-session", AssumeRolePolicyDocument=trust,
                       MaxSessionDuration=43200)["Role"]
iam.put_role_policy(RoleName="kvtier-test-session", PolicyName="allow-all",
                    PolicyDocument=allow_all)
session = client("sts", key_id, secret).assume_role(
    RoleArn=role["Arn"], RoleSessionName="kvtier-test", DurationSeconds=43200)["Credentials"]

client("s3", key_id, secret).create_bucket(Bucket=bucket)
# moto checks a session key's token: prove the session credentials work before handing them out.
client("s3", session["AccessKeyId"], session["SecretAccessKey"],
       session["SessionToken"]).head_bucket(Bucket=bucket)

values = {
    "AWS_ACCESS_KEY_ID": key_id,
    "AWS_SECRET_ACCESS_KEY": secret,
    "AWS_REGION": region,
    "AWS_DEFAULT_REGION": region,
    "AWS_ENDPOINT_URL": endpoint,
    "KVTIER_TEST_S3_URL": f"s3://{bucket}",
    "KVTIER_TEST_S3_SESSION_ACCESS_KEY_ID": session["AccessKeyId"],
    "KVTIER_TEST_S3_SESSION_SECRET_ACCESS_KEY": session["SecretAccessKey"],
    "KVTIER_TEST_S3_SESSION_TOKEN": session["SessionToken"],
}
# `env` copies these lines into shell code: nothing but these characters may reach it.
for name, value in values.items():
    if not re.fullmatch(r"[A-Za-z0-9+/=:._-]+", value):
        sys.exit(f"unexpected characters in {name} from moto: {value!r}")
tmp = f"{path}.tmp"
fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
with os.fdopen(fd, "w") as f:
    f.write(f"# Written by scripts/s3-server.sh start; valid while moto pid {pid} runs.\n")
    f.writelines(f"{name}={value}\n" for name, value in values.items())
os.replace(tmp, path)
EOF
}

# --- commands ------------------------------------------------------------------------------

do_start() {
  if ! [[ $want_port =~ ^[0-9]{1,5}$ ]] || ((10#$want_port < 1 || 10#$want_port > 65535)); then
    die "KVTIER_S3_PORT must be a TCP port number, not '$want_port'"
  fi
  want_port=$((10#$want_port))
  do_install

  local pid port
  pid=$(our_server)
  if [ -n "$pid" ]; then
    port=$(moto_port "$pid")
    retry_for "$READY_TIMEOUT_S" answering "$port" ||
      die "moto (pid $pid) from $state is running but not answering on port $port;" \
          "see $state/moto.log, or try: $0 restart $state"
    [ -s "$state/credentials.env" ] ||
      die "moto (pid $pid) from $state runs without credentials.env; try: $0 restart $state"
    [ "$port" = "$want_port" ] ||
      echo "note: it listens on port $port, not on KVTIER_S3_PORT=$want_port"
    echo "S3 already up: s3://$BUCKET at http://$HOST:$port (moto pid $pid)"
    return 0
  fi
  port=$want_port
  local busy
  busy=$(listener "$port")
  if [ -n "$busy" ]; then
    warn "port $port is already taken, not by a server started from $state" \
         "(set KVTIER_S3_PORT to another port):"
    echo "$busy" >&2
    exit 1
  fi

  rm -f "$state/moto.pid" "$state/credentials.env"
  mkdir -p "$state/spool"
  local log=$state/moto.log mark t0 ready=0
  mark=$(log_mark "$log")
  t0=$(now)
  # TMPDIR: moto moves each object over ~5 MiB into an unlinked temporary file; keep that space
  # on STATE_DIR's filesystem, not wherever the caller's TMPDIR points.
  launch "$log" env INITIAL_NO_AUTH_ACTION_COUNT=3 KVTIER_S3_STATE_DIR="$state" \
    TMPDIR="$state/spool" "$venv/bin/moto_server" -H "$HOST" -p "$port"
  pid=$launched_pid
  echo "$pid" > "$state/moto.pid"
  await_ready "$READY_TIMEOUT_S" "$pid" answering "$port" || ready=$?
  if [ "$ready" = 1 ]; then
    warn "moto exited at start; from $log:"
    log_since "$log" "$mark" | tail -n 20 >&2
    rm -f "$state/moto.pid"
    exit 1
  fi
  if [ "$ready" = 2 ]; then
    warn "moto (pid $pid) not answering on port $port after ${READY_TIMEOUT_S} s;" \
         "stopping it. From $log:"
    log_since "$log" "$mark" | tail -n 20 >&2
    terminate "$pid" moto is_server >&2
    rm -f "$state/moto.pid"
    exit 1
  fi
  local answered_s
  answered_s=$(since "$t0")
  # Something else may have answered on the port, had it bound it between the check and now.
  is_server "$pid" || die "moto (pid $pid) exited at start; see $log"
  if ! setup_server "$port" "$pid" >>"$log" 2>&1; then
    warn "setting up users, credentials and bucket failed; stopping moto. From $log:"
    log_since "$log" "$mark" | tail -n 20 >&2
    terminate "$pid" moto is_server >&2
    rm -f "$state/moto.pid" "$state/credentials.env" "$state/credentials.env.tmp"
    exit 1
  fi
  echo "S3 up: s3://$BUCKET at http://$HOST:$port (moto pid $pid, answering in $answered_s s," \
       "ready in $(since "$t0") s); credentials in $state/credentials.env"
}

do_stop() {
  local pid
  pid=$(our_server)
  if [ -n "$pid" ]; then
    terminate "$pid" moto is_server
  else
    echo "nothing running from $state"
  fi
  # The credentials died with the server.
  rm -f "$state/moto.pid" "$state/credentials.env"
}

do_status() {
  local pid port
  pid=$(our_server)
  if [ -z "$pid" ]; then
    echo "not running from $state"
    return 1
  fi
  port=$(moto_port "$pid")
  if ! answering "$port"; then
    echo "moto (pid $pid) running from $state but not answering on port $port"
    return 1
  fi
  if [ ! -s "$state/credentials.env" ]; then
    echo "moto (pid $pid) answering on port $port, but $state has no credentials.env"
    return 1
  fi
  echo "up: s3://$BUCKET at http://$HOST:$port (moto pid $pid)"
}

do_env() {
  local pid
  pid=$(our_server)
  # Without the server its credentials mean nothing; print nothing a test could mistake for one.
  [ -n "$pid" ] || die "no moto running from $state; start it: $0 start $state"
  [ -s "$state/credentials.env" ] ||
    die "moto (pid $pid) from $state has no credentials.env; try: $0 restart $state"
  # A token or profile from the caller's own AWS setup would be sent along with these keys, and
  # AWS_ENDPOINT_URL_S3 takes precedence over AWS_ENDPOINT_URL.
  echo "unset AWS_SESSION_TOKEN AWS_SECURITY_TOKEN AWS_PROFILE AWS_ENDPOINT_URL_S3"
  # Split by hand: `IFS='=' read` would drop a token's trailing '='.
  local line
  while IFS= read -r line; do
    [[ ${line%%=*} =~ ^[A-Z_][A-Z0-9_]*$ ]] || continue
    printf 'export %s=%q\n' "${line%%=*}" "${line#*=}"
  done < "$state/credentials.env"
  echo "export KVTIER_TEST_S3_PID=$pid"
  printf 'export KVTIER_TEST_S3_STATE_DIR=%q\n' "$state"
}

command_install() {
  do_install
  echo "moto is installed in $venv"
}

test_server_main "$@"
