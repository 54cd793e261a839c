# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [raw]
# # ASSIGNMENT CONFIG
# name: lab7-transformer
# environment: environment.yml
# files:
#   - jaxlab_form.py
# autograder_files:
#   - jaxlab_lab7.py
# tests:
#   ok_format: false
# export_cell:
#   pdf: false
#   instructions: "Upload the zip file this cell makes to the course's submission page. On Google Colab, which cannot make the zip, this cell instead tells you to submit the notebook itself: *File → Download → Download .ipynb*, then upload that file."
# check_all_cell: false

# %% [markdown]
# # Lab 7: A transformer trained the way large ones are
#
# Labs 3 to 6 each taught one family of techniques on a toy problem of its own. Every large
# training run uses several of them at once, on one model, and must also keep its state safe and
# say how well it uses the hardware. This lab does that on a small decoder-only transformer
# (the kind of model behind today's language models), on a mesh of 8 devices arranged as
# `data` × `model`:
#
# * **A.** tensor parallelism (Megatron style): the attention heads and the MLP's hidden units
#   split over the `model` axis, the batch over `data`;
# * **B.** fully sharded data parallelism (FSDP) on top: every weight matrix also split over
#   `data`, gathered one layer at a time inside the scan over the layers;
# * **C.** mixed precision and gradient accumulation: bfloat16 matrix products with float32
#   parameters, and a batch processed in microbatches;
# * **D.** sharded checkpoints (Orbax), restored onto a mesh of another shape;
# * **E.** how well the hardware is used: FLOPs per step, a fairly measured step time, and the
#   model FLOPs utilisation (MFU).
#
# At the end a short training run brings the loss down, is saved half way, restored on a smaller
# mesh and continued: the two halves of the loss curve join.
#
# ## How this lab works
#
# * Every task has one cell that starts with `### Your code here`. Replace the `...` with your
#   answer and run it. The cell after it, `grader.check("q…")`, runs the public checks, which
#   only test the form of the answer. Hidden checks run when your notebook is graded: they call
#   your functions on **new random parameters and tokens, of other sizes** (other numbers of
#   layers, widths, heads and batch sizes, and the meshes the task names), compare the results
#   with references computed from the lab's own model, and read the program your function
#   traces (`jax.make_jaxpr`) or compiles (`.lower(...).compile()`): **which layouts** it asks
#   for, **which dtypes** its matrix products use, **which loops** it runs. So follow the method
#   each task describes, not only its numbers.
# * Do not rename the variables a task asks for, and do not reuse their names later on.
# * Where a task says a function returns a tuple, a list of the same items is accepted too.
# * Run the notebook from the top (*Kernel → Restart & Run All*) before you submit.

# %% [markdown]
# ## Setup: eight devices
#
# As in the earlier labs, the next cell must run **before any other JAX code**. It asks for 8
# simulated CPU devices (unless the runtime has 8 or more accelerators) and sets `PJRT_NPROC`,
# which keeps XLA's communication threads from starving on machines with few CPU cores. If the
# cell says that JAX is already running, restart the kernel and run from the top. On Linux it
# also tells the C library to give large freed buffers straight back to the operating system,
# which keeps the notebook well inside a 768 MB grading container.
#
# Part D saves checkpoints with [Orbax](https://orbax.readthedocs.io), JAX's checkpointing
# library (`pip install orbax-checkpoint`); the cell after the next installs it if your runtime
# lacks it (Colab and Kaggle ship it).
#
# Tested with JAX 0.10.2 (the version this lab is graded with) and JAX 0.8.2 on Python 3.11, and
# with JAX 0.12 on Python 3.13.

# %%
import ctypes
import ctypes.util
import os

os.environ.setdefault("PJRT_NPROC", "16")
try:  # glibc (Linux) only; elsewhere there is nothing to do
    ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
except (OSError, AttributeError, TypeError):
    pass

import jax

N_DEVICES = 8
try:
    jax.config.update("jax_num_cpu_devices", N_DEVICES)
except RuntimeError:
    pass  # JAX already started; the check below says whether that is a problem

devices = jax.devices()
if len(devices) < N_DEVICES:
    devices = jax.devices("cpu")
    jax.config.update("jax_default_device", devices[0])
if len(devices) < N_DEVICES:
    raise RuntimeError(
        f"JAX is already running with {len(devices)} CPU device(s), and the number of devices "
        "can only be set before JAX starts. Restart the kernel (Kernel > Restart) and run the "
        "notebook from the top, starting with this cell.")
devices = devices[:N_DEVICES]
print(f"Using {len(devices)} {devices[0].platform.upper()} devices.")

# %%
import importlib.metadata
import importlib.util
import subprocess
import sys

if importlib.util.find_spec("orbax") is None:  # needs the internet once
    # pinned to the JAX already installed, so that pip picks an Orbax for it, not a new JAX
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "orbax-checkpoint",
                    f"jax=={importlib.metadata.version('jax')}"], check=True)

import math
import re
import tempfile
import time
from functools import partial
from typing import NamedTuple

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import orbax.checkpoint as ocp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

MiB = 2**20

# %% [markdown]
# Some cells after a task show what your answer does. Until you have answered that task, they
# print a note instead of failing, so that *Run All* always reaches the end of the notebook:

# %%
def answered(*answers):
    """Whether every answer given is filled in; if one is still `...`, say so and return False."""
    if any(answer is ... for answer in answers):
        print("Skipped: this cell uses your answer to the task above. Fill that in first.")
        return False
    return True


# %% [markdown]
# Every program JAX compiles stays in memory, in case it is called again, and with 8 devices
# each one is large. The cells that compile many programs to show you something end by giving
# them back (JAX compiles again whatever is used later), which keeps the notebook inside a
# 768 MB grading container:

# %%
import gc


