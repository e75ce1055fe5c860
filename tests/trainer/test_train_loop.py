"""The training loop in one process on CPU: the tiny model learns, runs are deterministic,
gradient accumulation equals the big batch, user errors are one message."""
import json
import sys

import pytest

from trainer import train
from trainer.config import DEFAULT_CONFIG, load
from trainer.data.check import check_data
from helpers.training import records

# A short tiny run: a few hundred tokens per step so it takes seconds on 2 cores.
SHORT = ["data.seq_len=64", "data.batch_size=8", "schedule.warmup_steps=5", "train.val_batches=2",
         "checkpoint.interval=0", "checkpoint.save_final=false", "logging.progress=false"]


pytestmark = pytest.mark.usefixtures("one_thread")




def train_run(tmp_path, dataset, *sets, name="run"):
    cfg = load(DEFAULT_CONFIG, [f"data.path={dataset}", *SHORT, *sets])
    run_dir = tmp_path / name
    assert train.run(cfg, run_dir) == 0
    return run_dir


def test_tiny_config_learns(tmp_path, dataset):
    run_dir = train_run(tmp_path, dataset, "train.steps=80", "train.log_interval=1", "train.val_interval=40",
                  "checkpoint.save_final=true")
    train_records = records(run_dir)
    first, last = train_records[0]["loss"], train_records[-1]["loss"]
    assert len(train_records) == 80
    assert first > 5.0                # ln(320) = 5.77 at init
    assert last < 0.6 * first         # well below the start
    vals = records(run_dir, "val")
    assert [v["step"] for v in vals] == [40, 80]
    assert vals[-1]["val_loss"] < 0.7 * first
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 80
    assert summary["final_loss"] == last and summary["tokens"] == 80 * 8 * 64
    assert (run_dir / "logs" / "rank0.log").read_text().count("| loss ") == 80
    assert (run_dir / "checkpoints" / "step_80" / "COMPLETE").is_file()
    lrs = [r["lr"] for r in train_records]
    assert lrs[4] == pytest.approx(3e-3) and lrs[-1] < lrs[10]   # warmup, then cosine decay
    assert all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in train_records)


def test_same_seed_same_curve_other_seed_differs(tmp_path, dataset):
    sets = ["train.steps=6", "train.log_interval=1", "train.val_batches=0"]
    a = [r["loss"] for r in records(train_run(tmp_path, dataset, *sets, name="a"))]
    b = [r["loss"] for r in records(train_run(tmp_path, dataset, *sets, name="b"))]
    c = [r["loss"] for r in records(train_run(tmp_path, dataset, *sets, "train.seed=7", name="c"))]
    assert a == b
    assert a != c


def test_grad_accumulation_equals_the_big_batch(tmp_path, dataset):
    sets = ["train.steps=5", "train.log_interval=1", "train.val_batches=0"]
    big = records(train_run(tmp_path, dataset, *sets, "data.batch_size=8", name="big"))
    accum = records(train_run(tmp_path, dataset, *sets, "data.batch_size=4", "data.grad_accum=2",
                        name="accum"))
    # fp32 on a CPU: the same sums in another order. On a GPU the step runs in bf16 autocast, where
    # the order moves the loss by ~1e-3; a wrong accumulation scale would move it by 2x.
    import torch
    loss_tol, norm_tol = (1e-5, 1e-4) if not torch.cuda.is_available() else (1e-2, 5e-2)
    for x, y in zip(big, accum):
        assert x["loss"] == pytest.approx(y["loss"], rel=loss_tol)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=norm_tol)


def test_synthetic_data_is_labelled(tmp_path):
    cfg = load(DEFAULT_CONFIG, [*SHORT, "data.path=synthetic", "train.steps=2", "train.val_batches=1"])
    assert train.run(cfg, tmp_path / "syn") == 0
    log = (tmp_path / "syn" / "logs" / "rank0.log").read_text()
    assert "SYNTHETIC random tokens" in log
    assert json.loads((tmp_path / "syn" / "summary.json").read_text())["data"].startswith("SYNTHETIC")


