#!/usr/bin/env bash
# session 54 (temporary, not committed): the GPU checks of this session's changes, then on an
# H200 the issue-19 table beside vLLM.
bash bench/gpu/session54b.sh
if nvidia-smi -L | grep -q H200; then bash bench/gpu/session54.sh; fi