def free_compiled():
    """Drop every compiled program and return the freed memory to the operating system."""
    jax.clear_caches()
    gc.collect()
    try:  # glibc (Linux) only
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass

# %% [markdown]
# ## The model
#
# A decoder-only transformer reads a sequence of tokens (integers below `vocab`) and, at each
# position, predicts the next token. Each token becomes a vector of `d_model` numbers (its
# embedding plus a learned position vector); `n_layers` identical **blocks** transform those
# vectors; a last projection turns each vector into `vocab` scores (the *logits*). One block:
#
# 1. **attention**: the normalised input `h` (`rms_norm`) is projected three times, into
#    queries, keys and values (`h @ wq`, `h @ wk`, `h @ wv`, each `d_model` wide). Those are cut
#    into `n_heads` **heads** of `d_model // n_heads` numbers; each head lets every position
#    look at the positions before it (the *causal* mask) and averages their values. The heads
#    are put side by side again and projected back with `wo`, and added to the input (the
#    *residual stream*);
# 2. **MLP**: the normalised stream is widened to `d_ff` hidden units (`@ w1`), passed through
#    `gelu`, narrowed back (`@ w2`) and added again.
#
# The parameters of all blocks are **stacked**, as in Lab 6: `params["layers"]["wq"]` has shape
# `(n_layers, d_model, d_model)`, and `lax.scan` runs one block per slice. The loss is the
# cross-entropy of the next token, averaged over the batch and the positions.

# %%
class Config(NamedTuple):
    vocab: int = 64
    d_model: int = 64
    n_heads: int = 4
    d_ff: int = 256
    n_layers: int = 2
    seq: int = 32  # the longest sequence the position table covers


def init_params(key, cfg):
    V, D, F, L, S = cfg.vocab, cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.seq
    k = jax.random.split(key, 9)

    def normal(key, shape, scale):
        return scale * jax.random.normal(key, shape)

    return {
        "embed": normal(k[0], (V, D), 0.5), "pos": normal(k[1], (S, D), 0.1),
        "layers": {"wq": normal(k[2], (L, D, D), D**-0.5), "wk": normal(k[3], (L, D, D), D**-0.5),
                   "wv": normal(k[4], (L, D, D), D**-0.5), "wo": normal(k[5], (L, D, D), D**-0.5),
                   "w1": normal(k[6], (L, D, F), D**-0.5), "w2": normal(k[7], (L, F, D), F**-0.5),
                   "norm1": jnp.ones((L, D)), "norm2": jnp.ones((L, D))},
        "norm_f": jnp.ones((D,)), "unembed": normal(k[8], (D, V), D**-0.5),
    }


def rms_norm(x, scale):
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def attention(q, k, v):
    """Causal attention of q, k, v of shape (batch, seq, heads, head_dim)."""
    S, d = q.shape[1], q.shape[3]
    scores = jnp.einsum("bshd,bthd->bhst", q, k) / math.sqrt(d)
    causal = jnp.arange(S)[:, None] >= jnp.arange(S)[None, :]
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
    return jnp.einsum("bhst,bthd->bshd", weights, v)


def block(x, p, n_heads):
    """One transformer block on the residual stream x of shape (batch, seq, d_model)."""
    B, S, D = x.shape
    h = rms_norm(x, p["norm1"])
    q, k, v = [(h @ p[w]).reshape(B, S, n_heads, D // n_heads) for w in ("wq", "wk", "wv")]
    x = x + attention(q, k, v).reshape(B, S, D) @ p["wo"]
    h = rms_norm(x, p["norm2"])
    return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def forward(params, tokens, n_heads):
    """Logits (batch, seq, vocab) for tokens (batch, seq)."""
    x = params["embed"][tokens] + params["pos"][:tokens.shape[1]]
    x, _ = lax.scan(lambda x, p: (block(x, p, n_heads), None), x, params["layers"])
    return rms_norm(x, params["norm_f"]) @ params["unembed"]


def cross_entropy(logits, targets):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def loss_fn(params, tokens, n_heads):
    """Next-token loss: position i predicts token i + 1."""
    return cross_entropy(forward(params, tokens[:, :-1], n_heads), tokens[:, 1:])


cfg = Config()
params = init_params(jax.random.key(0), cfg)
BATCH = 16
tokens = jax.random.randint(jax.random.key(1), (BATCH, cfg.seq), 0, cfg.vocab)
n_params = sum(x.size for x in jax.tree.leaves(params))
print(f"{n_params:,} parameters; loss {float(loss_fn(params, tokens, cfg.n_heads)):.3f} "
      f"(a uniform guess scores ln {cfg.vocab} = {math.log(cfg.vocab):.3f})")

# %% [markdown]
# ## Part A: tensor parallelism on a 2-D mesh
#
# The 8 devices form a mesh of 4 rows (`data`) by 2 columns (`model`). The batch is split over
# `data`, as in Lab 3. The `model` axis splits **the model itself**, following the Megatron-LM
# recipe, so that no device holds a whole block:
#
# * `wq`, `wk`, `wv` and `w1` are split by their **columns** (output dimension) over `model`:
#   each device computes some of the heads, and some of the MLP's hidden units, from the whole
#   normalised input. Heads are independent, and `gelu` works unit by unit, so nothing has to
#   be exchanged yet;
# * `wo` and `w2` are split by their **rows** (input dimension) over `model`: each device
#   multiplies its own heads (or hidden units) by its own rows, which gives a *partial sum* of
#   the result; one all-reduce over `model` adds the partial sums up. Two all-reduces per block,
#   one after attention and one after the MLP, are all the communication tensor parallelism
#   needs;
# * everything else (the embeddings, the position table, the norms' scales, the unembedding)
#   is small here and **replicated**.
#
# Stacked parameters keep the layer axis first, and it is never split: a spec for a stacked
# weight has three entries, the first `None`.

# %%
mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto),
                     devices=devices)