def test_missing_dataset_says_how_to_prepare(tmp_path):
    from trainer.data import DataError
    cfg = load(DEFAULT_CONFIG.parent / "llama3_1b.yaml", [f"data.path={tmp_path / 'llama3'}"])
    with pytest.raises(DataError) as err:
        check_data(cfg)
    message = str(err.value)
    assert "inv data.prepare" in message and "tokenizer.json" in message
    assert "data.path=synthetic" in message


def test_vocab_smaller_than_tokenizer_is_refused(dataset):
    from trainer.data import DataError
    cfg = load(DEFAULT_CONFIG, [f"data.path={dataset}", "model.vocab_size=128"])
    with pytest.raises(DataError, match="model.vocab_size is 128"):
        check_data(cfg)


def test_kernels_unavailable_is_a_clear_error(monkeypatch):
    from trainer.models import Transformer
    from trainer.config import ModelConfig
    monkeypatch.setitem(sys.modules, "kernels", None)  # import kernels -> ImportError
    with pytest.raises(train.TrainError, match="--kernels: the fused kernels are not available"):
        train.apply_kernels(Transformer(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=2,
                                                    ffn_dim=64, vocab_size=64)))


def test_cli_bad_config_exits_2_with_one_message(tmp_path, capsys):
    from trainer.__main__ import main
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lr: fast\n")
    assert main(["--config", str(bad), "--run-dir", str(tmp_path / "r")]) == 2   # a user error
    err = capsys.readouterr().err
    assert f"{bad}: optim.lr: expected a number" in err and "Traceback" not in err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_the_cli_keeps_a_copy_of_a_config_from_elsewhere_once(tmp_path, monkeypatch):
    """`python -m trainer --config X`: rank 0 keeps X as used in RUN_DIR/config.yaml; a config already in
    the run directory (inv's configs/train.yaml) is not written a second time."""
    from trainer.__main__ import _keep_config

    cfg = load(DEFAULT_CONFIG, ["train.steps=7"])
    monkeypatch.delenv("RANK", raising=False)
    _keep_config(cfg, DEFAULT_CONFIG, tmp_path / "r")
    assert load(tmp_path / "r" / "config.yaml").train.steps == 7
    inside = tmp_path / "s" / "configs" / "train.yaml"
    inside.parent.mkdir(parents=True)
    inside.write_text("train:\n  steps: 7\n")
    _keep_config(cfg, inside, tmp_path / "s")
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["configs"]
    monkeypatch.setenv("RANK", "1")
    _keep_config(cfg, DEFAULT_CONFIG, tmp_path / "t")
    assert not (tmp_path / "t" / "config.yaml").exists()


@pytest.mark.parametrize("setting", [None, True, False])
def test_tensorboard_is_used_when_installed_and_missing_it_is_said_only_when_asked_for(tmp_path, caplog, setting):
    """logging.tensorboard: null (the default) uses TensorBoard when it is installed and says nothing
    when it is not; true says once that it is missing; false never uses it."""
    import importlib.util
    import logging

    import torch

    from trainer.metrics import Metrics

    log = logging.getLogger("anvil-test-tensorboard")
    with caplog.at_level(logging.WARNING, logger=log.name):
        Metrics(tmp_path, is_main=True, log=log, device=torch.device("cpu"), world_size=1, total_steps=1,
                flops_per_token=1, tensorboard=setting, progress=False, gpu_stats=False).close()
    installed = importlib.util.find_spec("tensorboard") is not None
    assert (tmp_path / "tensorboard").is_dir() == (installed and setting is not False)
    assert caplog.text.count("TensorBoard cannot be used here") == (1 if setting is True and not installed else 0)


