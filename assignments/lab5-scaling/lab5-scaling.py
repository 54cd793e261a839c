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
# name: lab5-scaling
# environment: environment.yml
# files:
#   - jaxlab_form.py
# autograder_files:
#   - jaxlab_lab5.py
# tests:
#   ok_format: false
# export_cell:
#   pdf: false
#   instructions: "Upload the zip file this cell makes to the course's submission page. On Google Colab, which cannot make the zip, this cell instead tells you to submit the notebook itself: *File → Download → Download .ipynb*, then upload that file."
# check_all_cell: false

# %% [markdown]
# # Lab 5: Past one mesh axis and one process
#
# Labs 3 and 4 split a computation over the devices along **one** mesh axis at a time: the batch
# (data parallelism), the parameters (FSDP) or the features (tensor parallelism). Large training
# runs combine several of these at once, add two more ways of dividing the work, and run as one
# program spread over many processes. This lab covers them:
#
# * **A.** a 2-D mesh, `data` × `model`: data parallelism and tensor parallelism together, first
#   with explicit shardings under `jax.jit`, then by hand with `jax.shard_map` and one collective
#   per mesh axis;
# * **B.** pipeline parallelism: the layers of a deep network spread over the devices in
#   **stages**, microbatches flowing through them one step at a time with `ppermute`, the
#   gradient flowing back the same way, and the idle time ("bubble") this schedule costs;
# * **C.** expert parallelism: a mixture-of-experts layer whose tokens are routed to experts that
#   live on other devices, with `jax.lax.all_to_all` carrying them there and back.
# * **D.** one program, several processes: a training script that runs as two processes joined
#   by `jax.distributed`, each feeding its own share of the data into one mesh that spans both.
#
# ## How this lab works
#
# * Every task has one cell that starts with `### Your code here`. Replace the `...` with your
#   answer and run it. The cell after it, `grader.check("q…")`, runs the public checks, which
#   only test the form of the answer. Hidden checks run when your notebook is graded: they call
#   your functions on **new random inputs** (other sizes too, where the task says so), compare
#   the results with references computed in float64 from the lab's own recipe, and read the
#   program your function traces (`jax.make_jaxpr`) to see **which collectives** it uses, over
#   **which mesh axes**, **in which order**, and how its `in_specs` split each input; Part D's
#   check runs your training script again, as two processes, on new data. So follow the method
#   each task describes, not only its numbers.
# * Do not rename the variables a task asks for, and do not reuse their names later on.
# * Where a task says a function returns a tuple, a list of the same items is accepted too.
# * Run the notebook from the top (*Kernel → Restart & Run All*) before you submit.

# %% [markdown]
# ## Setup: eight devices
#
# As in Labs 3 and 4, the next cell must run **before any other JAX code**. It asks for 8
# simulated CPU devices (unless the runtime has 8 or more accelerators) and sets `PJRT_NPROC`,
# which keeps XLA's communication threads from starving on machines with few CPU cores
# (otherwise a loop of sharded steps can kill the kernel with "Expected 8 threads to join the
# rendezvous"). If the cell says that JAX is already running, restart the kernel and run from
# the top. On Linux it also tells the C library to give large freed buffers straight back to the
# operating system, which keeps the notebook well inside a 768 MB grading container.
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
from functools import partial

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

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
# ## Part A: a 2-D mesh, data × model
#
# ### Two axes
#
# `jax.make_mesh((2, 4), ('x', 'y'))` arranges the 8 devices as a grid of 2 rows and 4 columns
# and names the two directions. A `PartitionSpec` then says, for each dimension of an array,
# which mesh axis (if any) it is split over. A mesh axis that a spec does not mention holds
# **copies**: `P('x', None)` splits the rows in 2 and keeps each half on the 4 devices of its
# mesh row. With **Explicit** axes (Lab 3), `jax.typeof` shows the split in the type: `8@x` means
# "8 entries, split over `x`".

# %%
grid_mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2,
                          devices=devices)
grid = np.arange(64.0).reshape(8, 8)
for spec in (P("x", "y"), P("x", None), P(None, "y")):
    placed = jax.device_put(grid, NamedSharding(grid_mesh, spec))
    print(f"{spec}: {jax.typeof(placed)}")
    jax.debug.visualize_array_sharding(placed, scale=0.4)

# %% [markdown]
# ### Data and tensor parallelism at once
#
# A large model is trained on a mesh `data` × `model`: the batch is split over `data` (each row
# of the mesh sees a quarter of the examples, as in data parallelism), and inside each row the
# weights are split over `model` (tensor parallelism). For a two-layer MLP
# `tanh(x @ W1 + b1) @ W2 + b2`, the Megatron-LM layout splits the layers so that only one
# collective is needed per MLP:
#
# * `W1` (and `b1`) is split by **columns** over `model`: each device computes its columns of the
#   hidden activations `h = tanh(x @ W1 + b1)` from its own block, with no communication (tanh
#   acts entry by entry);
# * `W2` is split by **rows** over `model`: a device holding columns `k` of `h` and rows `k` of
#   `W2` computes `h_k @ W2_k`, one of the **summands** of `h @ W2`. Adding the summands of the
#   `model` axis is the one all-reduce;
# * `b2` is small and replicated.
#
# With Explicit axes JAX will not guess where the result of that second product should live: a
# product whose contracted dimension is split on both sides could be left split, or summed. It
# asks you to say it with `out_sharding`:

# %%
a = jax.device_put(np.ones((8, 8)), NamedSharding(grid_mesh, P("x", "y")))   # columns over y
b = jax.device_put(np.ones((8, 4)), NamedSharding(grid_mesh, P("y", None)))  # rows over y
try:
    a @ b
except Exception as err:
    print(type(err).__name__, ":", str(err).splitlines()[0][:150], "...")
summed = jnp.dot(a, b, out_sharding=NamedSharding(grid_mesh, P("x", None)))
print("with out_sharding:", jax.typeof(summed))

# %% [markdown]
# `out_sharding` takes a `NamedSharding` (the mesh and the spec of the result). Asking for an
# output that is not split over `y` makes XLA add up the summands over `y`: the
# all-reduce happens there, and nowhere else.
#
# The MLP of this part and its loss (the mean over examples of the squared error, summed over
# the outputs), with one batch of 32 examples:

# %%
def forward(params, x):
    W1, b1, W2, b2 = params
    return jnp.tanh(x @ W1 + b1) @ W2 + b2


def mlp_loss(params, batch):
    x, y = batch
    return jnp.mean(jnp.sum((forward(params, x) - y) ** 2, axis=-1))


def init_mlp(key, n_in=16, n_hidden=64, n_out=8, batch_size=32):
    k = jax.random.split(key, 6)
    W1 = jax.random.normal(k[0], (n_in, n_hidden)) / jnp.sqrt(n_in)
    b1 = 0.1 * jax.random.normal(k[1], (n_hidden,))
    W2 = jax.random.normal(k[2], (n_hidden, n_out)) / jnp.sqrt(n_hidden)
    b2 = 0.1 * jax.random.normal(k[3], (n_out,))
    x = jax.random.normal(k[4], (batch_size, n_in))
    y = jax.random.normal(k[5], (batch_size, n_out))
    return (W1, b1, W2, b2), (x, y)


