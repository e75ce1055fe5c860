"""Hugging Face in and out for the mixture-of-experts families: transformers' DeepseekV2ForCausalLM,
DeepseekV3ForCausalLM and Qwen3MoeForCausalLM (trainer/hf/mapping.py, the tables in
trainer/models/deepseek.py and qwen3_moe.py).

Against transformers itself, fp32 on the CPU, tiny shapes (3 layers, the first dense, 8 experts):
a random model saved by save_pretrained (the Hub's per-expert keys, DeepSeek's interleaved RoPE rows)
loads into Anvil's Transformer with transformers' logits, which proves the mapping and our layers
alike; an export of it is the same tensors, transformers loads it with the same logits, and Anvil
reads it back to the same tensors. The published checkpoints' config.json give the shipped configs'
shapes. A checkpoint of another shape, architecture or family is one line, exit 2, before anything
starts; a config that transformers' class cannot hold is not exported.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainer import checkpoint as ck
from trainer import config as config_mod
from trainer.hf import InitError, from_hf, load_config, load_weights, to_hf
from trainer.hf.errors import InexpressibleModel
from trainer.hf.load import model_tensors
from trainer.hf.config import mapping_for
from trainer.hf.mapping import HubReader, ours_value, sources
from trainer.hf.weights import HFWeights
from trainer.models import Transformer
from helpers.program import REPO, inv, one_line_error, runs

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402  (transformers brings it)

# initializer_range 0.1, not 0.02: every layer moves the logits well above fp32's rounding, so a
# tensor in the wrong place shows
SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.1)
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
           n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1)
# original_max_position_embeddings 16 < the 24 tokens the logits are compared on
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0}
VARIANTS = {
    "deepseek_v2-lite": ("DeepseekV2Config", dict(**MLA, q_lora_rank=None, n_shared_experts=2)),
    "deepseek_v2-grouped-yarn": ("DeepseekV2Config", dict(
        **MLA, q_lora_rank=12, n_shared_experts=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=2.0, rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707})),
    "deepseek_v3-sharded": ("DeepseekV3Config", dict(
        **MLA, q_lora_rank=12, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_key_value_heads=2, head_dim=6, num_experts=8, num_experts_per_tok=2,
                                         mlp_only_layers=[0], norm_topk_prob=True)),
    "qwen3_moe-tied-yarn": ("Qwen3MoeConfig", dict(num_key_value_heads=2, head_dim=6, num_experts=8,
                                                   num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=False,
                                                   tie_word_embeddings=True, rope_parameters=YARN)),
}


def write_hub(out: Path, variant: str, seed: int = 0, **changes):
    """A random transformers model of `variant` saved by save_pretrained; returns it, fp32, in eval mode.
    Its norms and V3's balancing bias are random too: ones and zeros would hide a misplaced one."""
    config_class, shape = VARIANTS[variant]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**SHAPE, **shape, **changes})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("norm.weight"):
                tensor.normal_(1.0, 0.2)
            elif name.endswith("e_score_correction_bias"):
                tensor.normal_(0.0, 0.2)
    model.save_pretrained(out, **({"max_shard_size": "40KB"} if "sharded" in variant else {}))
    return model


def hub_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {name: t for f in sorted(directory.glob("*.safetensors")) for name, t in load_file(f).items()}


def start_from(directory: Path, *sets: str) -> tuple[config_mod.TrainConfig, Transformer]:
    """The run's config and Anvil's model, as `train.pretrain --init-from directory` makes them."""
    cfg = load_config(None, [f"checkpoint.init_from={directory}", "data.seq_len=32", *sets])
    torch.manual_seed(1)
    model = Transformer(cfg.model).eval()      # initialised at random first, as the trainer does
    load_weights(model, directory)
    return cfg, model


def ours_from(directory: Path) -> Transformer:
    return start_from(directory)[1]


IDS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(IDS)
    return getattr(out, "logits", out)


# --------------------------------------------------------------------------- transformers -> Anvil

