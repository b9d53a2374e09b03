# Sourced by the GPU benchmarks that read their figures against the clock (sustained.sh,
# vllm_compare.sh): start_clock_sampler FILE INTERVAL_MS writes nvidia-smi's SM clock and board
# power every INTERVAL_MS to FILE as "unix_ms, MHz, W" lines (compare_report.py's clock_samples
# reads them), in the background until the sourcing script exits.
start_clock_sampler() {
  nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms "$2" |
    while read -r line; do echo "$(date +%s%3N), $line"; done >"$1" &
  CLOCK_SAMPLER=$!
  trap 'kill $CLOCK_SAMPLER 2>/dev/null || true; pkill -f "nvidia-smi --query-gpu=clocks.sm,power.draw" 2>/dev/null || true' EXIT
}