mlp_params, (x_mlp, y_mlp) = init_mlp(jax.random.key(0))
print("shapes:", [p.shape for p in mlp_params], x_mlp.shape, y_mlp.shape)
print(f"single-device loss: {float(mlp_loss(mlp_params, (x_mlp, y_mlp))):.4f}")

# %% [raw]
# # BEGIN QUESTION
# name: q1_mesh_2d
# points: 2

# %% [markdown]
# **Task 1** (`q1_mesh_2d`). Define
#
# * `mesh_2d`: a 4 × 2 mesh of `devices` with axes `('data', 'model')`, both **Explicit**;
# * `x_2d`: `x_mlp` on `mesh_2d`, its rows split over `data` (and so copied over `model`);
# * `params_2d`: the tuple `(W1, b1, W2, b2)` of `mlp_params` on `mesh_2d` in the Megatron
#   layout: `W1` split by columns over `model`, `b1` split over `model`, `W2` split by rows over
#   `model`, `b2` replicated;
# * `forward_2d(params, x)`: the MLP's forward pass, wrapped in `jax.jit`, for arrays laid out
#   like `params_2d` and `x_2d` (any batch size divisible by 4). The hidden activations must stay
#   split over `model` (never gather `W1`), and the output must come out split over `data` and
#   replicated over `model`: `jax.typeof` of the output reads `float32[32@data,8]` for 32
#   examples;
# * `out_2d = forward_2d(params_2d, x_2d)`.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
mesh_2d = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                        devices=devices)


def place_2d(value, *spec):
    return jax.device_put(value, NamedSharding(mesh_2d, P(*spec)))


W1, b1, W2, b2 = mlp_params
params_2d = (place_2d(W1, None, "model"), place_2d(b1, "model"), place_2d(W2, "model", None),
             place_2d(b2))
x_2d = place_2d(x_mlp, "data", None)


@jax.jit
def forward_2d(params, x):
    W1, b1, W2, b2 = params
    h = jnp.tanh(x @ W1 + b1)  # [batch@data, hidden@model]: no communication
    out = jnp.dot(h, W2, out_sharding=NamedSharding(mesh_2d, P("data", None)))  # sums over model
    return out + b2


out_2d = forward_2d(params_2d, x_2d)
# END SOLUTION
""" # BEGIN PROMPT
mesh_2d = ...
x_2d = ...
params_2d = ...
forward_2d = ...
out_2d = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q1_form(mesh_2d, x_2d, params_2d, forward_2d, out_2d):
    import jaxlab_form as form
    form.expect_defined("mesh_2d", form.evidence(mesh_2d))
    form.expect_on_mesh("x_2d", form.evidence(x_2d), shape=(32, 16))
    form.expect_defined("params_2d", form.evidence(params_2d))
    form.expect_callable("forward_2d", form.evidence(forward_2d))
    form.expect_on_mesh("out_2d", form.evidence(out_2d), shape=(32, 8))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q1_mesh_2d(mesh_2d, x_2d, params_2d, forward_2d, out_2d):
    import jaxlab_lab5
    jaxlab_lab5.check("q1_mesh_2d", mesh_2d=mesh_2d, x_2d=x_2d, params_2d=params_2d,
                      forward_2d=forward_2d, out_2d=out_2d)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(out_2d):
    print("output:", jax.typeof(out_2d))
    print("same as one device:", np.allclose(out_2d, forward(mlp_params, x_mlp), atol=1e-5))
    jax.debug.visualize_array_sharding(out_2d, scale=0.4)

# %% [markdown]
# ### The same loss by hand, with `jax.shard_map` over both axes
#
# `jax.shard_map` works on a 2-D mesh as on a 1-D one: an `in_specs` entry such as
# `P('data', None)` splits a dimension over one axis and copies it over the other, and a
# collective names the axis (or axes) it runs over: `jax.lax.psum(v, 'model')` adds `v` over the
# two devices of a mesh row, not over all 8.
#
# Written by hand, the Megatron MLP on a `data` × `model` mesh is: each device multiplies its
# block of examples by its columns of `W1`, applies `tanh`, multiplies by its rows of `W2`, and
# **one `psum` over `model`** adds the two summands of the output block. After adding `b2`, each
# device has the predictions of its examples; its mean loss over them, **averaged over `data`**,
# is the loss of the whole batch.
#
# Remember the gradient trap of Lab 4: take the gradient of the averaged loss, never average
# gradients yourself. Here it holds on both axes: `jax.grad` sums whatever each parameter's copies
# contribute.

# %% [raw]
# # BEGIN QUESTION
# name: q2_dp_tp_shard_map
# points: 2

# %% [markdown]
# **Task 2** (`q2_dp_tp_shard_map`). Define `loss_2d(params, batch)`, the loss `mlp_loss` written
# with `jax.shard_map` on `mesh_2d`, for `params` laid out like `params_2d` and `batch = (x, y)`
# with `x` and `y` split by rows over `data` (any batch size divisible by 4). Inside: local
# products only, **one** `psum` over `model` (of the output block, the summands of `h @ W2`),
# then the **mean over `data`** of the devices' losses, returned as a scalar (`out_specs=P()`).
# No `all_gather`. `loss_2d` and `jax.grad(loss_2d)` must equal `mlp_loss` and its gradient.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
MEGATRON_SPECS = (P(None, "model"), P("model"), P("model", None), P())


def loss_2d(params, batch):
    @partial(jax.shard_map, mesh=mesh_2d, in_specs=(MEGATRON_SPECS, P("data", None)),
             out_specs=P())
    def local_loss(params, batch):
        W1, b1, W2, b2 = params
        x, y = batch
        h = jnp.tanh(x @ W1 + b1)
        pred = lax.psum(h @ W2, "model") + b2
        return lax.pmean(jnp.mean(jnp.sum((pred - y) ** 2, axis=-1)), "data")

    return local_loss(params, batch)
# END SOLUTION
""" # BEGIN PROMPT
loss_2d = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q2_form(loss_2d):
    import jaxlab_form as form
    form.expect_callable("loss_2d", form.evidence(loss_2d))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q2_dp_tp_shard_map(loss_2d, mesh_2d):
    import jaxlab_lab5
    jaxlab_lab5.check("q2_dp_tp_shard_map", loss_2d=loss_2d, mesh_2d=mesh_2d)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(loss_2d, params_2d, x_2d):
    batch_2d = (x_2d, jax.device_put(y_mlp, x_2d.sharding))
    grads_2d = jax.jit(jax.grad(loss_2d))(params_2d, batch_2d)
    grads_1 = jax.grad(mlp_loss)(mlp_params, (x_mlp, y_mlp))
    print(f"loss {float(jax.jit(loss_2d)(params_2d, batch_2d)):.4f}")
    print("same gradient:", all(np.allclose(g, h, rtol=1e-3, atol=1e-5)
                                for g, h in zip(grads_2d, grads_1)))
    print("W1's gradient:", jax.typeof(grads_2d[0]))

# %% [markdown]
# ## Part B: pipeline parallelism
#
# ### Stages
#
# Tensor parallelism splits every layer; **pipeline parallelism** keeps layers whole and gives
# each device a few consecutive layers, a **stage**. The network below has 16 layers of width 24;
# on 8 devices each stage holds 2 of them. An activation leaves a stage and becomes the input of
# the next stage, on the next device: the only communication is that hand-over, from each device
# to its neighbour, which is what `jax.lax.ppermute` does.

