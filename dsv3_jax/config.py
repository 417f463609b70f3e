"""Model configuration: the reference's `ModelArgs`, read from a reference JSON or a Hugging Face
`config.json`, validated so that a bad config fails with one line naming the field."""
from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path
from typing import Any

from pallas_kernels import FP8_BLOCK


class ConfigError(ValueError):
    """A configuration that cannot describe a DeepSeek-V2/V3 model; the message names the field."""


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """Hyper-parameters of a DeepSeek-V2/V3 model, with the reference's names and defaults.

    The fields after `mscale` are facts a Hugging Face checkpoint states and the reference
    hard-codes or infers; their defaults reproduce the reference.
    """

    max_batch_size: int = 8
    max_seq_len: int = 4096 * 4
    dtype: str = "bf16"  # weight storage in the checkpoint: "bf16" or "fp8" (block-scaled e4m3)
    scale_fmt: str | None = None  # activation-scale format for the fp8 GEMM: None or "ue8m0"
    vocab_size: int = 102400
    dim: int = 2048
    inter_dim: int = 10944
    moe_inter_dim: int = 1408
    n_layers: int = 27
    n_dense_layers: int = 1
    n_heads: int = 16
    # moe
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    n_activated_experts: int = 6
    n_expert_groups: int = 1
    n_limited_groups: int = 1
    score_func: str = "softmax"
    route_scale: float = 1.0
    # mla
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # yarn
    original_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_factor: float = 40
    beta_fast: float = 32
    beta_slow: float = 1
    mscale: float = 1.0
    # beyond the reference's JSON
    norm_eps: float = 1e-6  # block and final RMSNorm epsilon (the latent norms always use 1e-6)
    norm_topk_prob: bool | None = None  # None: the reference's rule, normalise iff score_func == "sigmoid"
    gate_bias: bool | None = None  # score-correction bias; None: decided by the checkpoint
    use_yarn: bool | None = None  # None: the reference's rule, max_seq_len > original_seq_len
    rope_attention_factor: float = 1.0  # Hugging Face scales cos/sin by this (1.0 for DeepSeek's configs)
    rope_truncate: bool = True  # floor/ceil of the YaRN correction range
    rope_interleave: bool = True  # rotary pairs are adjacent elements (the DeepSeek weight layout)
    n_mtp_layers: int = 0  # multi-token-prediction modules stored after the last layer (not run)

    # ---------------------------------------------------------------- derived facts
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    @property
    def yarn_enabled(self) -> bool:
        return self.use_yarn if self.use_yarn is not None else self.max_seq_len > self.original_seq_len

    @property
    def normalize_topk(self) -> bool:
        return self.norm_topk_prob if self.norm_topk_prob is not None else self.score_func == "sigmoid"

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.yarn_enabled and self.rope_factor > 1:
            m = 0.1 * self.mscale * math.log(self.rope_factor) + 1.0
            scale *= m * m
        return scale

    @property
    def quantized(self) -> bool:
        return self.dtype == "fp8"

    def __post_init__(self):
        _check_types(self)
        _check_consistency(self)

    # ---------------------------------------------------------------- constructors
    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ModelArgs":
        """Build from the reference's JSON keys (plus this port's extra fields); unknown keys are errors."""
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in known:
                raise ConfigError(f"unknown config key {key!r} (not a ModelArgs field)")
        return cls(**values)

    @classmethod
    def from_reference_json(cls, path: str | Path) -> "ModelArgs":
        """Read one of the reference's `configs/*.json` files."""
        return cls.from_dict(_read_json(path))

    @classmethod
    def from_hf_config(cls, config: dict[str, Any] | str | Path) -> "ModelArgs":
        """Translate a Hugging Face DeepseekV2/V3 `config.json` (a dict or a path to the file)."""
        if not isinstance(config, dict):
            config = _read_json(config)
        try:
            return cls.from_dict(_translate_hf(config))
        except ConfigError as err:
            raise _in_hf_terms(err) from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelArgs":
        """Read either format, telling them apart by their keys (`hidden_size` marks Hugging Face)."""
        values = _read_json(path)
        if "hidden_size" in values or "model_type" in values:
            return cls.from_hf_config(values)
        return cls.from_dict(values)

    def replace(self, **changes) -> "ModelArgs":
        return dataclasses.replace(self, **changes)


def _read_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"config file {path} is not valid JSON: {err}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} does not hold a JSON object")
    return values


# ------------------------------------------------------------------------ validation
_CHOICES = {"dtype": ("bf16", "fp8"), "score_func": ("softmax", "sigmoid"), "scale_fmt": (None, "ue8m0")}


