"""W&B (offline) and TensorBoard sinks: the per-layer keys reach both, and a resumed run continues the same
W&B run id."""
import struct
import zlib
from pathlib import Path

import pytest
import torch

from conftest import TINY_RUN, read_metrics, run_train

LAYERS = 4


def wandb_records(path: Path):
    """Records of a W&B transaction log (`run-<id>.wandb`, read with wandb's own protobuf schema).

    The file is a LevelDB-style log: a 7-byte header (":W&B", magic 0xBEE1, version), then 32 KiB blocks of
    chunks, each `crc32 (4) | length (2) | type (1) | data`, type FULL=1, FIRST=2, MIDDLE=3, LAST=4.
    """
    from wandb.proto import wandb_internal_pb2
    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a W&B transaction log"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"bad checksum in {path} at {pos}"
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            yield rec
            pending = b""


def history_keys(run_dir: Path):
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert files, f"no offline W&B run under {run_dir}/wandb"
    keys, steps, ids = set(), set(), set()
    for f in files:
        ids.add(f.stem.removeprefix("run-"))
        for rec in wandb_records(f):
            if rec.WhichOneof("record_type") == "history":
                steps.add(rec.history.step.num)
                for item in rec.history.item:
                    # nested values (an image's width, path, ...) carry the top-level key first
                    keys.add(item.nested_key[0] if item.nested_key else item.key)
                    if item.key == "_step":
                        steps.add(int(item.value_json))
    return keys, steps, ids


@pytest.mark.slow
def test_wandb_offline_and_tensorboard_get_per_layer_keys(tmp_path, default_corpus):
    args = [*TINY_RUN, "logging=all", "logging.heatmap_interval=2", f"run.dir={tmp_path}", "checkpoint.interval=2"]
    run_train(*args, "train.steps=2", env={"WANDB_API_KEY": ""})
    keys, steps, ids = history_keys(tmp_path)
    for i in range(LAYERS):
        for k in ("ratio", "threshold", "gate_mean", "gate_std"):
            assert f"logo/{k}/layer_{i}" in keys, (k, i, sorted(keys)[:20])
    assert {"loss", "lr", "grad_norm"} <= keys
    assert "logo/ratio_heatmap" in keys  # the heatmap image
    assert len(ids) == 1
    first_id = ids.pop()
    state = torch.load(tmp_path / "checkpoints" / "step_00000002" / "train_state.pt", weights_only=False)
    assert state["wandb_id"] == first_id  # stored with the checkpoint

    # resume (the same run dir, a longer schedule): the same W&B run continues with the later steps
    run_train(*args, "train.steps=4", "run.extend=true")
    keys, steps, ids = history_keys(tmp_path)
    assert ids == {first_id}
    assert {3, 4} <= steps
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {f"logo/ratio/layer_{i}" for i in range(LAYERS)} <= tags
    assert {f"logo/threshold/layer_{i}" for i in range(LAYERS)} <= tags
    assert "loss" in tags
