# Sourced by the GPU benches that run the Python client (hf_generate.sh, device_rows.sh), from the
# repository root: PY (default: the GPU machine's torch venv), with grpcio and protobuf installed
# from dist/wheels into /tmp/moe-pydeps (put on PYTHONPATH) when that Python lacks them (the GPU
# machine reaches no package index). Returns 1 when the install fails.
PY="${PY:-/opt/torch/.venv/bin/python3}"
if ! "$PY" -c "import grpc, google.protobuf" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/moe-pydeps dist/wheels/*.whl || return 1
  export PYTHONPATH="/tmp/moe-pydeps${PYTHONPATH:+:$PYTHONPATH}"
fi
