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
#   `data`, gathered one layer at a time inside the scan over the layers, and gathered again in
#   the backward pass (rematerialization) so that no device ever holds more than one layer's
#   gathered weights;
# * **C.** mixed precision and gradient accumulation: bfloat16 matrix products with float32
#   parameters, and a batch processed in microbatches;
# * **D.** sharded checkpoints (Orbax), restored onto a mesh of another shape;
# * **E.** how well the hardware is used: FLOPs per step, a fairly measured step time, and the
#   model FLOPs utilisation (MFU);
# * **F.** all of it in one training step: FSDP × TP in mixed precision over microbatches, with
#   AdamW.
#
# At the end one run uses every part: your Task 10 step with AdamW (its state sharded like the
# parameters) brings the loss down, is saved half way with Orbax's `CheckpointManager`,
# restored on a smaller mesh of another shape and continued: the two halves of the loss curve
# join. Cells beside the text measure what it says the compiler does (which collectives run,
# forward and backward; memory per device; FLOPs) on the notebook's own sizes, so you can check
# every claim against the compiled programs.
#
# ## How this lab works
#
# * Every task has one cell that starts with `### Your code here`. Replace the `...` with your
#   answer and run it. The cell after it, `grader.check("q…")`, runs the **public checks**: they
#   call your functions on the notebook's own parameters, tokens and meshes, compare the results
#   with the notebook's single-device model (`forward`, `loss_fn`) and with the layouts of the
#   text's tables, and read the program your function traces the way the hidden checks do (the
#   layouts it asks for, the dtypes of its matrix products, its loops, what its backward pass
#   keeps). On a laptop CPU the slowest takes a few seconds.
# * **Hidden checks** run when your notebook is graded: they call your functions on **new
#   random parameters and tokens, of other sizes** (other numbers of layers, widths, heads and
#   batch sizes, and the meshes the task names), compare the results with references computed
#   from the lab's own model, and read the program your function traces (`jax.make_jaxpr`) or
#   compiles (`.lower(...).compile()`). So follow the method each task describes, not only its
#   numbers, and make it work for any sizes the task allows.
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

import contextlib
import functools
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
#   the result; one all-reduce over `model` adds the partial sums up;
# * everything else (the embeddings, the position table, the norms' scales, the unembedding)
#   is small here and **replicated**.
#
# So the **forward pass** of a block needs two all-reduces over `model`, one after attention and
# one after the MLP. The **backward pass** needs its own: the gradient with respect to the input
# of a column-split product (the `h` of `h @ wq`, `h @ wk`, `h @ wv`, and of `h @ w1`) is again a
# partial sum over `model`, so Megatron's backward pass all-reduces it, once for attention's
# input and once for the MLP's; and, as in any data parallelism, each weight's gradient is
# summed over `data`. The cell after Task 2 counts these collectives in the compiled programs.
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

# %% [markdown]
# ### Two kinds of mesh axes: why this lab's are `Auto`
#
# The mesh above is made with `axis_types=(AxisType.Auto, AxisType.Auto)`. Lab 3 also used
# **Explicit** axes, and since JAX 0.9 `jax.make_mesh` makes Explicit axes unless told
# otherwise. The two differ in who decides the layout of each intermediate value:
#
# * on **Explicit** axes the layout is part of the value's type: `jax.typeof(x)` prints it
#   (`float32[16@data,64]`: rows split over `data`), every operation's result gets its layout
#   from its operands by fixed rules, an operation whose result layout would be ambiguous is an
#   error that asks you to choose (`out_sharding=`), and you change a layout with
#   `jax.sharding.reshard(x, spec)` (inside `with jax.set_mesh(mesh):` a bare
#   `PartitionSpec` names the mesh's axes);
# * on **Auto** axes the compiler chooses the layouts under `jax.jit` from those of the inputs
#   (Lab 3's first section), and `jax.lax.with_sharding_constraint(x, NamedSharding(mesh,
#   spec))` pins the layout of a value where you want one. `jax.typeof` then shows no layout.
#
# This lab's model (`forward`, `block`) is written without layouts, as most model code is, and
# lets the compiler lay out everything you do not pin: that is Auto mode, and the tasks pin
# layouts with `with_sharding_constraint`. The constraint refuses Explicit axes. The cell
# below shows the default, the typed layouts of Explicit mode, that refusal and `reshard`, its
# Explicit-mode equivalent:

# %% tags=["claim:lab7-axis-types"]
default_mesh = jax.make_mesh((4, 2), ("data", "model"), devices=devices)  # no axis_types
print("jax.make_mesh's default axis types:", default_mesh.axis_types)  # Auto before JAX 0.9
explicit_mesh = jax.make_mesh((4, 2), ("data", "model"), devices=devices,
                              axis_types=(jax.sharding.AxisType.Explicit,) * 2)
rows_split = jax.device_put(jnp.ones((BATCH, cfg.d_model)), NamedSharding(explicit_mesh,
                                                                          P("data", None)))
print("Explicit: jax.typeof(x) =", jax.typeof(rows_split))
try:
    jax.jit(lambda x: lax.with_sharding_constraint(
        x, NamedSharding(explicit_mesh, P("data", "model"))))(rows_split)
    print("with_sharding_constraint on Explicit axes: accepted")
except ValueError as error:
    print("with_sharding_constraint on Explicit axes: ValueError:",
          str(error).split(" Got ")[0], "…", str(error).rsplit(". ", 1)[-1])
with jax.set_mesh(explicit_mesh):
    resharded = jax.jit(lambda x: jax.sharding.reshard(x, P("data", "model")))(rows_split)
print("Explicit: jax.typeof(reshard(x, P('data', 'model'))) =", jax.typeof(resharded))
auto_rows = jax.device_put(jnp.ones((BATCH, cfg.d_model)), NamedSharding(mesh, P("data", None)))
print("Auto: jax.typeof(x) =", jax.typeof(auto_rows), "and its sharding's spec is",
      auto_rows.sharding.spec)
del rows_split, resharded, auto_rows, default_mesh

# %% [raw]
# # BEGIN QUESTION
# name: q1_tp_specs
# points: 1

