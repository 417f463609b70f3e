# %% [markdown]
# # dsv3-jax from a notebook
# Cells (`# %%`) open in Jupyter (via jupytext) or VS Code; `python examples/notebook.py` runs them all.
# The embedded tiny DeepSeek-V3-shaped model is used, so nothing is downloaded; pass a Hugging Face
# checkpoint directory as the first argument to use a real one.

# %%
import sys
from pathlib import Path

import numpy as np

import dsv3_jax
from dsv3_jax.generate import decode, prefill
from dsv3_jax.tokenizer import Tokenizer

checkpoint = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(dsv3_jax.__file__).parent / "assets" / "tiny"
model = dsv3_jax.load(checkpoint, dtype="float32", max_batch_size=2, max_seq_len=256)
tokenizer = Tokenizer.from_dir(checkpoint)
print(model.args.n_layers, "layers,", model.args.n_routed_experts, "experts, mesh", dict(model.mesh.shape))

# %% [markdown]
# ## `model.forward`: logits of each row's last token; the cache keeps the positions it saw

# %%
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}])
logits = model.forward(np.array([prompt]))  # (batch, vocab) float32
first = int(np.argmax(np.asarray(logits)[0]))
logits = model.forward(np.array([[first]]), start_pos=len(prompt))  # the next position, from the cache
second = int(np.argmax(np.asarray(logits)[0]))
print("greedy by forward:", [first, second], repr(tokenizer.decode([first, second])))

# %% [markdown]
# ## The jitted steps: one prefill, then one decode step per token
# `prefill` pads the prompts to a length bucket and samples each row's first token on the device;
# `decode` feeds every row's newest token at its own position and samples the next, updating the
# donated cache in place. Both return a `DecodeState` that stays on the device.

# %%
longer = tokenizer.apply_chat_template([{"role": "user", "content": "Hi! My name is Ada. What is 2 plus 2?"}])
prompts = [prompt, longer]  # of different lengths: each row decodes from its own position
state, plan = prefill(model, prompts, max_new_tokens=12, temperature=0.0, eos_id=-1)
steps = [np.asarray(state.token)]
for _ in range(plan.max_new_tokens - 1):
    state = decode(model, state, plan)
    steps.append(np.asarray(state.token))
tokens = np.stack(steps, axis=1).tolist()  # (batch, 12)
print(plan)
print("prefill + decode:", tokens)
assert tokens[0][:2] == [first, second]

# %% [markdown]
# ## `model.generate`: the whole loop (prompts of any lengths, eos, sampling)

# %%
assert model.generate(prompts, 12, eos_id=-1, temperature=0.0) == tokens
for ids, completion in zip(prompts, model.generate(prompts, 40, tokenizer.eos_id, temperature=0.7, seed=1)):
    print(repr(tokenizer.decode(ids, skip_special_tokens=False)), "->", repr(tokenizer.decode(completion)))
