# Shell functions to start and stop a local cluster of moe-rankd processes (sourced by
# deploy/local_cluster.sh and tests/integration/local_cluster_test.sh).
#   start_ranks RANKD WORK RANKS CHECKPOINT [extra rankd flags...]  -> fills RANK_PIDS
#                (RANK<r>_FLAGS, when set, adds flags for rank r only; with CONTROLLER_ADDR set the
#                ranks join moe-controller's process group there, else they meet in $WORK/rendezvous)
#   start_rank R -> (re)starts rank R with the flags start_ranks used (a replacement), RANK_PIDS[R]
#   stop_ranks                                                       -> SIGTERM, wait
#   choose_backend RANKS   -> RANKD, RANKD_FLAGS, BACKEND_NAME (cpu+ucx, or cuda+nccl)
RANK_PIDS=()
RANKD_FLAGS=()

# CUDA kernels + NCCL when this machine has at least RANKS GPUs and moe-rankd's CUDA backend
# (libmoe_cuda.so next to RANKD; built here with --config=gpu when nvcc exists and SKIP_BUILD is
# unset); CPU kernels + UCX otherwise, or when BACKEND=cpu. One GPU per rank (NCCL needs
# distinct devices).
choose_backend() {
  local ranks="$1" gpus=0 plugin
  plugin="$(dirname "$RANKD")/libmoe_cuda.so"
  if command -v nvidia-smi >/dev/null 2>&1; then gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"; fi
  if [ "${BACKEND:-auto}" != cpu ] && [ "$gpus" -ge "$ranks" ] && [ ! -e "$plugin" ] && [ -z "${SKIP_BUILD:-}" ] &&
    [ -x /usr/local/cuda/bin/nvcc ]; then
    bazel build --config=gpu //server:libmoe_cuda.so >/dev/null 2>&1 || true
  fi
  if [ "${BACKEND:-auto}" != cpu ] && [ "$gpus" -ge "$ranks" ] && [ -e "$plugin" ]; then
    RANKD_FLAGS=(--kernels cuda --transport nccl)
    BACKEND_NAME="CUDA kernels + NCCL, one of $gpus GPUs per rank"
    export NCCL_NVLS_ENABLE=0
  else
    RANKD_FLAGS=()
    BACKEND_NAME="CPU kernels + UCX"
  fi
}

# Engines reach a rank on its Unix socket (--engine_socket); the sockets live in a short
# directory of their own (a socket path has at most 107 characters) and each rank's target is
# written to $work/ports/<r>.engine for the engine driver (--port_dir).
RANK_SOCKET_DIR=""
RANK_ARGS=()
start_ranks() {
  local rankd="$1" work="$2" ranks="$3" checkpoint="$4"
  shift 4
  mkdir -p "$work/rendezvous" "$work/ports" "$work/metrics"
  [ -n "$RANK_SOCKET_DIR" ] || RANK_SOCKET_DIR="$(mktemp -d /tmp/moe-sock.XXXXXX)"
  RANK_ARGS=("$rankd" "$work" "$ranks" "$checkpoint" "$@")
  local r
  for ((r = 0; r < ranks; r++)); do start_rank "$r" nowait; done
  for ((r = 0; r < ranks; r++)); do await_rank "$r" || return 1; done
}

# start_rank R [nowait]: starts rank R (again) with start_ranks' arguments; waits for its port file
# (written once it serves its first epoch) unless nowait.
start_rank() {
  local r="$1" rankd="${RANK_ARGS[0]}" work="${RANK_ARGS[1]}" ranks="${RANK_ARGS[2]}" checkpoint="${RANK_ARGS[3]}"
  local own="RANK${r}_FLAGS" group
  if [ -n "${CONTROLLER_ADDR:-}" ]; then group=(--controller "$CONTROLLER_ADDR"); else group=(--rendezvous_dir "$work/rendezvous"); fi
  echo "unix:$RANK_SOCKET_DIR/$r.sock" >"$work/ports/$r.engine"
  rm -f "$work/ports/$r.port"
  "$rankd" --rank "$r" --world "$ranks" "${group[@]}" --checkpoint "$checkpoint" \
    --engine_socket "$RANK_SOCKET_DIR/$r.sock" \
    --port_file "$work/ports/$r.port" --metrics_port_file "$work/metrics/$r.port" ${RANKD_FLAGS[@]+"${RANKD_FLAGS[@]}"} \
    ${!own:-} "${RANK_ARGS[@]:4}" >>"$work/rank$r.log" 2>&1 &
  RANK_PIDS[$r]=$!
  [ "${2:-}" = nowait ] || await_rank "$r"
}

await_rank() {
  local r="$1" work="${RANK_ARGS[1]}"
  for _ in $(seq 600); do [ -s "$work/ports/$r.port" ] && return 0; sleep 0.1; done
  echo "rank $r did not start:"
  cat "$work/rank$r.log"
  return 1
}

stop_ranks() {
  for pid in "${RANK_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${RANK_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  RANK_PIDS=()
  if [ -n "$RANK_SOCKET_DIR" ]; then rm -rf "$RANK_SOCKET_DIR"; RANK_SOCKET_DIR=""; fi
}