# %%
N_STAGES = 8
LAYERS_PER_STAGE = 2
N_LAYERS = N_STAGES * LAYERS_PER_STAGE
WIDTH = 24


def layer(h, W, b):
    return jnp.tanh(h @ W + b)


def sequential_forward(layers, x):
    """The whole network on one device: the 16 layers one after the other."""
    for W, b in layers:
        x = layer(x, W, b)
    return x


def init_layers(key, n_layers=N_LAYERS, width=WIDTH):
    layers = []
    for k in jax.random.split(key, n_layers):
        kW, kb = jax.random.split(k)
        layers.append((jax.random.normal(kW, (width, width)) / jnp.sqrt(width),
                       0.1 * jax.random.normal(kb, (width,))))
    return layers


layers = init_layers(jax.random.key(1))
print(len(layers), "layers; the first:", [p.shape for p in layers[0]])

# %% [markdown]
# With `shard_map`, a stage's parameters are most easily handed over as blocks of **stacked**
# arrays: all 16 weight matrices in one array of shape `(16, 24, 24)` whose leading dimension
# (the layer) is split over a mesh axis `stage`. Device `k` then holds the block of layers
# `2k` and `2k + 1`, in order.

# %% [raw]
# # BEGIN QUESTION
# name: q3_stage_params
# points: 1

# %% [markdown]
# **Task 3** (`q3_stage_params`). Define
#
# * `mesh_stage`: a 1-D mesh of the 8 `devices` with one axis named `'stage'`;
# * `stage_params`: the tuple `(W_stack, b_stack)` of the weights of `layers` stacked in layer
#   order, shape `(16, 24, 24)`, and their biases, shape `(16, 24)`, both on `mesh_stage` with the
#   leading (layer) dimension split over `'stage'`, so that device `k` holds layers `2k` and
#   `2k + 1`.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
mesh_stage = jax.make_mesh((N_STAGES,), ("stage",), axis_types=(AxisType.Auto,), devices=devices)
stage_params = tuple(
    jax.device_put(jnp.stack(leaves), NamedSharding(mesh_stage, P("stage")))
    for leaves in zip(*layers))
# END SOLUTION
""" # BEGIN PROMPT
mesh_stage = ...
stage_params = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q3_form(mesh_stage, stage_params):
    import jaxlab_form as form
    form.expect_defined("mesh_stage", form.evidence(mesh_stage))
    form.expect_defined("stage_params", form.evidence(stage_params))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q3_stage_params(mesh_stage, stage_params):
    import jaxlab_lab5
    jaxlab_lab5.check("q3_stage_params", mesh_stage=mesh_stage, stage_params=stage_params)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(stage_params):
    for name, stacked in zip(("W_stack", "b_stack"), stage_params):
        print(name, jax.typeof(stacked), "one device holds",
              stacked.addressable_shards[0].data.shape)

# %% [markdown]
# ### Microbatches and the schedule
#
# Pipelining one batch naively is no faster than one device: stage 1 waits for stage 0, stage 2
# for stage 1, and at any moment only one device works. **GPipe** splits the batch into `M`
# **microbatches** that follow each other through the pipeline: at step `t`, stage `s` works on
# microbatch `t - s` (when `0 <= t - s < M`). Stage 0 starts microbatch 0 at step 0, the last
# stage finishes microbatch `M - 1` at step `M + L - 2`, so `M` microbatches cross `L` stages in
# `M + L - 1` steps. Here is the schedule for 4 stages and 6 microbatches (`.` = idle):

# %%
def print_schedule(n_stages, n_micro):
    steps = n_micro + n_stages - 1
    print("step     " + " ".join(f"{t:>2}" for t in range(steps)))
    for s in range(n_stages):
        row = [f"{t - s:>2}" if 0 <= t - s < n_micro else " ." for t in range(steps)]
        print(f"stage {s}: " + " ".join(row))


print_schedule(4, 6)

# %% [markdown]
# In `shard_map` every device runs the same program, one loop over the `M + L - 1` steps. At each
# step a device
#
# 1. takes its input: stage 0 the next microbatch (`microbatches[t]`), every other stage the
#    activation its left neighbour sent at the end of the previous step;
# 2. applies its own layers (its block of `W_stack` and `b_stack`, shape `(2, 24, 24)` and
#    `(2, 24)`);
# 3. sends the result one stage on with `jax.lax.ppermute(out, 'stage', [(s, s + 1), ...])`.
#
# `jax.lax.axis_index('stage')` tells a device which stage it is, and `jnp.where` picks a value by
# stage (all devices compute both branches; that is fine). Devices outside their busy window
# compute on zeros or stale values: that is the pipeline's idle time, and its results are never
# used. From step `L - 1` on, the last stage's result at step `t` is the output of microbatch
# `t - (L - 1)`: keep it. At the end only the last stage holds the outputs; a `psum` over `stage`
# of the outputs, zeroed on every other stage, gives them to all devices, so the function can
# return them replicated (`out_specs=P()`). The microbatches themselves are replicated too
# (`P()`): every device receives them, only stage 0 reads them.
#
# Only activations travel; the parameters stay where they are (no `all_gather` of weights: that
# would be FSDP, not a pipeline).

# %%
N_MICRO, MICRO_SIZE = 8, 4
micro_x = jax.random.normal(jax.random.key(2), (N_MICRO, MICRO_SIZE, WIDTH))
micro_y = jax.random.normal(jax.random.key(3), (N_MICRO, MICRO_SIZE, WIDTH))
expected_outputs = jax.vmap(partial(sequential_forward, layers))(micro_x)

# %% [raw]
# # BEGIN QUESTION
# name: q4_pipeline_forward
# points: 2

# %% [markdown]
# **Task 4** (`q4_pipeline_forward`). Define `pipeline_forward(stage_params, microbatches)` with
# `jax.shard_map` on `mesh_stage`: `stage_params` as in Task 3 (in_specs `P('stage')`),
# `microbatches` of shape `(M, MICRO_SIZE, 24)` replicated (`P()`), the result the network's
# outputs for every microbatch, same shape, replicated (`out_specs=P()`). It must follow the
# GPipe schedule above, for any number `M` of microbatches and any microbatch size: `M + 8 - 1`
# steps, each moving the activations one stage on with `ppermute`. It must equal
# `sequential_forward` applied to each microbatch, and gather no parameter. Wrap it in `jax.jit`.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def stage_forward(local_params, h):
    """This device's layers, in order."""
    for W, b in zip(*local_params):
        h = layer(h, W, b)
    return h


@jax.jit
@partial(jax.shard_map, mesh=mesh_stage, in_specs=(P("stage"), P()), out_specs=P())
def pipeline_forward(local_params, microbatches):
    n_stages = lax.axis_size("stage")
    stage = lax.axis_index("stage")
    n_micro = microbatches.shape[0]
    to_next = [(s, s + 1) for s in range(n_stages - 1)]
    received = jnp.zeros_like(microbatches[0])
    outputs = jnp.zeros_like(microbatches)
    for t in range(n_micro + n_stages - 1):
        inputs = jnp.where(stage == 0, microbatches[min(t, n_micro - 1)], received)
        out = stage_forward(local_params, inputs)
        if t >= n_stages - 1:
            outputs = outputs.at[t - (n_stages - 1)].set(out)
        received = lax.ppermute(out, "stage", to_next)
    return lax.psum(jnp.where(stage == n_stages - 1, outputs, 0.0), "stage")
