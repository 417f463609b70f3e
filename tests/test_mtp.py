"""Multi-token prediction: the MTP module against Hugging Face's block (float32 torch) and against an
independent float64 numpy statement of the MTP module's math (DeepSeek-V3 technical report §2.2) (both
loaded from an HF directory), the converters keeping the MTP layer (bit for bit), greedy speculative
decoding identical to plain decoding (1 and 4 devices, unequal prompts, budgets cut by max_seq_len,
chunked prefill), and the sampled distribution equal to the main model's."""
import functools
import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
torch = pytest.importorskip("torch")  # a test-only package
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

import dsv3_jax
from dsv3_jax.config import ModelArgs
from dsv3_jax.decode.generate import prefill_chunks
from dsv3_jax.decode.step import StepParts
from dsv3_jax.errors import CheckpointError
from dsv3_jax.model.rope import inverse_frequencies, rotary_angles
from dsv3_jax.options import StepContext
from dsv3_jax.sharding import make_mesh
from hf_models import V3_TINY, hf_model, save
from model_checks import assert_same_model
from mtp_models import (SAMPLING_ROWS, SAMPLING_SEQ, SPEC_PROMPT_LENGTHS, SPEC_SIZES, VOCAB, build_tiny_mtp,
                        three_token_distribution)


# ------------------------------------------------------------------ the module against HF, loaded from HF
@pytest.fixture(scope="module")
def hf_mtp_dir(tmp_path_factory):
    """An HF V3 directory with 4 layers and an MTP layer (layer 4: an HF decoder layer, plus random
    enorm, hnorm, eh_proj, shared_head.norm and the embedding/head copies)."""
    hf = hf_model("v3", seed=5, vocab_size=64, num_hidden_layers=5)
    directory = save(hf, tmp_path_factory.mktemp("hf_mtp"))
    config = json.loads((directory / "config.json").read_text())
    config.update(num_hidden_layers=4, num_nextn_predict_layers=1)
    (directory / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    dim = V3_TINY["hidden_size"]
    extra = {"model.layers.4.enorm.weight": 0.5 + rng.random(dim), "model.layers.4.hnorm.weight": 0.5 + rng.random(dim),
             "model.layers.4.shared_head.norm.weight": 0.5 + rng.random(dim),
             "model.layers.4.eh_proj.weight": rng.standard_normal((dim, 2 * dim)) / np.sqrt(2 * dim),
             "model.layers.4.embed_tokens.weight": hf.model.embed_tokens.weight.detach().numpy(),
             "model.layers.4.shared_head.head.weight": hf.lm_head.weight.detach().numpy()}
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in extra.items()}, str(directory / "mtp.safetensors"))
    index = directory / "model.safetensors.index.json"
    if index.exists():
        meta = json.loads(index.read_text())
        meta["weight_map"].update({k: "mtp.safetensors" for k in extra})
        index.write_text(json.dumps(meta))
    return hf, extra, directory


@pytest.fixture(scope="module")
def bare_dir(tmp_path_factory):
    """The same HF V3 directory without an MTP layer (its 4 layers)."""
    return save(hf_model("v3", seed=5, vocab_size=64), tmp_path_factory.mktemp("bare"))


