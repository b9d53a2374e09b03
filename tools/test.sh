#!/usr/bin/env bash
# Runs the CPU test suite (everything not tagged gpu/benchmark) and prints one closing line
# "N passed, N failed", counting individual test cases from Bazel's test.xml files.
# Per-target status comes from this run's Bazel summary: a target that did not build, timed
# out or is missing from the summary counts as one failed case.
set -uo pipefail
cd "$(dirname "$0")/.."

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
bazel test //... "$@" 2>&1 | tee "$log"
bazel_rc=${PIPESTATUS[0]}

python3 - "$log" <<'PY'
import os, re, subprocess, sys, xml.etree.ElementTree as ET
log = open(sys.argv[1], errors="replace").read()
status = {}
for m in re.finditer(r"^(//\S+)\s+(?:\(cached\) )?(PASSED|FAILED TO BUILD|FAILED|NO STATUS|TIMEOUT|FLAKY|INCOMPLETE)", log, re.M):
    status[m.group(1)] = m.group(2)
targets = subprocess.run(
    ["bazel", "query", "--noshow_progress", "tests(//...) except attr(tags, 'gpu|benchmark', tests(//...))"],
    capture_output=True, text=True).stdout.split()
root = os.path.realpath("bazel-testlogs")
passed = failed = 0
for t in targets:
    st = status.get(t)
    xml = os.path.join(root, t.lstrip("/").replace(":", "/"), "test.xml")
    if st not in ("PASSED", "FAILED") or not os.path.exists(xml):
        print(f"{t}: {st or 'not run'}")
        failed += 1
        continue
    n = bad_n = 0
    for case in ET.parse(xml).getroot().iter("testcase"):
        n += 1
        bad_n += case.find("failure") is not None or case.find("error") is not None
    if st == "FAILED" and bad_n == 0:
        bad_n = 1  # crashed or exited non-zero outside any recorded case
    passed += max(n - bad_n, 0) if st == "FAILED" else n
    failed += bad_n
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
PY
py_rc=$?
if [ "$bazel_rc" -ne 0 ] && [ "$py_rc" -eq 0 ]; then
  echo "bazel test exited $bazel_rc"
  exit "$bazel_rc"
fi
exit "$py_rc"
