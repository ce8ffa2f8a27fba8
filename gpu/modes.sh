# Sourced by the GPU scripts (run-suite.sh, torch/run.sh, torch/suite.sh, torch/micro.sh): one
# standing `remora serve` for the shm, unix and tcp modes, the command line of each mode, and
# the arguments the torch scripts share.
#
#   bin_out_modes USAGE ARG...  parses `BIN_DIR OUT_DIR [MODE...]`: sets bin (BIN_DIR, absolute),
#                         out (OUT_DIR, created, absolute) and the array modes (the MODEs;
#                         default: shm unix tcp embedded); without BIN_DIR or OUT_DIR, USAGE
#                         and exit
#   start_serve BIN WORK  starts `BIN/remora serve` on unix://WORK/remora.sock and an ephemeral
#                         tcp://127.0.0.1 port (output in WORK/serve.{out,err}) and waits until
#                         both listen; sets serve_pid, sock (the socket's path), tcp (its URL)
#   mode_cmd BIN MODE     sets the array `run` to the prefix that runs a program in MODE:
#                         native (nothing), shm and unix (`remora run --transport MODE --server
#                         unix://$sock --`), tcp (`--server $tcp`), embedded (plain `remora run --`)
#   remora_commit BIN     unless REMORA_COMMIT is set, sets and exports it to the commit
#                         `BIN/remora --version` names (abc1234, or abc1234+dirty for a build
#                         from changed sources); left unset when that says none
# shellcheck shell=bash

# shellcheck disable=SC2034  # serve_pid, sock, tcp and run are for the caller
start_serve() {
  sock="$2/remora.sock"
  "$1/remora" serve --listen "unix://$sock" --listen tcp://127.0.0.1:0 > "$2/serve.out" 2> "$2/serve.err" &
  serve_pid=$!
  for _ in $(seq 100); do [ "$(grep -c 'listening on' "$2/serve.out")" -ge 2 ] && break; sleep 0.1; done
  tcp=$(grep -o 'tcp://[0-9.:]*' "$2/serve.out" | head -n 1)
}

# shellcheck disable=SC2034
mode_cmd() {
  case $2 in
    native*) run=() ;;
    shm|unix) run=("$1/remora" run --transport "$2" --server "unix://$sock" --) ;;
    tcp) run=("$1/remora" run --server "$tcp" --) ;;
    embedded) run=("$1/remora" run --) ;;
    *) echo "unknown mode $2" >&2; return 1 ;;
  esac
}

remora_commit() {
  if [ -z "${REMORA_COMMIT:-}" ] && [ -x "$1/remora" ]; then
    REMORA_COMMIT=$("$1/remora" --version 2>/dev/null | sed -n 's/.*(\([0-9a-f]*\(+dirty\)\{0,1\}\)).*/\1/p')
  fi
  if [ -n "${REMORA_COMMIT:-}" ]; then export REMORA_COMMIT; fi
}

# shellcheck disable=SC2034  # bin, out and modes are for the caller
bin_out_modes() {
  local usage=$1; shift
  bin=$(cd "${1:?$usage}" && pwd)
  out=${2:?$usage}; shift 2
  modes=("$@")
  if [ $# -eq 0 ]; then modes=(shm unix tcp embedded); fi
  mkdir -p "$out"; out=$(cd "$out" && pwd)
}
