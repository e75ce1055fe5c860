"""health.on_nonfinite=rerun in one process on CPU: a step whose loss is NaN is run again from the same
weights; a fault that comes back skips the batch's update (recorded with its samples), one that does not
blames the hardware (exit 5, logs/fault-rank0.json). The NaN comes from a patched forward, as a faulty
batch or GPU would give it."""
import json
import math

import pytest

from core.signals import EXIT_FAULTY
from trainer import numeric, train
from trainer.config import DEFAULT_CONFIG, ConfigError, load
from trainer.models import Transformer
from helpers.training import records

SHORT = ["data.seq_len=64", "data.batch_size=8", "schedule.warmup_steps=2", "train.val_batches=0",
         "checkpoint.interval=0", "checkpoint.save_final=false", "logging.progress=false", "train.log_interval=1",
         "train.steps=6", "health.on_nonfinite=rerun"]


pytestmark = pytest.mark.usefixtures("one_thread")


def nan_on_calls(monkeypatch, *calls_with_nan: int) -> None:
    """The training forward's n-th calls (1-based; one call per step here, two for a rerun step) give NaN."""
    forward, calls = Transformer.forward, []

    def faulty(self, *args, **kwargs):
        loss = forward(self, *args, **kwargs)
        if not self.training:
            return loss
        calls.append(1)
        return loss * math.nan if len(calls) in calls_with_nan else loss
    monkeypatch.setattr(Transformer, "forward", faulty)


def test_a_nan_that_comes_back_skips_the_batch_and_lists_its_samples(tmp_path, dataset, monkeypatch):
    nan_on_calls(monkeypatch, 3, 4)              # step 3, and its rerun: the batch
    cfg = load(DEFAULT_CONFIG, [f"data.path={dataset}", *SHORT])
    assert train.run(cfg, tmp_path / "run") == 0
    (skipped,) = records(tmp_path / "run", "skipped")
    assert skipped["step"] == 3 and skipped["why"] == "loss is nan" and skipped["samples"] == [16, 24]
    assert len(skipped["windows"]) == 8 and all(isinstance(w, int) for w in skipped["windows"])
    trained = records(tmp_path / "run", "train")
    assert [r["step"] for r in trained] == [1, 2, 4, 5, 6]          # no line for the skipped step
    assert all(math.isfinite(r["loss"]) for r in trained)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 6
    assert not list((tmp_path / "run" / "logs").glob("fault-rank*.json"))


def test_the_skipped_update_leaves_the_weights_as_they_were(tmp_path, dataset, monkeypatch):
    """The weights after a skipped step 3 are those after step 2 (read before each gradient clip)."""
    import torch

    from trainer import optim
    seen = {}
    clip = optim.clip_grad_norm

    def recording_clip(parameters, *args, **kwargs):
        parameters = list(parameters)
        seen.setdefault("params", parameters)
        seen.setdefault("snapshots", []).append([p.detach().clone() for p in parameters])
        return clip(parameters, *args, **kwargs)
    monkeypatch.setattr(optim, "clip_grad_norm", recording_clip)
    nan_on_calls(monkeypatch, 3, 4)
    cfg = load(DEFAULT_CONFIG, [f"data.path={dataset}", *SHORT, "train.steps=4"])
    assert train.run(cfg, tmp_path / "run") == 0
    snaps = seen["snapshots"]      # before each clip: steps 1, 2, 3, 3 (rerun), 4
    assert len(snaps) == 5
    assert all(torch.equal(a, b) for a, b in zip(snaps[2], snaps[4]))   # step 3 changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(snaps[1], snaps[2]))   # step 2 did


def test_a_nan_that_goes_away_blames_the_hardware_exit_5(tmp_path, dataset, monkeypatch):
    nan_on_calls(monkeypatch, 3)                 # step 3's first run only: a bit flip
    cfg = load(DEFAULT_CONFIG, [f"data.path={dataset}", *SHORT])
    with pytest.raises(numeric.NumericFault, match=r"step 3: loss is nan, but not when run again from the same "
                                                   r"weights \(loss [\d.]+\): the hardware is suspect, rank\(s\) 0"
                       ) as caught:
        train.run(cfg, tmp_path / "run")
    assert caught.value.exit_code == EXIT_FAULTY == 5
    (report,) = numeric.read_fault_reports(tmp_path / "run")
    assert report["rank"] == 0 and report["step"] == 3 and report["gpu"] is None   # (a CPU)
    assert math.isnan(report["first"]["loss"]) and math.isfinite(report["second"]["loss"])
    assert not records(tmp_path / "run", "skipped")


def test_the_guard_reads_nan_inf_and_spikes():
    guard = numeric.NumericGuard("rerun", spike_factor=3)
    assert guard.fault(float("nan"), 1.0) == "loss is nan" and guard.fault(2.0, float("inf")) == "gradient norm is inf"
    assert guard.fault(100.0, 1.0) is None                # no spike test before WARMUP steps
    for loss in [2.0] * numeric.WARMUP:
        guard.passed(loss)
    assert guard.fault(5.9, 1.0) is None
    assert guard.fault(6.5, 1.0) == "loss 6.5 is 3.2x the median 2 of the last 10 steps"
    assert not numeric.NumericGuard("stop").every_step and guard.every_step


def test_the_settings_are_checked():
    with pytest.raises(ConfigError, match="health.on_nonfinite: expected stop or rerun, got 'skip'"):
        load(DEFAULT_CONFIG, ["health.on_nonfinite=skip"])
    with pytest.raises(ConfigError, match="health.spike_factor: expected 0 unless health.on_nonfinite is rerun"):
        load(DEFAULT_CONFIG, ["health.spike_factor=3"])
    with pytest.raises(ConfigError, match="health.max_restarts: expected an integer >= 0"):
        load(DEFAULT_CONFIG, ["health.max_restarts=-1"])