def rms(x, w, eps=1e-6):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def hf_mtp_logits(hf, extra, tokens: np.ndarray) -> np.ndarray:
    """The MTP module in float32 torch with HF's modules: logits of t_{i+2} for i in [0, S-2]."""
    ids = torch.as_tensor(tokens, dtype=torch.long)
    t = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in extra.items()}
    with torch.no_grad():
        mtp_layer, hf.model.layers = hf.model.layers[4], hf.model.layers[:4]  # the main model: 4 layers
        try:
            hidden = hf.model(ids, use_cache=False).last_hidden_state  # after the final norm: what the head sees
        finally:
            hf.model.layers.append(mtp_layer)
        e = rms(hf.model.embed_tokens(ids[:, 1:]), t["model.layers.4.enorm.weight"])
        h = rms(hidden[:, :-1], t["model.layers.4.hnorm.weight"])
        x = torch.cat([e, h], -1) @ t["model.layers.4.eh_proj.weight"].T
        positions = torch.arange(1, ids.shape[1])[None]
        rotary = hf.model.rotary_emb(x, positions)
        seq = x.shape[1]
        mask = torch.full((seq, seq), float("-inf"), dtype=torch.float32).triu(1)[None, None]
        out = hf.model.layers[4](x, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
        y = out[0] if isinstance(out, tuple) else out
        return (rms(y, t["model.layers.4.shared_head.norm.weight"]) @ hf.lm_head.weight.T).numpy()


def our_mtp_logits(model, tokens: np.ndarray) -> np.ndarray:
    """The MTP module's logits through the cached inference path (prefill of the main model, then
    the module over positions 1..S-1)."""
    return np.asarray(mtp_logits_function(model.parts)(model.state, model.cache, jnp.asarray(tokens, jnp.int32)))


@functools.lru_cache(maxsize=8)
def mtp_logits_function(parts: StepParts):
    """`our_mtp_logits`' jitted (state, cache, tokens) -> logits for a model's parts, memoized on them as
    the library's step builders are: a model loaded again alike (a converted checkpoint) reuses its
    trace and compiled program."""
    args, options, layout = parts.args, parts.options, parts.layout
    inv_freq = inverse_frequencies(args)

    def ctx(positions, start=0):
        cos, sin = rotary_angles(positions, inv_freq, args.rope_attention_factor)
        return StepContext(positions, cos, sin, args.max_seq_len, options, args.scale_fmt, start, layout)

    def local(state, cache, tokens):
        m = nnx.merge(parts.graphdef, state)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32)[None], tokens.shape)
        hidden, cache = m.hidden(tokens, ctx(positions), cache)
        y, _ = m.mtp_hidden(tokens[:, 1:], hidden[:, :-1], ctx(positions[:, 1:], 1), cache)
        return m.logits(y, layout)

    return jax.jit(jax.shard_map(local, mesh=parts.mesh, in_specs=(parts.state_specs, parts.cache_specs, P()),
                                 out_specs=P(), check_vma=False))


def load_with_mtp(directory: Path, devices: int):
    return dsv3_jax.load(directory, compute_dtype="float32", max_batch_size=2, max_seq_len=64, mtp=True,
                         num_devices=devices)


@pytest.fixture(scope="module")
def hf_mtp_model(hf_mtp_dir):
    """devices -> the HF directory's model with its MTP module on that many devices, each loaded once
    for the module (the HF-statement and per-rank tests share the 4-device one and its programs)."""
    return functools.cache(functools.partial(load_with_mtp, hf_mtp_dir[2]))


@pytest.mark.parametrize("devices", [1, 4])
def test_mtp_logits_equal_hf_statement(hf_mtp_dir, hf_mtp_model, devices):
    hf, extra, _ = hf_mtp_dir
    model = hf_mtp_model(devices)
    tokens = np.random.default_rng(1).integers(0, 64, (2, 12))
    expected = hf_mtp_logits(hf, extra, tokens)
    got = our_mtp_logits(model, tokens)
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-4 * np.abs(expected).max())


def test_without_mtp_nothing_is_read_and_a_missing_layer_is_one_line(hf_mtp_dir, bare_dir):
    hf, _, directory = hf_mtp_dir
    plain = dsv3_jax.load(directory, compute_dtype="float32", max_batch_size=1, max_seq_len=64)
    assert not plain.has_mtp and "mtp" not in plain.state
    with pytest.raises(ValueError, match="mtp=True"):
        plain.generate([[1, 2]], 3, eos_id=-1, mtp=True)
    with pytest.raises(CheckpointError, match="no MTP layer"):
        dsv3_jax.load(bare_dir, compute_dtype="float32", max_batch_size=1, max_seq_len=64, mtp=True)


# ------------------------------------------------------------------ the module against a float64 numpy statement
def np_rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def yarn_m(factor, mscale):
    return 0.1 * mscale * np.log(factor) + 1.0