# END SOLUTION
""" # BEGIN PROMPT
pipeline_forward = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q4_form(pipeline_forward):
    import jaxlab_form as form
    form.expect_callable("pipeline_forward", form.evidence(pipeline_forward))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q4_pipeline_forward(pipeline_forward, mesh_stage):
    import jaxlab_lab5
    jaxlab_lab5.check("q4_pipeline_forward", pipeline_forward=pipeline_forward,
                      mesh_stage=mesh_stage)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(pipeline_forward, stage_params):
    piped = pipeline_forward(stage_params, micro_x)
    print("equals the sequential model:", np.allclose(piped, expected_outputs, atol=1e-5))
    program = str(jax.make_jaxpr(pipeline_forward)(stage_params, micro_x))
    print("ppermute steps:", program.count("ppermute["), "  all_gather:", "all_gather" in program)

# %% [markdown]
# ### The backward pass
#
# `jax.grad` differentiates through the pipeline by itself. The transpose of "send my activation
# to stage `s + 1`" is "send my gradient back to stage `s - 1`": the backward pass is a second
# pipeline running the other way, with `ppermute`s in the reverse direction. Because the
# parameters enter `shard_map` split over `stage`, each device's gradient comes out as the
# gradient of **its own** layers only: the gradient of `W_stack` is split over `stage` exactly
# like `W_stack`, and nothing is gathered.

# %% [raw]
# # BEGIN QUESTION
# name: q5_pipeline_grad
# points: 2

# %% [markdown]
# **Task 5** (`q5_pipeline_grad`). Define `pipeline_loss(stage_params, microbatches, targets)`: the
# mean over all examples of all microbatches of the squared error summed over the 24 outputs,
# where the outputs come from your pipeline (`pipeline_forward`, or a pipeline of your own on
# `mesh_stage`), `targets` having the shape of `microbatches`. Its value and its gradient
# `jax.grad(pipeline_loss)` must equal those of the sequential model's loss, and the gradient
# must stay split over `stage` like `stage_params` (each device holding only its stage's
# gradient).

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def pipeline_loss(stage_params, microbatches, targets):
    outputs = pipeline_forward(stage_params, microbatches)
    return jnp.mean(jnp.sum((outputs - targets) ** 2, axis=-1))
# END SOLUTION
""" # BEGIN PROMPT
pipeline_loss = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q5_form(pipeline_loss):
    import jaxlab_form as form
    form.expect_callable("pipeline_loss", form.evidence(pipeline_loss))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q5_pipeline_grad(pipeline_loss, mesh_stage):
    import jaxlab_lab5
    jaxlab_lab5.check("q5_pipeline_grad", pipeline_loss=pipeline_loss, mesh_stage=mesh_stage)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(pipeline_loss, stage_params):
    def sequential_loss(layers, x, y):
        return jnp.mean(jnp.sum((jax.vmap(partial(sequential_forward, layers))(x) - y) ** 2,
                                axis=-1))

    piped_grads = jax.jit(jax.grad(pipeline_loss))(stage_params, micro_x, micro_y)
    layer_grads = jax.grad(sequential_loss)(layers, micro_x, micro_y)
    print("same gradient:", all(np.allclose(g, jnp.stack(h), rtol=1e-3, atol=1e-5)
                                for g, h in zip(piped_grads, zip(*layer_grads))))
    print("gradient of W_stack:", jax.typeof(piped_grads[0]), piped_grads[0].sharding.spec)

# %% [markdown]
# ### The bubble
#
# Count the schedule's work. It has `M + L - 1` steps and `L` stages: `L (M + L - 1)` slots. Each
# stage is busy in exactly `M` of its slots (one per microbatch), so `L M` slots do useful work
# and `L (L - 1)` slots are idle: the triangles of dots in the schedule above, the **bubble**.
# The idle fraction of the schedule is therefore
#
# $$\frac{L(L-1)}{L(M+L-1)} = \frac{L-1}{M+L-1}.$$
#
# With one microbatch (`M = 1`) it is `(L - 1) / L`: only one stage works at a time, the naive
# pipeline. It falls as `M` grows, which is why pipelines use many microbatches (each must still
# be large enough to keep a device busy). The backward pass has the same shape, so the fraction
# holds for a whole training step too. (Some texts divide the idle time by the *busy* time
# instead, `(L - 1) / M`; that is not the fraction of the schedule.)
#
# To push the fraction **below** a bound `β`, solve `(L - 1) / (M + L - 1) < β` for the smallest
# whole number `M`.

# %% [raw]
# # BEGIN QUESTION
# name: q6_bubble
# points: 1

# %% [markdown]
# **Task 6** (`q6_bubble`). Define
#
# * `bubble_fraction(n_stages, n_micro)`: the idle fraction of the GPipe schedule of `n_micro`
#   microbatches through `n_stages` stages, as a float (idle slots over all slots), for any
#   `n_stages` and `n_micro` of 1 or more;
# * `microbatches_needed(n_stages, max_bubble)`: the smallest number of microbatches `M` (an
#   `int`, at least 1, also for one stage) whose idle fraction is **strictly** less than
#   `max_bubble` (`0 < max_bubble < 1`). When `max_bubble` is exactly the idle fraction of some
#   `M`, that `M` is not enough: with 8 stages, 63 microbatches give `7 / 70`, which is `0.1`,
#   so `microbatches_needed(8, 0.1)` is 64. Compare the fraction as `bubble_fraction` computes
#   it with `max_bubble`: a formula solved for `M` and rounded lands on either side of such a
#   tie.
#
# Both take plain Python numbers and return plain Python numbers (an `int` or a `float`, not a
# NumPy or JAX array).

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def bubble_fraction(n_stages, n_micro):
    return (n_stages - 1) / (n_micro + n_stages - 1)


def microbatches_needed(n_stages, max_bubble):
    n_micro = 1
    while bubble_fraction(n_stages, n_micro) >= max_bubble:
        n_micro += 1
    return n_micro