@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_transformers(tmp_path, variant):
    """The proof that the mapping and our DeepSeek / Qwen3 layers compute transformers' model."""
    hub = write_hub(tmp_path, variant)
    model = ours_from(tmp_path)
    assert model.cfg.family == variant.split("-")[0]
    assert [layer.mlp.__class__.__name__ for layer in model.model.layers] == ["MLP", "MoE", "MoE"]
    if "sharded" in variant:   # experts of one layer come from several files
        assert len(list(tmp_path.glob("*.safetensors"))) > 2
    theirs = logits(hub)
    assert theirs.abs().max() > 0.5
    torch.testing.assert_close(logits(model), theirs, rtol=1e-5, atol=1e-6)


def test_deepseek_rope_rows_and_experts_are_what_move(tmp_path):
    """Loaded as they lie (no RoPE permutation), DeepSeek's logits are wrong: the permutation is needed,
    and the expert weights are the Hub's, transposed and stacked gate then up."""
    write_hub(tmp_path, "deepseek_v2-lite")
    model, hub = ours_from(tmp_path), hub_tensors(tmp_path)
    attn, experts = model.model.layers[1].self_attn, model.model.layers[1].mlp.experts
    q = hub["model.layers.1.self_attn.q_proj.weight"].view(4, 12, 32)
    ours_q = attn.q_proj.weight.view(4, 12, 32)
    assert torch.equal(ours_q[:, :8], q[:, :8])                         # the parts without RoPE stay
    assert torch.equal(ours_q[:, 8:], q[:, [8, 10, 9, 11]])             # pairs (8, 9), (10, 11): evens first
    kv = hub["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    assert torch.equal(attn.kv_a_proj_with_mqa.weight, kv[[*range(16), 16, 18, 17, 19]])
    for e in (0, 7):
        gate, up = (hub[f"model.layers.1.mlp.experts.{e}.{w}_proj.weight"] for w in ("gate", "up"))
        assert torch.equal(experts.gate_up_proj[e], torch.cat((gate.T, up.T), dim=-1))
        assert torch.equal(experts.down_proj[e], hub[f"model.layers.1.mlp.experts.{e}.down_proj.weight"].T)
    with torch.no_grad():
        for name in ("q_proj", "kv_a_proj_with_mqa"):
            for layer in range(3):
                getattr(model.model.layers[layer].self_attn, name).weight.copy_(
                    hub[f"model.layers.{layer}.self_attn.{name}.weight"])
    assert not torch.allclose(logits(model), logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path)),
                              rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("variant", ["deepseek_v3-sharded", "qwen3_moe"])