def rope_scaling(cfg: dict) -> dict:
    return cfg.get("rope_scaling") or cfg["rope_parameters"]  # transformers >= 5 writes the latter


def yarn_frequencies(cfg: dict) -> np.ndarray:
    """YaRN (DeepSeek's reference rotary embedding), float64."""
    rs = rope_scaling(cfg)
    d, theta = cfg["qk_rope_head_dim"], cfg.get("rope_theta", rs.get("rope_theta"))
    freqs = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    orig, factor = rs["original_max_position_embeddings"], rs["factor"]

    def corr_dim(n):
        return d * np.log(orig / (n * 2 * np.pi)) / (2 * np.log(theta))

    low, high = max(np.floor(corr_dim(rs["beta_fast"])), 0), min(np.ceil(corr_dim(rs["beta_slow"])), d - 1)
    high = high + 0.001 if low == high else high
    smooth = 1 - np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)
    return freqs / factor * (1 - smooth) + freqs * smooth


def np_rotate(x, angles, attention_factor):
    """Adjacent pairs (x[2i], x[2i+1]) as one complex number, times attention_factor * e^{i angle}."""
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * attention_factor * np.exp(1j * angles)
    return np.stack([z.real, z.imag], -1).reshape(x.shape)


def np_mlp(T, p, x):
    gate, up = x @ T[p + "gate_proj.weight"].T, x @ T[p + "up_proj.weight"].T
    return (gate / (1 + np.exp(-gate)) * up) @ T[p + "down_proj.weight"].T


def np_block(T, cfg, layer, x, positions):
    """One decoder block (MLA, naive form; dense MLP or MoE), float64, causal over x's positions."""
    from test_gate import reference_gate

    p = f"model.layers.{layer}."
    B, S, dim = x.shape
    H, nope, rope, vd = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    rs = rope_scaling(cfg)
    a = np_rms(x, T[p + "input_layernorm.weight"])
    q = np_rms(a @ T[p + "self_attn.q_a_proj.weight"].T, T[p + "self_attn.q_a_layernorm.weight"])
    q = (q @ T[p + "self_attn.q_b_proj.weight"].T).reshape(B, S, H, nope + rope)
    kv = a @ T[p + "self_attn.kv_a_proj_with_mqa.weight"].T
    c, k_pe = kv[..., :cfg["kv_lora_rank"]], kv[..., cfg["kv_lora_rank"]:]
    kv = (np_rms(c, T[p + "self_attn.kv_a_layernorm.weight"]) @ T[p + "self_attn.kv_b_proj.weight"].T)
    kv = kv.reshape(B, S, H, nope + vd)
    angles = np.asarray(positions, np.float64)[:, None] * yarn_frequencies(cfg)  # (S, rope/2)
    factor = yarn_m(rs["factor"], rs["mscale"]) / yarn_m(rs["factor"], rs["mscale_all_dim"])
    q_pe = np_rotate(q[..., nope:], angles[None, :, None], factor)
    k_pe = np_rotate(k_pe, angles[None], factor)
    scale = (nope + rope) ** -0.5 * yarn_m(rs["factor"], rs["mscale_all_dim"]) ** 2
    scores = (np.einsum("bshd,bthd->bsht", q[..., :nope], kv[..., :nope])
              + np.einsum("bshd,btd->bsht", q_pe, k_pe)) * scale
    scores = scores + np.where(np.triu(np.ones((S, S), bool), 1), -np.inf, 0.0)[None, :, None, :]
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    o = np.einsum("bsht,bthd->bshd", probs, kv[..., nope:]).reshape(B, S, H * vd)
    h = x + o @ T[p + "self_attn.o_proj.weight"].T
    f = np_rms(h, T[p + "post_attention_layernorm.weight"]).reshape(B * S, dim)
    if layer < cfg["first_k_dense_replace"]:
        y = np_mlp(T, p + "mlp.", f)
    else:
        weights, indices = reference_gate(f, T[p + "mlp.gate.weight"], T.get(p + "mlp.gate.e_score_correction_bias"),
                                          cfg.get("scoring_func", "sigmoid"), cfg["n_group"], cfg["topk_group"],
                                          cfg["num_experts_per_tok"], cfg["norm_topk_prob"],
                                          cfg["routed_scaling_factor"])
        y = np_mlp(T, p + "mlp.shared_experts.", f)
        for t in range(len(f)):
            for w, e in zip(weights[t], indices[t]):
                y[t] += w * np_mlp(T, f"{p}mlp.experts.{e}.", f[t])
    return h + y.reshape(B, S, dim)


