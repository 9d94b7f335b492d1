"""A crafted run directory cannot aim a load outside itself: every path a checkpoint names (its
``.metadata``'s shard files, its manifest, the phase's ``latest``) stays inside the checkpoint (or
its phase directory), no symbolic link is followed, and every file read is in the manifest. Each
attack is built here with a payload (zeroed weights, an outside checkpoint, a marker in the
trainer state) and shown to work through plain torch, then refused in one line naming the file."""
import os
import pickle
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tests.helpers.checkpoint_cases import build_sharded, full_params

from polyfsdp.backends import get_backend, init_distributed
from polyfsdp.engines import checkpoint as ckpt
from polyfsdp.engines.checkpoint.files import load_plain, save_plain, write_manifest
from polyfsdp.engines.checkpoint.parts import sharded_state
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.run.resume import find_resume


@pytest.fixture(scope="module")
def mesh():
    return init_distributed(get_backend("cpu"))


def _trained(mesh, seed):
    model, opt, sched = build_sharded(mesh, seed=seed)
    x = torch.arange(8).view(1, 8)
    model(input_ids=x, labels=x, use_cache=False).loss.backward()
    opt.step()
    return model, opt, sched


def _save(parts, root, step):
    model, opt, sched = parts
    return ckpt.save_checkpoint(root, step, model=model, optimizer=opt, lr_scheduler=sched, extra={"who": "run"})


def _load(path, parts):
    model, opt, sched = parts
    return ckpt.load_checkpoint(path, model=model, optimizer=opt, lr_scheduler=sched)


@pytest.fixture()
def saved(mesh, tmp_path):
    parts = _trained(mesh, seed=0)
    return _save(parts, tmp_path / "run" / "checkpoints" / "rl", 2), parts


@pytest.fixture()
def zeroed_outside(mesh, tmp_path):
    """A checkpoint outside the run, of the same model with every weight zero: the payload."""
    model, opt, sched = _trained(mesh, seed=1)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    return _save((model, opt, sched), tmp_path / "elsewhere", 4)


@pytest.mark.parametrize("aim", ["absolute", "dot-dot"])
def test_metadata_naming_a_shard_file_outside_the_checkpoint_is_refused(saved, zeroed_outside, aim):
    path, parts = saved
    # The outside checkpoint's .metadata, its shard names turned into paths to its shard files.
    with open(zeroed_outside / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    for where in metadata.storage_data.values():
        outside = zeroed_outside / where.relative_path
        where.relative_path = str(outside) if aim == "absolute" else os.path.relpath(outside, path)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    write_manifest(path)  # whoever crafted it also fixed the manifest
    before = full_params(parts[0])

    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata: names the shard file '.*__0_0\.distcp', which is "
                                                   r"not a file of this checkpoint") as info:
        _load(path, parts)
    assert "\n" not in str(info.value)
    assert all(torch.equal(param, before[name]) for name, param in full_params(parts[0]).items())
    with pytest.raises(ckpt.CheckpointError, match="not a file of this checkpoint"):
        ckpt.verify_checkpoint(path)
    # Negative control: torch's own DCP load reads the outside file: every weight becomes zero.
    dcp.load(sharded_state(parts[0], parts[1]), checkpoint_id=str(path))
    assert all(not param.any() for param in full_params(parts[0]).values())


def test_metadata_naming_a_shard_file_the_manifest_does_not_list_is_refused(saved):
    path, parts = saved
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    for where in metadata.storage_data.values():
        where.relative_path = "unlisted.distcp"  # a plain name, but no file the manifest hashes
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    write_manifest(path)
    with pytest.raises(ckpt.CheckpointError, match=r"names the shard file 'unlisted.distcp', which manifest.json "
                                                   r"does not list"):
        _load(path, parts)


@pytest.mark.parametrize("aim", ["absolute", "dot-dot", "link"])
def test_latest_naming_a_checkpoint_outside_the_phase_directory_is_refused(saved, zeroed_outside, aim):
    phase_dir = saved[0].parent
    run = phase_dir.parent.parent
    latest = phase_dir / "latest"
    if aim == "link":
        (phase_dir / "step_000004").symlink_to(zeroed_outside)
        latest.write_text("step_000004\n")
    else:
        latest.write_text(f"{zeroed_outside if aim == 'absolute' else os.path.relpath(zeroed_outside, phase_dir)}\n")
    ckpt.verify_checkpoint(zeroed_outside)  # the outside checkpoint itself is intact: only the path is wrong

    with pytest.raises(ConfigError, match=r"trainer.resume=auto: .*/checkpoints/rl/latest: (names|a symbolic)") as info:
        find_resume(load_config([]), run, say=lambda line: None)
    assert "\n" not in str(info.value)
    with pytest.raises(ckpt.CheckpointError, match="latest: "):
        _load(phase_dir, saved[1])
    # Negative control: the pointer is all that is refused; one naming the run's own checkpoint resumes.
    latest.write_text("step_000002\n")
    assert find_resume(load_config([]), run, say=lambda line: None).checkpoint == saved[0]


def test_an_older_checkpoint_that_is_a_symbolic_link_is_skipped_by_resume_auto(saved, zeroed_outside):
    phase_dir = saved[0].parent
    (phase_dir / "step_000001").symlink_to(zeroed_outside)  # a complete checkpoint, to a scan
    said = []
    resume = find_resume(load_config([]), phase_dir.parent.parent, say=said.append)
    assert resume.checkpoint == saved[0] and resume.older == []
    assert len(said) == 1 and said[0].startswith(f"trainer.resume=auto: skipping {phase_dir / 'step_000001'}: a "
                                                 f"symbolic link (to {zeroed_outside})")