# END SOLUTION
""" # BEGIN PROMPT
bubble_fraction = ...
microbatches_needed = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q6_form(bubble_fraction, microbatches_needed):
    import jaxlab_form as form
    form.expect_callable("bubble_fraction", form.evidence(bubble_fraction))
    form.expect_callable("microbatches_needed", form.evidence(microbatches_needed))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q6_bubble(bubble_fraction, microbatches_needed):
    import jaxlab_lab5
    jaxlab_lab5.check("q6_bubble", bubble_fraction=bubble_fraction,
                      microbatches_needed=microbatches_needed)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(bubble_fraction, microbatches_needed):
    for n_micro in (1, 8, 32, 128):
        print(f"{N_STAGES} stages, {n_micro:3d} microbatches: idle "
              f"{bubble_fraction(N_STAGES, n_micro):.1%}")
    print("microbatches for under 10% idle on 8 stages:", microbatches_needed(N_STAGES, 0.1))

# %% [markdown]
# ## Part C: experts on other devices
#
# ### A mixture of experts
#
# A **mixture-of-experts** (MoE) layer replaces one MLP by `E` of them, the **experts**, and a
# small **router** that sends each token to one expert (top-1 routing, as in the Switch
# Transformer). The router scores every expert with `tokens @ router_weights`; a token goes to the
# expert with the highest score, and the expert's output is scaled by the **gate**, the softmax
# probability the router gave that expert. Each token costs one expert's work, whatever `E` is:
# parameters grow with `E`, computation does not.
#
# To keep the work balanced and the shapes static, each expert has a fixed **capacity**: it takes
# at most `capacity` tokens, in token order, and drops the rest. A dropped token gets no expert
# output (0 here; in a Transformer the residual connection carries it on unchanged). A token's
# **slot** is its place in its expert's queue: how many earlier tokens chose the same expert.
# It is kept when `slot < capacity`.

# %%
N_EXPERTS = 8
D_MODEL, D_HIDDEN = 16, 32
EXPERT_CAPACITY = 2
TOKENS_PER_DEVICE = 8


def expert_mlp(x, W_in, W_out):
    """One expert: a small ReLU MLP."""
    return jax.nn.relu(x @ W_in) @ W_out


def init_moe(key):
    k = jax.random.split(key, 4)
    tokens = jax.random.normal(k[0], (N_EXPERTS * TOKENS_PER_DEVICE, D_MODEL))
    router_weights = jax.random.normal(k[1], (D_MODEL, N_EXPERTS))
    W_in = jax.random.normal(k[2], (N_EXPERTS, D_MODEL, D_HIDDEN)) / jnp.sqrt(D_MODEL)
    W_out = jax.random.normal(k[3], (N_EXPERTS, D_HIDDEN, D_MODEL)) / jnp.sqrt(D_HIDDEN)
    return tokens, router_weights, W_in, W_out


moe_tokens, moe_router, moe_W_in, moe_W_out = init_moe(jax.random.key(4))
print("tokens", moe_tokens.shape, " router", moe_router.shape, " experts", moe_W_in.shape,
      moe_W_out.shape)

# %% [markdown]
# Useful tools: `jnp.argmax`, `jax.nn.softmax`, `jax.nn.one_hot(expert, E)` (a row per token with
# a 1 at its expert) and `jnp.cumsum` over the tokens of that one-hot matrix (a running count of
# the tokens each expert has received so far).

# %% [raw]
# # BEGIN QUESTION
# name: q7_router
# points: 1

# %% [markdown]
# **Task 7** (`q7_router`). Define `route(tokens, router_weights, capacity)` for `tokens` of shape
# `(T, D)` and `router_weights` of shape `(D, E)`, returning a tuple `(expert, gate, slot)` of
# three arrays of shape `(T,)`:
#
# * `expert`: integers, the index of the expert with the largest score `tokens @ router_weights`;
# * `slot`: integers, how many tokens **before** this one (lower index) chose the same expert;
# * `gate`: floats, the softmax probability (over the `E` experts) of the chosen expert, or `0`
#   for a dropped token, one whose `slot` is `capacity` or more.
#
# It must work under `jax.jit` with `capacity` a static Python int (Task 8 calls it inside
# `shard_map`), for any `T`, `D` and `E`.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def route(tokens, router_weights, capacity):
    probs = jax.nn.softmax(tokens @ router_weights, axis=-1)
    expert = jnp.argmax(probs, axis=-1)
    chosen = jax.nn.one_hot(expert, router_weights.shape[-1], dtype=jnp.int32)
    slot = jnp.sum((jnp.cumsum(chosen, axis=0) - 1) * chosen, axis=-1)
    gate = jnp.take_along_axis(probs, expert[:, None], axis=-1)[:, 0]
    return expert, jnp.where(slot < capacity, gate, 0.0), slot
# END SOLUTION
""" # BEGIN PROMPT
route = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q7_form(route):
    import jaxlab_form as form
    form.expect_callable("route", form.evidence(route))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q7_router(route):
    import jaxlab_lab5
    jaxlab_lab5.check("q7_router", route=route)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(route):
    expert, gate, slot = route(moe_tokens[:TOKENS_PER_DEVICE], moe_router, EXPERT_CAPACITY)
    print("expert:", expert)
    print("slot:  ", slot)
    print("gate:  ", np.round(np.asarray(gate, np.float64), 3), " (0 = dropped)")

# %% [markdown]
# ### `all_to_all`
#
# Put one expert on each device (expert parallelism): device `e` holds `W_in[e]` and `W_out[e]`,
# and the tokens are split over the same devices. A device's tokens want experts that mostly live
# elsewhere, so every device has something to send to every other device. That exchange is one
# collective, `jax.lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)`: each
# device cuts `x` into as many chunks along `split_axis` as the axis has devices, sends chunk `j`
# to device `j`, and concatenates what it receives along `concat_axis`, in the order of the
# senders. Think of a grid "sender × receiver": `all_to_all` transposes it.

# %%
mesh_expert = jax.make_mesh((N_EXPERTS,), ("expert",), axis_types=(AxisType.Auto,),
                            devices=devices)
messages = jnp.arange(64)  # device d starts with 8 messages: 8 d + j is meant for device j


@jax.jit
@partial(jax.shard_map, mesh=mesh_expert, in_specs=P("expert"), out_specs=P("expert"))
def exchange(block):
    return lax.all_to_all(block, "expert", 0, 0, tiled=True)


print("before (row = device):\n", np.asarray(messages).reshape(8, 8))
print("after:\n", np.asarray(exchange(messages)).reshape(8, 8))

# %% [markdown]
# ### The layer
#
# A mixture-of-experts layer in `shard_map`, on each device:
#
# 1. **route** its own tokens with `route(tokens, router_weights, EXPERT_CAPACITY)`: the capacity
#    counts per device, so each expert takes at most `EXPERT_CAPACITY` tokens **from each
#    device**;
# 2. **dispatch**: build a buffer of shape `(E, capacity, D)` whose row `[e, c]` is the token
#    in slot `c` of expert `e` (zeros where no token is). A dispatch tensor
#    `jax.nn.one_hot(expert, E)[:, :, None] * jax.nn.one_hot(slot, capacity)[:, None, :]`, shape
#    `(T, E, capacity)`, does it with one `jnp.einsum`; `one_hot` of a slot past the capacity is
#    all zeros, which drops the token;
# 3. `all_to_all` the buffer: device `e` receives, from every device, the tokens meant for
#    expert `e`;
# 4. apply its expert to everything it received;
# 5. `all_to_all` the results back to the devices the tokens came from;
# 6. **combine**: put each token's result back in its row, scaled by its gate (the dispatch
#    tensor times the gates, and `jnp.einsum` again).
#
# Two `all_to_all`s, and no other communication: the tokens travel, the experts stay.

# %% [raw]
# # BEGIN QUESTION
# name: q8_moe_all_to_all
# points: 3

