# Sourced by the device-call drivers (two_gpu.sh, many_gpu.sh): `part NAME TIMEOUT_S COMMAND...`
# runs one part under its timeout, its output in $OUT/NAME.txt and a one-line verdict on stdout;
# a failed part sets rc=1 and shows its last lines.
rc=0
part() {
  local name="$1" limit="$2"
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
  local r=$?
  echo "$name: rc=$r in $((SECONDS - start)) s"
  [ "$r" = 0 ] || { rc=1; tail -5 "$OUT/$name.txt"; }
}
