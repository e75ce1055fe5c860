"""Multi-token prediction (model.mtp_depth, trainer/models/multi_token.py): the objective against a reference
that truncates the rows instead of rolling them, what is logged and validated, the trainer's curve across a
resume and over 2 ranks with the experts or the rows split, what the plan counts, and the keys it refuses."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from core import runfiles
from trainer import config as config_mod
from trainer.config import ConfigError
from trainer.models import Transformer
from trainer.plan import ParamCount
from helpers.training import SEED_CONFIG as CONFIG, records, same_curve, trainer_losses

SETS = ["data.seq_len=64", "train.log_interval=1", "train.val_batches=0", "schedule.warmup_steps=2",
        "checkpoint.save_final=false", "logging.progress=false", "logging.tensorboard=false", "model.mtp_depth=1"]


def seed_model(depth: int, **sets) -> Transformer:
    items = [f"model.mtp_depth={depth}", "data.path=synthetic", "data.seq_len=16", "model.moe.aux_loss_alpha=0",
             *(f"{k}={v}" for k, v in sets.items())]
    torch.manual_seed(0)
    return Transformer(config_mod.load(str(CONFIG), items).model)


def reference_objective(model: Transformer, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list]:
    """(language loss + weight / depth x the depths' losses, each depth's loss), with depth k computed on
    the rows cut to their first T - k positions (causal attention: the same outputs there) rather than
    on rolled rows."""
    m, core = model.cfg, model.model
    cos, sin = core.rotary_emb(x.shape[1])
    embedded = core.embed_tokens(x)
    hidden = core(x)
    main = F.cross_entropy(model.lm_head(hidden).flatten(0, 1).float(), y.flatten(), reduction="sum")
    losses = []
    for k, layer in enumerate(core.prediction_layers(), start=1):
        T = x.shape[1] - k
        hidden, normed = layer(hidden[:, :T], embedded[:, k:], cos[:T], sin[:T])
        logits = model.lm_head(normed)
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), y[:, k:].flatten(), reduction="sum"))
    return main + m.mtp_loss_weight / m.mtp_depth * sum(losses), losses


def test_the_gradient_is_the_language_loss_plus_the_weighted_prediction_losses():
    model = seed_model(2).train()
    x = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    loss = model(x, y)
    (loss * 0.01).backward()       # the loop's scale (1 / tokens) reaches the prediction losses too
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    objective, depths = reference_objective(model, x, y)
    (objective * 0.01).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert ours["model.layers.5.eh_proj.weight"].abs().sum() > 0        # the second depth trains
    # the value returned (logged, validated) is the language model's alone; the depths' sum is counted
    with torch.no_grad():
        main = F.cross_entropy(model.lm_head(model.model(x)).flatten(0, 1).float(), y.flatten(), reduction="sum")
    torch.testing.assert_close(loss.detach(), main)
    torch.testing.assert_close(model.mtp_loss_sum, sum(depths).detach())
    assert int(model.mtp_tokens) == 2 * (15 + 14)


def test_evaluation_and_logits_run_without_the_prediction_layers():
    model = seed_model(1)
    x = torch.randint(0, model.cfg.vocab_size, (2, 16))
    model.eval()
    with torch.no_grad():
        assert model(x).shape == (2, 16, model.cfg.vocab_size)
        val = model(x, x)
        assert torch.allclose(val, F.cross_entropy(model(x).flatten(0, 1), x.flatten(), reduction="sum"))
    assert int(model.mtp_tokens) == 0


def test_the_plan_counts_the_prediction_layers():
    with_depth, without = seed_model(1), seed_model(0)
    assert ParamCount.of(with_depth.cfg).total == with_depth.num_params()
    extra = with_depth.num_params() - without.num_params()
    layer = sum(p.numel() for p in with_depth.model.layers[4].parameters())
    assert extra == layer > 2 * 64 * 64              # a decoder layer, its eh_proj and three norms


def test_training_logs_both_losses_and_resumes_on_the_same_curve(dataset, tmp_path):
    run = tmp_path / "run"
    losses = trainer_losses(CONFIG, run, 1, [f"data.path={dataset}", *SETS, "train.steps=6",
                                             "checkpoint.interval=3"])
    assert losses[6] < losses[1]
    train = records(run)
    assert all(r["mtp_loss"] > 0 for r in train) and train[-1]["mtp_loss"] < train[0]["mtp_loss"]
    assert [r["layers"] for r in runfiles.metrics_records(run) if r["kind"] == "moe"][0] == [1, 2, 3, 4]
    assert json.loads((run / "summary.json").read_text())["final_mtp_loss"] == train[-1]["mtp_loss"]
    resumed = trainer_losses(CONFIG, tmp_path / "resumed", 1, [f"data.path={dataset}", *SETS, "train.steps=6"],
                             resume=str(run / "checkpoints" / "step_3"))
    assert same_curve(resumed, {s: losses[s] for s in (4, 5, 6)}, 1e-5), (resumed, losses)


def test_two_ranks_with_the_experts_or_the_rows_split_give_the_one_process_losses(dataset, tmp_path):
    """Two depths (FSDP2 reshards the first after its forward: its head's norm runs inside it), over 2 ranks
    with the experts split (ep 2), or with each row split (cp 2, documents masked: the tokens ahead of a
    rank's last ones are on the other rank)."""
    sets = [f"data.path={dataset}", *SETS, "model.mtp_depth=2", "train.steps=3", "checkpoint.interval=0",
            "data.document_mask=true"]
    single = trainer_losses(CONFIG, tmp_path / "one", 1, [*sets, "data.batch_size=8"])
    for name, layout in (("ep2", ["data.batch_size=4", "parallel.ep=2"]), ("cp2", ["data.batch_size=8", "parallel.cp=2"])):
        split = trainer_losses(CONFIG, tmp_path / name, 2, [*sets, *layout])
        assert same_curve(split, single, 1e-4), (name, split, single)
        ahead = [r["mtp_loss"] for r in records(tmp_path / name)]
        assert ahead == pytest.approx([r["mtp_loss"] for r in records(tmp_path / "one")], rel=1e-4), name


@pytest.mark.parametrize("sets, expected", [
    (["model.mtp_depth=-1"], "model.mtp_depth: expected an integer from 0"),
    (["model.mtp_depth=64"], "model.mtp_depth: expected an integer from 0 .off. to below data.seq_len .64."),
    (["model.mtp_loss_weight=0"], "model.mtp_loss_weight: expected a positive number"),
    (["model.mtp_depth=1", "parallel.tp=2", "parallel.strategy=fsdp", "model.family=llama", "model.moe=null",
      "model.mla=null", "model.n_heads=4", "model.n_kv_heads=4"], "model.mtp_depth: expected 0 with parallel.tp"),
])
def test_bad_keys_are_one_line(sets, expected):
    with pytest.raises(ConfigError, match=expected):
        config_mod.load(str(CONFIG), ["data.path=synthetic", "data.seq_len=64", *sets])
