"""A run continued in a directory that may be crafted (trainer.resume=auto on a downloaded run) never
writes through a symbolic link it finds there: the temporary files and directories polyfsdp-train
rewrites (``metrics.jsonl.tmp``, ``generations.jsonl.tmp``, ``init_model.tmp``) may be links to the
user's files, which stay as they were (the payload: a marker file's content, a directory's listing).
The checkpoints' own leftovers are tests/cpu/trainer/run/test_checkpoint_paths.py's."""
import os

import pytest
from tests.cpu.trainer.test_cli import TINY

from polyfsdp.trainer.train import main


@pytest.mark.parametrize("leftover", ["metrics.jsonl.tmp", "generations.jsonl.tmp", "init_model.tmp"])
def test_polyfsdp_train_never_writes_through_a_link_left_in_its_output_directory(tmp_path, leftover):
    out = tmp_path / "out"
    out.mkdir()
    users = tmp_path / "users_files"
    users.mkdir()
    (users / "marker").write_text("keep")
    (out / leftover).symlink_to(users if leftover == "init_model.tmp" else users / "marker")
    if leftover == "generations.jsonl.tmp":
        (out / "generations.jsonl").touch()  # only an earlier run's file is rewritten (through the .tmp)

    assert main([*TINY, "algo=sft", "trainer.sft_steps=1", "trainer.plot=false", "trainer.export=false",
                 "trainer.log_val_generations=2", f"trainer.output_dir={out}"]) == 0
    assert (users / "marker").read_text() == "keep" and os.listdir(users) == ["marker"]
    assert not (out / leftover).is_symlink() and (out / leftover.removesuffix(".tmp")).exists()


@pytest.mark.parametrize("name", ["config.yaml", "generations.jsonl", "curves.png"])
def test_a_file_the_run_writes_in_place_that_is_a_link_is_refused_in_one_line(tmp_path, capsys, name):
    """The files written in place (not through a temporary file) would be written through the link:
    an existing target overwritten, a dangling link's created."""
    out = tmp_path / "out"
    out.mkdir()
    users = tmp_path / "users_files"
    users.mkdir()
    (users / "marker").write_text("keep")
    target = users / ("marker" if name == "config.yaml" else "created_by_the_run")
    (out / name).symlink_to(target)

    status = main([*TINY, "algo=sft", "trainer.sft_steps=1", "trainer.plot=true", "trainer.export=false",
                   "trainer.log_val_generations=2", f"trainer.output_dir={out}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert (users / "marker").read_text() == "keep" and os.listdir(users) == ["marker"]
    assert status == 2 and err == [f"polyfsdp-train: error: trainer.output_dir {out}: {out / name} is a symbolic "
                                   f"link (to {target}); refused: polyfsdp-train writes its files only inside its "
                                   f"output directory; remove the link or choose another trainer.output_dir"], err


def test_every_file_written_in_place_is_checked_for_a_link(tmp_path):
    """The trackers' files (only written with trainer.logger set) are checked as the others are."""
    from polyfsdp.trainer.errors import ConfigError
    from polyfsdp.trainer.run.resume import check_no_linked_run_files

    for name in ("trackers.json", "mlflow.db"):
        (tmp_path / name).symlink_to(tmp_path / "users_file")
        with pytest.raises(ConfigError, match=f"{tmp_path / name} is a symbolic link"):
            check_no_linked_run_files(tmp_path)
        (tmp_path / name).unlink()


def test_a_file_the_run_writes_in_place_that_is_a_hard_link_is_refused_in_one_line(tmp_path, capsys):
    """A run copied with ``cp -al`` shares its files with the original: config.yaml written in place
    through the shared file would rewrite the original run's (the payload: the other name's content)."""
    out = tmp_path / "out"
    out.mkdir()
    original = tmp_path / "original_run"
    original.mkdir()
    (original / "config.yaml").write_text("keep: the original run's\n")
    os.link(original / "config.yaml", out / "config.yaml")

    status = main([*TINY, "algo=sft", "trainer.sft_steps=1", "trainer.plot=false", "trainer.export=false",
                   f"trainer.output_dir={out}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert (original / "config.yaml").read_text() == "keep: the original run's\n"
    path = out / "config.yaml"
    assert status == 2 and err == [
        f"polyfsdp-train: error: trainer.output_dir {out}: {path} is a hard link (2 names for one file); refused: "
        f"polyfsdp-train writes it in place, which would change the file under its other names too (a copy made with "
        f"cp -al or rsync --link-dest shares it with the original); give the run its own copy (cp {path} "
        f"{path}.copy && mv {path}.copy {path}) or choose another trainer.output_dir"], err


def test_a_tracker_folder_that_is_a_link_is_refused_before_the_tracker_writes(tmp_path, capsys):
    """A crafted run's tensorboard/ linked to a folder of the user's: the event files would be written
    there. Refused in one line before anything is written; the folder stays empty."""
    pytest.importorskip("torch.utils.tensorboard")
    out = tmp_path / "out"
    out.mkdir()
    users = tmp_path / "users_folder"
    users.mkdir()
    (out / "tensorboard").symlink_to(users)

    status = main([*TINY, "algo=sft", "trainer.sft_steps=1", "trainer.plot=false", "trainer.export=false",
                   "trainer.logger=[console,jsonl,tensorboard]", f"trainer.output_dir={out}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert os.listdir(users) == []
    assert status == 2 and err == [
        f"polyfsdp-train: error: trainer.output_dir {out}: {out / 'tensorboard'} is a symbolic link (to {users}); "
        f"refused: what is written into it (trainer.logger's files, the rollout servers' logs) would land outside "
        f"the output directory; remove the link or choose another trainer.output_dir"], err


def test_every_folder_written_into_and_every_file_written_in_place_is_checked(tmp_path):
    """The trackers' folders (tensorboard/, wandb/, mlartifacts/) and the servers' logs are refused as
    links; the files written in place as hard links. A hard link the run only reads, or replaces by a
    rename (metrics.jsonl, a checkpoint's file), is not refused: it changes only the run's own name."""
    from polyfsdp.trainer.errors import ConfigError
    from polyfsdp.trainer.run.resume import check_no_linked_run_files

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    for name in ("tensorboard", "wandb", "mlartifacts", "rollout_servers"):
        (out / name).symlink_to(elsewhere)
        with pytest.raises(ConfigError, match=f"{out / name} is a symbolic link"):
            check_no_linked_run_files(out)
        (out / name).unlink()
    (elsewhere / "users_file").write_text("keep")
    for name in ("trackers.json", "mlflow.db", "generations.jsonl", "curves.png"):
        os.link(elsewhere / "users_file", out / name)
        with pytest.raises(ConfigError, match=f"{out / name} is a hard link \\(2 names for one file\\)"):
            check_no_linked_run_files(out)
        (out / name).unlink()
    os.link(elsewhere / "users_file", out / "metrics.jsonl")
    (out / "checkpoints" / "sft" / "step_1").mkdir(parents=True)
    os.link(elsewhere / "users_file", out / "checkpoints" / "sft" / "step_1" / "model.safetensors")
    (out / "tensorboard").mkdir()  # a folder of the run's own
    check_no_linked_run_files(out)
