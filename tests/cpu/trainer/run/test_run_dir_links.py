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
