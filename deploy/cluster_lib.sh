# Shell functions to start and stop a local cluster of moe-rankd processes (sourced by
# deploy/local_cluster.sh and tests/integration/local_cluster_test.sh).
#   start_ranks RANKD WORK RANKS CHECKPOINT [extra rankd flags...]  -> fills RANK_PIDS
#   stop_ranks                                                       -> SIGTERM, wait
RANK_PIDS=()

start_ranks() {
  local rankd="$1" work="$2" ranks="$3" checkpoint="$4"
  shift 4
  mkdir -p "$work/rendezvous" "$work/ports" "$work/metrics"
  for ((r = 0; r < ranks; r++)); do
    "$rankd" --rank "$r" --world "$ranks" --rendezvous_dir "$work/rendezvous" --checkpoint "$checkpoint" \
      --port_file "$work/ports/$r.port" --metrics_port_file "$work/metrics/$r.port" "$@" >"$work/rank$r.log" 2>&1 &
    RANK_PIDS+=($!)
  done
  for ((r = 0; r < ranks; r++)); do
    for _ in $(seq 600); do [ -s "$work/ports/$r.port" ] && break; sleep 0.1; done
    if [ ! -s "$work/ports/$r.port" ]; then
      echo "rank $r did not start:"
      cat "$work/rank$r.log"
      return 1
    fi
  done
}

stop_ranks() {
  for pid in "${RANK_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${RANK_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  RANK_PIDS=()
}