@pytest.mark.parametrize("linked", ["checkpoints", "checkpoints/rl"])
def test_resume_auto_refuses_checkpoints_reached_through_a_linked_directory(tmp_path, zeroed_outside, linked):
    """A crafted run whose ``checkpoints`` (or phase directory) links to another run's: resuming
    would load that run's checkpoints (the payload: zeroed weights) and save and prune among them."""
    out = tmp_path / "crafted"
    (out / linked).parent.mkdir(parents=True, exist_ok=True)
    phase_dir = zeroed_outside.parent
    if linked == "checkpoints":  # the other run's checkpoints: other/rl/step_000004
        (tmp_path / "other").mkdir()
        phase_dir = phase_dir.rename(tmp_path / "other" / "rl")
    (out / linked).symlink_to(phase_dir if linked == "checkpoints/rl" else phase_dir.parent)
    # Negative control: through the link, the other run's checkpoint is the newest of this one.
    assert ckpt.latest_checkpoint(out / "checkpoints" / "rl") == out / "checkpoints" / "rl" / zeroed_outside.name
    with pytest.raises(ConfigError, match=re.escape(f"trainer.resume=auto: {out / linked} is a symbolic link (to ")):
        find_resume(load_config([]), out, say=lambda line: None)


@pytest.mark.parametrize("name", ["trainer_state.pt", "manifest.json"])
def test_a_checkpoint_file_that_is_a_symbolic_link_is_refused(saved, tmp_path, name):
    path, parts = saved
    outside = tmp_path / "outside" / name
    outside.parent.mkdir()
    if name == "trainer_state.pt":
        state = load_plain(path / name)
        state["extra"] = {"who": "outside"}  # the marker
        save_plain(state, outside)
        (path / name).unlink()
        (path / name).symlink_to(outside)
        write_manifest(path)  # hashes what the link points at: the manifest vouches for it
    else:
        write_manifest(path)
        os.replace(path / name, outside)
        (path / name).symlink_to(outside)
    # Negative control: reading the file reads the outside one.
    if name == "trainer_state.pt":
        assert load_plain(path / name)["extra"] == {"who": "outside"}
    else:
        assert (path / name).read_bytes() == outside.read_bytes()

    refused = re.escape(f"{path / name}: a symbolic link (to {outside}); refused")
    for call in (lambda: ckpt.verify_checkpoint(path), lambda: _load(path, parts)):
        with pytest.raises(ckpt.CheckpointError, match=refused) as info:
            call()
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=f"trainer.resume=auto: {refused}"):
        find_resume(load_config([]), path.parent.parent.parent, say=lambda line: None)


@pytest.mark.parametrize("link, step", [(".tmp-step_000009", 3), (".tmp-step_000003", 3), ("latest.tmp", 3),
                                        (".tmp-old-step_000002", 2)])
def test_a_save_deletes_or_overwrites_a_symbolic_link_in_the_phase_directory_never_its_target(saved, tmp_path,
                                                                                             link, step):
    """A crafted run's leftovers that a save removes or rewrites (a crashed save's ``.tmp-*``, the
    temporary directory of this very step, ``latest.tmp``, a re-saved step's ``.tmp-old-*``) are
    links to the user's files: the save goes on, the links go, what they point at stays."""
    path, parts = saved
    phase_dir = path.parent
    outside = tmp_path / "users_files"
    outside.mkdir()
    (outside / "marker").write_text("keep")
    target = outside / "marker" if link == "latest.tmp" else outside
    (phase_dir / link).symlink_to(target)

    final = _save(parts, phase_dir, step)
    assert (outside / "marker").read_text() == "keep" and sorted(os.listdir(outside)) == ["marker"]
    assert not (phase_dir / link).is_symlink()
    assert ckpt.latest_checkpoint(phase_dir) == final and final.name == f"step_{step:06d}"


def test_polyfsdp_train_refuses_a_latest_naming_an_outside_checkpoint_in_one_line(tmp_path, capsys):
    import shutil

    from tests.cpu.trainer.test_cli import TINY

    from polyfsdp.trainer.train import main

    out = tmp_path / "out"
    run = [*TINY, "algo=sft", "trainer.plot=false", "trainer.export=false", "trainer.checkpoint_interval=1",
           f"trainer.output_dir={out}"]
    assert main([*run, "trainer.sft_steps=1"]) == 0
    phase_dir = out / "checkpoints" / "sft"
    # The payload: an intact checkpoint outside the run, which the pointer aims the resume at.
    outside = tmp_path / "elsewhere" / "step_000001"
    shutil.copytree(phase_dir / "step_000001", outside)
    (phase_dir / "latest").write_text(os.path.relpath(outside, phase_dir) + "\n")
    capsys.readouterr()

    assert main([*run, "trainer.sft_steps=2"]) == 2
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.strip()]
    assert err == [f"polyfsdp-train: error: trainer.resume=auto: {phase_dir / 'latest'}: names "
                   f"'../../../elsewhere/step_000001', which is not a step_* checkpoint of {phase_dir}; refused: a "
                   f"run's checkpoints are read only from its own directory"], err
    assert "resuming" not in captured.out and not (phase_dir / "step_000002").exists()