# %% [markdown]
# **Task 1** (`q1_tp_specs`). Define `tp_specs(params)`: a dict of the same structure as
# `params` (the same keys, nested the same way) whose leaves are `PartitionSpec`s of the
# Megatron layout above: `wq`, `wk`, `wv` and `w1` split by columns over `model`, `wo` and `w2`
# by rows over `model`, every other parameter replicated (`P()`). It must work for any config
# (the hidden check builds `params` with other sizes, `d_ff` smaller than `d_model` too); only
# the structure of `params` matters.

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
def test_q1_public(tp_specs, params):
    """tp_specs(params) on the notebook's params, leaf by leaf against Part A's layout."""
    import jax
    import jaxlab_form as form

    form.expect_callable("tp_specs", form.evidence(tp_specs))
    columns = [None, None, "model"], "split by its columns (output dimension) over 'model'"
    rows = [None, "model", None], "split by its rows (input dimension) over 'model'"
    table = {"wq": columns, "wk": columns, "wv": columns, "w1": columns, "wo": rows, "w2": rows}
    try:
        got = form.evidence(tp_specs(params))
    except Exception as exc:
        raise AssertionError(f"`tp_specs(params)` raised {form.student_error(exc)} on the "
                             "notebook's params.") from None

    def leaves(ev, path=()):
        if ev["kind"] != "dict":
            return {path: ev}
        return {p: leaf for key, value in ev["items"]
                for p, leaf in leaves(value, path + (key.get("value"),)).items()}

    def trimmed(entries):
        entries = list(entries)
        while entries and entries[-1] is None:
            entries.pop()
        return entries

    found = leaves(got) if got["kind"] == "dict" else {}
    wanted = [tuple(k.key for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(
        params)[0]]
    if sorted(found, key=str) != sorted(wanted, key=str):
        raise AssertionError(
            f"`tp_specs(params)` returned {form.describe(got)} with the leaves "
            f"{sorted('/'.join(map(str, p)) for p in found)}; expected a dict of the structure "
            f"of `params`: {sorted('/'.join(p) for p in wanted)}.")
    for path in wanted:
        spec, how = table[path[-1]] if path[0] == "layers" and path[-1] in table else \
            ([], "replicated")
        leaf = found[path]
        where = "".join(f"[{k!r}]" for k in path)
        if leaf["kind"] != "spec":
            raise AssertionError(f"`tp_specs(params){where}` is {form.describe(leaf)}; expected "
                                 "a PartitionSpec.")
        if trimmed(leaf["entries"]) != trimmed(spec):
            raise AssertionError(
                f"`tp_specs(params){where}` is {form.spec_repr(leaf['entries'])}; expected "
                f"{form.spec_repr(spec)} ({path[-1]} is {how}).")

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
# With these, each device computes attention for its own examples and its own heads only.

# %% [raw]
# # BEGIN QUESTION
# name: q2_tp_forward
# points: 2

# %% [markdown]
# **Task 2** (`q2_tp_forward`). Define `tp_forward(params, tokens, mesh, n_heads)`: the logits
# of `forward`, for parameters laid out by `tp_specs` and tokens `(batch, seq)` split by rows
# over `data`, on a 2-D mesh with axes `data` and `model` of any sizes that split the work
# evenly: the `data` size divides the batch, and the `model` size divides `n_heads` and `d_ff`
# (so `d_model` too). The hidden check uses 4 × 2 and 2 × 4. Inside the scan's body, constrain
# the queries, keys and values (each, as 4-D arrays) and the MLP's hidden units to the layouts
# of the table, and the residual stream after each block to `P('data', None, None)`. The hidden
# check calls it under `jax.jit` (with `mesh` and `n_heads` fixed), so it must be traceable; its
# values must equal `forward`'s.

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
def test_q2_public(tp_forward, forward, params, tokens, mesh, cfg):
    """tp_forward on the notebook's params, tokens and mesh: forward's logits, and the layouts
    the table asks for, pinned inside the scan's body (read from its jaxpr)."""
    import jax
    import numpy as np
    import jaxlab_form as form
    from jax.sharding import NamedSharding, PartitionSpec as P

    form.expect_callable("tp_forward", form.evidence(tp_forward))
    form.free_kernel_memory()  # what was compiled before this check
    split = {"wq": P(None, None, "model"), "wk": P(None, None, "model"),
             "wv": P(None, None, "model"), "w1": P(None, None, "model"),
             "wo": P(None, "model", None), "w2": P(None, "model", None)}
    placed = jax.tree_util.tree_map_with_path(lambda path, x: jax.device_put(x, NamedSharding(
        mesh, split.get(path[-1].key, P()) if path[0].key == "layers" else P())), params)
    data_tokens = jax.device_put(tokens, NamedSharding(mesh, P("data", None)))
    run = jax.jit(lambda p, t: tp_forward(p, t, mesh, cfg.n_heads))
    call = ("tp_forward(params, tokens, mesh, n_heads) on the notebook's params (laid out as in "
            "Part A), tokens and 4 × 2 mesh")
    try:
        logits = jax.block_until_ready(run(placed, data_tokens))
    except Exception as exc:
        raise AssertionError(f"`{call}` under jax.jit raised {form.student_error(exc)}.") from None
    form.expect_close(call, logits, forward(params, tokens, cfg.n_heads),
                      "the logits of `forward` on one device", rtol=1e-3, atol=1e-4)
    layout = form.evidence(logits)["sharding"]
    if layout.get("spec", [None])[:1] != ["data"]:
        raise AssertionError(f"`{call}` returns logits laid out "
                             f"{form.describe_sharding(layout)}; expected them split by "
                             "examples over 'data', as the residual stream is.")
    steps = []

    def walk(jaxpr, scans):
        for eqn in jaxpr.eqns:
            steps.append((eqn, scans))
            inner = scans + [eqn.params["length"]] if eqn.primitive.name == "scan" else scans
            for sub in form._sub_jaxprs(eqn.params):
                walk(sub, inner)

    walk(jax.make_jaxpr(run)(placed, data_tokens).jaxpr, [])

    def trimmed(entries):
        entries = [None if e is None else e for e in entries]
        while entries and entries[-1] is None:
            entries.pop()
        return entries

    B, S = tokens.shape
    H, D, F, L = cfg.n_heads, cfg.d_model, cfg.d_ff, cfg.n_layers
    wanted = (((B, S, H, D // H), ["data", None, "model", None], 3,
               f"the queries, keys and values (each, as 4-D arrays of shape {(B, S, H, D // H)})"),
              ((B, S, F), ["data", None, "model"], 1,
               f"the MLP's hidden units (shape {(B, S, F)})"),
              ((B, S, D), ["data", None, None], 1,
               f"the residual stream after each block (shape {(B, S, D)})"))
    for shape, spec, count, what in wanted:
        found = [scans for eqn, scans in steps if eqn.primitive.name == "sharding_constraint"
                 and tuple(eqn.invars[0].aval.shape) == shape
                 and trimmed(form._spec_entry(e) for e in eqn.params["sharding"].spec)
                 == trimmed(spec)]
        inside = [scans for scans in found if scans[:1] == [L]]
        if len(inside) < count:
            where = " only outside the scan over the layers" if len(found) >= count else ""
            raise AssertionError(
                f"traced on the notebook's inputs, `tp_forward` constrains {what} to "
                f"{form.spec_repr(spec)} {len(found)} time(s){where}; expected "
                f"{'each of them' if count > 1 else 'it'} constrained with "
                "jax.lax.with_sharding_constraint inside the scan's body.")

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

# %% [markdown]
# ### Reading the compiled program
#
# `jax.jit(f).lower(*args).compile()` gives the program XLA will run; `.as_text()` prints it.
# A loop (`lax.scan`) becomes a `while` whose body runs once per layer, and the backward pass
# of a scan is a second loop, run from the last layer to the first. The helper below lists the
# program's collectives: which loop each sits in (forward, backward, or outside the loops), over
# which mesh axes its groups of devices reach, and the bytes of its result on one device.

# %%
def collective_ops(compiled, mesh):
    """[(kind, where, over, bytes)] for each collective of a compiled program: `where` is
    'forward loop', 'backward loop' or 'outside the loops' (a loop's body runs once per layer),
    `over` the mesh axes its groups of devices span, `bytes` its result's size on one device."""
    kinds = "all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all"
    computations, name = {}, None
    for line in compiled.as_text().splitlines():
        head = re.match(r"(?:ENTRY )?%(\S+) ", line)
        if head:
            name, computations[head.group(1)] = head.group(1), []
        elif name:
            computations[name].append(line)
    where = {}  # a loop's body, and what it calls, by the direction of its loop
    for lines in computations.values():
        for line in lines:
            loop = re.search(r" while\(.*body=%([\w.\-]+)", line)
            if loop:  # the backward pass's loops are traced under `transpose`
                label = "backward loop" if "transpose(" in line else "forward loop"
                stack = [loop.group(1)]
                while stack:
                    body = stack.pop()
                    if body not in where:
                        where[body] = label
                        for inner in computations.get(body, []):
                            stack += re.findall(r"(?:calls|body|condition|to_apply)=%([\w.\-]+)",
                                                inner)
    sizes = dict(mesh.shape)
    axes_of = {math.prod(sizes[a] for a in axes): " and ".join(f"'{a}'" for a in axes)
               for axes in ([a] for a in reversed(list(sizes)))}
    axes_of.setdefault(mesh.size, " and ".join(f"'{a}'" for a in sizes))
    element = {"f32": 4, "bf16": 2, "s32": 4, "f16": 2, "pred": 1, "s8": 1, "u8": 1, "f64": 8}
    found = []
    for body, lines in computations.items():
        for line in lines:
            op = re.match(rf"\s*(?:ROOT )?%\S+ = (.*?) ({kinds})(?:-start)?\((.*)", line)
            if not op:
                continue
            result, kind, rest = op.groups()
            size = sum(element.get(t, 4) * math.prod(int(n) for n in dims.split(",") if n)
                       for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", result))
            groups = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
            named = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", rest)
            listed = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
            if groups:
                group = int(groups.group(2))
            elif named:
                mesh_axes = dict(re.findall(r"'(\w+)'=(\d+)", named.group(1)))
                group = math.prod(int(mesh_axes[a]) for a in re.findall(r"'(\w+)'",
                                                                        named.group(2)))
            else:
                group = len(listed.group(1).split(",")) if listed else mesh.size
            found.append((kind, where.get(body, "outside the loops"),
                          axes_of.get(group, f"groups of {group}"), size))
    return found


def show_collectives(title, ops):
    """Print the collectives of `collective_ops`, grouped by loop, kind and axes."""
    print(title)
    for place in ("forward loop", "backward loop", "outside the loops"):
        here = [op for op in ops if op[1] == place]
        if not here:
            continue
        counts = {}
        for kind, _, over, size in here:
            counts.setdefault((kind, over), []).append(size)
        per = ", per layer" if place != "outside the loops" else ""
        print(f"  {place}{per}: " + "; ".join(
            f"{len(sizes)} {kind} over {over} ({sum(sizes):,d} B)"
            for (kind, over), sizes in sorted(counts.items())))

# %% tags=["claim:lab7-tp-collectives"]
if answered(tp_specs, tp_forward):
    data_tokens = jax.device_put(tokens, NamedSharding(mesh, P("data", None)))
    tp_jit = jax.jit(partial(tp_forward, mesh=mesh, n_heads=cfg.n_heads))
    logits = tp_jit(tp_params, data_tokens)
    gap = float(jnp.max(jnp.abs(logits - forward(params, tokens, cfg.n_heads))))
    print(f"logits {logits.shape}, laid out {logits.sharding.spec}; largest difference from "
          f"forward on one device: {gap:.2e}")
    show_collectives("forward pass (tp_forward, compiled):",
                     collective_ops(tp_jit.lower(tp_params, data_tokens).compile(), mesh))

    def tp_loss(params, tokens):
        return cross_entropy(tp_forward(params, tokens[:, :-1], mesh, cfg.n_heads),
                             tokens[:, 1:])

    show_collectives("training step (jax.value_and_grad of the loss through tp_forward):",
                     collective_ops(jax.jit(jax.value_and_grad(tp_loss)).lower(
                         tp_params, data_tokens).compile(), mesh))
    free_compiled()

# %% [markdown]
# In the forward pass each block all-reduces twice over `model` (after `wo`, after `w2`). The
# training step's backward loop adds Megatron's backward all-reduces over `model` (XLA puts the
# three input gradients of `wq`, `wk` and `wv` into one combined all-reduce, so count the bytes:
# three activations' worth for attention's input, one for the MLP's) and one all-reduce over
# `data` per layer that sums the layer's weight gradients over the batch; the gradients of the
# replicated tables are summed over `data` once, after the loop.

# %% [markdown]
# ## Part B: fully sharded data parallelism on top
#
# Tensor parallelism cut each weight matrix in 2 (the size of `model`); the 4 devices of each
# `model` column still hold the same halves. **FSDP** (ZeRO stage 3, Lab 6 did stage 1) removes
# that last copy: each weight matrix is *also* split over `data`, along its other dimension, so
# that every device stores 1/8 of it.
#
# * **Forward pass.** Just before a layer runs, its weights are **all-gathered** over `data`
#   back into the tensor-parallel layout of Part A. Gathered *one layer at a time, inside the
#   scan over the layers*, only one layer's gathered weights need to exist at once. In JAX that
#   is one `with_sharding_constraint` of the layer's slice of the weights to the Part A layout,
#   written inside the scan's body (a layer's slice has no layer axis: drop the first entry of
#   the spec); the compiler turns it into all-gathers.
# * **Backward pass.** Differentiating a scan saves, for the backward pass, what each step
#   computed from its inputs, and the gathered weights are such values: plain `jax.grad` keeps
#   every layer's gathered weights from the forward pass until the backward pass reaches that
#   layer, so that all of them are held at once, the whole tensor-parallel model again, and
#   FSDP saves nothing. The cure is **rematerialization**, as in Lab 6: put the scan's body
#   under `jax.checkpoint`. The forward pass then keeps only each layer's input, and the
#   backward pass runs each layer's forward computation again, **gathering its weights
#   again**. Every layer is gathered twice per step, once in each pass: FSDP as the scaling
#   book describes it. A remat policy may keep other values (Lab 6's
#   `jax.checkpoint_policies.dots_with_no_batch_dims_saveable` keeps the matrix products'
#   results), as long as it does not keep the gathered weights.
# * **Gradients.** As the backward pass reaches a layer, that layer's weight gradients are summed
#   over `data` into the fully sharded layout: each device keeps the sum over the batch of its
#   own 1/8. Constrain the gradients to the fully sharded layout and the compiler writes the
#   reduction (the transpose of the gather).
#
# The cell after Task 4 measures all three in the compiled program. The fully sharded layout of
# this lab:
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
# the table, for any config (the hidden check tries `d_ff` smaller than `d_model` too: each
# parameter's layout follows from its name, not from its shape).

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
def test_q3_public(fsdp_specs, params):
    """fsdp_specs(params) on the notebook's params, leaf by leaf against Part B's table."""
    import jax
    import jaxlab_form as form

    form.expect_callable("fsdp_specs", form.evidence(fsdp_specs))
    columns = [None, "data", "model"], "split by rows over 'data', columns over 'model'"
    rows = [None, "model", "data"], "split by rows over 'model', columns over 'data'"
    table = {("layers", n): columns for n in ("wq", "wk", "wv", "w1")}
    table.update({("layers", n): rows for n in ("wo", "w2")})
    table.update({("embed",): ([None, "data"], "split by its columns over 'data'"),
                  ("pos",): ([None, "data"], "split by its columns over 'data'"),
                  ("unembed",): (["data", None], "split by its rows over 'data'")})
    try:
        got = form.evidence(fsdp_specs(params))
    except Exception as exc:
        raise AssertionError(f"`fsdp_specs(params)` raised {form.student_error(exc)} on the "
                             "notebook's params.") from None

    def leaves(ev, path=()):
        if ev["kind"] != "dict":
            return {path: ev}
        return {p: leaf for key, value in ev["items"]
                for p, leaf in leaves(value, path + (key.get("value"),)).items()}

    def trimmed(entries):
        entries = list(entries)
        while entries and entries[-1] is None:
            entries.pop()
        return entries

    found = leaves(got) if got["kind"] == "dict" else {}
    wanted = [tuple(k.key for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(
        params)[0]]
    if sorted(found, key=str) != sorted(wanted, key=str):
        raise AssertionError(
            f"`fsdp_specs(params)` returned {form.describe(got)} with the leaves "
            f"{sorted('/'.join(map(str, p)) for p in found)}; expected a dict of the structure "
            f"of `params`: {sorted('/'.join(p) for p in wanted)}.")
    for path in wanted:
        spec, how = table.get(path, ([], "replicated"))
        leaf = found[path]
        where = "".join(f"[{k!r}]" for k in path)
        if leaf["kind"] != "spec":
            raise AssertionError(f"`fsdp_specs(params){where}` is {form.describe(leaf)}; "
                                 "expected a PartitionSpec.")
        if trimmed(leaf["entries"]) != trimmed(spec):
            raise AssertionError(
                f"`fsdp_specs(params){where}` is {form.spec_repr(leaf['entries'])}; expected "
                f"{form.spec_repr(spec)} ({path[-1]} is {how}).")

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

# %% [markdown]
# Below, each parameter's block per device, and one layer's `w1` drawn on the device grid:
# each of its 8 blocks (rows over `data`, columns over `model`) lives on one device.

# %%
if answered(fsdp_specs):
    fsdp_params = shard(params, fsdp_specs(params), mesh)
    show_layout(fsdp_params)
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(fsdp_params))
    whole = sum(x.nbytes for x in jax.tree.leaves(params))
    print(f"one device holds {per_device:,} of the model's {whole:,} bytes "
          f"({per_device / whole:.1%})")
    print("one layer's w1 (d_model × d_ff), device by device; the mesh's device ids (rows "
          f"'data', columns 'model'):\n{np.vectorize(lambda d: d.id)(mesh.devices)}")
    jax.debug.visualize_array_sharding(fsdp_params["layers"]["w1"][0])

# %% [raw]
# # BEGIN QUESTION
# name: q4_fsdp_step
# points: 3

# %% [markdown]
# **Task 4** (`q4_fsdp_step`). Define `fsdp_loss_and_grad(params, tokens, mesh, n_heads)`,
# returning the tuple `(loss, grads)`: the value of `loss_fn(params, tokens, n_heads)` and its
# gradient in `params`, for parameters in the `fsdp_specs` layout and tokens split by rows over
# `data`, on any `data` × `model` mesh (the hidden check uses 4 × 2 and 2 × 4).
#
# * Run the layers with `lax.scan`, and inside its body constrain the layer's weights to the
#   tensor-parallel layout of Part A (the gather, one layer at a time).
# * Put the scan's body under `jax.checkpoint`, so that the backward pass gathers each layer
#   again instead of keeping every layer's gathered weights (a policy is allowed if it does not
#   keep them).
# * Gather the embedding, position and unembedding tables before they are used: constrain them
#   to their Part A layout, replicated. Left split over `data`, the embedding's layout spreads
#   into the activations, and the compiler must reshard them by copying whole arrays (newer JAX
#   warns about an "Involuntary full rematerialization").
# * Constrain the gradients to the `fsdp_specs` layout before returning them.
#
# Keep the activations' constraints of Task 2 if you like. The hidden check calls it under
# `jax.jit` (with `mesh` and `n_heads` fixed). Compiled, the step must need **less memory per
# device than the tensor-parallel step**, `jax.value_and_grad(loss_fn)` on parameters in the
# `tp_specs` layout and the same tokens, counting arguments and temporaries
# (`memory_analysis()`: `argument_size_in_bytes + temp_size_in_bytes`): the hidden check
# compares the two at its own sizes, the cell after this task at the notebook's.

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

    @jax.checkpoint  # the backward pass gathers the layer again instead of keeping it
    def body(x, p):
        return block(x, constrain(p, layer_tp), n_heads), None

    def loss(params):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        top = constrain({k: params[k] for k in tables}, {k: tp[k] for k in tables})
        x = top["embed"][inputs] + top["pos"][:inputs.shape[1]]
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
def test_q4_public(fsdp_loss_and_grad, loss_fn, params, tokens, mesh, cfg):
    """fsdp_loss_and_grad on the notebook's params (in Part B's layout), tokens and mesh: the
    value and gradient of loss_fn, the gradients' layout, and, from its jaxpr, each layer
    gathered inside the scan, the tables gathered, and no gathered weight kept for the
    backward pass."""
    import jax
    import numpy as np
    import jaxlab_form as form
    from jax.sharding import NamedSharding, PartitionSpec as P

    form.expect_callable("fsdp_loss_and_grad", form.evidence(fsdp_loss_and_grad))
    form.free_kernel_memory()  # what was compiled before this check
    columns, rows = [None, "data", "model"], [None, "model", "data"]
    table = {("layers", n): columns for n in ("wq", "wk", "wv", "w1")}
    table.update({("layers", n): rows for n in ("wo", "w2")})
    table.update({("embed",): [None, "data"], ("pos",): [None, "data"],
                  ("unembed",): ["data", None]})

    def path_of(path):
        return tuple(k.key for k in path)

    placed = jax.tree_util.tree_map_with_path(lambda path, x: jax.device_put(x, NamedSharding(
        mesh, P(*table.get(path_of(path), [])))), params)
    data_tokens = jax.device_put(tokens, NamedSharding(mesh, P("data", None)))
    run = jax.jit(lambda p, t: fsdp_loss_and_grad(p, t, mesh, cfg.n_heads))
    call = ("fsdp_loss_and_grad(params, tokens, mesh, n_heads) on the notebook's params (in "
            "the fsdp_specs layout), tokens and 4 × 2 mesh")
    try:
        out = jax.block_until_ready(run(placed, data_tokens))
        loss, grads = out
    except Exception as exc:
        raise AssertionError(f"`{call}` under jax.jit raised {form.student_error(exc)}; "
                             "expected the tuple (loss, grads).") from None
    references = form.__dict__.setdefault("_lab7_references", {})  # shared by the checks
    key = (id(loss_fn), id(params), id(tokens), tuple(cfg))
    if key not in references:
        references.clear()
        references[key] = jax.tree.map(np.asarray, jax.jit(
            jax.value_and_grad(loss_fn), static_argnums=2)(params, tokens, cfg.n_heads))
    want_loss, want_grads = references[key]
    form.expect_close(f"the loss `{call}` returned", loss, want_loss,
                      "loss_fn(params, tokens, n_heads)", rtol=1e-3, atol=1e-5)
    got = {path_of(p): g for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    for path, want in jax.tree_util.tree_flatten_with_path(want_grads)[0]:
        path = path_of(path)
        where = "".join(f"[{k!r}]" for k in path)
        if path not in got:
            raise AssertionError(f"the gradient `{call}` returned has no params{where}; "
                                 "expected a dict of the structure of `params`.")
        form.expect_close(f"the gradient of params{where} from `{call}`", got[path], want,
                          "the gradient of loss_fn in that parameter", rtol=1e-3, atol=1e-5)
        layout = form.evidence(got[path]).get("sharding", {})
        spec = table.get(path, [])
        if layout.get("kind") != "NamedSharding" or not form.is_laid_out_as(
                layout, np.ndim(want), P(*spec)):
            raise AssertionError(
                f"the gradient of params{where} from `{call}` is laid out "
                f"{form.describe_sharding(layout) if layout else 'off the mesh'}; expected the "
                f"fsdp_specs layout {form.spec_repr(spec)}.")
    closed = jax.make_jaxpr(run)(placed, data_tokens)
    steps = []

    def walk(jaxpr, scans):
        for eqn in jaxpr.eqns:
            steps.append((eqn, scans))
            inner = scans + [eqn.params["length"]] if eqn.primitive.name == "scan" else scans
            for sub in form._sub_jaxprs(eqn.params):
                walk(sub, inner)

    walk(closed.jaxpr, [])

    def trimmed(entries):
        entries = list(entries)
        while entries and entries[-1] is None:
            entries.pop()
        return entries

    def constraints(shape, spec):
        return [scans for eqn, scans in steps if eqn.primitive.name == "sharding_constraint"
                and tuple(eqn.invars[0].aval.shape) == tuple(shape)
                and trimmed(form._spec_entry(e) for e in eqn.params["sharding"].spec)
                == trimmed(spec)]

    V, D, F, L, S = cfg.vocab, cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.seq
    for shape, spec, count, names in (((D, D), [None, "model"], 3, "wq, wk and wv"),
                                      ((D, D), ["model", None], 1, "wo"),
                                      ((D, F), [None, "model"], 1, "w1"),
                                      ((F, D), ["model", None], 1, "w2")):
        inside = [scans for scans in constraints(shape, spec) if scans[:1] == [L]]
        if len(inside) < count:
            raise AssertionError(
                f"traced on the notebook's inputs, `fsdp_loss_and_grad` does not constrain the "
                f"layer's {names} (shape {shape}) to the tensor-parallel layout "
                f"{form.spec_repr(spec)} inside the body of the scan over the {L} layers; "
                "expected that constraint (the gather, one layer at a time).")
    for shape, name in (((V, D), "embed"), ((S, D), "pos"), ((D, V), "unembed")):
        if not constraints(shape, []) and not (name == "pos" and constraints((S - 1, D), [])):
            raise AssertionError(
                f"traced on the notebook's inputs, `fsdp_loss_and_grad` never constrains "
                f"`{name}` (shape {shape}) to its Part A layout, replicated (P()); expected the "
                "tables gathered before they are used.")
    weights = {(D, D), (D, F), (F, D)}
    for eqn, _ in steps:
        if eqn.primitive.name != "scan" or eqn.params["reverse"]:
            continue
        body = eqn.params["jaxpr"].jaxpr
        inputs = {id(v) for v in body.invars}
        n_carry = (eqn.params["num_carry"] if "num_carry" in eqn.params  # JAX 0.12: a flat
                   else len(eqn.params["ft_out"].unpack()[0]))          # tree, ft_out
        kept = [tuple(v.aval.shape) for v in body.outvars[n_carry:]
                if id(v) not in inputs and tuple(getattr(v.aval, "shape", ())) in weights]
        if kept:
            raise AssertionError(
                f"traced on the notebook's inputs, the scan over the layers in "
                f"`fsdp_loss_and_grad` hands {len(kept)} gathered weight(s) per layer (shapes "
                f"{sorted(set(kept))}) to the backward pass, which then holds every layer's "
                "gathered weights at once; expected the scan's body under jax.checkpoint, so "
                "that the backward pass gathers each layer again.")

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

# %% [markdown]
# What does remat buy? The cell below compiles four training steps at the notebook's sizes and
# reads their memory per device (`memory_analysis()`: arguments, and the temporaries the
# program needs while it runs) and their collectives: the replicated step on one device; the
# tensor-parallel step (`jax.value_and_grad(loss_fn)` on `tp_params`); your FSDP × TP step; and
# your step traced once more with `jax.checkpoint` made a no-op (`remat_disabled` below), which
# is what the step would be without remat.

# %%
@contextlib.contextmanager
def remat_disabled():
    """While tracing inside this block, `jax.checkpoint` (and `jax.remat`) rematerialize nothing."""
    saved = jax.checkpoint, jax.remat

    def no_remat(fun=None, **options):
        return fun if fun is not None else (lambda fun: fun)

    jax.checkpoint = jax.remat = no_remat
    try:
        yield
    finally:
        jax.checkpoint, jax.remat = saved

# %% tags=["claim:lab7-fsdp-memory", "claim:lab7-fsdp-gathers", "claim:lab7-fsdp-gradient-reduction"]
if answered(tp_specs, fsdp_specs, fsdp_loss_and_grad):
    fsdp_step = jax.jit(partial(fsdp_loss_and_grad, mesh=mesh, n_heads=cfg.n_heads))
    loss_value, grads = fsdp_step(fsdp_params, data_tokens)
    print(f"loss {float(loss_value):.4f}; the gradient of wq is laid out "
          f"{grads['layers']['wq'].sharding.spec}")
    step_of_loss_fn = jax.jit(jax.value_and_grad(partial(loss_fn, n_heads=cfg.n_heads)))
    steps = {"replicated": step_of_loss_fn.lower(params, tokens).compile(),
             "TP": step_of_loss_fn.lower(tp_params, data_tokens).compile()}
    with remat_disabled():
        steps["FSDP × TP, no remat"] = jax.jit(partial(
            fsdp_loss_and_grad, mesh=mesh, n_heads=cfg.n_heads)).lower(fsdp_params,
                                                                      data_tokens).compile()
    steps["FSDP × TP, remat"] = fsdp_step.lower(fsdp_params, data_tokens).compile()
    memory = {name: (step.memory_analysis().argument_size_in_bytes / MiB,
                     step.memory_analysis().temp_size_in_bytes / MiB)
              for name, step in steps.items()}
    print("memory per device (MiB):    arguments  temporaries   total")
    for name, (arguments, temp) in memory.items():
        print(f"  {name:24s} {arguments:9.2f} {temp:12.2f} {arguments + temp:8.2f}")
    for name in ("FSDP × TP, no remat", "FSDP × TP, remat"):
        show_collectives(f"{name} (compiled):", collective_ops(steps[name], mesh))
    reduction = [size for kind, place, over, size in collective_ops(steps["FSDP × TP, remat"],
                                                                     mesh)
                 if (kind, place, over) == ("all-reduce", "backward loop", "'data'")]
    one_layer = sum(math.prod(x.sharding.shard_shape(x.shape)[1:]) * x.dtype.itemsize
                    for x in jax.tree.leaves(tp_params["layers"]))
    print(f"gradient reduction over 'data' in the backward loop, per layer: {reduction} B; "
          f"one layer's gradients in the tensor-parallel layout: {one_layer:,d} B")
    fig, ax = plt.subplots(figsize=(6.5, 3))
    names = list(memory)
    arguments = [memory[n][0] for n in names]
    ax.barh(names, arguments, label="arguments")
    ax.barh(names, [memory[n][1] for n in names], left=arguments, label="temporaries")
    ax.invert_yaxis()
    ax.set_xlabel("MiB per device")
    ax.set_title("One training step, compiled at the notebook's sizes")
    ax.legend(loc="lower right")
    fig.tight_layout()
    plt.show()
    del steps
    free_compiled()

# %% [markdown]
# Without remat, the FSDP × TP step's temporaries hold every layer's gathered weights (the
# forward loop gathers, the backward loop does not) and it needs more memory than the
# tensor-parallel step it was meant to improve on; with remat the backward loop gathers each
# layer again and the temporaries shrink to one layer's worth.
#
# The reduction of the gradients over `data` is, on this CPU runtime, an **all-reduce** of each
# layer's whole tensor-parallel gradient in the backward loop, after which each device slices
# out its own quarter: every device receives the full sum and keeps a quarter of it. A
# **reduce-scatter** gives each device only its quarter of the sum and, by the ring rule of
# Lab 6, moves half the bytes of an all-reduce. XLA's GPU compiler rewrites an all-reduce
# followed by such a slice into a reduce-scatter (its `ReduceScatterCreator` pass), and TPU
# programs reduce-scatter too; the CPU compiler has no such rewrite. This runtime cannot show
# a GPU or TPU program: on one, count the `reduce-scatter`s with `collective_ops` yourself.

# %% [markdown]
# ## Part C: mixed precision and gradient accumulation
#
# ### bfloat16 products, float32 everything else
#
# Accelerators multiply `bfloat16` matrices several times faster than `float32` ones. `bfloat16`
# keeps `float32`'s 8 exponent bits, so it spans the same range (up to 3.4 × 10³⁸, and normal
# numbers down to 1.2 × 10⁻³⁸), but only 8 significant bits (7 stored, plus the leading 1 that
# is implied), about 2.4 decimal digits: a parameter update of one part in a thousand vanishes
# when added to a `bfloat16` weight (1 + 0.001 rounds back to 1), and a long sum in `bfloat16`
# loses its small terms. Because its range is `float32`'s, `bfloat16` needs **no loss scaling**,
# unlike `float16` (5 exponent bits: nothing above 65,504, and gradients below 6 × 10⁻⁸ become 0,
# so `float16` training multiplies the loss by a large factor to keep its gradients
# representable, and divides it out afterwards). The standard recipe, **mixed precision**:
#
# * keeps the **master parameters** (and the optimizer's state) in `float32`;
# * casts the two operands of every **matrix product** to `bfloat16` just before it, and asks
#   for the products to be **accumulated and returned in `float32`**:
#   `jnp.matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)`
#   (`jnp.einsum` takes `preferred_element_type` too);
# * computes the norms, the softmax and the loss in `float32`.
#
# The gradient of a `float32` parameter through a cast is `float32` again, so `jax.grad` gives
# `float32` gradients without further work. Since every product returns `float32`, the
# activations the backward pass keeps are `float32` too: this recipe buys speed, not memory
# (memory shrinks only where values are *stored* in `bfloat16`, which it does not do; the cell
# after Task 5 measures it). In the traced program each product is a `dot_general` whose
# operands are `bf16` and whose `preferred_element_type` is `float32`:

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
# stays `float32` (the loss it returns too), and `params` stay `float32` (cast inside the
# function). For any config, its value must be within 2% of `loss_fn`'s, and its gradient
# (`jax.grad`) `float32` and within 10% of `loss_fn`'s (measured as the norm of the difference
# over the norm of the float32 gradient, for each parameter).

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
def test_q5_public(mp_loss, loss_fn, params, tokens, cfg):
    """mp_loss on the notebook's params and tokens: value and gradient near loss_fn's, in
    float32, and from its jaxpr every product bfloat16 x bfloat16 accumulated in float32,
    everything else float32."""
    import math
    import jax
    import numpy as np
    import jaxlab_form as form

    form.expect_callable("mp_loss", form.evidence(mp_loss))
    form.free_kernel_memory()  # what was compiled before this check
    call = "jax.value_and_grad(mp_loss)(params, tokens, n_heads) on the notebook's params"
    try:
        loss, grads = jax.block_until_ready(jax.jit(jax.value_and_grad(mp_loss),
                                                    static_argnums=2)(params, tokens,
                                                                      cfg.n_heads))
    except Exception as exc:
        raise AssertionError(f"`{call}` raised {form.student_error(exc)}.") from None
    references = form.__dict__.setdefault("_lab7_references", {})  # shared by the checks
    key = (id(loss_fn), id(params), id(tokens), tuple(cfg))
    if key not in references:
        references.clear()
        references[key] = jax.tree.map(np.asarray, jax.jit(
            jax.value_and_grad(loss_fn), static_argnums=2)(params, tokens, cfg.n_heads))
    want, want_grads = references[key]
    if str(loss.dtype) != "float32":
        raise AssertionError(
            f"`mp_loss(params, tokens, n_heads)` returns its loss as {loss.dtype}; expected "
            "float32: only the operands of the matrix products are bfloat16, the loss is "
            "computed and returned in float32.")
    if not abs(float(loss) - float(want)) <= 0.02 * abs(float(want)):
        raise AssertionError(f"`mp_loss(params, tokens, n_heads)` is {float(loss):.5g}; "
                             f"expected within 2% of loss_fn's {float(want):.5g}.")
    for (path, g), want_g in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                                 jax.tree.leaves(want_grads)):
        where = jax.tree_util.keystr(path)
        if str(g.dtype) != "float32":
            raise AssertionError(
                f"the gradient of params{where} through `mp_loss` is {g.dtype}; expected "
                "float32 (the master parameters stay float32; cast them inside the function).")
        gap = float(np.linalg.norm(np.asarray(g, np.float64) - np.asarray(want_g, np.float64)))
        size = max(float(np.linalg.norm(np.asarray(want_g, np.float64))), 1e-12)
        if not gap <= 0.10 * size:
            raise AssertionError(
                f"the gradient of params{where} of `mp_loss`, through `{call}`, is "
                f"{gap / size:.1%} away from loss_fn's (the norm of the difference over the norm "
                "of the float32 gradient); expected within 10%.")
    steps = []

    def walk(jaxpr, scans):
        for eqn in jaxpr.eqns:
            steps.append((eqn, scans))
            inner = scans + [eqn.params["length"]] if eqn.primitive.name == "scan" else scans
            for sub in form._sub_jaxprs(eqn.params):
                walk(sub, inner)

    walk(jax.make_jaxpr(mp_loss, static_argnums=2)(params, tokens, cfg.n_heads).jaxpr, [])

    def shapes(vs):
        return " by ".join(f"{v.aval.dtype}{tuple(v.aval.shape)}" for v in vs)

    dots = [(eqn, scans) for eqn, scans in steps if eqn.primitive.name == "dot_general"]
    for eqn, _ in dots:
        if [str(v.aval.dtype) for v in eqn.invars] != ["bfloat16", "bfloat16"]:
            raise AssertionError(f"traced on the notebook's inputs, `mp_loss` multiplies "
                                 f"{shapes(eqn.invars)}; expected every matrix product to take "
                                 "bfloat16 operands.")
        preferred = eqn.params.get("preferred_element_type")
        if str(np.dtype(preferred) if preferred is not None else None) != "float32" or \
                str(eqn.outvars[0].aval.dtype) != "float32":
            raise AssertionError(
                f"traced on the notebook's inputs, `mp_loss` multiplies {shapes(eqn.invars)} "
                f"into {shapes(eqn.outvars)}; expected it accumulated and returned in float32 "
                "(preferred_element_type=jnp.float32).")
    runs = sum(math.prod(scans) for _, scans in dots)
    if runs < 8 * cfg.n_layers + 1:
        raise AssertionError(
            f"traced on the notebook's inputs, `mp_loss` runs {runs} matrix product(s); expected "
            f"the model's 8 per layer and the unembedding, {8 * cfg.n_layers + 1} in all, each "
            "in bfloat16.")
    structural = {"reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims",
                  "slice", "concatenate", "copy", "copy_p", "convert_element_type",
                  "dot_general", "pjit", "jit", "closed_call", "scan", "dynamic_slice",
                  "gather", "sharding_constraint"}
    for eqn, _ in steps:
        if eqn.primitive.name not in structural and any(
                str(v.aval.dtype) == "bfloat16" for v in eqn.outvars):
            raise AssertionError(
                f"traced on the notebook's inputs, `mp_loss` computes `{eqn.primitive.name}` in "
                f"bfloat16 ({shapes(eqn.outvars)}); expected everything but the matrix products' "
                "operands to stay float32 (norms, softmax, gelu, the residual stream and the "
                "loss).")

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

# %% tags=["claim:lab7-bf16-format", "claim:lab7-bf16-gradients", "claim:lab7-bf16-memory"]
bf16, fp16 = jnp.finfo(jnp.bfloat16), jnp.finfo(jnp.float16)
print(f"bfloat16: {bf16.nmant} stored significand bits + 1 implied = {bf16.nmant + 1} bits, "
      f"{math.log10(2 ** (bf16.nmant + 1)):.2f} decimal digits; largest {float(bf16.max):.3g}, "
      f"smallest normal {float(bf16.tiny):.3g}")
print(f"float16:  {fp16.nmant} stored significand bits; largest {float(fp16.max):.6g}, "
      f"smallest {float(fp16.smallest_subnormal):.3g}")
print(f"a gradient of 1e-8: float16 {float(jnp.float16(1e-8)):.3g}, "
      f"bfloat16 {float(jnp.bfloat16(1e-8)):.3g}; 1 + 0.001 in bfloat16: "
      f"{float(jnp.bfloat16(1) + jnp.bfloat16(0.001))}")
if answered(mp_loss):
    compiled = {name: jax.jit(jax.value_and_grad(partial(f, n_heads=cfg.n_heads))).lower(
        params, tokens).compile() for name, f in (("float32", loss_fn), ("mixed", mp_loss))}
    (full, full_grads), (mixed, mixed_grads) = (compiled[n](params, tokens)
                                               for n in ("float32", "mixed"))
    print(f"loss: float32 {float(full):.5f}, mixed precision {float(mixed):.5f} "
          f"({abs(float(mixed) - float(full)) / float(full):.2%} apart)")
    gaps = {jax.tree_util.keystr(path): float(jnp.linalg.norm(m - f) / jnp.linalg.norm(f))
            for (path, m), f in zip(jax.tree_util.tree_flatten_with_path(mixed_grads)[0],
                                    jax.tree.leaves(full_grads))}
    worst = max(gaps, key=gaps.get)
    print(f"gradients: {sorted({str(g.dtype) for g in jax.tree.leaves(mixed_grads)})}; relative "
          f"error per parameter: median {float(np.median(list(gaps.values()))):.2%}, largest "
          f"{gaps[worst]:.2%} ({worst})")
    for name, step in compiled.items():
        memory = step.memory_analysis()
        print(f"{name:8s} step: temporaries {memory.temp_size_in_bytes / MiB:.2f} MiB per device")
    del compiled
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
# n_heads)` (float32, as that returns them), computed over `n_micro` equal microbatches
# (consecutive rows of `tokens`: the first microbatch is the first `batch // n_micro` rows, and
# so on; `n_micro` divides the batch) with a `lax.scan` of length `n_micro` that accumulates the
# sums. It must work for any config and any `n_micro` that divides the batch, 1 included;
# compiled for a batch of 64 in 8 microbatches it must need less than half of the full batch's
# temporary memory (at the notebook's config).

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
def test_q6_public(accumulated_loss_and_grad, loss_fn, params, tokens, cfg):
    """accumulated_loss_and_grad on the notebook's params and tokens in 4 microbatches: the
    whole batch's value and gradient (float32), one top-level scan of length 4 carrying sums,
    and each microbatch consecutive rows (the rows loss_fn is called with, recorded)."""
    import jax
    import numpy as np
    import jaxlab_form as form

    form.expect_callable("accumulated_loss_and_grad", form.evidence(accumulated_loss_and_grad))
    form.free_kernel_memory()  # what was compiled before this check
    n_micro, rows = 4, tokens.shape[0] // 4
    call = (f"accumulated_loss_and_grad(params, tokens, n_heads, {n_micro}) on the notebook's "
            "params and tokens")
    seen, names = [], getattr(accumulated_loss_and_grad, "__globals__", {})

    def recording(params, batch, n_heads):  # loss_fn, noting which rows each call gets
        jax.debug.callback(lambda rows: seen.append(np.asarray(rows)), batch)
        return loss_fn(params, batch, n_heads)

    watched = names.get("loss_fn") is loss_fn
    if watched:
        names["loss_fn"] = recording
    try:
        loss, grads = jax.block_until_ready(jax.jit(
            lambda p, t: accumulated_loss_and_grad(p, t, cfg.n_heads, n_micro))(params, tokens))
        jax.effects_barrier()
    except Exception as exc:
        raise AssertionError(f"`{call}` under jax.jit raised {form.student_error(exc)}; expected "
                             "the tuple (loss, grads).") from None
    finally:
        if watched:
            names["loss_fn"] = loss_fn
    references = form.__dict__.setdefault("_lab7_references", {})  # shared by the checks
    key = (id(loss_fn), id(params), id(tokens), tuple(cfg))
    if key not in references:
        references.clear()
        references[key] = jax.tree.map(np.asarray, jax.jit(
            jax.value_and_grad(loss_fn), static_argnums=2)(params, tokens, cfg.n_heads))
    want, want_grads = references[key]
    for what, value in [("loss", loss)] + [
            (f"gradient of params{jax.tree_util.keystr(p)}", g)
            for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]]:
        if str(getattr(value, "dtype", "float32")) != "float32":
            raise AssertionError(
                f"the {what} from `{call}` is {value.dtype}; expected float32, as "
                "jax.value_and_grad(loss_fn) returns it (accumulate the sums in float32).")
    form.expect_close(f"the loss `{call}` returned", loss, want,
                      "the whole batch's loss_fn(params, tokens, n_heads)", rtol=1e-3, atol=1e-5)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                            jax.tree.leaves(want_grads)):
        form.expect_close(f"the gradient of params{jax.tree_util.keystr(path)} from `{call}`",
                          g, w, "the whole batch's gradient of loss_fn in that parameter",
                          rtol=1e-3, atol=1e-5)
    closed = jax.make_jaxpr(lambda p, t: accumulated_loss_and_grad(p, t, cfg.n_heads, n_micro))(
        params, tokens)
    loops = [eqn for eqn in closed.jaxpr.eqns if eqn.primitive.name == "scan"]
    over_micro = [eqn for eqn in loops if eqn.params["length"] == n_micro]
    if not over_micro:
        found = sorted(eqn.params["length"] for eqn in loops)
        layers = (f" (a length of {cfg.n_layers} is the scan over the layers, inside the model)"
                  if cfg.n_layers in found else "")
        raise AssertionError(
            f"traced on the notebook's inputs with {n_micro} microbatches, "
            f"`accumulated_loss_and_grad` has no lax.scan of length {n_micro} at its top level "
            f"(the scans there have lengths {found or 'none'}{layers}); expected one scan over "
            "the microbatches.")
    weights = {tuple(x.shape) for x in jax.tree.leaves(params)}
    def n_carry(eqn):  # the scan's carried outputs; the rest are stacked (JAX 0.12: ft_out)
        return (eqn.params["num_carry"] if "num_carry" in eqn.params
                else len(eqn.params["ft_out"].unpack()[0]))
    if all(any(tuple(v.aval.shape[1:]) in weights and v.aval.shape[:1] == (n_micro,)
               for v in eqn.outvars[n_carry(eqn):]) for eqn in over_micro):
        raise AssertionError(
            "the scan over the microbatches in `accumulated_loss_and_grad` returns every "
            f"microbatch's gradient, stacked ({n_micro} of them), and they are averaged "
            "afterwards; expected the scan to carry running sums, so that one microbatch's "
            "gradient is held at a time.")
    index = {row.tobytes(): i for i, row in enumerate(np.asarray(tokens))}
    for batch in seen:
        if batch.shape[0] != rows:
            continue
        taken = [index.get(row.tobytes(), -1) for row in batch]
        if taken != list(range(taken[0], taken[0] + rows)) or taken[0] % rows:
            raise AssertionError(
                f"`{call}` gives loss_fn a microbatch of the rows {taken} of `tokens`; expected "
                f"consecutive rows (the first microbatch rows 0 to {rows - 1}, the next "
                f"{rows} to {2 * rows - 1}, and so on).")

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

# %% tags=["claim:lab7-accumulation-memory"]
if answered(accumulated_loss_and_grad):
    big = jax.ShapeDtypeStruct((64, cfg.seq), jnp.int32)
    full_temp = jax.jit(jax.value_and_grad(partial(loss_fn, n_heads=cfg.n_heads))).lower(
        params, big).compile().memory_analysis().temp_size_in_bytes
    micro_temp = jax.jit(partial(accumulated_loss_and_grad, n_heads=cfg.n_heads, n_micro=8)
                         ).lower(params, big).compile().memory_analysis().temp_size_in_bytes
    print(f"batch 64 in one piece: {full_temp / MiB:.2f} MiB of temporary memory; "
          f"in 8 microbatches: {micro_temp / MiB:.2f} MiB ({micro_temp / full_temp:.0%})")
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
# target)`); it holds threads and files until it is closed, so use it in a `with` block (or call
# `.close()`). Given the sharded arrays themselves, it writes each array as chunks of one
# device's block and records each array's sharding in the checkpoint's metadata
# (`.metadata(path)`); given copies gathered to the host (`jax.device_get`, `np.asarray`), it
# writes each array whole, and the metadata records no sharding. The `target` of a restore says
# what to restore *into*: a pytree of the same structure whose leaves are
# `jax.ShapeDtypeStruct(shape, dtype, sharding=...)`, each array's shape, dtype and the sharding
# it should have now, on the new mesh. Orbax then reads, on each device, just the blocks it
# needs. The path must be absolute and must not exist yet when saving.
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
#   (sharded arrays, on any mesh) to the directory `path` **as it is laid out**: hand Orbax the
#   sharded arrays themselves, not copies gathered to the host, so that each device's blocks
#   are written as they are. Return only when it is written, and close the checkpointer;
# * `restore_state(path, abstract_state, mesh)`: restore the state saved at `path`, where
#   `abstract_state` gives its structure, shapes and dtypes (as `jax.eval_shape` does, no
#   shardings), onto `mesh` (a `data` × `model` mesh of any shape, on any number of devices):
#   the parameters in the `fsdp_specs` layout, the step replicated. Restore **straight into
#   that layout**: give Orbax a target whose shardings are that layout on `mesh`, so that each
#   device reads just its blocks (not whole arrays that are moved afterwards, with
#   `jax.device_put` or otherwise). Return the restored state.
#
# The hidden check restores your checkpoints with Orbax itself and reads their metadata (each
# array's sharding and chunks), and restores with your `restore_state` checkpoints that Orbax
# itself wrote, on meshes of 2 × 2 devices and 8 × 1, noting the layout Orbax reads each array
# into.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def save_state(path, state):
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state)
        checkpointer.wait_until_finished()