def shard(params, specs, mesh):
    """`params` placed on `mesh`, each leaf with the PartitionSpec at the same place in `specs`."""
    return jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), params,
                        specs, is_leaf=lambda x: isinstance(x, P))


def show_layout(params):
    """Each parameter's shape, spec and the shape of the block one device holds."""
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        block_shape = x.sharding.shard_shape(x.shape)
        print(f"{name:16s} {str(x.shape):16s} {str(x.sharding.spec):28s} per device "
              f"{str(block_shape):16s} {x.nbytes // math.prod(x.shape) * math.prod(block_shape):>8,d} B")

# %% [raw]
# # BEGIN QUESTION
# name: q1_tp_specs
# points: 1

# %% [markdown]
# **Task 1** (`q1_tp_specs`). Define `tp_specs(params)`: a dict of the same structure as
# `params` (the same keys, nested the same way) whose leaves are `PartitionSpec`s of the
# Megatron layout above: `wq`, `wk`, `wv` and `w1` split by columns over `model`, `wo` and `w2`
# by rows over `model`, every other parameter replicated (`P()`). It must work for any config
# (the hidden check builds `params` with other sizes); only the structure of `params` matters.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def tp_specs(params):
    columns, rows = P(None, None, "model"), P(None, "model", None)
    layers = {name: P() for name in params["layers"]}
    layers.update(wq=columns, wk=columns, wv=columns, w1=columns, wo=rows, w2=rows)
    return {"embed": P(), "pos": P(), "layers": layers, "norm_f": P(), "unembed": P()}
# END SOLUTION
""" # BEGIN PROMPT
tp_specs = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q1_form(tp_specs):
    import jaxlab_form as form
    form.expect_callable("tp_specs", form.evidence(tp_specs))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q1_tp_specs(tp_specs):
    import jaxlab_lab7
    jaxlab_lab7.check("q1_tp_specs", tp_specs=tp_specs)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(tp_specs):
    tp_params = shard(params, tp_specs(params), mesh)
    show_layout(tp_params)

# %% [markdown]
# ### Activations keep a layout too
#
# Under `jax.jit`, the compiler chooses a layout for every intermediate value from the layouts
# of the inputs (Lab 3). To be sure it follows the Megatron plan, pin the layouts that matter
# with `jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))`: it returns `x`
# unchanged, and tells the compiler which layout `x` must have at that point (moving data if it
# must). In a block:
#
# | value | shape | layout |
# |---|---|---|
# | residual stream `x` | `(batch, seq, d_model)` | `P('data', None, None)`: split by examples |
# | queries, keys, values, per head | `(batch, seq, n_heads, head_dim)` | `P('data', None, 'model', None)`: heads over `model` |
# | MLP hidden units (after `gelu`) | `(batch, seq, d_ff)` | `P('data', None, 'model')` |
#
# With these, each device computes attention for its own examples and its own heads only. The
# compiled program then holds, per block, an all-reduce over `model` after `wo` and another
# after `w2`.

# %% [raw]
# # BEGIN QUESTION
# name: q2_tp_forward
# points: 2

# %% [markdown]
# **Task 2** (`q2_tp_forward`). Define `tp_forward(params, tokens, mesh, n_heads)`: the logits
# of `forward`, for parameters laid out by `tp_specs` and tokens `(batch, seq)` split by rows
# over `data`, on a 2-D mesh with axes `data` and `model` (of any sizes that divide the batch
# and the number of heads: the hidden check uses 4 × 2 and 2 × 4). Inside the scan's body,
# constrain the queries, keys and values (each, as 4-D arrays) and the MLP's hidden units to
# the layouts of the table, and the residual stream after each block to `P('data', None,
# None)`. The hidden check calls it under `jax.jit` (with `mesh` and `n_heads` fixed), so it
# must be traceable; its values must equal `forward`'s.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def tp_forward(params, tokens, mesh, n_heads):
    def constrain(x, *spec):
        return lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

    def tp_block(x, p):
        B, S, D = x.shape
        h = rms_norm(x, p["norm1"])
        q, k, v = [constrain((h @ p[w]).reshape(B, S, n_heads, D // n_heads),
                             "data", None, "model", None) for w in ("wq", "wk", "wv")]
        x = x + attention(q, k, v).reshape(B, S, D) @ p["wo"]
        h = rms_norm(x, p["norm2"])
        hidden = constrain(jax.nn.gelu(h @ p["w1"]), "data", None, "model")
        return constrain(x + hidden @ p["w2"], "data", None, None), None

    x = params["embed"][tokens] + params["pos"][:tokens.shape[1]]
    x, _ = lax.scan(tp_block, constrain(x, "data", None, None), params["layers"])
    return rms_norm(x, params["norm_f"]) @ params["unembed"]
# END SOLUTION
""" # BEGIN PROMPT
tp_forward = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q2_form(tp_forward):
    import jaxlab_form as form
    form.expect_callable("tp_forward", form.evidence(tp_forward))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q2_tp_forward(tp_forward):
    import jaxlab_lab7
    jaxlab_lab7.check("q2_tp_forward", tp_forward=tp_forward)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
def collectives(compiled):
    """How many of each collective the compiled program's text holds."""
    found = re.findall(r"= \S+ (all-reduce|all-gather|reduce-scatter|collective-permute|"
                       r"all-to-all)(?:-start)?\(", compiled.as_text())
    return {name: found.count(name) for name in sorted(set(found))}


if answered(tp_specs, tp_forward):
    data_tokens = jax.device_put(tokens, NamedSharding(mesh, P("data", None)))
    tp_jit = jax.jit(partial(tp_forward, mesh=mesh, n_heads=cfg.n_heads))
    logits = tp_jit(tp_params, data_tokens)
    gap = float(jnp.max(jnp.abs(logits - forward(params, tokens, cfg.n_heads))))
    print(f"logits {logits.shape}, laid out {logits.sharding.spec}; largest difference from "
          f"forward on one device: {gap:.2e}")
    print("collectives in the compiled program:",
          collectives(tp_jit.lower(tp_params, data_tokens).compile()))
    free_compiled()