def test_a_shard_reads_its_own_box(tmp_path, variant):
    """What an FSDP2 rank reads (uneven rows of each tensor: its experts, its RoPE rows) is those rows
    of the whole tensor."""
    write_hub(tmp_path, variant)
    model = ours_from(tmp_path)
    weights = HFWeights.open(tmp_path)
    reader = HubReader({name: info.file for name, info in weights.tensors.items()})
    tensors = model_tensors(model)
    for name, source in sources(mapping_for(model.cfg.family), model.cfg, {n: tuple(t.shape) for n, t in tensors.items()}).items():
        rows = tensors[name].shape[0]
        for start, stop in ((0, rows // 3 + 1), (rows // 3 + 1, rows)):
            box = (slice(start, stop), *(slice(0, n) for n in tensors[name].shape[1:]))
            assert torch.equal(source.read(reader, box), tensors[name][start:stop]), name
        if tensors[name].dim() == 3:   # a box inside the other dims too: the up half's middle
            box = (slice(1, 3), slice(2, 7), slice(tensors[name].shape[2] - 5, tensors[name].shape[2] - 1))
            assert torch.equal(source.read(reader, box), tensors[name][box]), name


def test_v3_multi_token_prediction_layers_are_not_loaded(tmp_path):
    """DeepSeek-V3's checkpoints carry its multi-token prediction module as the layer after the last:
    a run without model.mtp_depth does not build it and skips it, as transformers does; any other stray
    tensor is refused."""
    hub = write_hub(tmp_path, "deepseek_v3-sharded")
    extra = {"model.layers.3.eh_proj.weight": torch.zeros(32, 64), "model.layers.3.enorm.weight": torch.ones(32)}
    save_file(extra, tmp_path / "mtp.safetensors")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(extra, "mtp.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    torch.testing.assert_close(logits(ours_from(tmp_path)), logits(hub), rtol=1e-5, atol=1e-6)
    index["weight_map"]["model.norm.bias"] = "mtp.safetensors"
    save_file({**extra, "model.norm.bias": torch.zeros(32)}, tmp_path / "mtp.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InitError, match=r"1 tensor unexpected \(model\.norm\.bias\)"):
        ours_from(tmp_path)


def test_v3_multi_token_prediction_out_and_back(tmp_path):
    """With model.mtp_depth 1 a transformers checkpoint (which saves no prediction layer) starts the layer
    fresh; the export writes it as DeepSeek-V3's checkpoint does (model.layers.3: enorm, hnorm, eh_proj, the
    decoder layer, shared_head.norm, and copies of the embedding and the head), transformers still loads it
    to the same logits, and Anvil reads it back to the same tensors, or skips it at depth 0."""
    from trainer.export import export_hf

    hub_model = write_hub(tmp_path / "hf", "deepseek_v3-sharded")
    cfg, model = start_from(tmp_path / "hf", f"data.path={tmp_path / 'none'}", "model.mtp_depth=1")
    torch.testing.assert_close(logits(model), logits(hub_model), rtol=1e-5, atol=1e-6)
    ck.save(tmp_path / "run" / "checkpoints", 1, model=model, optimizer=torch.optim.AdamW(model.parameters()),
            config=cfg.to_dict())
    out = export_hf(tmp_path / "run", tmp_path / "back", dtype="float32")
    back = hub_tensors(out)
    layer = {name[len("model.layers.3."):] for name in back if name.startswith("model.layers.3.")}
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
            "embed_tokens.weight", "self_attn.q_b_proj.weight", "mlp.gate.weight"} <= layer
    assert torch.equal(back["model.layers.3.shared_head.head.weight"], back["lm_head.weight"])
    assert torch.equal(back["model.layers.3.embed_tokens.weight"], back["model.embed_tokens.weight"])
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    torch.testing.assert_close(logits(transformers.AutoModelForCausalLM.from_pretrained(out)), logits(hub_model),
                               rtol=1e-5, atol=1e-6)
    _, again = start_from(out, f"data.path={tmp_path / 'none'}", "model.mtp_depth=1")
    ours = dict(model.named_parameters())
    assert all(torch.equal(p, ours[name]) for name, p in again.named_parameters()), "not the same tensors"
    _, without = start_from(out, f"data.path={tmp_path / 'none'}")
    assert len(without.model.layers) == 3
    torch.testing.assert_close(logits(without), logits(hub_model), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- Anvil -> transformers

@pytest.mark.parametrize("variant", ["deepseek_v2-grouped-yarn", "deepseek_v3-sharded", "qwen3_moe-tied-yarn"])
def test_export_round_trip(tmp_path, variant):
    """train.export of a model loaded from transformers: the same Hub tensors under the same names
    (per-expert keys, RoPE rows interleaved again, V3's bias), transformers loads it with the same
    logits, and Anvil reads it back to the same tensors."""
    from trainer.export import export_hf

    hub_model = write_hub(tmp_path / "hf", variant)
    cfg, model = start_from(tmp_path / "hf", f"data.path={tmp_path / 'none'}")
    ck.save(tmp_path / "run" / "checkpoints", 1, model=model, optimizer=torch.optim.AdamW(model.parameters()),
            config=cfg.to_dict())
    out = export_hf(tmp_path / "run", tmp_path / "back", dtype="float32")
    theirs, back = hub_tensors(tmp_path / "hf"), hub_tensors(out)
    assert back.keys() == theirs.keys()
    assert all(torch.equal(back[name], theirs[name]) for name in theirs)
    exported = from_hf(json.loads((out / "config.json").read_text()), "export")
    original = from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()), "hf")
    assert {key: exported[key] for key in original} == original
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(hub_model)
    torch.testing.assert_close(logits(reloaded), logits(hub_model), rtol=0, atol=0)
    again, before = model_tensors(ours_from(out)), model_tensors(model)
    assert again.keys() == before.keys() and all(torch.equal(again[n], before[n]) for n in before)
    if variant.startswith("deepseek_v3"):   # bf16 weights, the balancing bias kept fp32
        half = hub_tensors(export_hf(tmp_path / "run", tmp_path / "bf16", dtype="bfloat16"))
        assert half["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
        assert half["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("change, says", [
    ({"family": "qwen3_moe", "moe.n_shared_experts": 1},
     "Qwen3MoeForCausalLM cannot express model.moe.n_shared_experts 1 (it has 0)"),
    ({"family": "qwen3_moe", "moe.route_scale": 2.5}, "model.moe.route_scale 2.5 (it has 1.0)"),
    ({"family": "deepseek_v2", "moe.score_func": "sigmoid"}, "model.moe.score_func 'sigmoid' (it has 'softmax')"),
    ({"family": "deepseek_v2", "moe.bias_update_speed": 0.001}, "model.moe.bias_update_speed 0.001 (it has 0.0)"),
    ({"family": "deepseek_v3", "moe.score_func": "softmax"}, "model.moe.score_func 'softmax' (it has 'sigmoid')"),
])
def test_export_refuses_what_transformers_cannot_hold(change, says):
    cfg = config_mod.load(REPO / "configs" / "deepseek_v2_debug.yaml",
                          [f"model.{key}={json.dumps(value)}" for key, value in change.items()]
                          + (["model.mla=null"] if change["family"] == "qwen3_moe" else []))
    with pytest.raises(InexpressibleModel, match=says.replace("(", r"\(").replace(")", r"\)")):
        to_hf(cfg.model)


# --------------------------------------------------------------------------- config.json

@pytest.mark.parametrize("config", ["deepseek_v2_debug", "deepseek_v2_lite", "deepseek_v2", "deepseek_v3",
                                    "qwen3_30b_a3b"])
def test_config_json_both_ways(config):
    """from_hf(to_hf(m)) gives m's fields back, and transformers' config class takes to_hf(m)."""
    m = config_mod.load(REPO / "configs" / f"{config}.yaml").model
    written = to_hf(m)
    fields = from_hf(written, "config.json")
    assert {key: ours_value(m, key) for key in fields} == fields
    assert fields["family"] == m.family and fields["moe.n_routed_experts"] == m.moe.n_routed_experts
    hf = transformers.AutoConfig.for_model(written["model_type"], **{
        k: v for k, v in written.items() if k not in ("architectures", "model_type")})
    assert hf.num_hidden_layers == m.n_layers and hf.moe_intermediate_size == m.moe.ffn_dim


# The published checkpoints' config.json (deepseek-ai/DeepSeek-V2-Lite, deepseek-ai/DeepSeek-V3,
# Qwen/Qwen3-30B-A3B), the keys that matter: the configs Anvil ships claim their shapes.
PUBLISHED = {
    "deepseek_v2_lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "attention_bias": False,
        "aux_loss_alpha": 0.001, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
        "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
        "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "v_head_dim": 128,
        "vocab_size": 102400},
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
        "aux_loss_alpha": 0.001, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
        "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128,
        "vocab_size": 129280},
    "qwen3_30b_a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
        "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
        "max_window_layers": 48, "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
        "use_sliding_window": False, "vocab_size": 151936},
}


