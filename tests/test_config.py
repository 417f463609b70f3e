"""ModelArgs from the reference's JSON configs and from Hugging Face configs, and its errors."""
import dataclasses
import json
import math

import pytest
transformers = pytest.importorskip("transformers")  # a test-only package

from dsv3_jax.config import ConfigError, ModelArgs
from hf_models import V2_TINY, V3_TINY

REFERENCE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelArgs)}


@pytest.mark.parametrize("name", ["config_16B.json", "config_236B.json", "config_671B.json", "config_v3.1.json"])
def test_reference_json_round_trip(configs_dir, name):
    path = configs_dir / name
    raw = json.loads(path.read_text())
    args = ModelArgs.from_reference_json(path)
    for field, default in REFERENCE_DEFAULTS.items():
        assert getattr(args, field) == raw.get(field, default), field
    assert args.qk_head_dim == raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]
    assert args.n_moe_layers == raw["n_layers"] - raw["n_dense_layers"]
    assert ModelArgs.from_file(path) == args


def test_reference_softmax_scale_follows_max_seq_len(configs_dir):
    args = ModelArgs.from_reference_json(configs_dir / "config_16B.json")
    base = (128 + 64) ** -0.5
    assert args.yarn_enabled and math.isclose(args.softmax_scale, base * (0.1 * 0.707 * math.log(40) + 1) ** 2)
    short = args.replace(max_seq_len=4096)
    assert not short.yarn_enabled and math.isclose(short.softmax_scale, base)


def test_hf_v3_r1_config(fixtures_dir, configs_dir):
    hf = json.loads((fixtures_dir / "hf-configs" / "deepseek-v3-r1.config.json").read_text())
    args = ModelArgs.from_hf_config(hf)
    reference = ModelArgs.from_reference_json(configs_dir / "config_671B.json")
    for field in ("vocab_size", "dim", "inter_dim", "moe_inter_dim", "n_layers", "n_dense_layers", "n_heads",
                  "n_routed_experts", "n_shared_experts", "n_activated_experts", "n_expert_groups",
                  "n_limited_groups", "score_func", "route_scale", "q_lora_rank", "kv_lora_rank",
                  "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "dtype", "original_seq_len",
                  "rope_theta", "rope_factor", "beta_fast", "beta_slow", "mscale"):
        assert getattr(args, field) == getattr(reference, field), field
    assert args.gate_bias is True and args.normalize_topk and args.use_yarn and args.n_mtp_layers == 1
    assert args.rope_attention_factor == 1.0


def test_hf_kimi_config(fixtures_dir):
    args = ModelArgs.from_file(fixtures_dir / "hf-configs" / "kimi-k2.config.json")
    assert (args.n_routed_experts, args.n_heads, args.n_expert_groups, args.rope_theta) == (384, 64, 1, 50000.0)
    assert (args.beta_fast, args.beta_slow, args.rope_factor, args.route_scale) == (1.0, 1.0, 32.0, 2.827)


@pytest.mark.parametrize("family", ["v3", "v2"])
def test_saved_pretrained_configs(tmp_path, family):
    """What transformers' save_pretrained writes (rope_parameters, no scoring_func for V3, ...)."""
    if family == "v3":
        config, values = transformers.DeepseekV3Config(**V3_TINY), V3_TINY
    else:
        config, values = transformers.DeepseekV2Config(**V2_TINY), V2_TINY
    config.save_pretrained(tmp_path)
    args = ModelArgs.from_file(tmp_path / "config.json")
    assert (args.dim, args.n_heads, args.n_layers, args.n_dense_layers) == (
        values["hidden_size"], values["num_attention_heads"], values["num_hidden_layers"],
        values["first_k_dense_replace"])
    assert args.q_lora_rank == (values["q_lora_rank"] or 0)
    if family == "v3":
        assert args.score_func == "sigmoid" and args.gate_bias and args.normalize_topk
        assert (args.n_expert_groups, args.n_limited_groups) == (values["n_group"], values["topk_group"])
        assert args.use_yarn and args.rope_factor == values["rope_scaling"]["factor"]
        assert args.original_seq_len == values["rope_scaling"]["original_max_position_embeddings"]
    else:
        assert args.score_func == "softmax" and not args.gate_bias and not args.normalize_topk
        assert args.use_yarn is False and args.softmax_scale == args.qk_head_dim**-0.5


def _hf(**changes):
    base = json.loads(transformers.DeepseekV3Config(**V3_TINY).to_json_string())
    base.update(changes)
    return base


@pytest.mark.parametrize("values, field", [
    ({"dim": 64, "n_head": 4}, "n_head"),
    ({"n_heads": "16"}, "n_heads"),
    ({"n_heads": 4.0}, "n_heads"),
    ({"route_scale": "x"}, "route_scale"),
    ({"score_func": "relu"}, "score_func"),
    ({"dtype": "int4"}, "dtype"),
    ({"scale_fmt": "e5m2"}, "scale_fmt"),
    ({"n_routed_experts": 10, "n_expert_groups": 4}, "n_expert_groups"),
    ({"n_activated_experts": 80}, "n_activated_experts"),
    ({"n_dense_layers": 30}, "n_dense_layers"),
    ({"n_expert_groups": 2, "n_limited_groups": 3}, "n_limited_groups"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"dim": 0}, "dim"),
    ({"n_expert_groups": 32, "n_limited_groups": 2}, "n_limited_groups"),
])
def test_reference_errors_name_the_field(values, field):
    with pytest.raises(ConfigError) as err:
        ModelArgs.from_dict(values)
    message = str(err.value)
    assert field in message and "\n" not in message


@pytest.mark.parametrize("changes, field", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"some_new_knob": 1}, "some_new_knob"),
    ({"topk_method": "random"}, "topk_method"),
    ({"num_key_value_heads": 1}, "num_key_value_heads"),
    ({"hidden_size": "64"}, "'hidden_size' must be int"),
    ({"hidden_size": "big"}, "config key 'hidden_size' must be int, got str 'big'"),
    ({"num_attention_heads": "four"}, "config key 'num_attention_heads' must be int, got str 'four'"),
    ({"rope_theta": "big"}, "'rope_theta' must be a number"),
    ({"n_group": 0}, "'n_group' must be positive"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}, "weight_block_size"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_scaling.type"),
])
def test_hf_errors_name_the_field(changes, field):
    with pytest.raises(ConfigError) as err:
        ModelArgs.from_hf_config(_hf(**changes))
    assert field in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("missing", [("num_experts_per_tok",), ("routed_scaling_factor",), ("hidden_size",),
                                     ("n_group", "q_lora_rank", "v_head_dim")])
def test_hf_config_without_a_shape_key_names_it(missing):
    """No default fills a key that fixes the model's shape (transformers' and the reference's differ)."""
    config = {k: v for k, v in _hf().items() if k not in missing}
    with pytest.raises(ConfigError) as err:
        ModelArgs.from_hf_config(config)
    message = str(err.value)
    assert message.startswith("the Hugging Face config lacks ") and "\n" not in message
    assert all(repr(key) in message for key in missing), message


def test_expert_groups_are_optional_with_plain_greedy_routing():
    v2 = {k: v for k, v in json.loads(transformers.DeepseekV2Config(**V2_TINY).to_json_string()).items()
          if k not in ("n_group", "topk_group")}
    args = ModelArgs.from_hf_config(v2)
    assert (args.n_expert_groups, args.n_limited_groups) == (1, 1)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        ModelArgs.from_file(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelArgs.from_file(bad)