def test_compiled_steps_skip_guards_once_nothing_compiles_with_the_same_losses(tmp_path, dataset):
    """train.skip_guards: from the step after one that compiled nothing, training runs under
    skip_guard_eval_unsafe; the losses equal those of a run with every guard checked, and a
    validation pass in between (no_grad: an entry of its own) changes neither."""
    import torch
    from torch._dynamo.utils import counters

    sets = ("train.compile=true", "train.steps=6", "train.log_interval=1", "train.val_interval=3")
    torch._dynamo.reset()
    said = "step 2 compiled nothing: the steps after it skip torch.compile's guard checks (train.skip_guards)"
    skipped_dir = train_run(tmp_path, dataset, *sets, name="skipped")
    assert (skipped_dir / "logs" / "rank0.log").read_text().count(said) == 1
    torch._dynamo.reset()
    checked_dir = train_run(tmp_path, dataset, *sets, "train.skip_guards=false", name="checked")
    assert "guard checks" not in (checked_dir / "logs" / "rank0.log").read_text()
    skipped, checked = records(skipped_dir), records(checked_dir)
    assert len(skipped) == 6 and [r["loss"] for r in skipped] == [r["loss"] for r in checked]
    vals = [[(r["step"], r["val_loss"]) for r in records(d, "val")] for d in (skipped_dir, checked_dir)]
    assert vals[0] == vals[1] and [step for step, _ in vals[0]] == [3, 6]

    # The stance is on only after a step that compiled nothing; a call that would need new code then
    # stops with torch's error rather than running what was compiled for other inputs.
    from trainer.guards import GuardSkip
    f = torch.compile(lambda t: t * 2)
    skip = GuardSkip(True)
    with skip.step():
        f(torch.ones(3))
    assert not skip.active                              # the first call compiled
    misses = counters["frames"]["total"]
    with skip.step():
        f(torch.ones(3))
    assert skip.active and counters["frames"]["total"] == misses
    with pytest.raises(RuntimeError, match="skip_guard_eval_unsafe"), skip.step():
        f(torch.ones(3, dtype=torch.float64))
    assert GuardSkip(False).step().__class__.__name__ == "nullcontext"
    # a mixture of experts keeps its guards: tokens per expert, and so its shapes, change every step
    from trainer.guards import wanted
    assert wanted(True, True, experts=False) and not wanted(True, True, experts=True)
    assert not wanted(False, True, experts=False) and not wanted(True, False, experts=False)


def test_a_nan_loss_stops_the_run_before_that_steps_checkpoint(tmp_path, dataset, monkeypatch):
    """Losses are read a step late (metrics.DeferredScalars), but a checkpoint is never written from
    weights whose step's loss was NaN: the pending reading is taken before every save."""
    import math

    from trainer.models import Transformer
    forward, calls = Transformer.forward, []

    def nan_at_step_3(self, *args, **kwargs):
        loss = forward(self, *args, **kwargs)
        calls.append(1)
        return loss * math.nan if self.training and len(calls) == 3 else loss
    monkeypatch.setattr(Transformer, "forward", nan_at_step_3)
    cfg = load(DEFAULT_CONFIG, ["data.path=" + str(dataset), *SHORT, "train.steps=6", "train.log_interval=1",
                                "train.val_batches=0", "checkpoint.interval=3"])
    with pytest.raises(train.TrainError, match="loss is NaN at step 3"):
        train.run(cfg, tmp_path / "run")
    logged = records(tmp_path / "run")
    assert [r["step"] for r in logged] == [1, 2, 3] and logged[-1]["loss"] != logged[-1]["loss"]
    assert not (tmp_path / "run" / "checkpoints" / "step_3").exists()


def test_deferred_readings_come_back_in_order_with_their_context():
    import torch

    from trainer.metrics import DeferredScalars
    readings = DeferredScalars(torch.device("cpu"))
    assert readings.take() is None
    readings.put([torch.tensor(2.5), torch.tensor([0.25])], step=7)
    assert readings.pending
    with pytest.raises(AssertionError):
        readings.put([torch.tensor(1.0)], step=8)    # one at a time: take the first
    assert readings.take() == ([2.5, 0.25], {"step": 7}) and not readings.pending


def test_a_step_that_fails_still_leaves_the_previous_steps_line(tmp_path, dataset, monkeypatch):
    """The line of step 2 is written while step 3 runs; step 3 failing must not lose it."""
    from trainer.models import Transformer
    forward, calls = Transformer.forward, []

    def fail_at_step_3(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a failure in step 3")
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(Transformer, "forward", fail_at_step_3)
    cfg = load(DEFAULT_CONFIG, ["data.path=" + str(dataset), *SHORT, "train.steps=6", "train.log_interval=1",
                                "train.val_batches=0"])
    with pytest.raises(RuntimeError, match="a failure in step 3"):
        train.run(cfg, tmp_path / "run")
    assert [r["step"] for r in records(tmp_path / "run")] == [1, 2]