# %% [markdown]
# **Task 8** (`q8_moe_all_to_all`). Define `moe_layer(tokens, router_weights, W_in, W_out)` with
# `jax.shard_map` on `mesh_expert`: `tokens` (shape `(T, D_MODEL)`) split by rows over
# `'expert'`, `router_weights` replicated, `W_in` and `W_out` split over their leading (expert)
# dimension, so that device `e` holds expert `e`; the result, shape `(T, D_MODEL)`, split by rows
# like `tokens`. The output of a token is its gate times `expert_mlp` of its expert applied to
# it, and 0 for a token dropped by `route(..., EXPERT_CAPACITY)` on its own device. Use exactly
# two `jax.lax.all_to_all`s over `'expert'` (tokens out to the experts, results back) and no
# other collective. It must work for any number of tokens per device.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
@jax.jit
@partial(jax.shard_map, mesh=mesh_expert,
         in_specs=(P("expert"), P(), P("expert"), P("expert")), out_specs=P("expert"))
def moe_layer(tokens, router_weights, W_in, W_out):
    n_experts = router_weights.shape[-1]
    expert, gate, slot = route(tokens, router_weights, EXPERT_CAPACITY)
    dispatch = (jax.nn.one_hot(expert, n_experts)[:, :, None]
                * jax.nn.one_hot(slot, EXPERT_CAPACITY)[:, None, :])
    buffers = jnp.einsum("tec,td->ecd", dispatch, tokens)
    received = lax.all_to_all(buffers, "expert", 0, 0, tiled=True)  # row d: from device d
    processed = expert_mlp(received, W_in[0], W_out[0])
    returned = lax.all_to_all(processed, "expert", 0, 0, tiled=True)  # row e: from expert e
    return jnp.einsum("tec,ecd->td", dispatch * gate[:, None, None], returned)
# END SOLUTION
""" # BEGIN PROMPT
moe_layer = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q8_form(moe_layer):
    import jaxlab_form as form
    form.expect_callable("moe_layer", form.evidence(moe_layer))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q8_moe_all_to_all(moe_layer):
    import jaxlab_lab5
    jaxlab_lab5.check("q8_moe_all_to_all", moe_layer=moe_layer)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(moe_layer, route):
    def moe_dense(tokens, router_weights, W_in, W_out):
        """The same layer on one device: every expert's output, then keep each token's own."""
        rows = []
        for group in jnp.split(tokens, N_EXPERTS):  # the tokens of each device
            expert, gate, _ = route(group, router_weights, EXPERT_CAPACITY)
            all_experts = jax.vmap(expert_mlp, in_axes=(None, 0, 0))(group, W_in, W_out)
            rows.append(gate[:, None] * all_experts[expert, jnp.arange(len(group))])
        return jnp.concatenate(rows)

    moe_out = moe_layer(moe_tokens, moe_router, moe_W_in, moe_W_out)
    print("equals the dense layer:",
          np.allclose(moe_out, moe_dense(moe_tokens, moe_router, moe_W_in, moe_W_out),
                      atol=1e-5))
    print("dropped tokens:", int(np.sum(np.all(np.asarray(moe_out) == 0, axis=1))))

# %% [markdown]
# ## Part D: one program, several processes
#
# So far one Python process drove all 8 devices. A cluster does not work that way: every machine
# (a **host**) runs its own Python process, and each process sees only the accelerators plugged
# into its own host, typically 4 or 8. JAX runs a large job as **one program in many processes**:
# every process runs the *same* script, and a call to `jax.distributed.initialize` at its start
# joins them. After that:
#
# * `jax.process_index()` is this process's number (0, 1, …) and `jax.process_count()` how many
#   there are;
# * `jax.local_devices()` are this process's own devices, while `jax.devices()` lists the devices
#   of **all** processes, so a mesh built from `jax.devices()` spans every host;
# * a jitted function applied to arrays on such a mesh runs on all devices at once: each
#   process launches the same compiled program on its own devices, and the collectives
#   (`psum`, `all_gather`, the all-reduce that data parallelism needs, …) travel between
#   processes over the network: NCCL on GPUs, the TPU interconnect on TPUs, and on CPUs the
#   **gloo** library over TCP.
#
# **Global and process-local arrays.** An array on a mesh that spans processes is a *global*
# array: its shape is the whole array's, but each process holds only the blocks that live on its
# own devices (`x.addressable_shards`) and cannot read the others, which sit in another process's
# memory. So `np.asarray(x)` works only when every process holds all of `x` (replicated), and
# printing or saving a split array needs a gather first
# (`jax.experimental.multihost_utils.process_allgather`).
#
# **Data in, one slice per process.** In a real job each host reads its own part of the dataset:
# no host loads all of it. Each process passes its slice to
# `jax.make_array_from_process_local_data(sharding, local_data)`, which makes the global array
# whose rows are the slices of all processes, in process order: with 2 processes, process 0's
# rows come first, then process 1's. The sharding says how the rows are spread over the devices.
#
# **On one machine.** We pretend to be two hosts with 4 devices each: two processes on this
# machine, each with 4 simulated CPU devices. Before `jax.distributed.initialize`, each sets
# `jax.config.update("jax_num_cpu_devices", 4)` and picks gloo for the collectives between
# processes: `jax.config.update("jax_cpu_collectives_implementation", "gloo")` (JAX 0.8 and
# later choose gloo by themselves, JAX 0.5 chose none: set it anyway).
# `jax.distributed.initialize(coordinator_address, num_processes, process_id)` takes the address
# (`host:port`) where process 0 runs a small *coordination service* that the others contact to
# find each other, how many processes take part, and which one this is.
#
# A notebook is one process, so the program lives in a script that the notebook starts twice.
# The next cell defines `launch(script, *args)`: it runs
# `python SCRIPT COORDINATOR NUM_PROCESSES PROCESS_ID ARGS…` once for each process id 0 and 1, at
# the same time (with the Python of this notebook, `sys.executable`), with a free port of
# `127.0.0.1` as the coordinator address, waits for both and returns what each printed. If a
# process fails, or both are not done within `timeout` seconds, it stops them and raises an
# error showing the end of each process's output. The processes run on CPU devices only, even
# where this notebook has a GPU. Before starting them it frees the programs this notebook has
# compiled so far (`jax.clear_caches()`: they are compiled again when used): a few hundred MB
# that the two processes need more on a small machine.
#
# If every process fails with `enforce fail at …/gloo/transport/tcp/device.cc`, gloo found no
# network address for this machine's host name (`socket.gethostname()`), as on some laptops:
# add the line `127.0.0.1 NAME` (NAME: that host name) to `/etc/hosts`, or work on Colab.

# %%
import ctypes
import ctypes.util
import gc
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import time

import jax

PD_TIMEOUT = 120  # seconds; a launch of this part's scripts takes about 5 s on one core
PD_GRACE = 5  # seconds the other processes get to finish once one has failed
# gloo reports every connection it makes, a piece at a time from several threads at once (so
# one message can be cut by another's pieces or by newlines); that says nothing here: any run of
# its phrases and the numbers between them goes
PD_GLOO_WORDS = (r"\[Gloo\]\s+Rank|is\s+connected\s+to|peer\s+ranks\."
                 r"|Expected\s+number\s+of\s+connected\s+peer\s+ranks\s+is\s*:")
PD_GLOO_NOISE = re.compile(
    rf"[ \t]*(?:{PD_GLOO_WORDS})"
    rf"(?:\s*(?:{PD_GLOO_WORDS})|\s*\d+(?=\s*(?:{PD_GLOO_WORDS})|[ \t]*(?:\n|\Z))"
    r"|[ \t]*\d+)*(?:[ \t]*\n(?=[ \t]*\n))*[ \t]*")


def pd_free_port():
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pd_unnamed_host():
    """This machine's name when it has no address here (gloo, JAX's CPU collectives, looks it
    up to know where to listen; some containers and chroots lack it), else None."""
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
    except OSError:
        return name
    return None


def pd_tail(text, lines=15):
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


def pd_quiet(text):
    """`text` without gloo's connection messages."""
    # a message may span lines (another thread's newline inside it): match the whole text,
    # then drop the lines that held nothing else
    marked = PD_GLOO_NOISE.sub("\0", text)
    lines = [(line.replace("\0", ""), line) for line in marked.splitlines(True)]
    return "".join(kept for kept, line in lines if kept.strip() or "\0" not in line)


