# Sourced by the CLI tests. check NAME EXPECTED_RC PATTERN -- CMD...: runs CMD, requires its exit
# code and a line matching PATTERN in its output; sets fail=1 otherwise.
fail=0
check() {
  local name="$1" want_rc="$2" pattern="$3"; shift 4
  local out rc
  out="$("$@" 2>&1)"; rc=$?
  if [ "$rc" != "$want_rc" ]; then echo "FAIL $name: rc=$rc want $want_rc"; echo "$out" | tail -5; fail=1; return; fi
  if ! grep -q -- "$pattern" <<<"$out"; then echo "FAIL $name: output lacks '$pattern'"; echo "$out" | tail -8; fail=1; return; fi
  echo "ok   $name"
}
