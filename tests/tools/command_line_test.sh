#!/usr/bin/env bash
# The command lines of shardopt's binaries: --help and `shardopt help` exit 0
# and print to stdout, --version prints the project's version, and a bad
# argument exits 2 with a message instead of aborting.
#   command_line_test.sh CASE VERSION SERVER CLI BENCH DEMO
set -uo pipefail
case_name=$1 version=$2 server=$3 cli=$4 bench=$5 demo=$6
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
failures=0

# run EXPECTED_RC CMD...: runs CMD with stdout and stderr kept apart. A
# command that accepts a bad argument and runs on (a server that starts
# serving) is stopped after 60 s, and fails with 124.
run() {
  local want=$1
  shift
  timeout 60 "$@" >"$dir/out" 2>"$dir/err" </dev/null
  local rc=$?
  if [[ $rc -ne $want ]]; then
    echo "FAIL: '$*' exited $rc, want $want"
    echo "--- stdout:"; head -c 2000 "$dir/out"; echo "--- stderr:"; head -c 2000 "$dir/err"
    failures=$((failures + 1))
    return 1
  fi
}
# expect STREAM PATTERN: the last run's stdout or stderr has a line matching PATTERN.
expect() {
  if ! grep -qE -- "$2" "$dir/$1"; then
    echo "FAIL: no line matching '$2' in the $1 of the last command"
    echo "--- $1:"; head -c 2000 "$dir/$1"
    failures=$((failures + 1))
  fi
}
# expect_empty STREAM
expect_empty() {
  if [[ -s "$dir/$1" ]]; then
    echo "FAIL: the last command printed to its $1:"; head -c 2000 "$dir/$1"
    failures=$((failures + 1))
  fi
}

