"""generate()'s decode step as CUDA graphs (`RunOptions.decode_graph`): the step is traced with its layer
scans unrolled and compiled with XLA command buffers. On a CPU the command-buffer options belong to the
GPU compiler and change nothing, so what runs here is the unrolled step; its tokens must be those of the
model's own forward pass (greedy) and of the scanned decode step (sampled, the same seed); the GPU test
runs the same comparison where the graphs are real."""
from pathlib import Path

import jax
import numpy as np
import pytest

import dsv3_jax
from dsv3_jax.decode.generate import decode, prefill, read_out
from dsv3_jax.decode.step import COMMAND_BUFFERS, decode_graphs
from mtp_models import SPEC_PROMPT_LENGTHS, SPEC_SIZES, VOCAB, build_tiny_mtp

TINY = Path(dsv3_jax.__file__).parent / "assets" / "tiny"
PROMPTS = [[0, 2, 11, 12, 13], [0, 2, 14], [0, 2, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def pair():
    """The tiny model with scanned decode steps, and a twin on its weights whose decode steps are graphs."""
    scanned = dsv3_jax.load(TINY, compute_dtype="float32", max_batch_size=3, max_seq_len=64, decode_graph="off")
    graphs = dsv3_jax.Model(scanned.args, scanned.graphdef, scanned.state, scanned.mesh,
                            dsv3_jax.RunOptions.make(scanned.options, decode_graph="on"))
    return scanned, graphs


def greedy_by_forward(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation through `Model.forward`, one token a step (the prompt too: every step is the
    one-token forward program, whatever the prompt's length), host argmax."""
    for position, token in enumerate(prompt):
        logits = model.forward(np.array([[token]]), start_pos=position)
    out = []
    for index in range(new_tokens):
        out.append(int(np.argmax(np.asarray(logits)[0])))
        logits = model.forward(np.array([[out[-1]]]), start_pos=len(prompt) + index)
    return out


def test_auto_picks_graphs_only_on_a_gpu(pair):
    scanned, graphs = pair
    assert decode_graphs(graphs.parts) and not decode_graphs(scanned.parts)
    auto = scanned.parts._replace(options=dsv3_jax.RunOptions.make(scanned.options, decode_graph="auto"))
    assert decode_graphs(auto) == (jax.devices()[0].platform == "gpu")


def test_graph_step_is_unrolled_and_compiled_with_command_buffers(pair):
    """Would catch a graph step that still loops over the layers (a CUDA graph of a while loop's body is
    launched once per layer) or that lost its compiler options."""
    scanned, graphs = pair
    decode_state, plan = prefill(scanned, PROMPTS, 4, eos_id=-1, temperature=0.0)
    lowered = {name: model.decode_step.lower(model.state, model.cache, decode_state, kv_len=plan.kv_len,
                                             top_k=0, top_p=1.0)
               for name, model in (("scanned", scanned), ("graphs", graphs))}
    loops = {name: low.as_text().count("stablehlo.while") for name, low in lowered.items()}
    # the tiny model's two layer stacks (1 dense layer, 2 MoE layers) are loops only when scanned; the
    # sampler's random-key loops are in both
    assert loops["graphs"] == loops["scanned"] - 2, loops
    assert dict(lowered["graphs"]._lowering._compiler_options_kvs) == COMMAND_BUFFERS
    assert not lowered["scanned"]._lowering._compiler_options_kvs


def test_graph_decode_gives_the_models_tokens(pair):
    scanned, graphs = pair
    greedy = graphs.generate(PROMPTS, 12, eos_id=-1, temperature=0.0)
    assert greedy == [greedy_by_forward(scanned, p, 12) for p in PROMPTS]
    sampled = [model.generate(PROMPTS, 12, eos_id=-1, temperature=1.0, seed=7) for model in pair]
    assert sampled[0] == sampled[1] and sampled[0] != greedy


@pytest.mark.gpu
def test_graph_decode_on_a_gpu():
    """Command buffers around every kernel the step launches (the Pallas decode-attention kernel and
    the cuBLAS GEMMs included): the same tokens as the scanned step, greedy and sampled."""
    scanned = dsv3_jax.load(TINY, compute_dtype="float32", max_batch_size=3, max_seq_len=64, decode_graph="off")
    graphs = dsv3_jax.Model(scanned.args, scanned.graphdef, scanned.state, scanned.mesh,
                            dsv3_jax.RunOptions.make(scanned.options, decode_graph="auto"))
    assert decode_graphs(graphs.parts)
    with jax.default_matmul_precision("highest"):
        for temperature in (0.0, 1.0):
            expected = scanned.generate(PROMPTS, 12, eos_id=-1, temperature=temperature, seed=7)
            assert graphs.generate(PROMPTS, 12, eos_id=-1, temperature=temperature, seed=7) == expected


def test_speculative_step_as_a_graph_gives_the_same_tokens():
    """The MTP speculative step under decode graphs: unrolled, compiled with the command-buffer options,
    and emitting what the scanned speculative step emits. The random MTP model of the speculative
    greedy tests, with their sizes and prompt lengths, so that the scanned side runs their compiled
    programs (from the session's compilation cache)."""
    scanned = build_tiny_mtp(**SPEC_SIZES)
    graphs = dsv3_jax.Model(scanned.args, scanned.graphdef, scanned.state, scanned.mesh,
                            dsv3_jax.RunOptions.make(scanned.options, decode_graph="on"))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in SPEC_PROMPT_LENGTHS]
    for temperature in (0.0, 1.0):
        expected = scanned.generate(prompts, 10, eos_id=-1, temperature=temperature, seed=3, mtp=True)
        assert graphs.generate(prompts, 10, eos_id=-1, temperature=temperature, seed=3, mtp=True) == expected
    spec_state, plan = prefill(graphs, prompts, 4, eos_id=-1, temperature=0.0, mtp=True)
    lowered = graphs.mtp_steps[1].lower(graphs.state, graphs.cache, spec_state, kv_len=plan.kv_len, top_k=0,
                                        top_p=1.0)
    assert dict(lowered._lowering._compiler_options_kvs) == COMMAND_BUFFERS
    assert_state_donated(graphs, spec_state, plan, prompts, mtp=True)


def assert_state_donated(model, state, plan, prompts, mtp=False):
    """Would catch a decode step that allocates its state afresh each step: a CUDA graph whose buffers move
    is updated before every replay, which costs more than the step's kernels on a small model. The state
    handed to `decode` is consumed (its buffers reused for the next state), while `read_out`, taken
    before, still holds what the state emitted: the greedy first tokens that `generate` returns."""
    read = read_out(state)
    following = decode(model, state, plan)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state)), "the state was not donated"
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(following))
    first = np.asarray(read)[:, 0] if mtp else np.asarray(read)
    assert first.tolist() == [c[0] for c in model.generate(prompts, 1, eos_id=-1, temperature=0.0, mtp=mtp)]


def test_plain_decode_step_consumes_its_state(pair):
    for model in pair:
        decode_state, plan = prefill(model, PROMPTS, 4, eos_id=-1, temperature=0.0)
        assert_state_donated(model, decode_state, plan, PROMPTS)
