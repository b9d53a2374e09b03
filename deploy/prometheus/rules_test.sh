#!/usr/bin/env bash
# promtool checks the rules' syntax and runs their unit tests (moe-rules_test.yml).
set -euo pipefail
cd deploy/prometheus
promtool check rules moe-rules.yml
promtool test rules moe-rules_test.yml