# %% [markdown]
# ## Part B: fully sharded data parallelism on top
#
# Tensor parallelism cut each weight matrix in 2 (the size of `model`); the 4 devices of each
# `model` column still hold the same halves. **FSDP** (ZeRO stage 3, Lab 6 did stage 1) removes
# that last copy: each weight matrix is *also* split over `data`, along its other dimension, so
# that every device stores 1/8 of it. Just before a layer runs, its weights are **all-gathered**
# over `data` back into the tensor-parallel layout of Part A; after the backward pass the
# gradients are **reduce-scattered** over `data` into the fully sharded layout again (each
# device keeps the sum over the batch of its own 1/8).
#
# Gathering *one layer at a time inside the scan* is what keeps memory low: a device then holds
# its 1/8 of every layer plus the gathered weights of a single layer, never the whole model. In
# JAX that is one `with_sharding_constraint` of the layer's slice of the weights to the Part A
# layout, written inside the scan's body (a layer's slice has no layer axis: drop the first
# entry of the spec). The compiler turns it into all-gathers, and their transposes in the
# backward pass into the reductions of the gradients.
#
# The fully sharded layout of this lab:
#
# | parameter | layout |
# |---|---|
# | `wq`, `wk`, `wv`, `w1` `(L, d_model, ·)` | `P(None, 'data', 'model')`: rows over `data`, columns over `model` |
# | `wo`, `w2` `(L, ·, d_model)` | `P(None, 'model', 'data')`: rows over `model`, columns over `data` |
# | `embed` `(vocab, d_model)`, `pos` `(seq, d_model)` | `P(None, 'data')` |
# | `unembed` `(d_model, vocab)` | `P('data', None)` |
# | the norms' scales | `P()`: replicated |

# %% [raw]
# # BEGIN QUESTION
# name: q3_fsdp_specs
# points: 1

# %% [markdown]
# **Task 3** (`q3_fsdp_specs`). Define `fsdp_specs(params)`, like `tp_specs`: a dict of the
# structure of `params` whose leaves are the `PartitionSpec`s of the fully sharded layout in
# the table, for any config.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def fsdp_specs(params):
    columns, rows = P(None, "data", "model"), P(None, "model", "data")
    layers = {name: P() for name in params["layers"]}
    layers.update(wq=columns, wk=columns, wv=columns, w1=columns, wo=rows, w2=rows)
    return {"embed": P(None, "data"), "pos": P(None, "data"), "layers": layers, "norm_f": P(),
            "unembed": P("data", None)}
# END SOLUTION
""" # BEGIN PROMPT
fsdp_specs = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q3_form(fsdp_specs):
    import jaxlab_form as form
    form.expect_callable("fsdp_specs", form.evidence(fsdp_specs))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q3_fsdp_specs(fsdp_specs):
    import jaxlab_lab7
    jaxlab_lab7.check("q3_fsdp_specs", fsdp_specs=fsdp_specs)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(fsdp_specs):
    fsdp_params = shard(params, fsdp_specs(params), mesh)
    show_layout(fsdp_params)
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(fsdp_params))
    whole = sum(x.nbytes for x in jax.tree.leaves(params))
    print(f"one device holds {per_device:,} of the model's {whole:,} bytes "
          f"({per_device / whole:.1%})")

# %% [raw]
# # BEGIN QUESTION
# name: q4_fsdp_step
# points: 3

# %% [markdown]
# **Task 4** (`q4_fsdp_step`). Define `fsdp_loss_and_grad(params, tokens, mesh, n_heads)`,
# returning the tuple `(loss, grads)`: the value of `loss_fn(params, tokens, n_heads)` and its
# gradient in `params`, for parameters in the `fsdp_specs` layout and tokens split by rows over
# `data`, on any `data` × `model` mesh (the hidden check uses 4 × 2 and 2 × 4). Run the layers
# with `lax.scan`, and inside its body constrain the layer's weights to the tensor-parallel
# layout of Part A (the gather, one layer at a time); constrain the gradients to the
# `fsdp_specs` layout before returning them. Gather the embedding, position and unembedding
# tables the same way, before they are used (constrain them to their Part A layout,
# replicated): left split over `data`, the embedding's layout spreads into the activations,
# and the compiler must reshard them by copying whole arrays (newer JAX warns about an
# "Involuntary full rematerialization"; the check does not require this gather). Keep the
# activations' constraints of Task 2 if you like. The hidden check calls it under `jax.jit`
# (with `mesh` and `n_heads` fixed); the
# compiled step must need at most a quarter of the argument bytes, per device, of the
# replicated step `jax.value_and_grad(loss_fn)`.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def fsdp_loss_and_grad(params, tokens, mesh, n_heads):
    def constrain(tree, specs):
        return jax.tree.map(lambda x, spec: lax.with_sharding_constraint(
            x, NamedSharding(mesh, spec)), tree, specs, is_leaf=lambda x: isinstance(x, P))

    tp = tp_specs(params)
    # one layer's slice has no layer axis: drop the first entry of each spec
    layer_tp = {name: P(*spec[1:]) for name, spec in tp["layers"].items()}
    tables = ("embed", "pos", "unembed")

    def loss(params):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        # gathered before use: left split over 'data', embed's layout reaches the activations
        top = constrain({k: params[k] for k in tables}, {k: tp[k] for k in tables})
        x = top["embed"][inputs] + top["pos"][:inputs.shape[1]]

        def body(x, p):
            return block(x, constrain(p, layer_tp), n_heads), None

        x, _ = lax.scan(body, x, params["layers"])
        return cross_entropy(rms_norm(x, params["norm_f"]) @ top["unembed"], targets)

    value, grads = jax.value_and_grad(loss)(params)
    return value, constrain(grads, fsdp_specs(params))
# END SOLUTION
""" # BEGIN PROMPT
fsdp_loss_and_grad = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q4_form(fsdp_loss_and_grad):
    import jaxlab_form as form
    form.expect_callable("fsdp_loss_and_grad", form.evidence(fsdp_loss_and_grad))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q4_fsdp_step(fsdp_loss_and_grad):
    import jaxlab_lab7
    jaxlab_lab7.check("q4_fsdp_step", fsdp_loss_and_grad=fsdp_loss_and_grad)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(tp_specs, fsdp_specs, fsdp_loss_and_grad):
    fsdp_step = jax.jit(partial(fsdp_loss_and_grad, mesh=mesh, n_heads=cfg.n_heads))
    compiled_fsdp = fsdp_step.lower(fsdp_params, data_tokens).compile()
    compiled_replicated = jax.jit(jax.value_and_grad(partial(loss_fn, n_heads=cfg.n_heads))
                                  ).lower(params, tokens).compile()
    loss_value, grads = fsdp_step(fsdp_params, data_tokens)
    print(f"loss {float(loss_value):.4f}; the gradient of wq is laid out "
          f"{grads['layers']['wq'].sharding.spec}")
    for name, compiled in (("replicated", compiled_replicated), ("FSDP x TP", compiled_fsdp)):
        memory = compiled.memory_analysis()
        print(f"{name:10s}: arguments {memory.argument_size_in_bytes:>9,d} B per device, "
              f"collectives {collectives(compiled)}")
    del compiled_fsdp, compiled_replicated, compiled
    free_compiled()

