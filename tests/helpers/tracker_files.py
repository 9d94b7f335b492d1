"""Reading trackers' files back with the libraries' own readers (tests only)."""
from __future__ import annotations

import struct
from pathlib import Path

WANDB_BLOCK = 32768  # W&B's transaction log: LevelDB's log format in 32 KiB blocks


def _wandb_log_payloads(path: Path):
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pending = 7, b""  # the file header: ":W&B", a 2-byte magic, a version byte
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:      # a whole record
            yield chunk
        elif kind == 2:    # first, middle, last fragments
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk


def wandb_offline_runs(wandb_dir: Path) -> list[dict]:
    """Per offline run directory (oldest first): the run record (id, name, tags, config) and
    its history rows, parsed with W&B's own protobuf messages."""
    import json

    from wandb.proto import wandb_internal_pb2

    runs = []
    for log in sorted(wandb_dir.glob("offline-run-*/run-*.wandb")):
        run = {"history": []}
        for payload in _wandb_log_payloads(log):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                config = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                          for item in record.run.config.update}
                run.update(id=record.run.run_id, name=record.run.display_name, project=record.run.project,
                           tags=list(record.run.tags), config=config)
            elif kind == "history":
                run["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                       for item in record.history.item})
        runs.append(run)
    return runs