def restore_state(path, abstract_state, mesh):
    specs = {"params": fsdp_specs(abstract_state["params"]), "step": P()}
    target = jax.tree.map(
        lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                             sharding=NamedSharding(mesh, spec)),
        abstract_state, specs)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path, target)
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
def test_q7_public(save_state, restore_state, params, cfg, mesh, devices):
    """save_state on the notebook's params in Part B's layout (the checkpoint's metadata: each
    array's sharding and chunks), read back by Orbax; restore_state onto a 2 x 2 mesh of 4 of the
    notebook's devices: values, layout, and the layout Orbax reads each array into."""
    import os
    import shutil
    import tempfile
    import jax
    import numpy as np
    import jaxlab_form as form
    import orbax.checkpoint as ocp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    form.expect_callable("save_state", form.evidence(save_state))
    form.expect_callable("restore_state", form.evidence(restore_state))
    form.free_kernel_memory()  # what was compiled before this check
    columns, rows = P(None, "data", "model"), P(None, "model", "data")
    table = {("layers", n): columns for n in ("wq", "wk", "wv", "w1")}
    table.update({("layers", n): rows for n in ("wo", "w2")})
    table.update({("embed",): P(None, "data"), ("pos",): P(None, "data"),
                  ("unembed",): P("data", None)})

    def key(path):
        return tuple(k.key for k in path)

    state = {"params": jax.tree_util.tree_map_with_path(lambda path, x: jax.device_put(
        x, NamedSharding(mesh, table.get(key(path), P()))), params),
        "step": jax.device_put(np.int32(7), NamedSharding(mesh, P()))}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    small = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                          devices=devices[:4])
    reads = []
    handlers = (ocp.type_handlers.ArrayHandler, ocp.type_handlers.NumpyHandler,
                ocp.type_handlers.ScalarHandler)
    saved = [h.deserialize for h in handlers]

    def watch(handler, original):
        async def deserialize(self, infos, args=None):
            out = await original(self, infos, args)
            for info, x in zip(infos, out):
                reads.append((info.name, form.evidence(x) if hasattr(x, "sharding") else None))
            return out
        return deserialize

    root = tempfile.mkdtemp()  # removed at the end, whatever a background save still writes
    try:
        path = os.path.join(root, "saved")
        try:
            save_state(path, state)
        except Exception as exc:
            raise AssertionError(f"`save_state(path, state)` raised {form.student_error(exc)} "
                                 "for the notebook's params in the fsdp_specs layout.") from None
        with ocp.StandardCheckpointer() as checkpointer:
            try:
                meta = checkpointer.metadata(path)
                meta = getattr(meta, "item_metadata", meta)
            except Exception:
                meta = None
            if meta is None:
                listing = sorted(os.listdir(path)) if os.path.isdir(path) else None
                there = "nothing there" if listing is None else f"the entries {listing}"
                raise AssertionError(
                    f"after `save_state(path, state)` returned, Orbax found no checkpoint at "
                    f"`path` ({there}); expected the state saved to the directory `path` itself "
                    "(ocp.StandardCheckpointer().save(path, state)), complete when save_state "
                    "returns (wait_until_finished).")
            if set(meta) != {"params", "step"}:
                raise AssertionError(
                    f"the checkpoint `save_state(path, state)` wrote holds {sorted(meta)} at its "
                    "top level; expected the whole state, 'params' and 'step'.")
            for path_, info in jax.tree_util.tree_flatten_with_path(
                    meta["params"], is_leaf=lambda m: hasattr(m, "storage"))[0]:
                where = "".join(f"[{k!r}]" for k in key(path_))
                block = state["params"]
                for k in key(path_):
                    block = block[k]
                block = tuple(block.sharding.shard_shape(block.shape))
                chunks = tuple(getattr(info.storage, "chunk_shape", None) or ())
                if info.sharding is None or len(chunks) != len(block) or any(
                        b % c for b, c in zip(block, chunks)):
                    raise AssertionError(
                        f"the checkpoint `save_state` wrote holds state['params']{where} in "
                        f"chunks of {chunks} with "
                        f"{'no sharding recorded' if info.sharding is None else 'its sharding'}"
                        f"; expected it saved as it is laid out, in chunks within one device's "
                        f"block {block} with its sharding recorded: hand Orbax the sharded "
                        "arrays themselves, not copies gathered to the host.")
            one = NamedSharding(jax.make_mesh((1, 1), ("data", "model"), devices=devices[:1],
                                              axis_types=(AxisType.Auto,) * 2), P())
            back = checkpointer.restore(path, jax.tree.map(
                lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), abstract))
            for (path_, x), y in zip(jax.tree_util.tree_flatten_with_path(back)[0],
                                     jax.tree.leaves(state)):
                if not np.array_equal(np.asarray(x), np.asarray(y)):
                    raise AssertionError(
                        f"Orbax restored state{jax.tree_util.keystr(path_)} from the checkpoint "
                        "`save_state(path, state)` wrote with other values than state's.")
        path = os.path.join(root, "by_orbax")
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(path, state)
            checkpointer.wait_until_finished()
        for h in handlers:
            h.deserialize = watch(h, h.deserialize)
        call = "restore_state(path, abstract_state, mesh) onto a 2 × 2 mesh of 4 devices"
        try:
            restored = restore_state(path, abstract, small)
        except Exception as exc:
            raise AssertionError(f"`{call}` raised {form.student_error(exc)}.") from None
        finally:
            for h, original in zip(handlers, saved):
                h.deserialize = original
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for (path_, x), y in zip(jax.tree_util.tree_flatten_with_path(restored)[0],
                             jax.tree.leaves(state)):
        where = jax.tree_util.keystr(path_)
        ev = form.evidence(x)
        spec = table.get(key(path_)[1:], P()) if key(path_)[0] == "params" else P()
        if ev["kind"] != "array" or not np.array_equal(ev["value"], np.asarray(y)):
            raise AssertionError(f"`{call}`{where} is {form.describe(ev)} with other values "
                                 "than the saved state's; expected it restored exactly.")
        if ev["sharding"].get("mesh_shape") != [2, 2] or not form.is_laid_out_as(
                ev["sharding"], x.ndim, spec):
            raise AssertionError(f"`{call}`{where} is laid out "
                                 f"{form.describe_sharding(ev['sharding'])}; expected "
                                 f"{form.spec_repr(list(spec))} on the 2 × 2 mesh given.")
    for name, ev in reads:
        parts = tuple(name.split("."))
        if parts[0] != "params":
            continue
        spec = table.get(parts[1:], P())
        if ev is None or ev["sharding"].get("mesh_shape") != [2, 2] or not \
                form.is_laid_out_as(ev["sharding"], len(ev["shape"]), spec):
            how = "as a NumPy array on the host" if ev is None else \
                form.describe_sharding(ev["sharding"])
            raise AssertionError(
                f"`{call}` has Orbax read {name} {how}, not in the layout it returns it in; "
                "expected a target whose shardings are the fsdp_specs layout on the mesh given "
                f"({form.spec_repr(list(spec))} for {name}), so that each device reads just its "
                "blocks.")

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

