#!/usr/bin/env bash
# On a machine with a GPU or an Ascend NPU: run the device tests and the benchmarks,
# and write everything to one report file (default: accelerator-report.txt).
# Usage: bash scripts/validate_accelerator.sh [REPORT_PATH]
set -uo pipefail
cd "$(dirname "$0")/.."
report="${1:-accelerator-report.txt}"
status=0

backend=$(python -c "import polyfsdp.backends as b; print(b.get_backend().name)") || exit 1
{
  echo "# polyfsdp accelerator report ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
  python -m polyfsdp.backends
  echo
  case "$backend" in
    cuda) tests=tests/cuda ;;
    npu) tests=tests/npu ;;
    *) echo "no accelerator found (selected backend: $backend)"; exit 1 ;;
  esac
  # tests/cuda includes engine.offload=params (test_offload_cuda.py: peak memory, same losses).
  echo "## pytest $tests"
  python -m pytest -q "$tests" || status=1
  for bench in benchmarks/*.py; do
    echo
    echo "## $bench"
    python "$bench" || status=1
  done
  exit $status
} 2>&1 | tee "$report"
exit "${PIPESTATUS[0]}"