def pd_free_memory():
    """Give back the memory of the programs this notebook has compiled (compiled again when
    used) and the C library's free blocks."""
    jax.clear_caches()
    gc.collect()
    try:  # glibc (Linux) only, as in the setup cell
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def launch(script, *args, num_processes=2, timeout=PD_TIMEOUT):
    """Run `python SCRIPT COORDINATOR NUM_PROCESSES PROCESS_ID *ARGS` for every process id at once
    and wait for all of them; return what each process printed (a list, by process id)."""
    pd_free_memory()
    coordinator = f"127.0.0.1:{pd_free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "FORCE_COLOR")}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PYTHON_COLORS="0", NO_COLOR="1")
    env.setdefault("PJRT_NPROC", "16")  # as in the setup cell: the processes' collectives need it
    logs = [tempfile.TemporaryFile("w+") for _ in range(num_processes)]
    procs = [subprocess.Popen([sys.executable, script, coordinator, str(num_processes), str(i),
                               *map(str, args)], stdout=log, stderr=subprocess.STDOUT, env=env)
             for i, log in enumerate(logs)]
    deadline = time.monotonic() + timeout
    while None in [p.poll() for p in procs] and time.monotonic() < deadline:
        if any(p.returncode for p in procs):  # the others may wait for it for ever
            deadline = min(deadline, time.monotonic() + PD_GRACE)
        time.sleep(0.05)
    stopped = [p.poll() is None for p in procs]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(pd_quiet(log.read()))
        log.close()
    if any(stopped) or any(p.returncode for p in procs):
        report = []
        for i, (p, out) in enumerate(zip(procs, outputs)):
            state = ("stopped: still running" if stopped[i] else
                     "finished" if p.returncode == 0 else f"failed with exit code {p.returncode}")
            report.append(f"process {i}: {state}; its last lines:\n{pd_tail(out)}")
        why = (f"were not all done after {timeout} s" if all(p.returncode in (0, -9) for p in procs)
               else "did not all succeed")
        name = pd_unnamed_host()
        if name:
            report.append(f"This machine's name, {name!r}, has no address here, and the processes "
                          f"need one to reach each other: add the line `127.0.0.1 {name}` to "
                          "/etc/hosts (or ask whoever runs this machine), then launch again.")
        raise RuntimeError(f"the processes of `python {script}` {why}.\n\n" + "\n\n".join(report))
    return outputs

# %% [markdown]
# Here is the smallest such program. It joins the two processes, looks at the devices, makes a
# global array of 8 rows from 4 rows per process, and computes with it. `%%writefile` saves a
# cell as a file instead of running it.

# %%
# %%writefile pd_hello.py
import sys

import jax
import numpy as np

coordinator, num_processes, process_id = sys.argv[1:4]
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator, num_processes=int(num_processes),
                           process_id=int(process_id))

from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

me = jax.process_index()
print(f"process {me} of {jax.process_count()}: devices {[d.id for d in jax.local_devices()]} "
      f"of its own, {jax.device_count()} in all")
mesh = jax.make_mesh((jax.device_count(),), ("batch",), axis_types=(AxisType.Auto,))
local = 10.0 * me + np.arange(4.0)[:, None] * np.ones((1, 2))  # this process's 4 rows
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("batch")), local)
rows = [shard.index[0].start for shard in x.addressable_shards]
print(f"process {me}: x has shape {x.shape}; this process holds rows {rows}")
try:
    np.asarray(x)
except RuntimeError:
    print(f"process {me}: np.asarray(x) fails, the other rows are in the other process")
total = jax.jit(lambda x: x.sum(axis=0))(x)  # one program over the devices of both processes
print(f"process {me}: column sums of all 8 rows: {np.asarray(total).tolist()}")
print(f"process {me}: x gathered:", multihost_utils.process_allgather(x, tiled=True).tolist())

# %%
for pd_output in launch("pd_hello.py"):
    print(pd_output)

# %% [markdown]
# The column sums are replicated (every process holds the whole result), so `np.asarray` reads
# them in both processes; the 8 rows of `x` are not.
#
# ### Training data-parallel in two processes
#
# We now train Lab 3's regression network (smaller, so that it trains in a second) with data
# parallelism over the 8 devices of the two processes. The network, its loss and the training
# settings go into a module that the notebook and the script share. Its `load_params` and
# `save_params` read and write the parameters (a list of `(W, b)` pairs) as an `.npz` file.

# %%
# %%writefile pd_model.py
"""Lab 3's regression network, for the training script of Part D."""
import jax.numpy as jnp
import numpy as np

LAYER_SIZES = [1, 64, 64, 1]
STEPS = 20
STEP_SIZE = 0.02


def forward(params, x):
    for w, b in params[:-1]:
        x = jnp.tanh(jnp.dot(x, w) + b)
    final_w, final_b = params[-1]
    return jnp.dot(x, final_w) + final_b


def loss(params, x, y):
    return jnp.mean(jnp.square(forward(params, x) - y))


def load_params(path):
    """The list of (W, b) pairs stored in the .npz file `path`, as NumPy arrays."""
    with np.load(path) as stored:
        return [(stored[f"W{i}"], stored[f"b{i}"]) for i in range(len(LAYER_SIZES) - 1)]


def save_params(path, params):
    """Store a list of (W, b) pairs in the .npz file `path`.

    Every W and b must be readable in this process with np.asarray: a jax.Array replicated on
    every device is, one split across the devices of several processes is not."""
    arrays = {}
    for i, (W, b) in enumerate(params):
        arrays[f"W{i}"], arrays[f"b{i}"] = np.asarray(W), np.asarray(b)
    np.savez(path, **arrays)

# %% [markdown]
# The data file `pd_data.npz` holds 256 noisy points `x`, `y` around Lab 3's curve and the
# initial parameters (drawn as in Lab 3). Training on **one** process, on all 256 rows, as the
# reference:

# %%
import importlib

import jax.numpy as jnp
import numpy as np

import pd_model