# %% tags=["claim:lab7-checkpoint-blocks"]
small_mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                           devices=devices[:4])
if answered(fsdp_specs, save_state, restore_state):
    demo_dir = tempfile.mkdtemp()
    save_state(os.path.join(demo_dir, "demo"), {"params": fsdp_params,
                                                 "step": jnp.array(0, jnp.int32)})
    print("files:", sorted(os.listdir(os.path.join(demo_dir, "demo"))))
    with ocp.StandardCheckpointer() as checkpointer:
        metadata = checkpointer.metadata(os.path.join(demo_dir, "demo"))
    metadata = getattr(metadata, "item_metadata", metadata)
    for name in ("wq", "w2"):
        info, array = metadata["params"]["layers"][name], fsdp_params["layers"][name]
        print(f"saved layers/{name} {array.shape}: chunks {info.storage.chunk_shape}, one "
              f"device's block {array.sharding.shard_shape(array.shape)}, sharding recorded "
              f"{info.sharding.partition_spec if info.sharding else None}")
    restored = restore_state(os.path.join(demo_dir, "demo"), abstract_state, small_mesh)
    show_layout(restored["params"])
    free_compiled()

# %% [markdown]
# ### Checkpoints in a training loop: `CheckpointManager`
#
# A training loop saves every few hundred steps and must not stall while it writes. Orbax's
# `ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=2))` is the
# API made for that: `.save(step, args=ocp.args.StandardSave(state))` writes the state into a
# folder numbered by the step, in the background, while training goes on (the next
# `.save`, `.wait_until_finished()` and `.close()` wait for it); it keeps the last
# `max_to_keep` steps and deletes older ones; `.all_steps()` and `.latest_step()` say what is
# there, and `.restore(step, args=ocp.args.StandardRestore(target))` restores onto the target's
# shardings, as above. The run at the end of the lab saves its whole train state with it:
# parameters, the optimizer's state and the step.

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
#   `2·B·S·S·D` over all heads together;
# * once, the unembedding: `2·B·S·D·V`.
#
# The backward pass takes **twice** the forward's FLOPs (for each product, one product for the
# gradient of each operand), so a training step takes **3 ×** the forward. Summed up, with
# `N = L·(4·D² + 2·D·F) + D·V` the parameters that take part in matrix products (the embedding
# and position tables are looked up, not multiplied) and `B·S` tokens, a step takes
# `6·N·B·S + 12·L·B·S²·D` FLOPs: the scaling book's count, `6·N` per token plus attention.
#
# Counting attention's **whole `S × S` square** is a convention. With the causal mask, only the
# scores of earlier positions are needed, about half of them, and some codebases (MaxText, for
# one) count half the square; this lab counts it whole, as the products here compute it whole.
# State the convention beside any MFU you report.
#
# The program's own count, `.cost_analysis()['flops']` (here of the lowered program,
# `jax.jit(f).lower(...)`, which needs no compiling), counts every operation, so a bit more, but,
# as Lab 6 showed, it counts **the body of a loop once**: for our scan over the layers it does not
# grow with `n_layers`.