def numpy_mtp_logits(directory: Path, tokens: np.ndarray) -> np.ndarray:
    """The MTP module in float64 numpy from the checkpoint's tensors: logits of t_{i+2}, i in [0, S-2]."""
    from safetensors.numpy import load_file

    cfg = json.loads((directory / "config.json").read_text())
    T = {}
    for f in sorted(directory.glob("*.safetensors")):
        T.update({k: v.astype(np.float64) for k, v in load_file(str(f)).items()})
    L, S = cfg["num_hidden_layers"], tokens.shape[1]
    x = T["model.embed_tokens.weight"][tokens]
    for layer in range(L):
        x = np_block(T, cfg, layer, x, np.arange(S))
    hidden = np_rms(x, T["model.norm.weight"], cfg["rms_norm_eps"])  # what the main head sees
    p = f"model.layers.{L}."
    e = np_rms(T["model.embed_tokens.weight"][tokens[:, 1:]], T[p + "enorm.weight"])
    h = np_rms(hidden[:, :-1], T[p + "hnorm.weight"])
    x = np.concatenate([e, h], -1) @ T[p + "eh_proj.weight"].T
    y = np_block(T, cfg, L, x, np.arange(1, S))
    return np_rms(y, T[p + "shared_head.norm.weight"]) @ T["lm_head.weight"].T


def test_mtp_logits_equal_float64_numpy_statement(hf_mtp_dir, hf_mtp_model):
    tokens = np.random.default_rng(2).integers(0, 64, (2, 12))
    expected = numpy_mtp_logits(hf_mtp_dir[2], tokens)
    got = our_mtp_logits(hf_mtp_model(1), tokens)
    # measured: 9e-7 of the largest logit (float32 compute, routing as in the reference)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


# ------------------------------------------------------------------ greedy identity
def same_weights(model, num_devices: int = 1, **sizes):
    """A model of `model`'s weights on `num_devices` devices, with other sizes (max_batch_size,
    max_seq_len) where given: what `build` makes there too (its random init gives the same weights on
    any mesh and for any sizes), without compiling that init again. Placed from the host: no slicing
    program per array shape."""
    return dsv3_jax.Model(model.args.replace(**sizes), model.graphdef, jax.device_get(model.state),
                          make_mesh(num_devices), model.options)


@pytest.fixture(scope="module")
def spec_model_1dev():
    return build_tiny_mtp(**SPEC_SIZES)


@pytest.fixture(scope="module", params=[1, 4], ids=["1dev", "4dev"])
def spec_model(request, spec_model_1dev):
    """The random MTP model of the greedy and chunked-prefill tests, which share its compiled steps.
    5 cache rows for batches of 4: every call also runs the rows-below-max_batch_size path; max_seq_len
    150 is not a power of two: prompt buckets are capped at it, and chunks of 64 end with one that
    redoes part of the one before. On 4 devices, the one-device model's weights (`same_weights`)."""
    return spec_model_1dev if request.param == 1 else same_weights(spec_model_1dev, request.param)