# %% [markdown]
# The gathers appear as `all-gather`s of the weights. On the CPU backend the reduction of the
# gradients over `data` shows up as an `all-reduce` whose result each device then slices (a
# reduce-scatter in effect); on GPUs and TPUs the compiler usually emits a `reduce-scatter`.

# %% [markdown]
# ## Part C: mixed precision and gradient accumulation
#
# ### bfloat16 products, float32 everything else
#
# Accelerators multiply `bfloat16` matrices several times faster than `float32` ones, and a
# `bfloat16` activation takes half the memory. But `bfloat16` keeps only 8 bits of mantissa
# (about 3 decimal digits): a parameter update of one part in a thousand would vanish when added
# to a `bfloat16` weight, and a long sum in `bfloat16` loses its small terms. The standard
# recipe, **mixed precision**, therefore:
#
# * keeps the **master parameters** (and the optimizer's state) in `float32`;
# * casts the two operands of every **matrix product** to `bfloat16` just before it, and asks
#   for the products to be **accumulated and returned in `float32`**:
#   `jnp.matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)`
#   (`jnp.einsum` takes `preferred_element_type` too);
# * computes the norms, the softmax and the loss in `float32`.
#
# The gradient of a `float32` parameter through a cast is `float32` again, so `jax.grad` gives
# `float32` gradients without further work. In the traced program each product is a
# `dot_general` whose operands are `bf16` and whose `preferred_element_type` is `float32`:

# %%
a = jnp.ones((4, 8))
print(jax.make_jaxpr(lambda a: jnp.matmul(a.astype(jnp.bfloat16), a.T.astype(jnp.bfloat16),
                                          preferred_element_type=jnp.float32))(a))

# %% [raw]
# # BEGIN QUESTION
# name: q5_mixed_precision
# points: 2