# %%
def counted_flops(n_layers, batch=BATCH):
    layer_cfg = cfg._replace(n_layers=n_layers)
    shapes = jax.eval_shape(lambda: init_params(jax.random.key(0), layer_cfg))
    step = jax.jit(jax.value_and_grad(partial(loss_fn, n_heads=cfg.n_heads)))
    cost = step.lower(shapes, jax.ShapeDtypeStruct((batch, cfg.seq), jnp.int32)).cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # a list of one dict in older JAX
    return cost.get("flops", float("nan"))


LAYER_COUNTS = (1, 2, 4, 8)
counted = {n: counted_flops(n) for n in LAYER_COUNTS}
for n in LAYER_COUNTS:
    print(f"{n} layer(s): cost_analysis counts {counted[n]:,.0f} FLOPs per step")

# %% [raw]
# # BEGIN QUESTION
# name: q8_step_flops
# points: 1

# %% [markdown]
# **Task 8** (`q8_step_flops`). Define `step_flops(cfg, batch, seq)`: the FLOPs of one training
# step (forward and backward, 3 × the forward) of the model with config `cfg` on `batch`
# sequences of `seq` tokens, counting exactly the matrix products listed above, attention's
# whole square included (use `seq` for `S`, not `cfg.seq`). Return a Python `int`.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def step_flops(cfg, batch, seq):
    D, F, V, L = cfg.d_model, cfg.d_ff, cfg.vocab, cfg.n_layers
    n_tokens = batch * seq
    per_layer = 2 * n_tokens * (4 * D * D + 2 * D * F) + 2 * (2 * batch * seq * seq * D)
    return 3 * (L * per_layer + 2 * n_tokens * D * V)
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
def test_q8_public(step_flops, loss_fn, params, tokens, cfg):
    """step_flops at the notebook's sizes against the matrix products of the traced training
    step (jax.value_and_grad(loss_fn)), each loop's body counted once per layer; a Python int."""
    import math
    import jax
    import jaxlab_form as form

    form.expect_callable("step_flops", form.evidence(step_flops))
    B, S = tokens.shape[0], tokens.shape[1] - 1  # the loss reads S - 1 positions
    call = f"step_flops(cfg, {B}, {S}) at the notebook's config"
    try:
        got = form.evidence(step_flops(cfg, B, S))
    except Exception as exc:
        raise AssertionError(f"`{call}` raised {form.student_error(exc)}.") from None

    def products(jaxpr, times=1):
        total = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                (contract, _), _ = eqn.params["dimension_numbers"]
                total += times * 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(
                    eqn.invars[0].aval.shape[d] for d in contract)
            inner = times * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
            for sub in form._sub_jaxprs(eqn.params):
                total += products(sub, inner)
        return total

    wanted = products(jax.make_jaxpr(jax.value_and_grad(loss_fn), static_argnums=2)(
        params, tokens, cfg.n_heads).jaxpr)
    if got["kind"] != "number" or got["value"] != wanted:
        found = form.describe(got) if got["kind"] != "number" else f"{got['value']:,.0f}"
        hint = {wanted // 3: " That is the forward pass alone; a training step takes 3 × it.",
                wanted // 2: " That counts one FLOP per multiply-add; count 2."}.get(
            got.get("value"), "")
        raise AssertionError(
            f"`{call}` is {found}; expected {wanted:,d}, the FLOPs of the matrix products that "
            "the traced training step (jax.value_and_grad(loss_fn)) runs, forward and "
            f"backward.{hint}")
    if got.get("type") != "int":
        raise AssertionError(f"`{call}` is the right number, but of type {got.get('type')}; "
                             "expected a Python int.")

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