def test_greedy_output_is_identical_with_mtp(spec_model):
    """Three calls of one batch size and one prompt bucket (150, max_seq_len) with one window, so that
    each function compiles once, not once per case (the chunked-prefill test's one-step side reuses them)."""
    rng = np.random.default_rng(0)
    total = dict(drafts=0, accepted=0)
    cases = [(list(SPEC_PROMPT_LENGTHS), 21, -1),  # unequal prompts, whole budgets (total_len 150)
             # budgets cut by max_seq_len = 150: 8, 20, 4, 18 (and 2-token steps at the end)
             ([142, 130, 146, 132], 20, -1),
             ([122, 113, 109, 149], 30, 5)]  # eos; the last prompt one short of max_seq_len (a budget of 1)
    for lengths, new, eos in cases:
        prompts = [rng.integers(0, 8, n).tolist() for n in lengths]
        stats = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", dsv3_jax.MaxSeqLenWarning)
            plain = spec_model.generate(prompts, new, eos_id=eos, temperature=0.0)
            fast = spec_model.generate(prompts, new, eos_id=eos, temperature=0.0, mtp=True, stats=stats)
        assert fast == plain, (lengths, new)
        cut = [str(w.message) for w in caught if w.category is dsv3_jax.MaxSeqLenWarning]
        # a MaxSeqLenWarning from each call, naming the same rows, where max_seq_len cut one (case 2; case 1:
        # none; case 3: where eos came first, none)
        assert len(cut) in (0, 2) and len(set(cut)) <= 1, cut
        assert eos != -1 or len(cut) == (2 if max(lengths) + new > spec_model.args.max_seq_len else 0), cut
        total["drafts"] += stats["drafts"]
        total["accepted"] += stats["accepted"]
    assert 0 < total["accepted"] < total["drafts"]  # both branches ran


# ------------------------------------------------------------------ sampling keeps the main model's distribution
@pytest.fixture(scope="module")
def sampling_model(spec_model_1dev):
    """`build_tiny_mtp(SAMPLING_ROWS, SAMPLING_SEQ)`, from the spec model's weights (`same_weights`)."""
    return same_weights(spec_model_1dev, max_batch_size=SAMPLING_ROWS, max_seq_len=SAMPLING_SEQ)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (4, 0.8)], ids=["unfiltered", "top_k_top_p"])
def test_sampled_tokens_follow_the_main_model(sampling_model, top_k, top_p):
    """Draft q and target p are both the filtered distributions; min(1, p/q) acceptance with the
    normalize(max(p - q, 0)) residual is exact for any pair, so the output is the main model's
    filtered distribution (one device: the statistics do not depend on the split). 1200 completions:
    20 seeds of 60 rows."""
    prompt, rows, runs = [1, 5, 2], 60, 20
    joint, third = three_token_distribution(sampling_model, prompt, top_k, top_p)
    counts, third_counts = np.zeros((VOCAB, VOCAB)), np.zeros(VOCAB)
    for seed in range(runs):
        for row in sampling_model.generate([prompt] * rows, 3, eos_id=-1, temperature=1.0, seed=seed, mtp=True,
                                           top_k=top_k, top_p=top_p):
            counts[row[0], row[1]] += 1
            third_counts[row[2]] += 1
    n = counts.sum()
    for observed, expected in ((counts.ravel(), joint.ravel() * n), (third_counts, third * n)):
        keep = expected > 5
        chi2 = (((observed[keep] - expected[keep]) ** 2) / expected[keep]).sum()
        dof = keep.sum() - 1
        assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)  # about a 5-sigma bound
        assert observed[~keep].sum() <= max(20, 3 * expected[~keep].sum())
        assert observed[expected == 0].sum() == 0  # filtered-out tokens never appear
    if top_k:
        assert (joint == 0).any()


# ------------------------------------------------------------------ the MTP layer through the converters
def assert_same_mtp_model(expected, other):
    """`other` (a converted checkpoint) is `expected` (the HF directory's model on as many devices): the
    same step parts (graphdef, args, mesh, options, layout), on which every step builder is memoized, so
    it runs the same compiled programs (its generate, greedy or MTP, is `expected`'s), and every weight,
    the MTP layer's included, bit for bit in the same split; its MTP module's logits then equal bitwise."""
    assert other.has_mtp and any("eh_proj" in jax.tree_util.keystr(path)
                                 for path, _ in jax.tree_util.tree_flatten_with_path(expected.state["mtp"])[0])
    assert_same_model(expected, other)
    tokens = np.random.default_rng(3).integers(0, 64, (2, 12))
    np.testing.assert_array_equal(our_mtp_logits(other, tokens), our_mtp_logits(expected, tokens))