@pytest.mark.parametrize("config", PUBLISHED)
def test_shipped_configs_have_the_published_shapes(tmp_path, config):
    """Each shipped config, started from its published config.json, agrees with it key for key
    (load_config checks every shape key the config gives)."""
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED[config]))
    cfg = load_config(REPO / "configs" / f"{config}.yaml", [f"checkpoint.init_from={tmp_path}"])
    assert cfg.model == config_mod.load(REPO / "configs" / f"{config}.yaml").model
    # With no config file, the model is config.json's alone.
    alone = load_config(None, [f"checkpoint.init_from={tmp_path}", "data.seq_len=64"]).model
    shipped = cfg.model
    assert (alone.family, alone.mla, alone.rope_scaling, alone.head_dim) == \
        (shipped.family, shipped.mla, shipped.rope_scaling, shipped.head_dim)
    assert {k: v for k, v in vars(alone.moe).items() if k not in ("aux_loss_alpha", "bias_update_speed")} == \
        {k: v for k, v in vars(shipped.moe).items() if k not in ("aux_loss_alpha", "bias_update_speed")}


@pytest.mark.parametrize("change, says", [
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]},
     "model_type 'mixtral', architectures ['MixtralForCausalLM']: Anvil starts from Llama, DeepSeek-V2, "
     "DeepSeek-V3 and Qwen3-MoE checkpoints only"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}},
     "quantization_config 'fp8': Anvil starts from unquantized weights"),
    ({"rope_interleave": False}, "rope_interleave False: Anvil's DeepSeek-V3 has rope_interleave True only"),
    ({"topk_method": "greedy"}, "topk_method 'greedy': Anvil's DeepSeek-V3 has topk_method 'noaux_tc' only"),
    ({"moe_layer_freq": 2}, "moe_layer_freq 2: Anvil's DeepSeek-V3 has moe_layer_freq 1 only"),
    ({"n_routed_experts": 0}, "n_routed_experts: expected a positive integer, got 0"),
    ({"q_lora_rank": "1536"}, "q_lora_rank: expected a positive integer or null, got '1536'"),
    ({"rope_scaling": {"type": "yarn", "factor": 40, "attention_factor": 2.0}},
     "rope_scaling.attention_factor 2.0: Anvil derives it from factor, mscale and mscale_all_dim"),
])
def test_what_anvil_cannot_compute_is_refused(change, says):
    raw = {**PUBLISHED["deepseek_v3"], **change}
    raw.pop("rope_parameters", None)
    with pytest.raises(InitError, match=says.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        from_hf(raw, "config.json")


@pytest.mark.parametrize("layers, step", [([1], 1), ([0, 2], 1), ([], 2)])
def test_qwen3_layouts_anvil_cannot_express_are_refused(layers, step):
    raw = {**PUBLISHED["qwen3_30b_a3b"], "mlp_only_layers": layers, "decoder_sparse_step": step}
    with pytest.raises(InitError, match=rf"mlp_only_layers \[.*\] with decoder_sparse_step {step}: Anvil's "
                                        r"Qwen3-MoE has experts in every layer from model.moe.first_k_dense on"):
        from_hf(raw, "config.json")
    assert from_hf({**raw, "mlp_only_layers": [1, 0], "decoder_sparse_step": 1}, "c")["moe.first_k_dense"] == 2


def test_v2_topk_method_is_its_groups():
    raw = {**PUBLISHED["deepseek_v2_lite"], "n_group": 8, "topk_group": 3}
    assert (from_hf(raw, "c")["moe.n_group"], from_hf(raw, "c")["moe.topk_group"]) == (1, 1)   # greedy: unused
    grouped = from_hf({**raw, "topk_method": "group_limited_greedy"}, "c")
    assert (grouped["moe.n_group"], grouped["moe.topk_group"]) == (8, 3)
    with pytest.raises(InitError, match="topk_method 'noaux_tc': Anvil's DeepSeek-V2 routes by 'greedy' or"):
        from_hf({**raw, "topk_method": "noaux_tc"}, "c")


# --------------------------------------------------------------------------- one line, exit 2

def test_another_shape_or_family_than_the_config_is_one_line(tmp_path):
    """A config that asks for another MoE shape than the checkpoint: each key, where it came from and
    config.json's value; a family mismatch says both families; a checkpoint whose tensors do not fit
    its own config.json names the tensors."""
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED["deepseek_v2_lite"]))
    lite = REPO / "configs" / "deepseek_v2_lite.yaml"
    with pytest.raises(InitError) as err:
        load_config(lite, [f"checkpoint.init_from={tmp_path}", "model.moe.n_routed_experts=16", "model.moe.top_k=4",
                           "model.mla.kv_lora_rank=256", "model.moe.aux_loss_alpha=0.01"])
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'config.json'}: the config differs")
    assert "model.moe.n_routed_experts 16 (--set model.moe.n_routed_experts=16) vs n_routed_experts 64" in message
    assert "model.moe.top_k 4 (--set model.moe.top_k=4) vs num_experts_per_tok 6" in message
    assert "model.mla.kv_lora_rank 256 (--set model.mla.kv_lora_rank=256) vs kv_lora_rank 512" in message
    assert "aux_loss_alpha" not in message and "ffn_dim" not in message   # the balance loss's weight is the config's
    with pytest.raises(InitError, match=r"model.family qwen3_moe \(.*qwen3_30b_a3b.yaml\) vs deepseek_v2 "
                                        r"\(DeepseekV2ForCausalLM in config.json\)"):
        load_config(REPO / "configs" / "qwen3_30b_a3b.yaml", [f"checkpoint.init_from={tmp_path}"])
    with pytest.raises(InitError, match=r"model.moe.bias_update_speed 0.001 \(--set .*\) vs 0.0 \(what "
                                        r"DeepseekV2ForCausalLM always has\)"):
        load_config(lite, [f"checkpoint.init_from={tmp_path}", "model.moe.bias_update_speed=0.001"])
    # config.json says 16 experts, the tensors hold 8
    write_hub(tmp_path / "hub", "qwen3_moe")
    raw = json.loads((tmp_path / "hub" / "config.json").read_text())
    (tmp_path / "hub" / "config.json").write_text(json.dumps({**raw, "num_local_experts": 16}))
    with pytest.raises(InitError, match=r"model.safetensors: 48 tensors missing \(model.layers.1.mlp.experts.8"
                                        r".down_proj.weight, .*\); 2 tensors of the wrong shape \(model.layers.1.mlp"
                                        r".gate.weight \[8, 32\] \(the model's is \[16, 32\]\)"):
        ours_from(tmp_path / "hub")