# %% [markdown]
# **Task 5** (`q5_mixed_precision`). Define `mp_loss(params, tokens, n_heads)`: `loss_fn` in
# mixed precision. Every matrix product of the model (the projections `wq`, `wk`, `wv`, `wo`,
# `w1`, `w2` and `unembed`, and the two products inside `attention`) must take `bfloat16`
# operands and accumulate in `float32` (`preferred_element_type=jnp.float32`); everything else
# stays `float32`, and `params` stay `float32` (cast inside the function). For any config, its
# value must be within 2% of `loss_fn`'s, and its gradient (`jax.grad`) `float32` and within
# 10% of `loss_fn`'s (measured as the norm of the difference over the norm of the float32
# gradient, for each parameter).

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def mp_loss(params, tokens, n_heads):
    def mm(spec, a, b):
        return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32)

    def mp_block(x, p):
        B, S, D = x.shape
        h = rms_norm(x, p["norm1"])
        q, k, v = [mm("bsd,de->bse", h, p[w]).reshape(B, S, n_heads, D // n_heads)
                   for w in ("wq", "wk", "wv")]
        scores = mm("bshd,bthd->bhst", q, k) / math.sqrt(D // n_heads)
        causal = jnp.arange(S)[:, None] >= jnp.arange(S)[None, :]
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
        heads = mm("bhst,bthd->bshd", weights, v).reshape(B, S, D)
        x = x + mm("bsd,de->bse", heads, p["wo"])
        h = rms_norm(x, p["norm2"])
        return x + mm("bsf,fd->bsd", jax.nn.gelu(mm("bsd,df->bsf", h, p["w1"])), p["w2"]), None

    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"][inputs] + params["pos"][:inputs.shape[1]]
    x, _ = lax.scan(mp_block, x, params["layers"])
    logits = mm("bsd,dv->bsv", rms_norm(x, params["norm_f"]), params["unembed"])
    return cross_entropy(logits, targets)
# END SOLUTION
""" # BEGIN PROMPT
mp_loss = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q5_form(mp_loss):
    import jaxlab_form as form
    form.expect_callable("mp_loss", form.evidence(mp_loss))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q5_mixed_precision(mp_loss):
    import jaxlab_lab7
    jaxlab_lab7.check("q5_mixed_precision", mp_loss=mp_loss)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(mp_loss):
    full, mixed = (float(f(params, tokens, cfg.n_heads)) for f in (loss_fn, mp_loss))
    print(f"loss: float32 {full:.5f}, mixed precision {mixed:.5f} "
          f"({abs(mixed - full) / full:.2%} apart)")
    grad_dtypes = {str(g.dtype) for g in jax.tree.leaves(
        jax.grad(mp_loss)(params, tokens, cfg.n_heads))}
    print("gradient dtypes:", grad_dtypes)
    free_compiled()

# %% [markdown]
# ### Gradient accumulation
#
# A large batch may not fit: the activations a backward pass keeps grow with the batch. Then
# split the batch into `n_micro` **microbatches** of equal size, compute the loss and gradient
# of each in turn, and average them. With equal microbatches the average of their mean losses
# is the mean loss of the whole batch, and likewise for the gradients: the result is the same
# step, computed with the memory of one microbatch.
#
# Written as a `lax.scan` over the microbatches (`tokens.reshape(n_micro, -1, seq)` gives them
# one after another on a new leading axis), the compiler sees one microbatch's program and a
# carried running sum, and its temporary memory is that of one microbatch.

# %% [raw]
# # BEGIN QUESTION
# name: q6_accumulation
# points: 2

# %% [markdown]
# **Task 6** (`q6_accumulation`). Define `accumulated_loss_and_grad(params, tokens, n_heads,
# n_micro)`, returning the tuple `(loss, grads)` of `jax.value_and_grad(loss_fn)(params, tokens,
# n_heads)`, computed over `n_micro` equal microbatches (consecutive rows of `tokens`; `n_micro`
# divides the batch) with a `lax.scan` of length `n_micro` that accumulates the sums. It must
# work for any config and any `n_micro` that divides the batch, 1 included; compiled for a batch
# of 64 in 8 microbatches it must need less than half of the full batch's temporary memory.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def accumulated_loss_and_grad(params, tokens, n_heads, n_micro):
    micro = tokens.reshape(n_micro, tokens.shape[0] // n_micro, tokens.shape[1])
    step = jax.value_and_grad(loss_fn)

    def body(total, batch):
        loss, grads = step(params, batch, n_heads)
        return jax.tree.map(jnp.add, total, (loss, grads)), None

    zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = lax.scan(body, zero, micro)
    return loss / n_micro, jax.tree.map(lambda g: g / n_micro, grads)
# END SOLUTION
""" # BEGIN PROMPT
accumulated_loss_and_grad = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q6_form(accumulated_loss_and_grad):
    import jaxlab_form as form
    form.expect_callable("accumulated_loss_and_grad", form.evidence(accumulated_loss_and_grad))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q6_accumulation(accumulated_loss_and_grad):
    import jaxlab_lab7
    jaxlab_lab7.check("q6_accumulation", accumulated_loss_and_grad=accumulated_loss_and_grad)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(accumulated_loss_and_grad):
    big = jax.ShapeDtypeStruct((64, cfg.seq), jnp.int32)
    full_temp = jax.jit(jax.value_and_grad(partial(loss_fn, n_heads=cfg.n_heads))).lower(
        params, big).compile().memory_analysis().temp_size_in_bytes
    print(f"batch 64 in one piece: {full_temp / MiB:.2f} MiB of temporary memory")
    for n_micro in (2, 8):
        temp = jax.jit(partial(accumulated_loss_and_grad, n_heads=cfg.n_heads, n_micro=n_micro)
                       ).lower(params, big).compile().memory_analysis().temp_size_in_bytes
        print(f"           in {n_micro} microbatches: {temp / MiB:.2f} MiB")
    free_compiled()

# %% [markdown]
# ## Part D: sharded checkpoints
#
# A long run is stopped and restarted many times: by crashes, by preemption, to move to other
# hardware. Its **train state** (parameters, optimizer state, step number) must be saved as it
# is laid out, each device writing its own blocks, without first gathering the whole model on
# one host. And it must be restorable onto **another mesh**: the restarted job may have fewer
# or more devices, or arrange them differently.
#
# [Orbax](https://orbax.readthedocs.io) does both. `ocp.StandardCheckpointer()` saves a pytree of
# arrays to a directory (`.save(path, state)`, which writes **in the background**: call
# `.wait_until_finished()` before relying on the files) and restores it (`.restore(path,
# target)`). The `target` says what to restore *into*: a pytree of the same structure whose
# leaves are `jax.ShapeDtypeStruct(shape, dtype, sharding=...)`, each array's shape, dtype and
# the sharding it should have now, on the new mesh. Orbax reads, on each device, just the
# blocks it needs. The path must be absolute and must not exist yet when saving.
#
# `jax.eval_shape(f, *args)` gives the shapes and dtypes of what `f` would return, without
# computing it: an easy way to describe a state you have not restored yet.

# %%
abstract_state = jax.eval_shape(lambda: {"params": init_params(jax.random.key(0), cfg),
                                         "step": jnp.zeros((), jnp.int32)})
print(jax.tree.map(lambda s: f"{s.dtype}{list(s.shape)}", abstract_state))

# %% [raw]
# # BEGIN QUESTION
# name: q7_checkpoint
# points: 2

# %% [markdown]
# **Task 7** (`q7_checkpoint`). Define two functions with Orbax:
#
# * `save_state(path, state)`: save the train state `state = {"params": ..., "step": ...}`
#   (sharded arrays, on any mesh) to the directory `path`, and return only when it is written;
# * `restore_state(path, abstract_state, mesh)`: restore the state saved at `path`, where
#   `abstract_state` gives its structure, shapes and dtypes (as `jax.eval_shape` does, no
#   shardings), onto `mesh` (a `data` × `model` mesh of any shape, on any number of devices):
#   the parameters in the `fsdp_specs` layout, the step replicated. Return the restored state.
#
# The hidden check restores your checkpoints with Orbax itself, and restores with your
# `restore_state` checkpoints that Orbax itself wrote, on meshes of 2 × 2 devices and 8 × 1.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def save_state(path, state):
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, state)
    checkpointer.wait_until_finished()


def restore_state(path, abstract_state, mesh):
    specs = {"params": fsdp_specs(abstract_state["params"]), "step": P()}
    target = jax.tree.map(
        lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                             sharding=NamedSharding(mesh, spec)),
        abstract_state, specs)
    return ocp.StandardCheckpointer().restore(path, target)