case $case_name in
  server_help)
    run 0 "$server" --help && expect out '--checkpoint_dir' && expect out '--port_file'
    ;;
  cli_help)
    run 0 "$cli" --help && expect out 'describe' && expect out '--server'
    run 0 "$cli" help && expect out 'read JOB TENSOR' && expect out 'export'
    run 0 "$cli" help read && expect out 'read JOB TENSOR' && expect_empty err
    run 0 "$cli" help export && expect out '--checkpoint_dir'
    run 0 "$cli" help checkpoint && expect out 'checkpoint JOB \[STEP\]' && expect out 'complete'
    run 0 "$cli" help list && expect out 'list$' && expect out 'token may describe'
    ;;
  cli_bad_arguments)
    # Each is refused before any server is contacted.
    run 2 "$cli" read JOB T master abc && expect err 'abc' && expect_empty out
    run 2 "$cli" read JOB T master 0 12abc && expect err "12abc"
    # A negative number is an argument, not a flag named by its digits.
    run 2 "$cli" read JOB T master -1 && expect err "OFFSET must be a whole number in digits, got '-1'"
    run 2 "$cli" read JOB T master 0 -5 --server=127.0.0.1:1 && expect err "COUNT must be a whole number in digits, got '-5'"
    run 2 "$cli" read JOB T master " 5" && expect err "OFFSET must be a whole number in digits, got ' 5'"
    run 2 "$cli" read JOB T master +5 && expect err "OFFSET must be a whole number in digits, got '[+]5'"
    run 2 "$cli" --server= describe JOB && expect err 'server must name a server'
    # gRPC would dial port 0 (or 443) and call the server down.
    run 2 "$cli" --server=127.0.0.1 describe JOB && expect err "server '127.0.0.1' is not host:port"
    # Verbs that reach no server do not need it.
    run 0 "$cli" --server= help describe && expect out 'describe'
    run 2 "$cli" read JOB T momentum && expect err 'momentum'
    run 2 "$cli" read JOB T && expect err 'read'
    run 2 "$cli" describe && expect err 'describe'
    run 2 "$cli" describe JOB extra && expect err 'extra'
    run 2 "$cli" list JOB && expect err 'list: too many arguments: JOB'
    run 2 "$cli" checkpoint JOB 1x && expect err "STEP must be a whole number in digits, got '1x'"
    run 2 "$cli" frobnicate JOB && expect err 'frobnicate'
    # Protobuf would send a name that is not UTF-8, and the server refuse the call.
    run 2 "$cli" describe $'j\xe9' && expect err "JOB 'j\\\\xe9' is not UTF-8"
    run 2 "$cli" read job $'w\xff' master && expect err "TENSOR 'w\\\\xff' is not UTF-8"
    run 2 "$cli" export --checkpoint_dir="$dir" $'j\xe9' "$dir/out.safetensors" && expect err "JOB 'j\\\\xe9' is not UTF-8"
    run 2 "$cli" help frobnicate && expect err 'frobnicate'
    run 2 "$cli" && expect err 'usage'
    run 2 "$cli" --no_such_flag describe JOB && expect err 'no_such_flag'
    run 2 "$cli" --step=x export --checkpoint_dir=/nonexistent JOB out.safetensors && expect err 'step'
    run 2 "$cli" --dtype=fp16 export --checkpoint_dir=/nonexistent JOB out.safetensors && expect err 'fp16'
    run 2 "$cli" export JOB out.safetensors && expect err 'checkpoint_dir'
    # Not a file named '-' (many tools read it as stdout), from a checkpoint
    # export could read (the format-v1 fixture): it wrote one, exit 0.
    fixture="$(cd "$(dirname "$0")/../data/checkpoint-format-v1" && pwd)"
    pushd "$dir" >/dev/null
    run 2 "$cli" export --checkpoint_dir="$fixture" format-v1 - && expect err "'-' \\(stdout\\) is not taken"
    [[ ! -e - ]] || { echo "FAIL: export wrote a file named '-'"; failures=$((failures + 1)); }
    popd >/dev/null
    run 2 "$cli" --timeout_s=0 describe JOB && expect err 'timeout_s must be at least 1, got 0'
    # A negative number right after a flag without '=' is that flag's value.
    run 2 "$cli" --timeout_s -5 describe JOB && expect err 'timeout_s must be at least 1, got -5'
    # A token file of whitespace alone (an empty Secret) is refused, not sent
    # as no token; nothing listens on port 1, so a call would be UNAVAILABLE.
    printf ' \n' > "$dir/blank-token"
    run 1 "$cli" --server=127.0.0.1:1 --token_file="$dir/blank-token" describe JOB && expect err 'holds no token'
    # An empty PEM file would otherwise mean plaintext to a server meant to be verified.
    : > "$dir/empty.pem"
    run 1 "$cli" --server=127.0.0.1:1 --tls_ca="$dir/empty.pem" describe JOB &&
      expect err 'INVALID_ARGUMENT: .*empty.pem holds nothing'
    # A name in an error comes back with its control bytes as \xHH, as the
    # server's log writes them, not as escape sequences to the terminal.
    run 1 "$cli" --server=127.0.0.1:1 --tls_ca="$dir/no"$'\x1b[31m'"such.pem" describe JOB &&
      expect err 'no\\x1b\[31msuch\.pem cannot be read'
    if grep -q $'\x1b' "$dir/err"; then
      echo "FAIL: an escape byte reached the terminal"; failures=$((failures + 1))
    fi
    ;;
  server_bad_arguments)
    run 2 "$server" --port=abc && expect err 'port'
    run 2 "$server" --no_such_flag && expect err 'no_such_flag'
    run 2 "$server" --port=0 stray && expect err 'stray'
    # A port in --host was taken for part of an IPv6 address: the plaintext
    # refusal, or with --insecure a start that failed to listen (exit 1).
    run 2 "$server" --port=0 --host=127.0.0.1:5 --insecure && expect err 'host takes an address or a name without a port'
    run 2 "$server" --port=0 --host='[::1]:5' && expect err 'host takes an address or a name without a port'
    # One port for two listeners: the second failed "address in use" (exit 1)
    # without saying the server itself held it.
    run 2 "$server" --port=0 --health_port=23456 --metrics_port=23456 &&
      expect err 'health_port and --metrics_port are both 23456'
    run 2 "$server" --port=23457 --metrics_port=23457 && expect err 'port and --metrics_port are both 23457'
    ;;
  version)
    for binary in "$server" "$cli" "$bench" "$demo"; do
      [[ -n $binary ]] || continue  # shardopt-bench is optional (SHARDOPT_BUILD_BENCH)
      run 0 "$binary" --version && expect out "^shardopt ${version//./\\.}\$"
    done
    ;;
  bench_arguments)
    # A tiny e2e run, the flags' values in both forms.
    for form in "--servers 3 --workers 2" "--servers=3 --workers=2"; do
      # shellcheck disable=SC2086  # $form is two words on purpose
      run 0 "$bench" e2e $form --params=64K --steps=1 && expect out '"servers":3' && expect out '"workers":2'
    done
    run 0 "$bench" --help && expect out '--servers'
    run 2 "$bench" e2e --servers=0 && expect err 'servers'
    run 2 "$bench" e2e --params=lots && expect err 'params'
    run 2 "$bench" kernel --servers=3 && expect err 'servers'
    run 2 "$bench" frobnicate && expect err 'frobnicate'
    run 2 "$bench" && expect err 'kernel'
    ;;
  demo_arguments)
    run 0 "$demo" --help && expect out '--steps'
    run 2 "$demo" --steps=abc && expect err 'steps'
    run 2 "$demo" --print_every=0 && expect err 'print_every'
    ;;
  *)
    echo "unknown case $case_name"
    exit 2
    ;;
esac
[[ $failures -eq 0 ]]