@pytest.mark.parametrize("kind", ["other-experts", "other-family", "other-architecture"])
def test_inv_pretrain_refuses_before_anything_starts(tmp_path, dataset, kind):
    hub = tmp_path / "hub"
    write_hub(hub, "deepseek_v2-lite")
    config, says = REPO / "configs" / "deepseek_v2_debug.yaml", "the config differs from the checkpoint"
    if kind == "other-family":
        config, says = REPO / "configs" / "qwen3_30b_a3b.yaml", "model.family qwen3_moe"
    elif kind == "other-architecture":
        raw = json.loads((hub / "config.json").read_text())
        (hub / "config.json").write_text(json.dumps({**raw, "architectures": ["MixtralForCausalLM"],
                                                     "model_type": "mixtral"}))
        says = "Anvil starts from Llama, DeepSeek-V2, DeepSeek-V3 and Qwen3-MoE checkpoints only"
    proc = inv(tmp_path, "train.pretrain", "--config", config, "--init-from", hub,
               "--set", f"data.path={dataset}", "--set", "data.seq_len=32", timeout=120)
    line = one_line_error(proc, says)
    if kind == "other-experts":   # the debug config's 4 layers, dim 128 and 8 experts of 96 vs the tiny 3 x 32
        assert "model.dim 128" in line and "model.moe.ffn_dim 96" in line and "model.n_layers 4" in line
    assert runs(tmp_path) == []