def _check_types(args: ModelArgs) -> None:
    for field in dataclasses.fields(args):
        value = getattr(args, field.name)
        kind = field.type
        optional = "None" in kind
        if value is None:
            if optional:
                continue
            raise ConfigError(f"config field {field.name!r} must not be null")
        if kind.startswith("int"):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind.startswith("float"):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif kind.startswith("bool"):
            ok = isinstance(value, bool)
        else:
            ok = isinstance(value, str)
        if not ok:
            want = kind.split(" |")[0]
            raise ConfigError(f"config field {field.name!r} must be {want}, got {type(value).__name__} {value!r}")
    for name, allowed in _CHOICES.items():
        if getattr(args, name) not in allowed:
            raise ConfigError(f"config field {name!r} must be one of {allowed}, got {getattr(args, name)!r}")


def _check_consistency(a: ModelArgs) -> None:
    positive = ("max_batch_size", "max_seq_len", "vocab_size", "dim", "inter_dim", "n_layers", "n_heads",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "original_seq_len",
                "n_expert_groups", "n_limited_groups")
    for name in positive:
        if getattr(a, name) <= 0:
            raise ConfigError(f"config field {name!r} must be positive, got {getattr(a, name)}")
    for name in ("n_dense_layers", "q_lora_rank", "n_shared_experts", "n_mtp_layers"):
        if getattr(a, name) < 0:
            raise ConfigError(f"config field {name!r} must not be negative, got {getattr(a, name)}")
    if a.rope_theta <= 0 or a.rope_factor <= 0 or a.norm_eps <= 0:
        raise ConfigError("config fields 'rope_theta', 'rope_factor' and 'norm_eps' must be positive")
    if a.qk_rope_head_dim % 2:
        raise ConfigError(f"config field 'qk_rope_head_dim' must be even, got {a.qk_rope_head_dim}")
    if a.n_dense_layers > a.n_layers:
        raise ConfigError(f"config field 'n_dense_layers' ({a.n_dense_layers}) exceeds 'n_layers' ({a.n_layers})")
    if a.n_moe_layers > 0:
        if a.moe_inter_dim <= 0 or a.n_routed_experts <= 0 or a.n_activated_experts <= 0:
            raise ConfigError("config fields 'moe_inter_dim', 'n_routed_experts' and 'n_activated_experts' "
                              "must be positive when there are MoE layers")
        if a.n_activated_experts > a.n_routed_experts:
            raise ConfigError(f"config field 'n_activated_experts' ({a.n_activated_experts}) exceeds "
                              f"'n_routed_experts' ({a.n_routed_experts})")
        if a.n_routed_experts % a.n_expert_groups:
            raise ConfigError(f"config field 'n_expert_groups' ({a.n_expert_groups}) does not divide "
                              f"'n_routed_experts' ({a.n_routed_experts})")
        if a.n_limited_groups > a.n_expert_groups:
            raise ConfigError(f"config field 'n_limited_groups' ({a.n_limited_groups}) exceeds "
                              f"'n_expert_groups' ({a.n_expert_groups})")
        per_group = a.n_routed_experts // a.n_expert_groups
        if a.n_expert_groups > 1 and a.n_limited_groups * per_group < a.n_activated_experts:
            raise ConfigError(f"config field 'n_limited_groups' ({a.n_limited_groups}) leaves fewer experts "
                              f"than 'n_activated_experts' ({a.n_activated_experts})")
        if a.gate_bias and a.n_expert_groups > 1 and per_group < 2:
            raise ConfigError("config field 'n_expert_groups' leaves fewer than 2 experts per group, "
                              "which the biased group score (sum of the top 2) needs")


# ------------------------------------------------------------------------ Hugging Face
_HF_RENAMES = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "intermediate_size": "inter_dim",
    "moe_intermediate_size": "moe_inter_dim",
    "num_hidden_layers": "n_layers",
    "first_k_dense_replace": "n_dense_layers",
    "num_attention_heads": "n_heads",
    "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts",
    "num_experts_per_tok": "n_activated_experts",
    "n_group": "n_expert_groups",
    "topk_group": "n_limited_groups",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "rms_norm_eps": "norm_eps",
    "norm_topk_prob": "norm_topk_prob",
    "num_nextn_predict_layers": "n_mtp_layers",
    "rope_interleave": "rope_interleave",
}
# Keys that carry nothing the forward pass needs (training knobs, generic PretrainedConfig fields).
_HF_IGNORED = {
    "architectures", "auto_map", "aux_loss_alpha", "seq_aux", "ep_size", "initializer_range",
    "transformers_version", "torch_dtype", "dtype", "use_cache", "bos_token_id", "eos_token_id",
    "pad_token_id", "attention_dropout", "pretraining_tp", "max_position_embeddings", "head_dim",
    "qk_head_dim", "model_type", "num_key_value_heads", "hidden_act", "moe_layer_freq",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "topk_method", "rope_scaling", "rope_parameters",
    "rope_theta", "quantization_config", "output_attentions", "output_hidden_states", "return_dict",
    "id2label", "label2id", "problem_type", "tokenizer_class", "chunk_size_feed_forward", "is_encoder_decoder",
    "add_cross_attention", "tf_legacy_loss", "use_bfloat16", "torchscript", "sep_token_id",
    "decoder_start_token_id", "task_specific_params", "finetuning_task", "prefix", "pruned_heads",
    "cross_attention_hidden_size", "is_decoder", "tie_encoder_decoder", "use_flash_attn",
}