def test_orbax_conversion_keeps_the_mtp_layer(hf_mtp_dir, hf_mtp_model, tmp_path):
    from dsv3_jax.convert.to_orbax import to_orbax

    to_orbax(hf_mtp_dir[2], tmp_path / "orbax")
    assert_same_mtp_model(hf_mtp_model(1), load_with_mtp(tmp_path / "orbax", 1))


@pytest.mark.parametrize("ranks", [1, 4])
def test_per_rank_files_keep_the_mtp_layer_with_keep_mtp(hf_mtp_dir, hf_mtp_model, bare_dir, tmp_path, ranks):
    from dsv3_jax.convert.convert import main as convert_main

    directory = hf_mtp_dir[2]
    convert_main(["--hf-ckpt-path", str(directory), "--save-path", str(tmp_path / "plain"), "--n-experts", "8",
                  "--model-parallel", str(ranks)])
    convert_main(["--hf-ckpt-path", str(directory), "--save-path", str(tmp_path / "mtp"), "--n-experts", "8",
                  "--model-parallel", str(ranks), "--keep-mtp"])
    args = ModelArgs.from_file(directory / "config.json")
    common = dict(config=args, compute_dtype="float32", max_batch_size=2, max_seq_len=64)
    with pytest.raises(CheckpointError, match="no MTP layer"):  # the reference's layout: no MTP
        dsv3_jax.load(tmp_path / "plain", mtp=True, **common)
    converted = dsv3_jax.load(tmp_path / "mtp", mtp=True, num_devices=ranks, **common)
    if ranks == 1:
        from dsv3_jax.convert.common import ToolError

        with pytest.raises(ToolError, match="holds no MTP layer"):
            convert_main(["--hf-ckpt-path", str(bare_dir), "--save-path", str(tmp_path / "x"), "--n-experts", "8",
                          "--model-parallel", "1", "--keep-mtp"])
    assert_same_mtp_model(hf_mtp_model(ranks), converted)  # bitwise: the HF directory's model on as many devices


# ------------------------------------------------------------------ chunked prefill
def test_greedy_output_is_identical_with_mtp_and_chunked_prefill(spec_model):
    """max_seq_len 150 (not a power of two): the bucket of a 140-token prompt is 150, chunks of 64 start at
    0, 64 and 86 (the last one redoing part of the one before); rows end inside a chunk, just before and at a
    chunk boundary and inside the redone part, so each row's first token and draft come from a different chunk.
    The main model's and the MTP module's windows (one position later) differ in two chunks: 64 | 128 and
    128 | 150, then 150 | 150 (each a compilation: the few a bucket needs)."""
    whole = spec_model
    chunked = dsv3_jax.Model(whole.args, whole.graphdef, whole.state, whole.mesh,
                             dsv3_jax.RunOptions.make(whole.options, prefill_chunk=64))
    assert [tuple(c) for c in prefill_chunks(150, 64, 150)] == [(0, 64, 128), (64, 128, 150), (86, 150, 150)]
    rng = np.random.default_rng(11)  # prompts whose completions accept drafts and reject others
    prompts = [rng.integers(0, 8, n).tolist() for n in (100, 63, 64, 140)]
    plain = whole.generate(prompts, 9, eos_id=-1, temperature=0.0)
    stats = {}
    assert chunked.generate(prompts, 9, eos_id=-1, temperature=0.0, mtp=True, stats=stats) == plain
    assert stats["drafts"] > 0 and stats["accepted"] > 0
    sampled = whole.generate(prompts, 9, eos_id=-1, temperature=1.0, seed=6, mtp=True)
    assert chunked.generate(prompts, 9, eos_id=-1, temperature=1.0, seed=6, mtp=True) == sampled
