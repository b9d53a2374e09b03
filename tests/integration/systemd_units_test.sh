#!/usr/bin/env bash
# The systemd units of deploy/systemd: `systemd-analyze verify` with the built daemons in place
# of /usr/bin (any warning about the units fails too), and every flag their ExecStart lines pass
# is one the daemon declares.
set -uo pipefail
RANKD="$1" CONTROLLER="$2"
work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/units.XXXXXX")"
fail=0
sed "s|/usr/bin/moe-rankd|$(realpath "$RANKD")|" deploy/systemd/moe-rankd@.service >"$work/moe-rankd@.service"
sed "s|/usr/bin/moe-controller|$(realpath "$CONTROLLER")|" deploy/systemd/moe-controller.service \
  >"$work/moe-controller.service"
ln -s "moe-rankd@.service" "$work/moe-rankd@0.service"
out="$(cd "$work" && systemd-analyze verify ./moe-rankd@0.service ./moe-controller.service 2>&1)"
rc=$?
if [ "$rc" -ne 0 ] || grep -q "service" <<<"$out"; then
  echo "FAIL systemd-analyze verify (rc $rc):"
  echo "$out"
  fail=1
else
  echo "ok   systemd-analyze verify: moe-rankd@0.service, moe-controller.service"
fi
# ExecStart's flags (continuation lines joined) against each daemon's --helpfull.
for pair in "moe-rankd@.service:$RANKD" "moe-controller.service:$CONTROLLER"; do
  unit="${pair%%:*}" bin="${pair#*:}"
  help="$("$bin" --helpfull 2>&1)"
  flags="$(sed -n '/^ExecStart=/,/[^\\]$/p' "deploy/systemd/$unit" | grep -o -- '--[a-z_]*' | sort -u)"
  [ -n "$flags" ] || { echo "FAIL $unit: no flags found in ExecStart"; fail=1; }
  for f in $flags; do
    if ! grep -qE -- "^ +$f \(" <<<"$help"; then
      echo "FAIL $unit: $(basename "$bin") declares no flag $f"
      fail=1
    fi
  done
  echo "ok   $unit: $(echo $flags | wc -w) flags, each declared by $(basename "$bin")"
done
exit "$fail"
