"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention in every layer; a dense SwiGLU MLP in the
first model.moe.first_k_dense layers and DeepSeekMoE (shared plus routed experts) in the others.

V2 scores experts with a softmax and balances them with the sequence-level auxiliary loss; V3 with
a sigmoid, group-limited routing and the auxiliary-loss-free bias. Both are the same code here: the
difference is model.moe's keys (configs/deepseek_v2*.yaml, configs/deepseek_v3.yaml).
Names are transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM's; HF_MAPPINGS is their
Hugging Face mapping (the machinery is trainer/hf), RoPE rows permuted (LatentAttention's docstring).
"""
from __future__ import annotations

from trainer.config import ModelConfig
from trainer.hf.errors import InitError
from trainer.hf.mapping import COMMON_FIXED, OMITTED, HFFamily, Key, RopeRows, Source, stacked_experts
from trainer.models.attention import LatentAttention
from trainer.models.blocks import MLP, DecoderLayer
from trainer.models.moe import MoE


def layer(cfg: ModelConfig, layer_id: int) -> DecoderLayer:
    mlp = MoE(cfg) if cfg.moe_layer(layer_id) else MLP(cfg.dim, cfg.ffn_dim)
    return DecoderLayer(cfg, layer_id, LatentAttention(cfg), mlp)


# --------------------------------------------------------------------------- Hugging Face

def rope_rows(name: str, shape: tuple[int, ...], m: ModelConfig) -> Source | None:
    """The projections that make RoPE parts: each query head's last qk_rope_head_dim outputs, and
    kv_a_proj_with_mqa's last qk_rope_head_dim (the key's, shared by the heads)."""
    a = m.mla
    if name.endswith((".self_attn.q_proj.weight", ".self_attn.q_b_proj.weight")):
        head = a.qk_nope_head_dim + a.qk_rope_head_dim
        starts = tuple(h * head + a.qk_nope_head_dim for h in range(m.n_heads))
    elif name.endswith(".self_attn.kv_a_proj_with_mqa.weight"):
        starts = (a.kv_lora_rank,)
    else:
        return None
    return RopeRows(name, shape, starts, a.qk_rope_head_dim)


def _read_v2_routing(raw: dict, fields: dict, source: str) -> None:
    """V2's topk_method: greedy (n_group and topk_group unused), or group_limited_greedy."""
    method = raw.get("topk_method", "greedy")
    if method == "greedy":
        fields["moe.n_group"] = fields["moe.topk_group"] = 1
    elif method == "group_limited_greedy":
        for key in ("n_group", "topk_group"):
            value = raw.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InitError(f"{source}: {key}: expected a positive integer with topk_method "
                                f"group_limited_greedy, got {value!r}")
            fields[f"moe.{key}"] = value
    else:
        raise InitError(f"{source}: topk_method {method!r}: Anvil's DeepSeek-V2 routes by 'greedy' or "
                        f"'group_limited_greedy'")


def _write_v2_routing(m: ModelConfig, config: dict) -> None:
    config.update(topk_method="group_limited_greedy" if m.moe.n_group > 1 else "greedy",
                  n_group=m.moe.n_group, topk_group=m.moe.topk_group)


MLA_KEYS = (Key("mla.q_lora_rank", "q_lora_rank", null=0), Key("mla.kv_lora_rank", "kv_lora_rank"),
            Key("mla.qk_nope_head_dim", "qk_nope_head_dim"), Key("mla.qk_rope_head_dim", "qk_rope_head_dim"),
            Key("mla.v_head_dim", "v_head_dim"))
MOE_KEYS = (Key("moe.n_routed_experts", "n_routed_experts"),
            Key("moe.n_shared_experts", "n_shared_experts", zero_ok=True), Key("moe.top_k", "num_experts_per_tok"), Key("moe.ffn_dim", "moe_intermediate_size"),
            Key("moe.first_k_dense", "first_k_dense_replace", zero_ok=True),
            Key("moe.route_scale", "routed_scaling_factor", float), Key("moe.norm_topk_prob", "norm_topk_prob", bool),
            Key("moe.aux_loss_alpha", "aux_loss_alpha", float, OMITTED, zero_ok=True))
# DeepSeek's config.json: experts in every layer from first_k_dense_replace on (moe_layer_freq 1)
DEEPSEEK_FIXED = {**COMMON_FIXED, "moe_layer_freq": 1}

HF_MAPPINGS = {
    "deepseek_v2": HFFamily(
        "deepseek_v2", "DeepSeek-V2", "DeepseekV2ForCausalLM", "deepseek_v2", keys=(*MLA_KEYS, *MOE_KEYS),
        fixed={**DEEPSEEK_FIXED, "mlp_bias": False, "scoring_func": "softmax"},
        # no balancing bias in V2's class: a config that moves one (bias_update_speed) is not a V2
        implied={"moe.score_func": "softmax", "moe.bias_update_speed": 0.0}, rope_types=("yarn",),
        read=_read_v2_routing, write=_write_v2_routing,
        derived={"moe.n_group": "topk_method, n_group", "moe.topk_group": "topk_method, topk_group"},
        weight_rules=(rope_rows, stacked_experts)),
    "deepseek_v3": HFFamily(
        "deepseek_v3", "DeepSeek-V3", "DeepseekV3ForCausalLM", "deepseek_v3",
        keys=(*MLA_KEYS, *MOE_KEYS, Key("moe.n_group", "n_group"), Key("moe.topk_group", "topk_group")),
        # rope_interleave false would be half-split weights already: not the Hub's layout, refused
        fixed={**DEEPSEEK_FIXED, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_interleave": True},
        implied={"moe.score_func": "sigmoid"}, rope_types=("yarn",),
        weight_rules=(rope_rows, stacked_experts)),
}
