"""A checkpoint, dataset or Hugging Face directory from elsewhere is data, never code (issue 44).

torch.distributed.checkpoint unpickles `.metadata`, and each non-tensor value of a shard, with pickle:
a checkpoint whose pickles call os.system ran the command on `inv train.export` and `inv train.pretrain
--resume`, its checksums.json recomputed to match. Now they are read as data (trainer/checkpoint/
safe_dcp.py) and anything else is one line naming the file and the global, exit 2, before any of it
runs: each payload here would create a marker file, which must never appear. Files named by a
checkpoint's .metadata or checksums.json, or by a dataset's manifest, stay inside their folder; a
safetensors header whose data_offsets do not fit its tensors' shapes is refused before the launch."""
from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch

from trainer import checkpoint as ck
from trainer import config as config_mod
from trainer.checkpoint import checksums, safe_dcp
from trainer.models import Transformer
from helpers.program import inv, one_line_error, runs

MODEL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=320, max_seq_len=128)
TRAIN = ["--set", "data.path=synthetic", "--set", "data.seq_len=32", "--set", "data.batch_size=2",
         *[item for key, value in MODEL.items() for item in ("--set", f"model.{key}={value}")]]


class Payload:
    """Unpickled, it runs `touch MARKER`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _checkpoint(root):
    """A run folder with one checkpoint of a small model and its AdamW state (as a trainer saves it)."""
    raw = config_mod.load(config_mod.DEFAULT_CONFIG).to_dict()
    raw["model"].update(MODEL)
    raw["data"].update(path="synthetic", seq_len=32)
    cfg = config_mod.from_dict(raw)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 320, (2, 16))
    model(ids, ids).backward()
    optimizer.step()
    return ck.save(root / "checkpoints", 1, model=model, optimizer=optimizer, config=cfg.to_dict()), cfg


def _rehash_checkpoint(step):
    """checksums.json recomputed over whatever the folder holds now, as anyone can."""
    names = sorted(p.relative_to(step).as_posix() for p in step.rglob("*")
                   if p.is_file() and p.name not in (ck.CHECKSUMS_FILE, ck.COMPLETE_MARKER))
    checksums.write_manifest(step, {name: checksums.hash_file(step / name) for name in names})


def _metadata(step):
    with open(step / ".metadata", "rb") as handle:
        return pickle.load(handle)      # our own, untouched checkpoint


def _write_metadata(step, metadata):
    (step / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))
    _rehash_checkpoint(step)


@pytest.fixture
def planted_checkpoint(tmp_path):
    """A run whose checkpoint's .metadata runs `touch MARKER` when unpickled, checksums recomputed."""
    run = tmp_path / "run"
    step, cfg = _checkpoint(run)
    marker = tmp_path / "metadata-ran"
    (step / ".metadata").write_bytes(pickle.dumps(Payload(marker), protocol=4))
    _rehash_checkpoint(step)
    return run, step, marker, cfg


def test_export_refuses_a_metadata_that_would_run_code(planted_checkpoint):
    run, step, marker, _cfg = planted_checkpoint
    proc = inv(run.parent, "train.export", run)
    one_line_error(proc, f"{step / '.metadata'}", "names the global posix.system", "refused")
    assert not marker.exists(), "export unpickled the payload"
    assert not (run / "export").exists()


def test_resume_refuses_it_before_a_run_directory_exists(planted_checkpoint):
    _run, step, marker, _cfg = planted_checkpoint
    proc = inv(step.parent.parent.parent, "train.pretrain", "--resume", step, *TRAIN)
    one_line_error(proc, f"{step / '.metadata'}", "names the global posix.system")
    assert not marker.exists(), "the resume unpickled the payload"
    assert not runs(step.parent.parent.parent)


def test_the_trainer_and_the_exporter_read_it_as_data_too(planted_checkpoint):
    _run, step, marker, cfg = planted_checkpoint
    model = Transformer(cfg.model)
    for read in (lambda: ck.load(step, model=model, optimizer=torch.optim.AdamW(model.parameters())),
                 lambda: ck.load_model_state(step),
                 lambda: safe_dcp.read_metadata(step)):
        with pytest.raises(ck.CheckpointError, match="names the global posix.system, which no DCP checkpoint holds"):
            read()
    assert not marker.exists()