# %% [markdown]
# The cell below checks your count three ways at the notebook's sizes: against the scaling
# book's `6·N·tokens + 12·L·B·S²·D`, against the matrix products of the traced training step
# (each loop's body counted once per layer), and against `cost_analysis` as the layers grow.

# %% tags=["claim:lab7-flops-formula", "claim:lab7-cost-analysis-loop"]
def traced_matmul_flops(jaxpr, times=1):
    """FLOPs of every matrix product under `jaxpr`, a loop's body counted once per iteration."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            total += times * 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(
                eqn.invars[0].aval.shape[d] for d in contract)
        inner = times * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    total += traced_matmul_flops(sub, inner)
    return total


if answered(step_flops):
    S = cfg.seq - 1  # the loss reads seq - 1 positions: the last token is only a target
    N = cfg.n_layers * (4 * cfg.d_model**2 + 2 * cfg.d_model * cfg.d_ff) + cfg.d_model * cfg.vocab
    traced = traced_matmul_flops(jax.make_jaxpr(jax.value_and_grad(loss_fn), static_argnums=2)(
        params, tokens, cfg.n_heads).jaxpr)
    print(f"step_flops(cfg, {BATCH}, {S}) = {step_flops(cfg, BATCH, S):,d}; "
          f"6·N·tokens + 12·L·B·S²·D = "
          f"{6 * N * BATCH * S + 12 * cfg.n_layers * BATCH * S**2 * cfg.d_model:,d}; "
          f"products of the traced step: {traced:,d}")
    model_counts = [step_flops(cfg._replace(n_layers=n), BATCH, S) for n in LAYER_COUNTS]
    for n, flops in zip(LAYER_COUNTS, model_counts):
        print(f"{n} layer(s): step_flops {flops:,d}, cost_analysis {counted[n]:,.0f}")
    fig, ax = plt.subplots(figsize=(6.5, 3))
    ax.plot(LAYER_COUNTS, [f / 1e6 for f in model_counts], marker="o", label="step_flops")
    ax.plot(LAYER_COUNTS, [counted[n] / 1e6 for n in LAYER_COUNTS], marker="s",
            label="cost_analysis (the loop's body once)")
    ax.set_xlabel("layers")
    ax.set_ylabel("MFLOPs per step")
    ax.set_xticks(LAYER_COUNTS)
    ax.legend()
    fig.tight_layout()
    plt.show()

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
#   it is done. Block on the result (`jax.block_until_ready(out)`, which accepts a tuple or any
#   pytree of arrays) before reading the clock, or you time the queueing.
#
# Time several steps and divide: the mean over the calls. Calls differ (other processes, the
# processor's clock), so a figure to report is the **median over a few such measurements**, not
# the fastest call. The **model FLOPs utilisation** is then the share of the hardware's peak
# that the model's FLOPs achieve: `MFU = step FLOPs / step seconds / peak FLOP/s`, with the
# step's FLOPs counted as `step_flops` counts them: the model's own products, by the convention
# above, not the products the program spends on recomputation (remat runs each layer's forward
# pass again) or on anything else. Counting what the program actually executes gives the
# **hardware FLOPs utilisation** (HFU), which remat makes larger than the MFU. Well-tuned
# large runs reach an MFU of 40 to 60%.
#
# The peak is the hardware's. Here the 8 devices are simulated on one computer and **share its
# processor cores**: their peak together is the host's, which the lab measures (a large matrix
# product on all 8 devices at once, in the precision the step multiplies in) rather than
# assumes.

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
#   the result with `jax.block_until_ready` before the clock stops, and divide by `repeats` (the
#   mean of those calls). The step may return one array or a tuple of them (the run's
#   `train_step` returns the tuple `(state, loss)`);
# * `mfu(flops, seconds, peak_flops_per_s)`: the model FLOPs utilisation (a Python `float`
#   between 0 and 1 for a real step).
#
# The hidden check times steps of its own whose compilation and queued work take known times,
# and whose calls do not all take the same time.

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
def test_q9_public(time_step, mfu):
    """time_step on a stand-in step whose compilation and queued work take known times (it
    returns a tuple, as the run's train_step does, and its calls take 10, 10 and 40 ms in turn);
    mfu on round numbers."""
    import math
    import time
    import jaxlab_form as form

    form.expect_callable("time_step", form.evidence(time_step))
    form.expect_callable("mfu", form.evidence(mfu))

    class Done:  # done at `at` (perf_counter); blocking waits until then
        def __init__(self, at):
            self.at = at

        def block_until_ready(self):
            time.sleep(max(0.0, self.at - time.perf_counter()))
            return self

    class Step:  # compiles for 0.15 s on its first call, then queues each call's work
        work = (0.01, 0.01, 0.04)

        def __init__(self):
            self.calls, self.busy = 0, 0.0

        def __call__(self, *args):
            self.calls += 1
            if self.calls == 1:
                time.sleep(0.15)
            work = self.work[(self.calls - 2) % 3] if self.calls > 1 else 0.05
            self.busy = max(time.perf_counter(), self.busy) + work
            return Done(self.busy), Done(self.busy)

    step, repeats = Step(), 6
    call = (f"time_step(step, args, {repeats}) for a step that compiles in 150 ms, returns a "
            "tuple, and whose calls then take 10, 10 and 40 ms of queued work in turn")
    try:
        seconds = time_step(step, (object(),), repeats)
    except Exception as exc:
        raise AssertionError(f"`{call}` raised {form.student_error(exc)}; expected a time: "
                             "block on the whole result with jax.block_until_ready(out), "
                             "which takes a tuple too.") from None
    got = form.evidence(seconds)
    if got["kind"] != "number" or got.get("is_int"):
        raise AssertionError(f"`{call}` returned {form.describe(got)}; expected a Python float.")
    if step.calls != repeats + 1:
        raise AssertionError(f"`{call}` called the step {step.calls} times; expected "
                             f"{repeats + 1}: once to compile, then {repeats} timed calls.")
    mean = sum(Step.work) / 3
    if not 0.9 * mean <= seconds <= 1.5 * mean + 0.004:
        hints = {mean * repeats: f" That is the time of all {repeats} calls: divide by repeats.",
                 mean * 1e3: " That is in milliseconds; return seconds."}
        near = min(hints, key=lambda v: abs(math.log(max(seconds, 1e-9) / v)))
        hint = hints[near] if abs(math.log(max(seconds, 1e-9) / near)) < math.log(1.25) else ""
        if seconds < 0.5 * min(Step.work):  # faster than any call: not waited for
            hint = (" JAX returns before the work is done: block on the result "
                    "(jax.block_until_ready) before stopping the clock.")
        elif seconds < 0.9 * mean:
            hint = (" That is less than the mean of the calls, as the fastest call or the median "
                    "is; return their mean (their total over repeats).")
        raise AssertionError(f"`{call}` measured {seconds * 1e3:.2f} ms per call; expected "
                             f"about {mean * 1e3:.0f} ms, their mean.{hint}")
    try:
        share = mfu(6e12, 2.0, 1e13)
    except Exception as exc:
        raise AssertionError(f"`mfu(6e12, 2.0, 1e13)` raised {form.student_error(exc)}.") from None
    if not (isinstance(share, float) and math.isclose(share, 0.3)):
        raise AssertionError(f"`mfu(6e12, 2.0, 1e13)` is {share!r}; expected 0.3, the step's "
                             "FLOPs over its seconds over the peak FLOP/s, as a float.")

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
# ## Part F: one step that uses everything
#
# A large run does not choose between these techniques: its training step is FSDP × TP, in
# mixed precision, over microbatches, all at once. Put your Tasks 4, 5 and 6 together.

# %% [raw]
# # BEGIN QUESTION
# name: q10_composed_step
# points: 2

# %% [markdown]
# **Task 10** (`q10_composed_step`). Define `composed_loss_and_grad(params, tokens, mesh,
# n_heads, n_micro)`, returning the tuple `(loss, grads)`: the value of `loss_fn(params, tokens,
# n_heads)` and its gradient in `params`, for parameters in the `fsdp_specs` layout and tokens
# split by rows over `data`, on the `data` × `model` mesh it is given (the hidden check uses
# 2 × 4, not the notebook's 4 × 2), computed the way a large run computes them:
#
# * over `n_micro` equal microbatches (`n_micro` divides the batch; how the rows are split is up
#   to you) with a `lax.scan` of length `n_micro` that carries the sums, as in Task 6;
# * each microbatch's loss as in Task 4: the layers in a `lax.scan` whose body is under
#   `jax.checkpoint` and constrains the layer's weights to the tensor-parallel layout (the
#   gather), the embedding, position and unembedding tables constrained to their replicated
#   Part A layout before use;
# * every matrix product in mixed precision, as in Task 5: `bfloat16` operands accumulated in
#   `float32`, everything else `float32`;
# * the gradients `float32`, constrained to the `fsdp_specs` layout.
#
# Its loss must be within 2% of `loss_fn`'s and each gradient within 10% (as in Task 5). The
# hidden check calls it under `jax.jit` (with `mesh`, `n_heads` and `n_micro` fixed).

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def composed_loss_and_grad(params, tokens, mesh, n_heads, n_micro):
    def constrain(tree, specs):
        return jax.tree.map(lambda x, spec: lax.with_sharding_constraint(
            x, NamedSharding(mesh, spec)), tree, specs, is_leaf=lambda x: isinstance(x, P))

    def mm(spec, a, b):
        return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32)

    tp = tp_specs(params)
    layer_tp = {name: P(*spec[1:]) for name, spec in tp["layers"].items()}
    tables = ("embed", "pos", "unembed")

    @jax.checkpoint
    def body(x, p):
        p = constrain(p, layer_tp)
        B, S, D = x.shape
        h = rms_norm(x, p["norm1"])
        q, k, v = [mm("bsd,de->bse", h, p[w]).reshape(B, S, n_heads, D // n_heads)
                   for w in ("wq", "wk", "wv")]
        scores = mm("bshd,bthd->bhst", q, k) / math.sqrt(D // n_heads)
        causal = jnp.arange(S)[:, None] >= jnp.arange(S)[None, :]
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
        x = x + mm("bsd,de->bse", mm("bhst,bthd->bshd", weights, v).reshape(B, S, D), p["wo"])
        h = rms_norm(x, p["norm2"])
        return x + mm("bsf,fd->bsd", jax.nn.gelu(mm("bsd,df->bsf", h, p["w1"])), p["w2"]), None

    def loss(params, batch):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        top = constrain({k: params[k] for k in tables}, {k: tp[k] for k in tables})
        x = top["embed"][inputs] + top["pos"][:inputs.shape[1]]
        x, _ = lax.scan(body, x, params["layers"])
        logits = mm("bsd,dv->bsv", rms_norm(x, params["norm_f"]), top["unembed"])
        return cross_entropy(logits, targets)

    step = jax.value_and_grad(loss)
    micro = tokens.reshape(n_micro, tokens.shape[0] // n_micro, tokens.shape[1])

    def accumulate(total, batch):
        return jax.tree.map(jnp.add, total, step(params, batch)), None

    zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
    (loss_sum, grad_sum), _ = lax.scan(accumulate, zero, micro)
    grads = jax.tree.map(lambda g: g / n_micro, grad_sum)
    return loss_sum / n_micro, constrain(grads, fsdp_specs(params))
# END SOLUTION
""" # BEGIN PROMPT
composed_loss_and_grad = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q10_public(composed_loss_and_grad, loss_fn, params, tokens, mesh, cfg):
    """composed_loss_and_grad on the notebook's params (in Part B's layout), tokens and mesh, in
    4 microbatches: loss and gradients near loss_fn's, float32, in the fsdp_specs layout; from
    its jaxpr, a scan of length 4 carrying sums, each layer gathered inside a checkpointed scan
    (no gathered weight kept for the backward pass), the tables gathered, every product
    bfloat16 x bfloat16 accumulated in float32 and nothing else computed in bfloat16."""
    import math
    import jax
    import numpy as np
    import jaxlab_form as form
    from jax.sharding import NamedSharding, PartitionSpec as P

    form.expect_callable("composed_loss_and_grad", form.evidence(composed_loss_and_grad))
    form.free_kernel_memory()  # what was compiled before this check
    columns, rows = [None, "data", "model"], [None, "model", "data"]
    table = {("layers", n): columns for n in ("wq", "wk", "wv", "w1")}
    table.update({("layers", n): rows for n in ("wo", "w2")})
    table.update({("embed",): [None, "data"], ("pos",): [None, "data"],
                  ("unembed",): ["data", None]})

    def path_of(path):
        return tuple(k.key for k in path)

    placed = jax.tree_util.tree_map_with_path(lambda path, x: jax.device_put(x, NamedSharding(
        mesh, P(*table.get(path_of(path), [])))), params)
    data_tokens = jax.device_put(tokens, NamedSharding(mesh, P("data", None)))
    n_micro = 4  # not the notebook's 2 layers: the scans tell apart
    run = jax.jit(lambda p, t: composed_loss_and_grad(p, t, mesh, cfg.n_heads, n_micro))
    call = (f"composed_loss_and_grad(params, tokens, mesh, n_heads, {n_micro}) on the "
            "notebook's params (in the fsdp_specs layout), tokens and 4 × 2 mesh")
    try:
        loss, grads = jax.block_until_ready(run(placed, data_tokens))
    except Exception as exc:
        raise AssertionError(f"`{call}` under jax.jit raised {form.student_error(exc)}; "
                             "expected the tuple (loss, grads).") from None
    references = form.__dict__.setdefault("_lab7_references", {})  # shared by the checks
    key = (id(loss_fn), id(params), id(tokens), tuple(cfg))
    if key not in references:
        references.clear()
        references[key] = jax.tree.map(np.asarray, jax.jit(
            jax.value_and_grad(loss_fn), static_argnums=2)(params, tokens, cfg.n_heads))
    want, want_grads = references[key]
    if str(getattr(loss, "dtype", "")) != "float32":
        raise AssertionError(f"the loss `{call}` returned is {form.describe(form.evidence(loss))}"
                             "; expected a float32 scalar.")
    if not abs(float(loss) - float(want)) <= 0.02 * abs(float(want)):
        raise AssertionError(f"the loss `{call}` returned is {float(loss):.5g}; expected within "
                             f"2% of loss_fn's {float(want):.5g}.")
    got = {path_of(p): g for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    for path, want_g in jax.tree_util.tree_flatten_with_path(want_grads)[0]:
        path = path_of(path)
        where = "".join(f"[{k!r}]" for k in path)
        g = got.get(path)
        if g is None or str(getattr(g, "dtype", "")) != "float32":
            raise AssertionError(
                f"the gradient of params{where} from `{call}` is "
                f"{form.describe(form.evidence(g))}; expected a float32 array.")
        gap = float(np.linalg.norm(np.asarray(g, np.float64) - np.asarray(want_g, np.float64)))
        size = max(float(np.linalg.norm(np.asarray(want_g, np.float64))), 1e-12)
        if not gap <= 0.10 * size:
            raise AssertionError(
                f"the gradient of params{where} from `{call}` is {gap / size:.1%} away from "
                "loss_fn's (the norm of the difference over the norm of the float32 gradient); "
                "expected within 10%.")
        layout = form.evidence(g)["sharding"]
        if layout.get("kind") != "NamedSharding" or not form.is_laid_out_as(
                layout, g.ndim, P(*table.get(path, []))):
            raise AssertionError(
                f"the gradient of params{where} from `{call}` is laid out "
                f"{form.describe_sharding(layout)}; expected the fsdp_specs layout "
                f"{form.spec_repr(table.get(path, []))}.")
    steps = []

    def walk(jaxpr, scans):
        for eqn in jaxpr.eqns:
            steps.append((eqn, scans))
            inner = scans + [eqn.params["length"]] if eqn.primitive.name == "scan" else scans
            for sub in form._sub_jaxprs(eqn.params):
                walk(sub, inner)

    walk(jax.make_jaxpr(run)(placed, data_tokens).jaxpr, [])
    V, D, F, L, S = cfg.vocab, cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.seq
    words = f"traced on the notebook's inputs with {n_micro} microbatches"
    outer = [(eqn, scans) for eqn, scans in steps if eqn.primitive.name == "scan"
             and not scans and eqn.params["length"] == n_micro]
    if not outer:
        raise AssertionError(f"{words}, `composed_loss_and_grad` has no lax.scan of length "
                             f"{n_micro} (over the microbatches) at its top level; expected one.")
    weights = {(D, D), (D, F), (F, D)}
    def n_carry(eqn):  # the scan's carried outputs; the rest are stacked (JAX 0.12: ft_out)
        return (eqn.params["num_carry"] if "num_carry" in eqn.params
                else len(eqn.params["ft_out"].unpack()[0]))
    if all(any(tuple(v.aval.shape[1:]) in {(L,) + w for w in weights}
               for v in eqn.outvars[n_carry(eqn):]) for eqn, _ in outer):
        raise AssertionError(f"{words}, the scan over the microbatches in "
                             "`composed_loss_and_grad` stacks every microbatch's gradient; "
                             "expected it to carry running sums.")

    def trimmed(entries):
        entries = list(entries)
        while entries and entries[-1] is None:
            entries.pop()
        return entries

    def constraints(shape, spec):
        return [scans for eqn, scans in steps if eqn.primitive.name == "sharding_constraint"
                and tuple(eqn.invars[0].aval.shape) == tuple(shape)
                and trimmed(form._spec_entry(e) for e in eqn.params["sharding"].spec)
                == trimmed(spec)]

    for shape, spec, names in (((D, D), [None, "model"], "wq, wk and wv"),
                               ((D, D), ["model", None], "wo"), ((D, F), [None, "model"], "w1"),
                               ((F, D), ["model", None], "w2")):
        if not any(scans[-2:] == [n_micro, L] for scans in constraints(shape, spec)):
            raise AssertionError(
                f"{words}, `composed_loss_and_grad` does not constrain the layer's {names} "
                f"(shape {shape}) to the tensor-parallel layout {form.spec_repr(spec)} inside "
                f"the body of the scan over the {L} layers; expected that gather, one layer at "
                "a time.")
    for shape, name in (((V, D), "embed"), ((S, D), "pos"), ((D, V), "unembed")):
        if not constraints(shape, []) and not (name == "pos" and constraints((S - 1, D), [])):
            raise AssertionError(f"{words}, `composed_loss_and_grad` never constrains `{name}` "
                                 f"(shape {shape}) to P(), replicated; expected the tables "
                                 "gathered before they are used.")
    for eqn, _ in steps:
        if eqn.primitive.name != "scan" or eqn.params["reverse"] or eqn.params["length"] != L:
            continue
        body = eqn.params["jaxpr"].jaxpr
        inputs = {id(v) for v in body.invars}
        n_carry = (eqn.params["num_carry"] if "num_carry" in eqn.params  # JAX 0.12: a flat
                   else len(eqn.params["ft_out"].unpack()[0]))          # tree, ft_out
        kept = [tuple(v.aval.shape) for v in body.outvars[n_carry:]
                if id(v) not in inputs and tuple(getattr(v.aval, "shape", ())) in weights]
        if kept:
            raise AssertionError(
                f"{words}, the scan over the layers in `composed_loss_and_grad` hands "
                f"{len(kept)} gathered weight(s) per "
                f"layer (shapes {sorted(set(kept))}) to the backward pass; expected the scan's "
                "body under jax.checkpoint, so that the backward pass gathers each layer again.")

    def shapes(vs):
        return " by ".join(f"{v.aval.dtype}{tuple(v.aval.shape)}" for v in vs)

    dots = [(eqn, scans) for eqn, scans in steps if eqn.primitive.name == "dot_general"]
    low = [(eqn, scans) for eqn, scans in dots
           if [str(v.aval.dtype) for v in eqn.invars] == ["bfloat16", "bfloat16"]]
    for eqn, _ in dots:
        if all(str(v.aval.dtype) == "float32" for v in eqn.invars):
            raise AssertionError(f"{words}, `composed_loss_and_grad` multiplies "
                                 f"{shapes(eqn.invars)}; expected every matrix product of the "
                                 "model to take bfloat16 operands.")
    for eqn, _ in low:
        preferred = eqn.params.get("preferred_element_type")
        if str(np.dtype(preferred) if preferred is not None else None) != "float32":
            raise AssertionError(
                f"{words}, `composed_loss_and_grad` multiplies {shapes(eqn.invars)} into "
                f"{shapes(eqn.outvars)}; expected it accumulated and returned in float32 "
                "(preferred_element_type=jnp.float32).")
    if sum(math.prod(scans) for _, scans in low) < n_micro * (8 * L + 1):
        raise AssertionError(
            f"{words}, `composed_loss_and_grad` runs "
            f"{sum(math.prod(scans) for _, scans in low)} bfloat16 matrix product(s); expected "
            f"at least the model's 8 per layer and the unembedding for each microbatch, "
            f"{n_micro * (8 * L + 1)} in all.")
    structural = {"reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims",
                  "slice", "concatenate", "copy", "copy_p", "convert_element_type",
                  "dot_general", "pjit", "jit", "closed_call", "scan", "dynamic_slice",
                  "gather", "sharding_constraint", "remat2", "checkpoint"}
    for eqn, _ in steps:
        if eqn.primitive.name not in structural and any(
                str(getattr(v.aval, "dtype", "")) == "bfloat16" for v in eqn.outvars):
            raise AssertionError(
                f"{words}, `composed_loss_and_grad` computes `{eqn.primitive.name}` in bfloat16 "
                f"({shapes(eqn.outvars)}); expected everything but the matrix products' "
                "operands to stay float32.")

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q10_composed_step(composed_loss_and_grad):
    import jaxlab_lab7
    jaxlab_lab7.check("q10_composed_step", composed_loss_and_grad=composed_loss_and_grad)

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
# The run trains on the 4 × 2 mesh with your `composed_loss_and_grad` (2 microbatches) and
# **AdamW**: Adam's two moments `m` and `v` (Lab 6), bias-corrected, plus a decoupled weight
# decay. The master parameters and both moments are `float32` and laid out like the parameters
# (`fsdp_specs`), so the optimizer's state is fully sharded too. Half way it saves the whole
# train state (parameters, moments, step) with a `CheckpointManager`, in the background while
# training goes on; then it restores that state onto the 2 × 2 mesh of 4 devices (another shape,
# fewer devices) and continues there. If everything is right, the continued curve lies on the
# uninterrupted one: the same state, the same data, another mesh (the two differ only by the
# rounding of sums taken in another order).

# %%
STEPS, N_MICRO = 16, 2
LEARNING_RATE, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.95), 1e-8, 0.01


def toy_batch(step, batch=BATCH):
    rng = np.random.default_rng(step)
    start = rng.integers(0, cfg.vocab, (batch, 1))
    stride = rng.integers(1, 4, (batch, 1))
    return jnp.asarray((start + stride * np.arange(cfg.seq)) % cfg.vocab, dtype=jnp.int32)


def adamw(params, grads, opt, step):
    """One AdamW update at step `step` (1, 2, …): float32 throughout."""
    b1, b2 = BETAS
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, opt["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, opt["v"], grads)

    def update(p, m, v):
        m_hat, v_hat = m / (1 - b1**step), v / (1 - b2**step)
        return p - LEARNING_RATE * (m_hat / (jnp.sqrt(v_hat) + EPS) + WEIGHT_DECAY * p)

    return jax.tree.map(update, params, m, v), {"m": m, "v": v}


def state_shardings(mesh):
    """The train state's layout on `mesh`: parameters and both moments as fsdp_specs says."""
    specs = fsdp_specs(params)
    specs = {"params": specs, "opt": {"m": specs, "v": specs}, "step": P()}
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, P))


