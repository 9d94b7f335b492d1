"""Rollout servers' settings, command line and keeper (trainer/rollout/servers/), without vLLM:
a bad ``rollout.server`` value is one line naming the key; the YAML's defaults are the
declaration's; a started server's command carries what polyfsdp relies on; a server's failure
is reported by its root cause; and the keeper ends a server's whole process group when the
trainer is killed with SIGKILL, when asked to stop, and when the server exits by itself."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict

import pytest

from polyfsdp.trainer.config.composition import compose, to_container
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.rollout.servers import launch as launch_module
from polyfsdp.trainer.rollout.servers.launch import ServerLaunch, launch_parser, server_environment
from polyfsdp.trainer.rollout.servers.server_log import log_root_cause
from polyfsdp.trainer.rollout.servers.settings import ServerSettings



@pytest.mark.parametrize("section, key", [
    ({"count": 0}, "rollout.server.count"), ({"count": True}, "rollout.server.count"),
    ({"urls": []}, "rollout.server.urls"), ({"urls": "http://a:1"}, "rollout.server.urls"),
    ({"urls": ["a:8000"]}, "rollout.server.urls"), ({"port": -1}, "rollout.server.port"),
    ({"port": 65535, "count": 2}, "rollout.server.port"), ({"start_timeout_s": 0}, "rollout.server.start_timeout_s"),
    ({"devices": ["0"], "count": 2}, "rollout.server.devices"), ({"gpus": 2}, "rollout.server.gpus"),
    ({"tensor_parallel_size": 0}, "rollout.server.tensor_parallel_size"),
])
def test_a_bad_server_setting_is_one_line_naming_the_key(section, key):
    with pytest.raises(ConfigError) as err:
        ServerSettings.from_section(section)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_the_composed_defaults_are_the_declared_ones():
    section = to_container(compose(["trainer.output_dir=x"]))["rollout"]["server"]
    assert ServerSettings.from_section(section) == ServerSettings()
    assert set(section) == set(asdict(ServerSettings()))


def test_the_command_serves_token_ids_with_the_sampled_log_probs_and_the_weight_routes():
    launch = ServerLaunch("/m", 8123, dtype="bfloat16", weight_transfer="polyfsdp_cpu", max_model_len=64,
                          extra_args=["--max-num-batched-tokens", "512"])
    cmd = launch.command("python")
    flag = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert cmd[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag("--model") == "/m" and flag("--port") == "8123" and flag("--dtype") == "bfloat16"
    assert flag("--logprobs-mode") == "processed_logprobs" and flag("--generation-config") == "vllm"
    assert json.loads(flag("--weight-transfer-config")) == {"backend": "polyfsdp_cpu"}
    assert flag("--max-model-len") == "64" and "--enforce-eager" in cmd and "--skip-tokenizer-init" in cmd
    assert cmd[-2:] == ["--max-num-batched-tokens", "512"] and "--max-num-seqs" not in cmd
    assert server_environment("0-3", "VLLM_CPU_OMP_THREADS_BIND") == {"VLLM_SERVER_DEV_MODE": "1",
                                                                     "VLLM_CPU_OMP_THREADS_BIND": "0-3"}
    assert server_environment(None, "CUDA_VISIBLE_DEVICES") == {"VLLM_SERVER_DEV_MODE": "1"}


def test_a_vision_language_models_server_loads_its_processor_and_opens_the_route_that_takes_images(
        tmp_path, monkeypatch):
    cmd = ServerLaunch("/m", 8123, images=4).command("python")
    assert "--skip-tokenizer-init" not in cmd and "--enable-scale-out" in cmd
    assert json.loads(cmd[cmd.index("--limit-mm-per-prompt") + 1]) == {"image": 4, "video": 0}
    # The launcher for a user's own server sets it from the directory's config.
    commands = {}
    monkeypatch.setattr(launch_module.os, "execvpe", lambda path, cmd, env: commands.setdefault("cmd", cmd))
    for name, config in (("vlm", {"model_type": "qwen2_vl", "vision_config": {}}), ("lm", {"model_type": "qwen2"})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        commands.clear()
        launch_module.main(["--model", str(tmp_path / name), "--weight-transfer", "polyfsdp_cpu",
                            "--gpu-memory-utilization", "0.1"])
        assert ("--enable-scale-out" in commands["cmd"]) == (name == "vlm")
        assert ("--skip-tokenizer-init" in commands["cmd"]) == (name == "lm")


def test_a_failed_start_is_reported_by_its_root_cause(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(textwrap.dedent("""\
        WARNING Found ulimit of 20000 ... `OSError: [Errno 24] Too many open files`.
        (Worker pid=1) ERROR ValueError: Available memory on node 0 is less than desired CPU memory utilization
        Traceback (most recent call last):
        RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
        """))
    assert log_root_cause(str(log)) == "last error: ValueError: Available memory on node 0 is less than desired " \
                                       "CPU memory utilization"
    log.write_text("INFO starting\nINFO still starting\n")
    assert log_root_cause(str(log)) == "last line: INFO still starting"


@pytest.mark.parametrize("config, dtype, source", [
    ({"model_type": "qwen2", "torch_dtype": "float32"}, "float32", "config.json torch_dtype"),
    ({"model_type": "qwen2", "dtype": "bfloat16"}, "bfloat16", "config.json dtype"),
    ({"model_type": "qwen2_vl", "text_config": {"dtype": "float16"}}, "float16", "config.json text_config.dtype"),
    ({"model_type": "qwen2"}, "float32", "config.json names no dtype: float32, the trainer's default"),
])
def test_the_launchers_dtype_is_the_model_directorys_unless_given(tmp_path, monkeypatch, capsys, config, dtype,
                                                                   source):
    """Not a fixed bfloat16: a float32 checkpoint for a float32 CPU trainer is served in float32 (the
    first sync's check_sync failed at 0.00163 with the old default), and the launcher says where the
    dtype came from; an explicit --dtype is used as given."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    commands = []
    monkeypatch.setattr(launch_module.os, "execvpe", lambda path, cmd, env: commands.append(cmd))
    base = ["--model", str(tmp_path), "--weight-transfer", "polyfsdp_cpu", "--gpu-memory-utilization", "0.1"]
    launch_module.main(base)
    assert commands[-1][commands[-1].index("--dtype") + 1] == dtype
    assert f"dtype {dtype} ({tmp_path}/{source}" in capsys.readouterr().out
    launch_module.main([*base, "--dtype", "bfloat16"])
    assert commands[-1][commands[-1].index("--dtype") + 1] == "bfloat16"
    assert "dtype bfloat16 (--dtype)" in capsys.readouterr().out


def test_the_launchers_help_gives_every_options_default():
    parser = launch_parser()
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.dest in ("help", "model"):
            continue
        assert "default" in " ".join(action.help.split()), action.dest
    assert "(default: 0.0.0.0," in text and "(default: 8000)" in text and "(default: 1)" in text
    assert "(default: auto, the model directory's config.json dtype or torch_dtype, float32 where it names none" \
        in text


# A stand-in trainer: starts a keeper over a "server" (a shell whose children are two sleeps,
# one group, as vLLM's API server, engine core and workers are), prints the group's id, waits.
TRAINER = textwrap.dedent("""\
    import os, subprocess, sys, time
    keeper = subprocess.Popen([sys.executable, "-m", "polyfsdp.trainer.rollout.servers.supervisor",
                               str(os.getpid()), "--", "bash", "-c", sys.argv[1]])
    time.sleep(1.5)
    print(keeper.pid, flush=True)
    time.sleep(300)
    """)


def _group_of(pid: int) -> list[int]:
    """The processes of the group the keeper ``pid`` started (its child leads it)."""
    out = subprocess.run(["ps", "-eo", "pid,ppid,pgid"], capture_output=True, text=True).stdout.split("\n")[1:]
    rows = [tuple(map(int, line.split())) for line in out if line.strip()]
    leaders = [p for p, ppid, _ in rows if ppid == pid]
    return [p for p, _, g in rows if leaders and g == leaders[0]]


def _wait_gone(pids, timeout=20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if _alive(p)]
    return alive


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")


@pytest.mark.parametrize("how", ["trainer killed", "stop asked", "server exits"])
def test_the_keeper_ends_the_servers_whole_group(how):
    script = "sleep 300 & sleep 300 & wait" if how != "server exits" else "(sleep 300 &); sleep 4; exit 3"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, script], stdout=subprocess.PIPE, text=True)
    try:
        keeper = int(trainer.stdout.readline())
        group = _group_of(keeper)
        assert len(group) >= 2, group  # the shell and its sleeps
        if how == "trainer killed":
            trainer.send_signal(signal.SIGKILL)
        elif how == "stop asked":
            os.kill(keeper, signal.SIGTERM)
        assert _wait_gone(group + [keeper]) == []
    finally:
        trainer.kill()
        trainer.wait()


