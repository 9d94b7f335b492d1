#!/usr/bin/env bash
# On a machine with a GPU or an Ascend NPU: run the device test suite, the multi-rank tests on the
# device's collective library, and the device benchmarks with their checks; write ONE markdown
# report (device, versions, each part's counts/time/result, each benchmark's table) and exit
# non-zero if any part failed or ran out of time. Every part has a time limit, so the whole run
# stays under 10.5 minutes (6.5 with --quick, for a 15-minute device lease that includes start-up).
# Usage: bash scripts/validate_accelerator.sh [--quick] [REPORT_PATH]   (default accelerator-report.md)
set -uo pipefail
cd "$(dirname "$0")/.."
quick=0
if [ "${1:-}" = "--quick" ]; then quick=1; shift; fi
report="${1:-accelerator-report.md}"
python="${PYTHON:-python}"
# Deterministic cuBLAS for the bit-identical checkpoint test (tests/cuda/conftest.py sets it too).
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
# Unbuffered, so a part stopped by its time limit still leaves what it printed in the report.
export PYTHONUNBUFFERED=1
logs=$(mktemp -d)
failed=0
rows=()

backend=$("$python" -c "import polyfsdp.backends as b; print(b.get_backend().name)") || {
  echo "cannot select a backend (see the error above)"; exit 1; }
case "$backend" in
  cuda|npu) ;;
  *) echo "no accelerator found (selected backend: $backend)" | tee "$report"; exit 1 ;;
esac

# part NAME LIMIT_S COMMAND...: run COMMAND under a time limit, keep its output, record one row.
part() {
  local name=$1 limit=$2; shift 2
  local log="$logs/$(echo "$name" | tr -c 'a-zA-Z0-9' '_').log" start=$SECONDS rc counts
  echo ">>> $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  local took=$((SECONDS - start)) result="ok"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then result="TIMEOUT after ${limit}s"; failed=1
  elif [ "$rc" -ne 0 ]; then result="FAILED (exit $rc)"; failed=1; fi
  # pytest's summary line ("3 passed, 1 skipped in 2.1s"); benchmarks have none.
  counts=$(grep -E "^=*.*[0-9]+ (passed|failed|error|errors|skipped|deselected)" "$log" | tail -n 1 | tr -d '=' | sed 's/^ *//')
  rows+=("| $name | $result | ${counts:--} | $took |")
  echo "<<< $name: $result ${counts} (${took}s)"
  printf '\n## %s\n\n`%s` (limit %ss): **%s** in %ss\n\n```\n' "$name" "$*" "$limit" "$result" "$took" >>"$logs/details.md"
  tail -n 80 "$log" >>"$logs/details.md"
  printf '```\n' >>"$logs/details.md"
}

if [ "$quick" -eq 1 ]; then
  limits=(150 45 45 60 90); pf_args=(--reps 1 --warmup 1); fl_args=(--quick)
else
  limits=(200 60 90 120 150); pf_args=(); fl_args=()
fi
start_all=$SECONDS
part "pytest tests/$backend" "${limits[0]}" "$python" -m pytest -q -rs -p no:cacheprovider "tests/$backend"
# Only the cases parametrized with this backend (nccl/hccl); they skip with the reason when the
# host has fewer than two devices. The gloo cases are CI's.
part "pytest tests/distributed ($backend)" "${limits[1]}" \
  "$python" -m pytest -q -rs -p no:cacheprovider tests/distributed -k "$backend"
part "benchmark padding_free --check" "${limits[2]}" \
  "$python" benchmarks/padding_free.py --device-backend auto --check "${pf_args[@]}"
part "benchmark fused_logprob --check" "${limits[3]}" \
  "$python" benchmarks/fused_logprob.py --device-backend auto --check "${fl_args[@]}"
# rollout.engine=vllm (when vLLM is installed: the part says "skipped" otherwise): greedy
# completions equal our decoding loop's, and GRPO steps whose sampled log-probs equal the policy's
# after every weight sync (with sleep/wake_up between rollouts on the device).
part "pytest vllm rollouts" "${limits[4]}" "$python" -m pytest -q -rs -p no:cacheprovider \
  tests/cpu/trainer/rollout/test_vllm_rollout.py -k "greedy or grpo_step"

{
  echo "# polyfsdp accelerator report"
  echo
  echo "$(date -u +%Y-%m-%dT%H:%M:%SZ), mode: $([ "$quick" -eq 1 ] && echo quick || echo full), total $((SECONDS - start_all)) s," \
       "result: **$([ "$failed" -eq 0 ] && echo PASS || echo FAIL)**"
  echo
  echo "## Device and versions"
  echo
  echo '```'
  "$python" -m polyfsdp.backends 2>&1
  "$python" - <<'PY' 2>&1
import importlib.util, platform, torch, transformers
print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")
print(f"torch.version.cuda {torch.version.cuda}, flash_attn installed: {importlib.util.find_spec('flash_attn') is not None}")
if torch.cuda.is_available():
    print(f"cuda devices: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
if importlib.util.find_spec("torch_npu") is not None:
    import torch_npu  # noqa: F401
    print(f"torch_npu {torch_npu.__version__}, npu devices: {torch.npu.device_count()}")
    print(f"torchair installed: {importlib.util.find_spec('torchair') is not None}")
PY
  echo '```'
  echo
  echo "## Parts"
  echo
  echo "| part | result | counts | seconds |"
  echo "| --- | --- | --- | --- |"
  printf '%s\n' "${rows[@]}"
  cat "$logs/details.md"
} >"$report"
echo "report: $report ($([ "$failed" -eq 0 ] && echo PASS || echo FAIL))"
exit "$failed"