# --------------------------------------------------------------------------- end to end

@pytest.mark.slow
def test_inv_pretrain_deepseek_v2_debug_from_a_transformers_checkpoint(tmp_path, dataset):
    """inv train.pretrain --config configs/deepseek_v2_debug.yaml --init-from DIR: a checkpoint of that
    shape trains two steps, and the first loss it logs is transformers' loss on the same batch."""
    hub = tmp_path / "hub"
    debug = config_mod.load(REPO / "configs" / "deepseek_v2_debug.yaml").model
    a, e = debug.mla, debug.moe
    hub_model = write_hub(
        hub, "deepseek_v2-lite", vocab_size=debug.vocab_size, hidden_size=debug.dim, intermediate_size=debug.ffn_dim,
        num_hidden_layers=debug.n_layers, num_attention_heads=debug.n_heads, num_key_value_heads=debug.n_kv_heads,
        rms_norm_eps=debug.norm_eps, max_position_embeddings=debug.max_seq_len, initializer_range=0.02,
        kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim, n_routed_experts=e.n_routed_experts, n_shared_experts=e.n_shared_experts,
        num_experts_per_tok=e.top_k, moe_intermediate_size=e.ffn_dim, first_k_dense_replace=e.first_k_dense)
    sets = [f"data.path={dataset}", "data.seq_len=64", "data.batch_size=2", "train.steps=2", "train.log_interval=1",
            "train.val_interval=0", "train.val_batches=0", "schedule.warmup_steps=1", "logging.progress=false"]
    proc = inv(tmp_path, "train.pretrain", "--config", REPO / "configs" / "deepseek_v2_debug.yaml", "--init-from",
               hub, "--json", *[a for item in sets for a in ("--set", item)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["init_from"]["tensors"] == len(hub_tensors(hub)) and summary["steps"] == 2
    [run] = runs(tmp_path)
    used = config_mod.load(run / "configs" / "train.yaml")
    from trainer.distributed import DistInfo
    from trainer.train import make_loader
    x, y = next(make_loader(used, "train", DistInfo(0, 0, 1, torch.device("cpu"), None)))
    with torch.no_grad():
        expected = F.cross_entropy(hub_model(x).logits.flatten(0, 1), y.flatten(), ignore_index=-100).item()
    first = next(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line)["kind"] == "train")
    assert first["step"] == 1 and first["loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
def test_fsdp2_two_gloo_ranks_read_their_experts_and_rope_rows(tmp_path, dataset, ep):
    """Under FSDP2 (meta init) each rank reads its own rows: its experts of each stacked tensor (from
    several files), its permuted RoPE rows; with parallel.ep 2 its own 4 of the 8 experts. A step at
    lr 1e-30 cannot move an fp32 weight, so the checkpoint after it exports to exactly the Hub's
    tensors (V3's balancing bias, a buffer, too)."""
    import os
    import subprocess
    import sys

    from trainer.export import export_hf

    hub = tmp_path / "hub"
    write_hub(hub, "deepseek_v3-sharded", vocab_size=320)   # the byte tokenizer's 259 ids
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "-m", "trainer", "--run-dir", str(run), "--init-from", str(hub)]
    for item in [f"data.path={dataset}", "data.seq_len=32", "data.batch_size=2", "train.steps=1",
                 "train.log_interval=1", "train.val_batches=0", "parallel.strategy=fsdp", "parallel.meta_init=true",
                 "optim.lr=1e-30", "logging.progress=false", "logging.tensorboard=false", f"parallel.ep={ep}"]:
        argv += ["--set", item]
    proc = subprocess.run(argv, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "ANVIL_LOG_RANK": "0"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = hub_tensors(hub)
    back = hub_tensors(export_hf(run, tmp_path / "back", dtype="float32"))
    assert back.keys() == theirs.keys()
    # the bias moved by bias_update_speed (0: the tiny default) and nothing else moved
    assert all(torch.equal(back[name], theirs[name]) for name in theirs)