# END SOLUTION
""" # BEGIN PROMPT
save_state = ...
restore_state = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q7_form(save_state, restore_state):
    import jaxlab_form as form
    form.expect_callable("save_state", form.evidence(save_state))
    form.expect_callable("restore_state", form.evidence(restore_state))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q7_checkpoint(save_state, restore_state):
    import jaxlab_lab7
    jaxlab_lab7.check("q7_checkpoint", save_state=save_state, restore_state=restore_state)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
small_mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                           devices=devices[:4])
if answered(fsdp_specs, save_state, restore_state):
    demo_dir = tempfile.mkdtemp()
    save_state(os.path.join(demo_dir, "demo"), {"params": fsdp_params,
                                                 "step": jnp.array(0, jnp.int32)})
    print("files:", sorted(os.listdir(os.path.join(demo_dir, "demo"))))
    restored = restore_state(os.path.join(demo_dir, "demo"), abstract_state, small_mesh)
    show_layout(restored["params"])
    free_compiled()

# %% [markdown]
# ## Part E: how well is the hardware used?
#
# ### FLOPs of one training step
#
# Count the matrix products; everything else (norms, softmax, `gelu`, the embedding lookup) is a
# few operations per number, negligible beside them. A product of an `(m, k)` by a `(k, n)`
# matrix takes `2·m·k·n` FLOPs (a multiply and an add per term). For a batch of `B` sequences
# of `S` tokens, the forward pass takes:
#
# * per layer, the four `d_model × d_model` projections and the two MLP matrices:
#   `2·B·S·(4·D² + 2·D·F)`;
# * per layer, attention's two products (scores `q·kᵀ`, then weights times values), each
#   `2·B·S·S·D` over all heads together (count the whole `S × S` square: the causal mask does not
#   save work here);
# * once, the unembedding: `2·B·S·D·V`.
#
# The backward pass takes **twice** the forward's FLOPs (for each product, one product for the
# gradient of each operand), so a training step takes **3 ×** the forward.
#
# The compiled program's `.cost_analysis()['flops']` counts FLOPs too (every operation, so a bit
# more), but, as Lab 6 showed, it counts **the body of a loop once**: for our scan over the
# layers it does not grow with `n_layers`.

# %%
def compiled_flops(n_layers, batch=BATCH):
    layer_cfg = cfg._replace(n_layers=n_layers)
    shapes = jax.eval_shape(lambda: init_params(jax.random.key(0), layer_cfg))
    step = jax.jit(jax.value_and_grad(partial(loss_fn, n_heads=cfg.n_heads)))
    cost = step.lower(shapes, jax.ShapeDtypeStruct((batch, cfg.seq), jnp.int32)).compile()
    cost = cost.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # a list of one dict in older JAX
    return cost.get("flops", float("nan"))


LAYER_COUNTS = (1, 2, 4)
counted = {n: compiled_flops(n) for n in LAYER_COUNTS}
for n in LAYER_COUNTS:
    print(f"{n} layer(s): cost_analysis counts {counted[n]:,.0f} FLOPs per step")
free_compiled()

# %% [raw]
# # BEGIN QUESTION
# name: q8_step_flops
# points: 1

# %% [markdown]
# **Task 8** (`q8_step_flops`). Define `step_flops(cfg, batch, seq)`: the FLOPs of one training
# step (forward and backward, 3 × the forward) of the model with config `cfg` on `batch`
# sequences of `seq` tokens, counting exactly the matrix products listed above (use `seq` for
# `S`, not `cfg.seq`). Return a Python `int`.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def step_flops(cfg, batch, seq):
    D, F, V, L = cfg.d_model, cfg.d_ff, cfg.vocab, cfg.n_layers
    tokens = batch * seq
    per_layer = 2 * tokens * (4 * D * D + 2 * D * F) + 2 * (2 * batch * seq * seq * D)
    return 3 * (L * per_layer + 2 * tokens * D * V)
# END SOLUTION
""" # BEGIN PROMPT
step_flops = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q8_form(step_flops):
    import jaxlab_form as form
    form.expect_callable("step_flops", form.evidence(step_flops))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q8_step_flops(step_flops):
    import jaxlab_lab7
    jaxlab_lab7.check("q8_step_flops", step_flops=step_flops)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(step_flops):
    for n in LAYER_COUNTS:
        print(f"{n} layer(s): step_flops {step_flops(cfg._replace(n_layers=n), BATCH, cfg.seq - 1):,d}"
              f", cost_analysis {counted[n]:,.0f}")

# %% [markdown]
# With one layer the two agree to within the elementwise work the count leaves out; with more,
# only `step_flops` grows.
#
# ### Timing a step fairly, and MFU
#
# Two traps make a naive timing wrong:
#
# * the **first call compiles** the function (seconds, here more than the step itself), and
#   its first run is often slower too (memory is allocated, caches warm up): call it once, and
#   wait for it, before the clock starts;
# * JAX **dispatches asynchronously**: a call returns as soon as the work is queued, long before
#   it is done. Block on the result (`jax.block_until_ready(out)`) before reading the clock, or
#   you time the queueing.
#
# Time several steps and divide. The **model FLOPs utilisation** is then the share of the
# hardware's peak that the model's own FLOPs achieve: `MFU = step FLOPs / step seconds / peak
# FLOP/s`. It counts only the FLOPs the model needs (`step_flops`), not those the program spends
# on recomputation or overhead; well-tuned large runs reach 40 to 60%.