def test_our_own_checkpoints_read_as_before(tmp_path):
    step, cfg = _checkpoint(tmp_path / "run")
    model = Transformer(cfg.model)
    loaded = ck.load(step, model=model, optimizer=torch.optim.AdamW(model.parameters()))
    assert loaded["step"] == 1
    assert set(ck.load_model_state(step)) == set(model.state_dict())


def test_a_value_in_a_shard_that_would_run_code_is_refused(tmp_path):
    """The optimizer's param_groups go into the shards as pickles, which DCP reads with weights_only=False."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    step, cfg = _checkpoint(tmp_path / "run")
    marker = tmp_path / "value-ran"
    metadata = _metadata(step)
    (index,) = [i for i in metadata.storage_data if i.fqn == "optim.param_groups.0.lr"]
    import io
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    (step / "__9_0.distcp").write_bytes(buffer.getvalue())
    metadata.storage_data[index] = _StorageInfo("__9_0.distcp", 0, len(buffer.getvalue()))
    _write_metadata(step, metadata)
    model = Transformer(cfg.model)
    with pytest.raises(ck.CheckpointError, match=r"__9_0.distcp: the value of optim.param_groups.0.lr holds the "
                                                 r"global posix.system, which no DCP checkpoint holds"):
        ck.load(step, model=model, optimizer=torch.optim.AdamW(model.parameters()))
    assert not marker.exists(), "DCP unpickled the payload"


@pytest.mark.parametrize("where", ["metadata", "checksums"])
def test_files_a_checkpoint_names_stay_inside_it(tmp_path, where):
    run = tmp_path / "run"
    step, _cfg = _checkpoint(run)
    if where == "metadata":
        metadata = _metadata(step)
        first = next(iter(metadata.storage_data))
        info = metadata.storage_data[first]
        metadata.storage_data[first] = type(info)("../../../../etc/passwd", info.offset, info.length)
        _write_metadata(step, metadata)
        said = (f"{step / '.metadata'}", "puts a shard in '../../../../etc/passwd', which leads outside the folder")
    else:
        manifest = json.loads((step / ck.CHECKSUMS_FILE).read_text())
        manifest["files"]["../../../../etc/passwd"] = {"size": os.path.getsize("/etc/passwd"), "digest": "0"}
        (step / ck.CHECKSUMS_FILE).write_text(json.dumps(manifest))
        said = ("checksums.json names '../../../../etc/passwd', which leads outside the folder",)
    proc = inv(tmp_path, "train.export", run)
    one_line_error(proc, *said)
    proc = inv(tmp_path, "train.pretrain", "--resume", step, *TRAIN)
    one_line_error(proc, *said)
    assert not runs(tmp_path)


def test_a_dataset_manifest_naming_a_file_outside_it_is_refused_even_unsealed(tmp_path, dataset):
    copy = tmp_path / "ds"
    shutil.copytree(dataset, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest.pop("record_sha256")
    shard = manifest["splits"]["train"]["shards"][0]
    shard.update(file="../../../../etc/passwd", tokens=os.path.getsize("/etc/passwd") // 2)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    proc = inv(tmp_path, "train.pretrain", "--set", f"data.path={copy}", "--set", "data.seq_len=32")
    one_line_error(proc, f"{copy / 'manifest.json'}", "names '../../../../etc/passwd' as a file of split 'train', "
                                                      "which leads outside the folder")
    assert not runs(tmp_path)


def _lie(path, change):
    """Rewrite a safetensors file's header (its bytes of data kept as they are)."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    change(header)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length:])


@pytest.mark.parametrize("lie", ["short", "overlap"])
def test_safetensors_offsets_that_do_not_fit_their_shapes_are_refused_before_the_launch(tmp_path, lie):
    from trainer.export import export_hf

    step, _cfg = _checkpoint(tmp_path / "run")
    hf = export_hf(step, tmp_path / "hf", dtype="float32")
    weights = hf / "model.safetensors"

    def change(header):
        norm, other = header["model.norm.weight"], header["model.layers.0.input_layernorm.weight"]
        if lie == "short":       # the same bytes, a longer tensor: its end reads the next tensor's
            norm["shape"] = [norm["shape"][0] * 2]
        else:                    # two tensors over the same bytes, the sizes right
            other["data_offsets"] = list(norm["data_offsets"])
    _lie(weights, change)
    proc = inv(tmp_path, "train.pretrain", "--init-from", hf, *TRAIN)
    line = one_line_error(proc, f"{weights}: damaged header")
    assert ("model.norm.weight is F32 [128]" if lie == "short" else "data_offsets") in line, line
    assert not runs(tmp_path)