# Keys that fix the model's shape: a config without one is an error (transformers would fill in its
# own class defaults, this port its reference's, and neither is the checkpoint's model). null is a
# value (q_lora_rank: none; n_routed_experts: a dense model). Expert groups count with group routing.
_HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "first_k_dense_replace", "num_attention_heads", "n_routed_experts", "n_shared_experts",
                "num_experts_per_tok", "routed_scaling_factor", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim")
_HF_REQUIRED_WITH_GROUPS = ("n_group", "topk_group")

# The Hugging Face key behind each ModelArgs field, so that an error names what the user wrote.
_HF_KEY_OF = {field: key for key, field in _HF_RENAMES.items()} | {
    "rope_factor": "rope_scaling.factor", "original_seq_len": "rope_scaling.original_max_position_embeddings",
    "beta_fast": "rope_scaling.beta_fast", "beta_slow": "rope_scaling.beta_slow",
    "mscale": "rope_scaling.mscale_all_dim",
}


def _in_hf_terms(err: ConfigError) -> ConfigError:
    """`err` (about ModelArgs fields) reworded for a Hugging Face config: 'dim' becomes 'hidden_size'."""
    message = str(err)
    for field, key in _HF_KEY_OF.items():
        message = message.replace(repr(field), repr(key))
    return ConfigError(message.replace("config fields ", "config keys ").replace("config field ", "config key "))


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config key {key!r} must be a number, got {type(value).__name__} {value!r}")
    return value


def _check_required_keys(hf: dict[str, Any], topk_method: str) -> None:
    """Every key of _HF_REQUIRED in `hf` (and the expert groups, unless routing is plain greedy)."""
    required = _HF_REQUIRED + (_HF_REQUIRED_WITH_GROUPS if topk_method != "greedy" else ())
    missing = [key for key in required if key not in hf]
    if missing:
        raise ConfigError(f"the Hugging Face config lacks {', '.join(map(repr, missing))}: "
                          "the model's shape needs every one")


