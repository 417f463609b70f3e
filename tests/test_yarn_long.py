"""YaRN at long positions: tokens past `original_seq_len` (4,096, DeepSeek-V3's own) match Hugging Face
transformers in float32, in prefill chunks and in decode steps around positions 4,100 and 20,000, with both
attention forms on 1 and 4 devices.

Positions this far out are where a wrong correction shows: a rotary frequency off by YaRN's ramp turns a
key 20,000 positions back by a different angle, and the softmax scale's mscale factor changes every score.
The sequence is fed in the same chunks to both models (HF through its own cache).

The models have one (dense) layer: YaRN is one rotary table and one softmax scale shared by every layer,
so more layers would repeat the same check at several times the cost of the 20,000-key attention."""
import numpy as np
import pytest

import dsv3_jax
from optimised_compile import optimised

torch = pytest.importorskip("torch")  # the oracle (test extra)
pytest.importorskip("transformers")
from hf_models import hf_model, save  # noqa: E402

ORIGINAL = 4096
END = 20_002
# (start, length) of each call: prefill chunks, then decode steps just past 4,096 and around 20,000.
# The chunks between end in two cache windows (16,384 and the whole cache): three of one length up to
# 16,384, then one to 20,000, so the model compiles two long steps for them.
WINDOW = 16_384


def _plan() -> list[tuple[int, int]]:
    plan = [(0, ORIGINAL), (ORIGINAL, 4), (ORIGINAL + 4, 1), (ORIGINAL + 5, 1)]
    start = ORIGINAL + 6
    length = (WINDOW - start) // 3
    plan += [(start + i * length, length) for i in range(3)]
    return plan + [(WINDOW, 20_000 - WINDOW), (20_000, 1), (20_001, 1)]


PLAN = _plan()
TOL = 5e-5

YARN_V3 = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": ORIGINAL, "beta_fast": 32,
           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
YARN_V2_LITE = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": ORIGINAL, "beta_fast": 32,
                "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


def test_plan_is_contiguous():
    ends = [start + length for start, length in PLAN]
    assert [start for start, _ in PLAN[1:]] == ends[:-1] and ends[-1] == END


def _hf_run(family: str, rope: dict, plan: list[tuple[int, int]], tmp_path_factory):
    """(directory, tokens, plan, HF logits after each call of `plan`) for a one-layer tiny model with the
    real YaRN settings."""
    # HF's eager attention (its reference form): with one thread, faster here than its default (SDPA) on
    # these 4,096-query chunks over up to 20,000 keys
    hf = hf_model(family, seed=11, max_position_embeddings=163_840, rope_scaling=rope, num_hidden_layers=1,
                  attn_implementation="eager")
    tokens = np.random.default_rng(12).integers(0, 512, size=(1, END))
    expected, cache = [], None
    with torch.no_grad():
        for start, length in plan:
            ids = torch.as_tensor(tokens[:, start: start + length])
            out = hf(ids, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            expected.append(out.logits[:, -1].float().numpy())
    return save(hf, tmp_path_factory.mktemp(family)), tokens, plan, expected


@pytest.fixture(scope="module")
def v3_run(tmp_path_factory):
    return _hf_run("v3", YARN_V3, PLAN, tmp_path_factory)


def optimised_step(model) -> None:
    """Compile `model`'s prefill chunks with XLA:CPU's backend optimisation on (the suite turns it off, which
    halves compile times): the same program, whose 4,096-query chunks over 20,000 keys then run several
    times faster. Steps of a few tokens (the decode steps), which run in milliseconds either way, keep the
    quicker compile. The arguments, donation and results are the step's own."""
    short = model.step
    long = optimised(short, static_argnames=("kv_len",), donate_argnums=(1,))

    def step(state, cache, tokens, *positions, kv_len):
        return (short if tokens.shape[1] < 64 else long)(state, cache, tokens, *positions, kv_len=kv_len)

    model.step = step


def _check(run, attn_impl: str, devices: int) -> None:
    directory, tokens, plan, expected = run
    end = plan[-1][0] + plan[-1][1]
    model = dsv3_jax.load(directory, compute_dtype="float32", attn_impl=attn_impl, num_devices=devices,
                          max_batch_size=1, max_seq_len=end)
    optimised_step(model)
    assert model.args.yarn_enabled and model.args.original_seq_len == ORIGINAL
    worst = {}
    for (start, length), want in zip(plan, expected, strict=True):
        got = np.asarray(model.forward(tokens[:, start: start + length], start))
        worst[start] = float(np.abs(got - want).max())
    print(f"{attn_impl} on {devices} devices: max |logit diff| vs HF by call start: {worst}")
    assert max(worst.values()) <= TOL


# The naive form and the 4-device split are proven equal to absorb on 1 device at short positions
# (test_model.py); at long positions they run with the slow tests (`pytest -m slow`).
@pytest.mark.parametrize("attn_impl,devices", [("absorb", 1), pytest.param("naive", 1, marks=pytest.mark.slow),
                                               pytest.param("absorb", 4, marks=pytest.mark.slow),
                                               pytest.param("naive", 4, marks=pytest.mark.slow)])
def test_long_positions_match_hf(v3_run, attn_impl, devices):
    _check(v3_run, attn_impl, devices)


def test_long_positions_match_hf_with_v2_lite_mscale(tmp_path_factory):
    """V2-Lite's mscale 0.707: the rotary attention factor and the softmax scale both change, in every
    score at any position, so the plan stops at the decode steps just past 4,096 (keys up to 4,101
    positions back, past the original context as YaRN is meant for); V2's own rotary layout
    (interleaved) turns them by the same corrected frequencies as the V3 case checks out to 20,001."""
    _check(_hf_run("v2", YARN_V2_LITE, PLAN[:4], tmp_path_factory), "absorb", 1)
