#!/usr/bin/env bash
# Runs the Python client's tests (pytest, Debian's python3 and packages: tools/setup.sh) against
# the moe-rankd and moectl built for this test; JUnit XML for tools/test.sh's case count.
set -euo pipefail
RANKD="$(realpath "$1")" MOECTL="$(realpath "$2")"
export RANKD MOECTL
root="$(pwd)"
export PYTHONPATH="$root/python:$root/tests/python"
exec /usr/bin/python3 -m pytest -q -p no:cacheprovider "$root/tests/python" \
  --junitxml="${XML_OUTPUT_FILE:-$root/pytest.xml}" -o junit_family=xunit1