pd_model = importlib.reload(pd_model)  # the file above may have changed
pd_rng = np.random.default_rng(0)
pd_x = pd_rng.uniform(0.0, 2.0, size=(256, 1)).astype(np.float32)
pd_y = (np.sin(6 * pd_x) - 0.5 * pd_x**2 + 0.1 * pd_rng.normal(size=pd_x.shape)).astype(np.float32)
pd_init = {}
for pd_i, (pd_in, pd_out) in enumerate(zip(pd_model.LAYER_SIZES[:-1], pd_model.LAYER_SIZES[1:])):
    pd_init[f"W{pd_i}"] = (0.1 * pd_rng.normal(size=(pd_in, pd_out))).astype(np.float32)
    pd_init[f"b{pd_i}"] = (0.1 * pd_rng.normal(size=(pd_out,))).astype(np.float32)
np.savez("pd_data.npz", x=pd_x, y=pd_y, **pd_init)


@jax.jit
def pd_train_step(params, x, y):
    loss, grads = jax.value_and_grad(pd_model.loss)(params, x, y)
    return [(W - pd_model.STEP_SIZE * dW, b - pd_model.STEP_SIZE * db)
            for (W, b), (dW, db) in zip(params, grads)], loss


pd_params_single = pd_model.load_params("pd_data.npz")
for pd_step in range(pd_model.STEPS):
    pd_params_single, pd_loss = pd_train_step(pd_params_single, pd_x, pd_y)
    if pd_step % 5 == 0:
        print(f"step {pd_step:2d}, loss {float(pd_loss):.4f}")

# %% [markdown]
# **Why only process 0 saves.** After each data-parallel step every process holds the same
# replicated parameters. If each process wrote them to the same file, two processes would write
# one file at once (on a cluster: one file on a shared file system), and the file could end up
# half of one write and half of the other. By convention process 0 alone writes checkpoints,
# logs and results. (Parameters split across processes are saved block by block, each process
# writing its own blocks, with a library such as Orbax: beyond this lab.)

# %% [raw]
# # BEGIN QUESTION
# name: q9_multi_process
# points: 3

# %% [markdown]
# **Task 9** (`q9_multi_process`). Define `train_script`: a **string** holding the source of a
# complete Python program. The cell after the check writes it to `pd_train.py` and runs
# `launch("pd_train.py", "pd_data.npz", "pd_params.npz")`, so each of the two processes runs
#
# ```
# python pd_train.py COORDINATOR NUM_PROCESSES PROCESS_ID DATA_FILE OUT_FILE
# ```
#
# (read them from `sys.argv[1:]`). The program must:
#
# 1. join the processes with `jax.distributed.initialize(COORDINATOR, num_processes=...,
#    process_id=...)`, after giving each process 4 CPU devices (`jax_num_cpu_devices`) and the
#    gloo CPU collectives (`jax_cpu_collectives_implementation`), as `pd_hello.py` does;
# 2. build one 1-D mesh of all 8 devices of both processes;
# 3. read `x` and `y` from DATA_FILE (`np.load`), and pass **only this process's share** of each to
#    `jax.make_array_from_process_local_data`: with N rows, process `p` takes the N/2 rows from
#    row `p * N/2` on, in order (`x[p * N//2 : (p + 1) * N//2]`), so that the global arrays hold
#    the rows in the data file's order. The global arrays `x` and `y` (N rows) must be split over
#    the 8 devices by rows;
# 4. start from `pd_model.load_params(DATA_FILE)`, replicated on the 8 devices
#    (`jax.device_put(params, NamedSharding(mesh, P()))`), and take `pd_model.STEPS` steps of
#    gradient descent with step size `pd_model.STEP_SIZE` on `pd_model.loss` over the global
#    `x`, `y`, as `pd_train_step` does: data parallelism, as in Lab 3 (automatic) or with
#    `jax.shard_map` (Lab 4);
# 5. in process 0 **only**, save the trained parameters with
#    `pd_model.save_params(OUT_FILE, params)`.
#
# The trained parameters must equal those of training on one process (`pd_params_single`). The
# hidden check runs your program again on new data, with another number of rows N (divisible by
# 8) and new initial parameters, and also looks at what each process passed to
# `jax.make_array_from_process_local_data` and which process wrote OUT_FILE. Print what you like
# (the loss, say) from process 0 to follow the training.
#
# Tip: write the program in a text editor or in a cell first, then paste it between the quotes of
# a raw string, `r'''...'''` (raw: a backslash in the program stays a backslash).

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
train_script = r'''
import sys

import jax
import numpy as np

coordinator, num_processes, process_id, data_file, out_file = sys.argv[1:]
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator, num_processes=int(num_processes),
                           process_id=int(process_id))

from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import pd_model

mesh = jax.make_mesh((jax.device_count(),), ("batch",), axis_types=(AxisType.Auto,))
with np.load(data_file) as data:
    share = len(data["x"]) // jax.process_count()
    mine = slice(jax.process_index() * share, (jax.process_index() + 1) * share)
    x_local, y_local = data["x"][mine], data["y"][mine]
rows = NamedSharding(mesh, P("batch"))
x = jax.make_array_from_process_local_data(rows, x_local)
y = jax.make_array_from_process_local_data(rows, y_local)
params = jax.device_put(pd_model.load_params(data_file), NamedSharding(mesh, P()))


@jax.jit
def train_step(params, x, y):
    loss, grads = jax.value_and_grad(pd_model.loss)(params, x, y)
    return [(W - pd_model.STEP_SIZE * dW, b - pd_model.STEP_SIZE * db)
            for (W, b), (dW, db) in zip(params, grads)], loss


for step in range(pd_model.STEPS):
    params, loss = jax.block_until_ready(train_step(params, x, y))
    if jax.process_index() == 0 and step % 5 == 0:
        print(f"step {step:2d}, loss {float(loss):.4f}")
if jax.process_index() == 0:
    pd_model.save_params(out_file, params)
'''
# END SOLUTION
""" # BEGIN PROMPT
train_script = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q9_form(train_script):
    import jaxlab_form as form
    form.expect_kind("train_script", form.evidence(train_script), "str",
                     "a string holding the source of your training script")
    try:
        compile(train_script, "pd_train.py", "exec")
    except SyntaxError as exc:
        raise AssertionError(f"`train_script` is not a valid Python program: {exc.msg} on line "
                             f"{exc.lineno} of the script; expected the source of a script "
                             "that Python can run.") from None

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q9_multi_process(train_script):
    import jaxlab_lab5
    jaxlab_lab5.check("q9_multi_process", train_script=train_script)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %% [markdown]
# Your program, run as two processes on `pd_data.npz`, against the single-process reference:

# %%
if answered(train_script):
    pathlib.Path("pd_train.py").write_text(train_script)
    pathlib.Path("pd_params.npz").unlink(missing_ok=True)  # no result of an earlier run
    pd_outputs = launch("pd_train.py", "pd_data.npz", "pd_params.npz")
    print("process 0 printed:\n" + pd_outputs[0])
    pd_params_multi = pd_model.load_params("pd_params.npz")
    print("same parameters as on one process:", all(
        np.allclose(a, b, rtol=1e-4, atol=1e-5)
        for pair, ref in zip(pd_params_multi, pd_params_single) for a, b in zip(pair, ref)))

# %% [markdown]
# ## Submitting
#
# Run the whole notebook from the top (*Kernel → Restart & Run All*), check that every
# `grader.check` cell says the public checks passed, then run the cell below.