@functools.cache  # one compiled step per mesh
def make_train_step(mesh):
    @jax.jit
    def train_step(state, tokens):
        loss, grads = composed_loss_and_grad(state["params"], tokens, mesh, cfg.n_heads, N_MICRO)
        step = state["step"] + 1
        new_params, opt = adamw(state["params"], grads, state["opt"], step)
        return {"params": new_params, "opt": opt, "step": step}, loss
    return train_step


def train(state, mesh, first, last):
    train_step, losses = make_train_step(mesh), []
    batch_layout = NamedSharding(mesh, P("data", None))
    for step in range(first, last):
        state, loss = train_step(state, jax.device_put(toy_batch(step), batch_layout))
        losses.append(float(loss))
    return state, losses

# %% tags=["claim:lab7-restore-continues"]
if answered(fsdp_specs, composed_loss_and_grad):
    zeros = jax.tree.map(jnp.zeros_like, params)
    state = jax.device_put({"params": params, "opt": {"m": zeros, "v": zeros},
                            "step": jnp.array(0, jnp.int32)}, state_shardings(mesh))
    run_dir = tempfile.mkdtemp()
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(os.path.join(run_dir, "run"), options=options) as manager:
        half, losses = train(state, mesh, 0, STEPS // 2)
        manager.save(STEPS // 2, args=ocp.args.StandardSave(half))  # written in the background
        _, rest = train(half, mesh, STEPS // 2, STEPS)
        manager.wait_until_finished()
        target = jax.tree.map(
            lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
            jax.eval_shape(lambda: half), state_shardings(small_mesh))
        print(f"checkpoints: steps {manager.all_steps()}")
        resumed = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(target))
    # each compiled step holds ~200 MiB here: give back the 4 × 2 one before the 2 × 2 one
    # compiles (Gradescope's container has 768 MB; the next cell compiles it again)
    free_compiled()
    moment = resumed["opt"]["v"]["layers"]["w1"]
    print(f"restored at step {int(resumed['step'])} on a {dict(small_mesh.shape)} mesh; "
          f"v of w1 {moment.dtype}{list(moment.shape)} laid out {moment.sharding.spec}")
    _, resumed_losses = train(resumed, small_mesh, STEPS // 2, STEPS)
    gap = max(abs(a - b) for a, b in zip(rest, resumed_losses))
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    ax.plot(range(STEPS), losses + rest, marker=".", label="4 × 2 mesh, uninterrupted")
    ax.plot(range(STEPS // 2, STEPS), resumed_losses, linestyle="--", marker="x",
            label="restored from the checkpoint on 2 × 2")
    ax.axvline(STEPS // 2 - 0.5, color="grey", linewidth=0.8)
    ax.axhline(math.log(cfg.vocab), color="grey", linestyle=":", label="uniform guess")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss")
    ax.set_title("FSDP × TP, mixed precision, 2 microbatches, AdamW; checkpointed half way")
    ax.legend()
    fig.tight_layout()
    plt.show()
    print(f"loss {losses[0]:.3f} → {rest[-1]:.3f} on 4 × 2; the resumed run ends at "
          f"{resumed_losses[-1]:.3f}; largest gap between the two second halves: {gap:.2e}")
    free_compiled()

# %% [markdown]
# Last, the utilisation of one step of this run, with the host's peak measured first: a
# `bfloat16` product accumulated in `float32` on each of the 8 devices at once (they share the
# host's cores), timed with your `time_step`. Each figure is the median of a few measurements.
# On a real accelerator the same lines, with the chip's peak, give the MFU a paper reports.

# %% tags=["claim:lab7-mfu", "claim:lab7-hardware-flops"]
if answered(composed_loss_and_grad, step_flops, time_step, mfu):
    n = 512
    all_devices = jax.make_mesh((N_DEVICES,), ("d",), axis_types=(AxisType.Auto,),
                                devices=devices)
    blocks = jax.device_put(jnp.ones((N_DEVICES, n, n)), NamedSharding(all_devices, P("d")))
    products = jax.jit(lambda a: jnp.einsum("dij,djk->dik", a.astype(jnp.bfloat16),
                                            a.astype(jnp.bfloat16),
                                            preferred_element_type=jnp.float32))
    peaks = [N_DEVICES * 2 * n**3 / time_step(products, (blocks,), 3) for _ in range(3)]
    peak = float(np.median(peaks))
    train_step = make_train_step(mesh)
    args = (state, jax.device_put(toy_batch(0), NamedSharding(mesh, P("data", None))))
    times = sorted(time_step(train_step, args, 3) for _ in range(5))
    seconds = float(np.median(times))
    flops = step_flops(cfg, BATCH, cfg.seq - 1)
    hardware = traced_matmul_flops(jax.make_jaxpr(train_step)(*args).jaxpr)
    print(f"host peak, measured: {peak / 1e9:.2f} GFLOP/s (median of "
          f"{', '.join(f'{p / 1e9:.2f}' for p in peaks)})")
    print(f"step: median {seconds * 1e3:.2f} ms of {len(times)} measurements "
          f"({times[0] * 1e3:.2f} to {times[-1] * 1e3:.2f} ms)")
    print(f"model FLOPs {flops:,d}; products the program runs {hardware:,d} "
          f"({hardware / flops:.2f} × the model's: remat's second forward pass)")
    print(f"MFU {mfu(flops, seconds, peak):.2%}, HFU {mfu(hardware, seconds, peak):.2%} of the "
          "measured peak")
    del blocks, args
    free_compiled()

# %% [markdown]
# ## Submitting
#
# Run the whole notebook from the top (*Kernel → Restart & Run All*), check that every
# `grader.check` cell says the public checks passed, then run the cell below.