def _translate_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Map a Hugging Face DeepSeek config onto ModelArgs fields, rejecting what the port cannot run."""
    model_type = hf.get("model_type", "deepseek_v3")
    if model_type not in ("deepseek_v3", "deepseek_v2", "kimi_k2"):
        raise ConfigError(f"config key 'model_type' must be deepseek_v2/deepseek_v3, got {model_type!r}")
    for key in hf:
        if key not in _HF_RENAMES and key not in _HF_IGNORED and not key.startswith("_"):
            raise ConfigError(f"unknown config key {key!r} in the Hugging Face config")
    for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                          ("tie_word_embeddings", False), ("moe_layer_freq", 1)):
        if key in hf and hf[key] != expected:
            raise ConfigError(f"config key {key!r} = {hf[key]!r} is not supported (only {expected!r})")
    is_v3 = model_type != "deepseek_v2"
    topk_method = hf.get("topk_method", "noaux_tc" if is_v3 else "greedy")
    _check_required_keys(hf, topk_method)
    heads = hf["num_attention_heads"]  # (its type is checked with the other fields')
    if "num_key_value_heads" in hf and isinstance(heads, int) and hf["num_key_value_heads"] != heads:
        raise ConfigError("config key 'num_key_value_heads' must equal 'num_attention_heads' (MLA has no GQA)")

    out = {_HF_RENAMES[k]: v for k, v in hf.items() if k in _HF_RENAMES}
    for key in ("q_lora_rank", "n_expert_groups", "n_limited_groups", "n_shared_experts"):
        if key in out and out[key] is None:
            out[key] = 0 if key in ("q_lora_rank", "n_shared_experts") else 1
    if out.get("n_routed_experts") is None:
        out.pop("n_routed_experts", None)

    out.setdefault("score_func", "sigmoid" if is_v3 else "softmax")
    if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ConfigError(f"config key 'topk_method' = {topk_method!r} is not supported")
    out["gate_bias"] = topk_method == "noaux_tc"
    if topk_method == "greedy":  # Hugging Face ignores the groups in plain greedy routing
        out["n_expert_groups"], out["n_limited_groups"] = 1, 1
    if not is_v3:  # DeepseekV2's router never renormalises the top-k weights
        out["norm_topk_prob"] = False
    elif "norm_topk_prob" not in out:
        out["norm_topk_prob"] = True  # DeepseekV3Config's default

    out.update(_translate_rope(hf))
    out.update(_translate_quant(hf))
    return out


def _translate_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """The rotary-embedding fields (rope_theta, YaRN) of a Hugging Face config."""
    out: dict[str, Any] = {}
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError("config key 'rope_scaling' must be an object or null")
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    out["rope_theta"] = float(_number("rope_theta", theta))
    rope_type = rope.get("type", rope.get("rope_type", "default"))
    if rope_type == "yarn":
        factor = rope.get("factor")
        original = rope.get("original_max_position_embeddings")
        if original is None:
            raise ConfigError("config key 'rope_scaling.original_max_position_embeddings' is required for yarn")
        original = _number("rope_scaling.original_max_position_embeddings", original)
        if factor is None:
            factor = _number("max_position_embeddings", hf.get("max_position_embeddings", original)) / original
        factor = _number("rope_scaling.factor", factor)
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        for key, value in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim),
                           ("attention_factor", rope.get("attention_factor"))):
            if value is not None:
                _number(f"rope_scaling.{key}", value)
        attention_factor = rope.get("attention_factor")
        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor, 1.0)
        out.update(
            use_yarn=True, rope_factor=float(factor), original_seq_len=int(original),
            beta_fast=rope.get("beta_fast") or 32, beta_slow=rope.get("beta_slow") or 1,
            mscale=float(mscale_all_dim or 0.0), rope_attention_factor=float(attention_factor),
            rope_truncate=bool(rope.get("truncate", True)),
        )
    elif rope_type == "default":
        out["use_yarn"] = False
    else:
        raise ConfigError(f"config key 'rope_scaling.type' = {rope_type!r} is not supported (yarn or none)")
    return out


def _translate_quant(hf: dict[str, Any]) -> dict[str, Any]:
    """The weight-format fields of a Hugging Face config (block-wise fp8, or none)."""
    quant = hf.get("quantization_config")
    if quant and not isinstance(quant, dict):
        raise ConfigError("config key 'quantization_config' must be an object or null")
    if quant:
        if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
            raise ConfigError("config key 'quantization_config' must describe block-wise fp8 e4m3")
        if list(quant.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])) != [FP8_BLOCK, FP8_BLOCK]:
            raise ConfigError(f"config key 'quantization_config.weight_block_size' must be [{FP8_BLOCK}, {FP8_BLOCK}]")
        return {"dtype": "fp8", "scale_fmt": quant.get("scale_fmt")}
    return {}


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class PositionLimitWarning(UserWarning):
    """A max_seq_len above the positions a checkpoint was trained at (its config's
    max_position_embeddings, with no rope scaling): the window is cut to those positions."""


DEFAULT_MAX_SEQ_LEN = 4096


def trained_positions(config_path) -> int | None:
    """The positions a Hugging Face config says its model was trained at: max_position_embeddings when
    no rope scaling extends it (rope_scaling null or absent, rope_parameters of the default type);
    None for other configs (YaRN-extended, the reference's JSON)."""
    try:
        hf = json.loads(Path(config_path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(hf, dict) or "hidden_size" not in hf or "max_position_embeddings" not in hf:
        return None
    rope = hf.get("rope_parameters") or {}
    if hf.get("rope_scaling") or rope.get("rope_type", rope.get("type", "default")) != "default":
        return None
    limit = hf["max_position_embeddings"]
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def window_for(requested: int | None, limit: int | None) -> int:
    """max_seq_len for a request (None: the default) given a checkpoint's trained positions (None: no limit):
    the default is cut to the limit silently, a larger explicit request with a PositionLimitWarning."""
    if requested is None:
        return min(DEFAULT_MAX_SEQ_LEN, limit) if limit else DEFAULT_MAX_SEQ_LEN
    if limit and requested > limit:
        warnings.warn(f"max_seq_len={requested} exceeds the {limit} positions the checkpoint was trained at "
                      f"(max_position_embeddings, no rope scaling): using max_seq_len={limit}", PositionLimitWarning,
                      stacklevel=3)
        return limit
    return requested