def test_cpu_server_devices_name_the_cores_of_the_servers_every_process():
    from polyfsdp.backends.cpu import CPUBackend

    backend = CPUBackend()
    assert backend.server_cores("1") == {1} and backend.server_cores("0-3") == {0, 1, 2, 3}
    assert backend.server_cores("4,5") == {4, 5} and backend.server_cores("0-1|4-5") == {0, 1, 4, 5}
    assert backend.server_cores("auto") is None and backend.server_cores("nobind") is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two cores")
def test_the_keeper_runs_the_server_on_its_cores_not_the_trainers():
    """A trainer under ``taskset -c A`` starting a server on core B: every process of the server
    (vLLM's API server and engine core, not only its OpenMP threads) runs on B alone."""
    first, last = min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))
    trainer = textwrap.dedent(f"""\
        import os, subprocess, sys
        os.sched_setaffinity(0, {{{first}}})
        probe = "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0)), flush=True); " \\
                "subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'])"
        subprocess.run([sys.executable, "-m", "polyfsdp.trainer.rollout.servers.supervisor", str(os.getpid()),
                        "--cores", "{last}", "--", sys.executable, "-c", probe], check=True)
        """)
    out = subprocess.run([sys.executable, "-c", trainer], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == [f"[{last}]", f"[{last}]"]  # the server and what it starts
    bad = subprocess.run([sys.executable, "-m", "polyfsdp.trainer.rollout.servers.supervisor", str(os.getpid()),
                          "--cores", "100000", "--", "true"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "rollout.server.devices" in bad.stderr