# %% [raw]
# # BEGIN QUESTION
# name: q9_utilisation
# points: 2

# %% [markdown]
# **Task 9** (`q9_utilisation`). Define
#
# * `time_step(step, args, repeats)`: the seconds one call `step(*args)` takes, as a Python
#   `float`: call it once first and block on its result (compilation and a first run, which is
#   often slower, not timed), then time `repeats` calls with `time.perf_counter()`, blocking on
#   the result with `jax.block_until_ready` before the clock stops, and divide by `repeats`;
# * `mfu(flops, seconds, peak_flops_per_s)`: the model FLOPs utilisation (a Python `float`
#   between 0 and 1 for a real step).
#
# The hidden check times steps of its own whose compilation and queued work take known times.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def time_step(step, args, repeats):
    jax.block_until_ready(step(*args))  # compiles
    start = time.perf_counter()
    for _ in range(repeats):
        out = step(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def mfu(flops, seconds, peak_flops_per_s):
    return flops / seconds / peak_flops_per_s
# END SOLUTION
""" # BEGIN PROMPT
time_step = ...
mfu = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q9_form(time_step, mfu):
    import jaxlab_form as form
    form.expect_callable("time_step", form.evidence(time_step))
    form.expect_callable("mfu", form.evidence(mfu))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q9_utilisation(time_step, mfu):
    import jaxlab_lab7
    jaxlab_lab7.check("q9_utilisation", time_step=time_step, mfu=mfu)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %% [markdown]
# ## Putting it together: a short training run
#
# The token stream below is a toy language: each sequence counts upward from a random start,
# by a step of 1, 2 or 3 chosen per sequence (modulo `vocab`). After seeing two tokens a model
# can predict the rest, so the loss can fall far below `ln vocab`.
#
# The run trains with FSDP × TP on the 4 × 2 mesh (your `fsdp_loss_and_grad`, plain gradient
# descent), saves the state half way (`save_state`), restores it on the 2 × 2 mesh of 4 devices
# (`restore_state`) and continues there. If everything is right, the continued curve lies on
# the uninterrupted one: the same state, the same data, another mesh.

# %%
STEPS, LEARNING_RATE = 40, 0.5


def toy_batch(step, batch=BATCH):
    rng = np.random.default_rng(step)
    start = rng.integers(0, cfg.vocab, (batch, 1))
    stride = rng.integers(1, 4, (batch, 1))
    return jnp.asarray((start + stride * np.arange(cfg.seq)) % cfg.vocab, dtype=jnp.int32)


def make_train_step(mesh):
    @jax.jit
    def train_step(state, tokens):
        loss, grads = fsdp_loss_and_grad(state["params"], tokens, mesh, cfg.n_heads)
        new = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, state["params"], grads)
        return {"params": new, "step": state["step"] + 1}, loss
    return train_step


def train(state, mesh, first, last):
    train_step, losses = make_train_step(mesh), []
    batch_layout = NamedSharding(mesh, P("data", None))
    for step in range(first, last):
        state, loss = train_step(state, jax.device_put(toy_batch(step), batch_layout))
        losses.append(float(loss))
    return state, losses


if answered(fsdp_specs, fsdp_loss_and_grad, save_state, restore_state):
    state = {"params": fsdp_params, "step": jnp.array(0, jnp.int32)}
    half, losses = train(state, mesh, 0, STEPS // 2)
    run_dir = tempfile.mkdtemp()
    save_state(os.path.join(run_dir, "half"), half)
    _, rest = train(half, mesh, STEPS // 2, STEPS)
    resumed = restore_state(os.path.join(run_dir, "half"), abstract_state, small_mesh)
    print(f"restored at step {int(resumed['step'])} on a {dict(small_mesh.shape)} mesh")
    _, resumed_losses = train(resumed, small_mesh, STEPS // 2, STEPS)
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    ax.plot(range(STEPS), losses + rest, marker=".", label="4 × 2 mesh, uninterrupted")
    ax.plot(range(STEPS // 2, STEPS), resumed_losses, linestyle="--", marker="x",
            label="restored from the checkpoint on 2 × 2")
    ax.axvline(STEPS // 2 - 0.5, color="grey", linewidth=0.8)
    ax.axhline(math.log(cfg.vocab), color="grey", linestyle=":", label="uniform guess")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss")
    ax.set_title("FSDP × TP training, checkpointed half way")
    ax.legend()
    fig.tight_layout()
    plt.show()
    print(f"loss {losses[0]:.3f} → {rest[-1]:.3f}; the resumed run ends at "
          f"{resumed_losses[-1]:.3f}")
    free_compiled()

# %% [markdown]
# Last, the utilisation of one step of this run. A CPU's peak depends on the machine; the figure
# below assumes a nominal 50 GFLOP/s per device, so read it as an illustration of the method.
# On real accelerators the same three lines, with the chip's peak, give the MFU a paper reports.

# %%
NOMINAL_PEAK = N_DEVICES * 50e9
if answered(fsdp_loss_and_grad, step_flops, time_step, mfu):
    train_step = make_train_step(mesh)
    args = ({"params": fsdp_params, "step": jnp.array(0, jnp.int32)},
            jax.device_put(toy_batch(0), NamedSharding(mesh, P("data", None))))
    seconds = time_step(train_step, args, 10)
    flops = step_flops(cfg, BATCH, cfg.seq - 1)
    print(f"{flops:,d} FLOPs per step in {seconds * 1e3:.2f} ms: "
          f"{flops / seconds / 1e9:.2f} GFLOP/s, MFU {mfu(flops, seconds, NOMINAL_PEAK):.2%} of "
          "the nominal peak")
    free_compiled()

# %% [markdown]
# ## Submitting
#
# Run the whole notebook from the top (*Kernel → Restart & Run All*), check that every
# `grader.check` cell says the public checks passed, then run the cell below.
