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
# name: lab6-memory
# environment: environment.yml
# files:
#   - jaxlab_form.py
# autograder_files:
#   - jaxlab_lab6.py
# tests:
#   ok_format: false
# export_cell:
#   pdf: false
#   instructions: "Upload the zip file this cell makes to the course's submission page. On Google Colab, which cannot make the zip, this cell instead tells you to submit the notebook itself: *File → Download → Download .ipynb*, then upload that file."
# check_all_cell: false

# %% [markdown]
# # Lab 6: Memory and cost
#
# Labs 3 to 5 split a computation over devices. Whether a large model fits on those devices at
# all, and how fast it trains there, is decided by two budgets: **memory** (what each device
# must hold at once) and **cost** (how many operations it does, and how many bytes it moves
# between its memory, its neighbours and its arithmetic units). This lab covers the four tools
# every large training run uses to stay inside them:
#
# * **A.** recomputing activations in the backward pass instead of storing them
#   (`jax.checkpoint`, also called rematerialization or *remat*), and choosing what to keep;
# * **B.** splitting the optimizer's state over the data-parallel devices (ZeRO): Adam keeps two
#   numbers per parameter, so its state is twice the size of the model;
# * **C.** attention over a sequence too long for one device: the softmax computed block by
#   block, then the blocks passed around a ring of devices (ring attention);
# * **D.** the arithmetic that plans all of it: FLOPs, bytes and collectives of a sharded
#   matrix product, read off the compiled program, and the roofline that turns them into time.
#
# ## How this lab works
#
# * Every task has one cell that starts with `### Your code here`. Replace the `...` with your
#   answer and run it. The cell after it, `grader.check("q…")`, runs the public checks, which
#   only test the form of the answer. Hidden checks run when your notebook is graded: they call
#   your functions on **new random inputs** (other sizes too, where the task says so), compare
#   the results with references computed in float64 from the lab's own recipe, and read the
#   program your function traces (`jax.make_jaxpr`) or compiles (`.lower(...).compile()`) to see
#   **what it saves for the backward pass**, **which collectives** it uses and **how much memory**
#   it needs. So follow the method each task describes, not only its numbers.
# * Do not rename the variables a task asks for, and do not reuse their names later on.
# * Where a task says a function returns a tuple, a list of the same items is accepted too.
# * Run the notebook from the top (*Kernel → Restart & Run All*) before you submit.

# %% [markdown]
# ## Setup: eight devices
#
# As in the earlier labs, the next cell must run **before any other JAX code**. It asks for 8
# simulated CPU devices (unless the runtime has 8 or more accelerators) and sets `PJRT_NPROC`,
# which keeps XLA's communication threads from starving on machines with few CPU cores
# (otherwise a loop of sharded steps can kill the kernel with "Expected 8 threads to join the
# rendezvous"). If the cell says that JAX is already running, restart the kernel and run from
# the top. On Linux it also tells the C library to give large freed buffers straight back to the
# operating system, which keeps the notebook well inside a 768 MB grading container.
#
# On a runtime with one GPU (or fewer than 8 accelerators) the lab runs on the 8 CPU devices, so
# the memory figures it prints are the CPU compiler's. Other backends give other numbers; the
# ratios this lab is about stay.
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
import math
import re
from functools import partial

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals
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
# ## Part A: recompute instead of store
#
# ### What the backward pass keeps
#
# `jax.grad(f)` runs `f` forward, then runs the chain rule backward. The backward pass needs
# some of the values the forward pass computed: for `y = tanh(x @ W)`, the gradient with respect
# to `W` is `x.T @ (g * (1 - y**2))`, so both `x` and `y` must still be in memory when the
# backward pass reaches this layer. JAX calls the values kept from the forward pass for the
# backward pass **residuals**, and `jax.ad_checkpoint.print_saved_residuals(f, *args)` lists
# them: their type, and where each comes from.

# %%
def layer(h, W, b):
    return jnp.tanh(h @ W + b)


demo_W, demo_b = jnp.ones((4, 4)) / 4, jnp.zeros(4)
demo_x = jnp.ones((2, 4))
print_saved_residuals(lambda W, x: jnp.sum(layer(x, W, demo_b)), demo_W, demo_x)

# %% [markdown]
# The input `x` and the weights come from the arguments (they are in memory anyway); the `tanh`
# output is new memory, one activation of shape `(batch, width)` per layer.
#
# ### Deep networks as a `lax.scan`
#
# A deep network made of identical layers is best written with its parameters **stacked**: all
# `L` weight matrices in one array of shape `(L, width, width)`, and a `jax.lax.scan` that runs
# the layer once per slice. The compiler then sees one loop body instead of `L` copies of it
# (compile time stays the same for any `L`), and the residuals of the iterations come out
# stacked too: one array of shape `(L, batch, width)` per kind of residual.

# %%
N_LAYERS, WIDTH, BATCH = 16, 128, 64


def init_deep(key, n_layers=N_LAYERS, width=WIDTH, batch=BATCH):
    kW, kb, kx, ky = jax.random.split(key, 4)
    W = jax.random.normal(kW, (n_layers, width, width)) / jnp.sqrt(width)
    b = 0.1 * jax.random.normal(kb, (n_layers, width))
    x = jax.random.normal(kx, (batch, width))
    y = jax.random.normal(ky, (batch, width))
    return (W, b), x, y


def deep_loss(params, x, y):
    """Mean over the examples of the squared error summed over the outputs, after L layers."""
    def body(h, layer_params):
        W, b = layer_params
        return layer(h, W, b), None

    h, _ = lax.scan(body, x, params)
    return jnp.mean(jnp.sum((h - y) ** 2, axis=-1))


deep_params, deep_x, deep_y = init_deep(jax.random.key(0))
print(f"loss {float(deep_loss(deep_params, deep_x, deep_y)):.4f}")
print_saved_residuals(deep_loss, deep_params, deep_x, deep_y)

# %% [markdown]
# Three arrays of shape `(16, 64, 128)`, for all 16 layers: every layer's input, its output, and
# one more value computed from the output (`tanh`'s derivative, `1 - tanh**2`, is built from
# it). They grow with the depth.
#
# ### What the compiled program needs
#
# `jax.jit(f).lower(*args).compile()` compiles `f` for those arguments without running it (the
# arguments may even be `jax.ShapeDtypeStruct`s: shapes and dtypes, no data). The compiled
# program knows its memory: `.memory_analysis()` gives the bytes of its arguments
# (`argument_size_in_bytes`), of its results (`output_size_in_bytes`) and of the scratch memory
# it needs while it runs (`temp_size_in_bytes`), where the residuals live between the forward
# and the backward pass. These are the compiler's figures for one device; they differ between
# backends and versions, so compare them with each other, never with a number from elsewhere.

# %%
def compiled_grad(loss_fn, *args):
    """The compiled program of jax.grad(loss_fn) for these arguments (not run)."""
    return jax.jit(jax.grad(loss_fn)).lower(*args).compile()


plain = compiled_grad(deep_loss, deep_params, deep_x, deep_y).memory_analysis()
print(f"arguments {plain.argument_size_in_bytes / MiB:.2f} MiB, "
      f"outputs {plain.output_size_in_bytes / MiB:.2f} MiB, "
      f"temporary {plain.temp_size_in_bytes / MiB:.2f} MiB")

# %% [markdown]
# The same for other depths, compiled from shapes only:

# %%
DEPTHS = [4, 8, 16, 32]


def deep_shapes(n_layers, width=WIDTH, batch=BATCH):
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    return ((spec(n_layers, width, width), spec(n_layers, width)), spec(batch, width),
            spec(batch, width))


def temp_by_depth(loss_fn):
    """Temporary memory (MiB) of jax.grad(loss_fn) at each of DEPTHS."""
    return [compiled_grad(loss_fn, *deep_shapes(n)).memory_analysis().temp_size_in_bytes / MiB
            for n in DEPTHS]


plain_by_depth = temp_by_depth(deep_loss)
print("layers:", DEPTHS, " temporary MiB:", [round(m, 2) for m in plain_by_depth])

# %% [markdown]
# ### `jax.checkpoint`
#
# `jax.checkpoint(fn)` (also spelled `jax.remat`) returns a function that computes the same
# values as `fn` and has the same gradient, but whose only residuals are **its inputs**: when the
# backward pass needs the values inside `fn`, it runs `fn` forward again from those inputs.
# Memory goes down; the price is one more forward pass through `fn`. For a matrix product the
# backward pass costs about twice the forward, so recomputing everything costs about a third
# more FLOPs in all.

# %%
print_saved_residuals(lambda W, x: jnp.sum(jax.checkpoint(layer)(x, W, demo_b)), demo_W, demo_x)

# %% [markdown]
# Only the inputs are left. Put around the **body of the scan**, `jax.checkpoint` keeps each
# layer's input (the carry the scan hands to it) and nothing else from inside the layer. Put
# around the whole scan, it keeps only the network's input, and the backward pass then reruns
# the whole scan, storing every residual of every layer at once: no saving at all.
#
# The compiler may also undo a checkpoint: in a straight-line program (a Python `for` loop over
# the layers) it is free to keep a value instead of computing it twice, and on CPU a loop of
# checkpointed layers written that way was measured using no less memory. Inside a scan the
# recomputation stays where it is. So checkpoint the body of a scan.

# %% [raw]
# # BEGIN QUESTION
# name: q1_remat_scan
# points: 2

# %% [markdown]
# **Task 1** (`q1_remat_scan`). Define `remat_loss(params, x, y)`: the loss `deep_loss`, a
# `lax.scan` over the stacked layers `params = (W, b)` (shapes `(L, width, width)` and
# `(L, width)`), with the scan's body (one layer) wrapped in `jax.checkpoint`. It must work for
# any number of layers `L`, width and batch size. Its value and its gradient (`jax.grad`) must
# equal those of `deep_loss`; the residuals it saves (`print_saved_residuals`), besides its
# arguments, must be **each layer's input** (one stacked array of shape `(L, batch, width)`)
# and nothing else that grows with `L`; and the compiled gradient must need clearly less
# temporary memory than `deep_loss`'s (under 80% of it).

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def remat_loss(params, x, y):
    @jax.checkpoint
    def body(h, layer_params):
        W, b = layer_params
        return layer(h, W, b), None

    h, _ = lax.scan(body, x, params)
    return jnp.mean(jnp.sum((h - y) ** 2, axis=-1))
# END SOLUTION
""" # BEGIN PROMPT
remat_loss = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q1_form(remat_loss):
    import jaxlab_form as form
    form.expect_callable("remat_loss", form.evidence(remat_loss))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q1_remat_scan(remat_loss):
    import jaxlab_lab6
    jaxlab_lab6.check("q1_remat_scan", remat_loss=remat_loss)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(remat_loss):
    print(f"loss {float(remat_loss(deep_params, deep_x, deep_y)):.4f}")
    print_saved_residuals(remat_loss, deep_params, deep_x, deep_y)
    remat_by_depth = temp_by_depth(remat_loss)
    print(f"temporary memory at {N_LAYERS} layers: "
          f"{remat_by_depth[DEPTHS.index(N_LAYERS)]:.2f} MiB with jax.checkpoint, "
          f"{plain_by_depth[DEPTHS.index(N_LAYERS)]:.2f} MiB without")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(DEPTHS, plain_by_depth, marker="o", label="deep_loss (stores every residual)")
    ax.plot(DEPTHS, remat_by_depth, marker="o", label="remat_loss (jax.checkpoint on the body)")
    ax.set_xlabel("layers L")
    ax.set_ylabel("temporary memory of jax.grad (MiB)")
    ax.set_title(f"Memory of the gradient, batch {BATCH}, width {WIDTH}")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    plt.show()

# %% [markdown]
# Both lines grow with the depth: the checkpointed scan still keeps one activation per layer,
# but only one instead of three.
#
# ### Counting FLOPs: a trap
#
# The compiled program also estimates its cost: `.cost_analysis()` returns a dict whose `'flops'`
# entry counts floating-point operations (JAX documents it as best effort; on some backends it
# may be missing). It counts **the body of a loop once**, not once per iteration:

# %%
for n in (4, 32):
    flops = compiled_grad(deep_loss, *deep_shapes(n)).cost_analysis()["flops"]
    print(f"{n:2d} layers: cost_analysis says {flops / 1e6:.1f} MFLOPs")

# %% [markdown]
# The same number for 4 and 32 layers. A scan's cost is the body's cost times its length: do
# that multiplication yourself, or compare programs with the same loops only.
#
# ### Choosing what to keep: names and policies
#
# Recomputing everything is not the only choice. `jax.checkpoint(fn, policy=...)` takes a
# **policy** that decides, value by value, what is saved and what is recomputed. A value can be
# given a name inside `fn` with `jax.ad_checkpoint.checkpoint_name(value, "some_name")` (it
# returns `value` unchanged), and
# `jax.checkpoint_policies.save_only_these_names("some_name", ...)` saves the named values and
# recomputes everything else. Other policies: `nothing_saveable` (the default of
# `jax.checkpoint`), `dots_saveable` (save every matrix product's result).
#
# The blocks below are residual MLP blocks, `h + tanh(h @ W_in) @ W_out`, with a hidden width
# `D_FF` four times the model width. What does the backward pass of a block need? The block's
# input `h` (for the gradient of `W_in`), and `tanh(h @ W_in)` (for the gradient of `W_out` and
# for the derivative of `tanh`). If the product `h @ W_in` is saved, `tanh` of it is cheap to
# recompute, and **no matrix product is computed twice**: memory between full storage and full
# recomputation, at no extra matrix work.

# %%
N_BLOCKS, D_MODEL, D_FF, BLOCK_BATCH = 12, 64, 256, 32


def mlp_block(h, W_in, W_out):
    return h + jnp.tanh(h @ W_in) @ W_out


def init_blocks(key, n_blocks=N_BLOCKS, d_model=D_MODEL, d_ff=D_FF, batch=BLOCK_BATCH):
    k_in, k_out, kx, ky = jax.random.split(key, 4)
    W_in = jax.random.normal(k_in, (n_blocks, d_model, d_ff)) / jnp.sqrt(d_model)
    W_out = jax.random.normal(k_out, (n_blocks, d_ff, d_model)) / jnp.sqrt(4 * d_ff)
    x = jax.random.normal(kx, (batch, d_model))
    y = jax.random.normal(ky, (batch, d_model))
    return (W_in, W_out), x, y


def blocks_loss(params, x, y):
    """The loss of the stacked blocks, every residual stored."""
    def body(h, block_params):
        return mlp_block(h, *block_params), None

    h, _ = lax.scan(body, x, params)
    return jnp.mean(jnp.sum((h - y) ** 2, axis=-1))


def full_remat_blocks_loss(params, x, y):
    def body(h, block_params):
        return jax.checkpoint(mlp_block)(h, *block_params), None

    h, _ = lax.scan(body, x, params)
    return jnp.mean(jnp.sum((h - y) ** 2, axis=-1))


def residual_shapes(loss_fn, *args):
    """The shapes of the residuals print_saved_residuals lists, except the arguments."""
    import contextlib
    import io

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_saved_residuals(loss_fn, *args)
    return [line.split()[0] for line in text.getvalue().splitlines()
            if line and "from the argument" not in line]


def print_costs(loss_fn, label):
    """A row of the table below: what loss_fn saves, and its gradient's memory and FLOPs."""
    compiled = compiled_grad(loss_fn, block_params, block_x, block_y)
    saved = ", ".join(residual_shapes(loss_fn, block_params, block_x, block_y))
    print(f"{label:27} {saved:46} {compiled.memory_analysis().temp_size_in_bytes / MiB:8.2f} "
          f"{compiled.cost_analysis()['flops'] / 1e6:7.1f}")


block_params, block_x, block_y = init_blocks(jax.random.key(1))
print(f"loss {float(blocks_loss(block_params, block_x, block_y)):.4f}\n")
print(f"{'':27} {'saved (not arguments)':46} {'temp MiB':>8} {'MFLOPs':>7}")
print_costs(blocks_loss, "store everything")
print_costs(full_remat_blocks_loss, "jax.checkpoint, no policy")

# %% [markdown]
# The columns: the residuals saved (besides the arguments), the temporary memory of the
# compiled gradient, and its FLOPs (those of one loop iteration: the scan bodies are counted
# once, as above). Full recomputation saves memory and adds the block's matrix products once
# more; the policy of the task keeps the products and recomputes only `tanh`.

# %% [raw]
# # BEGIN QUESTION
# name: q2_remat_policy
# points: 2

# %% [markdown]
# **Task 2** (`q2_remat_policy`). Define `policy_loss(params, x, y)`: the loss `blocks_loss`
# (a `lax.scan` over the stacked blocks `params = (W_in, W_out)`, shapes `(L, D, F)` and
# `(L, F, D)`), where inside each block the product `h @ W_in` is named `"hidden"` with
# `checkpoint_name`, and the block is wrapped in `jax.checkpoint` with a policy that saves
# **exactly the values named `"hidden"`** and recomputes everything else. For any `L`, `D`, `F`
# and batch size, its value and gradient must equal those of `blocks_loss`, and the residuals it
# saves besides its arguments must be each block's input (`(L, batch, D)`) and each block's
# `"hidden"` product (`(L, batch, F)`), and nothing else that grows with `L`.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def policy_loss(params, x, y):
    policy = jax.checkpoint_policies.save_only_these_names("hidden")

    @partial(jax.checkpoint, policy=policy)
    def block(h, W_in, W_out):
        hidden = checkpoint_name(h @ W_in, "hidden")
        return h + jnp.tanh(hidden) @ W_out

    def body(h, block_params):
        return block(h, *block_params), None

    h, _ = lax.scan(body, x, params)
    return jnp.mean(jnp.sum((h - y) ** 2, axis=-1))
# END SOLUTION
""" # BEGIN PROMPT
policy_loss = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q2_form(policy_loss):
    import jaxlab_form as form
    form.expect_callable("policy_loss", form.evidence(policy_loss))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q2_remat_policy(policy_loss):
    import jaxlab_lab6
    jaxlab_lab6.check("q2_remat_policy", policy_loss=policy_loss)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %% [markdown]
# Your policy, in the table above's columns:

# %%
if answered(policy_loss):
    print_costs(policy_loss, "save only 'hidden'")

# %% [markdown]
# ## Part B: the optimizer's state, split over the devices
#
# ### Adam
#
# Adam keeps, for every parameter, two running averages: `m` of its gradients and `v` of their
# squares. At step `t` (counting from 1), with gradient `g`:
#
# $$m \leftarrow \beta_1 m + (1-\beta_1)\, g, \qquad v \leftarrow \beta_2 v + (1-\beta_2)\, g^2,$$
#
# $$\hat m = \frac{m}{1-\beta_1^t}, \qquad \hat v = \frac{v}{1-\beta_2^t}, \qquad
# \theta \leftarrow \theta - \mathrm{lr}\,\frac{\hat m}{\sqrt{\hat v} + \epsilon}.$$
#
# `m` and `v` start at zero, so in the first steps they are too small; dividing by
# `1 - β^t` (the **bias correction**) undoes that. Note where `ε` goes: outside the square root.
#
# Each of `m` and `v` has the size of the parameters, so Adam's state is **twice the model**;
# with the parameters themselves, three copies (mixed-precision training keeps a float32 master
# copy of bfloat16 parameters too, more still).

# %%
LR, B1, B2, EPS = 1e-2, 0.9, 0.999, 1e-8

# %% [raw]
# # BEGIN QUESTION
# name: q3_adam_reference
# points: 1

# %% [markdown]
# **Task 3** (`q3_adam_reference`). Define `adam_update(param, grad, m, v, t, lr=LR, b1=B1,
# b2=B2, eps=EPS)`, one Adam step for an array of parameters of any shape, written with `jnp`
# (no optimizer library): it returns the tuple `(new_param, new_m, new_v)` by the formulas above,
# `t` being the number of the step (1 at the first step; a Python int or an integer `jax.Array`,
# also under `jax.jit`). It must be a pure function: it changes none of its arguments.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def adam_update(param, grad, m, v, t, lr=LR, b1=B1, b2=B2, eps=EPS):
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad**2
    m_hat = m / (1 - b1**t)
    v_hat = v / (1 - b2**t)
    return param - lr * m_hat / (jnp.sqrt(v_hat) + eps), m, v
# END SOLUTION
""" # BEGIN PROMPT
adam_update = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q3_form(adam_update):
    import jaxlab_form as form
    form.expect_callable("adam_update", form.evidence(adam_update))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q3_adam_reference(adam_update):
    import jaxlab_lab6
    jaxlab_lab6.check("q3_adam_reference", adam_update=adam_update)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %% [markdown]
# Training a small regression model with it, on one device. `regression_loss` is the model of
# this part: one `tanh` layer, `W` of shape `(64, 16)`.

# %%
ZERO_STEPS = 3


def regression_loss(W, x, y):
    return jnp.mean(jnp.sum((jnp.tanh(x @ W) - y) ** 2, axis=-1))


def init_regression(key, d_in=64, d_out=16, batch=32, steps=ZERO_STEPS):
    kW, *kb = jax.random.split(key, 1 + 2 * steps)
    W = jax.random.normal(kW, (d_in, d_out)) / jnp.sqrt(d_in)
    batches = [(jax.random.normal(kb[2 * i], (batch, d_in)),
                jax.random.normal(kb[2 * i + 1], (batch, d_out))) for i in range(steps)]
    return W, batches


reg_W, reg_batches = init_regression(jax.random.key(2))
if answered(adam_update):
    W_single, m_single, v_single = reg_W, jnp.zeros_like(reg_W), jnp.zeros_like(reg_W)
    for t, (x_t, y_t) in enumerate(reg_batches, start=1):
        g = jax.grad(regression_loss)(W_single, x_t, y_t)
        W_single, m_single, v_single = adam_update(W_single, g, m_single, v_single, t)
        print(f"step {t}: loss {float(regression_loss(W_single, x_t, y_t)):.4f}")

# %% [markdown]
# ### ZeRO: each device keeps a slice of the state
#
# In plain data parallelism (Lab 3) every device holds the whole model **and** the whole
# optimizer state, and updates all of it, identically: `n` copies of the same work and the same
# memory. **ZeRO** (the Zero Redundancy Optimizer of DeepSpeed, also what PyTorch's FSDP and
# JAX's fully sharded training do) splits them instead. With `W`, `m` and `v` all split by rows
# over the mesh axis `data`, one training step on each device is:
#
# 1. **all-gather** its slice of the parameters into the whole `W` (`jax.lax.all_gather(...,
#    tiled=True)`), which the forward and backward pass need;
# 2. compute the gradient of the loss **of its own examples** with respect to the whole `W`;
# 3. **reduce-scatter** the gradients (`jax.lax.psum_scatter(..., scatter_dimension=0,
#    tiled=True)`): each device receives the sum over the devices of **its rows** of the
#    gradient, and nothing else; divided by the number of devices, that is its slice of the mean
#    gradient over the whole batch;
# 4. update **its slice** of `W`, `m` and `v` with Adam. No device ever holds the whole `m` or
#    `v`, and it holds the whole gradient only within the step.
#
# Take care of step 3's division: Adam's update barely changes when every gradient is scaled by
# the same factor (`m / sqrt(v)` does not), so the sum taken for the mean goes unnoticed in `W`;
# it does not in `m` and `v`.
#
# A reduce-scatter followed by an all-gather moves exactly what one all-reduce moves (an
# all-reduce is usually implemented that way), so compared with data parallelism, which
# all-reduces the gradient, ZeRO divides the optimizer's memory by `n` **at no extra
# communication**.
#
# The devices of this part, with an Explicit axis so that `jax.typeof` shows the split, and
# what one device holds as the arguments of a data-parallel step that keeps the state replicated
# (`replicated_step`, the automatic data parallelism of Lab 3), for a model with `W` of shape
# `(1024, 512)`, compiled from shapes only:

# %%
mesh_data = jax.make_mesh((N_DEVICES,), ("data",), axis_types=(AxisType.Explicit,),
                          devices=devices)


@jax.jit
def replicated_step(state, x, y, t):
    W, m, v = state
    return adam_update(W, jax.grad(regression_loss)(W, x, y), m, v, t)


def step_shapes(state_spec, d_in=1024, d_out=512, batch=64):
    spec = lambda shape, s: jax.ShapeDtypeStruct(  # noqa: E731
        shape, jnp.float32, sharding=NamedSharding(mesh_data, s))
    state = tuple(spec((d_in, d_out), state_spec) for _ in range(3))
    return state, spec((batch, d_in), P("data")), spec((batch, d_out), P("data")), 1


if answered(adam_update):
    replicated_arguments = replicated_step.lower(*step_shapes(P())).compile().memory_analysis(
        ).argument_size_in_bytes
    print(f"replicated: arguments {replicated_arguments / MiB:.2f} MiB per device "
          "(W, m and v whole, a slice of the batch)")

# %% [raw]
# # BEGIN QUESTION
# name: q4_zero_sharded_adam
# points: 3

# %% [markdown]
# **Task 4** (`q4_zero_sharded_adam`). Define
#
# * `zero_init(W)`: the state `(W, m, v)` of ZeRO training for the parameters `W` (an array of
#   shape `(d_in, d_out)`, `d_in` divisible by 8): three `jax.Array`s on `mesh_data`, each split
#   by rows over `'data'`, `m` and `v` zeros;
# * `zero_step(state, x, y, t)`: one ZeRO step of Adam (your `adam_update`, its default
#   settings) on `regression_loss`, written with `jax.shard_map` on `mesh_data`, for the state
#   from `zero_init`, a batch `x`, `y` split by rows over `'data'` (any batch size divisible by
#   8) and the step number `t`. It follows the four points above: one `all_gather` of the
#   parameters, the gradient of each device's own loss, one `psum_scatter` of the gradient (no
#   `psum` of it: that would be data parallelism's all-reduce), each device's Adam update of its
#   slice. It returns the new state, each array split by rows over `'data'`.
#
# After any number of steps, the state must equal that of your `adam_update` on one device with
# the mean gradient over the whole batch.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def zero_init(W):
    rows = NamedSharding(mesh_data, P("data", None))
    return tuple(jax.device_put(a, rows) for a in (W, jnp.zeros_like(W), jnp.zeros_like(W)))


@jax.jit
@partial(jax.shard_map, mesh=mesh_data, in_specs=(P("data"), P("data"), P("data"), P()),
         out_specs=P("data"))
def zero_step(state, x, y, t):
    W_slice, m, v = state
    W = lax.all_gather(W_slice, "data", tiled=True)  # the whole W, for this step only
    g = jax.grad(regression_loss)(W, x, y)  # this device's examples
    n = lax.axis_size("data")
    g_slice = lax.psum_scatter(g, "data", scatter_dimension=0, tiled=True) / n
    return adam_update(W_slice, g_slice, m, v, t)
# END SOLUTION
""" # BEGIN PROMPT
zero_init = ...
zero_step = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q4_form(zero_init, zero_step):
    import jaxlab_form as form
    form.expect_callable("zero_init", form.evidence(zero_init))
    form.expect_callable("zero_step", form.evidence(zero_step))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q4_zero_sharded_adam(zero_init, zero_step, adam_update):
    import jaxlab_lab6
    jaxlab_lab6.check("q4_zero_sharded_adam", zero_init=zero_init, zero_step=zero_step,
                      adam_update=adam_update)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
def place_rows(a, mesh=mesh_data):
    return jax.device_put(a, NamedSharding(mesh, P("data", None)))


if answered(zero_init, zero_step, adam_update):
    zero_state = zero_init(reg_W)
    for t, (x_t, y_t) in enumerate(reg_batches, start=1):
        zero_state = zero_step(zero_state, place_rows(x_t), place_rows(y_t), t)
    print("m:", jax.typeof(zero_state[1]), " one device holds",
          zero_state[1].addressable_shards[0].data.shape)
    print("same parameters as on one device:",
          np.allclose(zero_state[0], W_single, rtol=1e-4, atol=1e-5))

# %% [markdown]
# What one device holds as the step's arguments, for a model with `W` of shape `(1024, 512)`
# (compiled from shapes only): the ZeRO step against the data-parallel step of the table above.
# The cell compiles `jax.jit(zero_step)`, so it runs whether or not your `zero_step` is jitted.

# %%
if answered(zero_step, adam_update):
    memory = jax.jit(zero_step).lower(*step_shapes(P("data"))).compile().memory_analysis()
    print(f"ZeRO: arguments {memory.argument_size_in_bytes / MiB:6.2f} MiB per device, against "
          f"{replicated_arguments / MiB:.2f} MiB for the replicated step")

# %% [markdown]
# ## Part C: attention over a long sequence
#
# ### Attention, and the size of its scores
#
# Causal self-attention of one head, for a sequence of `S` positions with queries `q`, keys `k`
# and values `v` of shape `(S, d)`:
#
# 1. scores `s = q @ k.T / sqrt(d)`, shape `(S, S)`: how well query `i` matches key `j`;
# 2. the **causal mask**: query `i` may only look at keys `j <= i` (the past and itself); the
#    others get a score of `-inf`;
# 3. a softmax over each row, `p = exp(s) / sum(exp(s))`;
# 4. output `p @ v`, shape `(S, d)`.
#
# The softmax is **numerically safe** only when computed as `exp(s - max(s))` (divided by its
# sum): subtracting a row's maximum changes nothing mathematically, and keeps every `exp` at most
# 1. Computed naively, a score above 88 already overflows float32 (`exp(89) = inf`) and the row
# becomes `inf / inf = nan`.
#
# The `(S, S)` score matrix is the problem: for `S = 128 000` tokens it is 65 GB in float32, per
# head. Long sequences never build it.

# %%
S_DEMO, D_HEAD = 64, 16
att_q, att_k, att_v = jax.random.normal(jax.random.key(3), (3, S_DEMO, D_HEAD))
print("exp(89) in float32:", jnp.exp(jnp.float32(89.0)), "  exp(89 - 89):",
      jnp.exp(jnp.float32(89.0) - jnp.float32(89.0)))

# %% [raw]
# # BEGIN QUESTION
# name: q5_attention_reference
# points: 1

# %% [markdown]
# **Task 5** (`q5_attention_reference`). Define `attention(q, k, v)`: causal softmax attention of
# one head as above, for `q`, `k`, `v` of shape `(S, d)` (any `S` and `d`), scores scaled by
# `1 / sqrt(d)`, the softmax numerically safe (it must stay finite however large the scores),
# returning the output of shape `(S, d)`.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def attention(q, k, v):
    S, d = q.shape
    scores = q @ k.T / jnp.sqrt(d)
    causal = jnp.arange(S)[:, None] >= jnp.arange(S)[None, :]
    scores = jnp.where(causal, scores, -jnp.inf)
    weights = jnp.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v
# END SOLUTION
""" # BEGIN PROMPT
attention = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q5_form(attention):
    import jaxlab_form as form
    form.expect_callable("attention", form.evidence(attention))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q5_attention_reference(attention):
    import jaxlab_lab6
    jaxlab_lab6.check("q5_attention_reference", attention=attention)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
S_LONG = 2048


def seq_shapes(S, d=D_HEAD, sharding=None):
    return [jax.ShapeDtypeStruct((S, d), jnp.float32, sharding=sharding)] * 3


if answered(attention):
    att_out = attention(att_q, att_k, att_v)
    print("output", att_out.shape, " first row equals v[0]:", np.allclose(att_out[0], att_v[0]))
    print("finite with scores in the thousands:",
          bool(jnp.isfinite(attention(100 * att_q, 100 * att_k, att_v)).all()))
    attention_temp = jax.jit(attention).lower(*seq_shapes(S_LONG)).compile().memory_analysis(
        ).temp_size_in_bytes
    print(f"S = {S_LONG} on one device: {attention_temp / MiB:.2f} MiB of temporary memory "
          f"(the S × S scores alone: {S_LONG**2 * 4 / MiB:.0f} MiB)")

# %% [markdown]
# ### The softmax, one block of keys at a time
#
# The softmax of a row needs its maximum and its sum over **all** keys, yet it can be computed
# while the keys arrive block by block. Keep, for every query, three running quantities: the
# largest score seen so far `m`, the sum `l` of `exp(score - m)` over the keys seen so far, and
# the output so far `o`, the sum of `exp(score - m) * v` over them. A new block of keys with
# scores `s` (shape `(S, block)`) and values `v_blk` updates them as
#
# ```
# m_new = maximum(m, max of s over the block)
# scale = exp(m - m_new)              # the old terms were relative to m: rescale them
# p = exp(s - m_new[:, None])
# l = scale * l + p.sum(axis=-1)
# o = scale[:, None] * o + p @ v_blk
# m = m_new
# ```
#
# and at the end `o / l[:, None]` is exactly the softmax-weighted output. Start with `m = -inf`,
# `l = 0`, `o = 0` (the first `scale` is then 0). This **online softmax** is what
# FlashAttention computes on one chip, and what lets the blocks live on different devices below.
# Every `exp` is again at most 1, so it is as safe as subtracting the maximum.
#
# One detail for the causal mask: in a block where a query may see no key at all, the masked
# scores must not give `exp(-inf - (-inf)) = nan`. Masking with a large finite negative number
# such as `-1e30` instead of `-inf` avoids it: such a block adds terms that the next real
# maximum multiplies by `exp(-1e30 - m) = 0`.

# %% [raw]
# # BEGIN QUESTION
# name: q6_online_softmax
# points: 2

# %% [markdown]
# **Task 6** (`q6_online_softmax`). Define `blocked_attention(q, k, v, block_size)`: the same
# causal attention as `attention`, computed with the online softmax over blocks of
# `block_size` consecutive keys and values (a Python int that divides `S`; any value from 1 to
# `S`), the queries all at once. Each block's scores have shape `(S, block_size)`: no array of
# `S × S` entries may appear when `block_size < S`. It must equal `attention` for any `S`, `d`
# and block size, and stay finite however large the scores.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
MASKED = -1e30


def online_softmax_step(carry, q, k_blk, v_blk, q_pos, k_pos):
    """Fold one block of keys and values into the running (m, l, o) of the queries."""
    m, l, o = carry
    s = q @ k_blk.T / jnp.sqrt(q.shape[-1])
    s = jnp.where(q_pos[:, None] >= k_pos[None, :], s, MASKED)
    m_new = jnp.maximum(m, s.max(axis=-1))
    scale = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    return m_new, scale * l + p.sum(axis=-1), scale[:, None] * o + p @ v_blk


def blocked_attention(q, k, v, block_size):
    S = q.shape[0]
    carry = (jnp.full((S,), -jnp.inf), jnp.zeros((S,)), jnp.zeros_like(q))
    positions = jnp.arange(S)
    for start in range(0, S, block_size):
        blk = slice(start, start + block_size)
        carry = online_softmax_step(carry, q, k[blk], v[blk], positions, positions[blk])
    _, l, o = carry
    return o / l[:, None]
# END SOLUTION
""" # BEGIN PROMPT
blocked_attention = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q6_form(blocked_attention):
    import jaxlab_form as form
    form.expect_callable("blocked_attention", form.evidence(blocked_attention))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q6_online_softmax(blocked_attention):
    import jaxlab_lab6
    jaxlab_lab6.check("q6_online_softmax", blocked_attention=blocked_attention)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(blocked_attention, attention):
    for block_size in (1, 8, S_DEMO):
        same = np.allclose(blocked_attention(att_q, att_k, att_v, block_size),
                           attention(att_q, att_k, att_v), atol=1e-5)
        print(f"block size {block_size:2d}: equals attention: {same}")

# %% [markdown]
# ### Ring attention: the sequence split over the devices
#
# Now split the sequence over the 8 devices: device `i` holds the queries, keys and values of
# positions `i·b` to `(i+1)·b - 1` (`b = S / 8`). Its queries need the keys and values of every
# earlier block. Instead of gathering them (which would put all `S` keys on every device), the
# blocks travel around a **ring**: each device computes with the key/value block it holds, then
# passes that block to the next device with `jax.lax.ppermute` (device `j` sends to `j + 1`, the
# last to device 0) and receives one from the previous device. After `n - 1` moves every device
# has seen all `n` blocks, one at a time, and folded each into its running `m`, `l`, `o` with the
# online softmax. No device ever holds more than one block of keys, and its scores are `b × b`.
# (On real hardware the next block is in flight while the current one is being used, so the
# communication hides behind the computation.)
#
# The causal mask needs **global** positions: at step `t` (`t = 0` before any move) device `i`
# holds the block that started on device `(i - t) mod n`, whose keys are at positions
# `((i - t) mod n)·b + 0, …, b - 1`; its own queries are at `i·b + 0, …, b - 1`.
# `jax.lax.axis_index('seq')` gives `i`. Blocks from later devices are entirely masked: that is
# where masking with `-1e30` instead of `-inf` matters.
#
# ### Loops inside `shard_map`, and `pcast`
#
# Inside `shard_map` JAX tracks, for every value, whether it can differ between devices
# ("varying" over an axis) or is the same on all of them. A loop (`lax.fori_loop`, `lax.scan`)
# must hand its body a carry of the **same** kind as the body returns. A carry started as
# `jnp.zeros(...)` is the same on every device, but after one step it depends on the device's
# data, so the loop refuses it. The error says what to do:

# %%
mesh_seq = jax.make_mesh((N_DEVICES,), ("seq",), axis_types=(AxisType.Auto,), devices=devices)
RING = [(j, (j + 1) % N_DEVICES) for j in range(N_DEVICES)]


def sum_around_the_ring(block, start):
    """Every device adds up all 8 blocks, passing them around the ring."""
    def step(_, carry):
        total, travelling = carry
        return total + travelling, lax.ppermute(travelling, "seq", RING)

    total, _ = lax.fori_loop(0, N_DEVICES, step, (start(block), block))
    return total


constant_start = jax.shard_map(partial(sum_around_the_ring, start=lambda b: jnp.zeros(b.shape)),
                               mesh=mesh_seq, in_specs=P("seq"), out_specs=P("seq"))
try:
    constant_start(jnp.arange(16.0))
except Exception as err:
    print(type(err).__name__ + ":", "\n".join(str(err).strip().splitlines()[:8]))

# %% [markdown]
# `jax.lax.pcast(x, 'seq', to='varying')` marks a value that is the same on every device as
# varying over `'seq'`. (Starting from `jnp.zeros_like(block)` also works: it takes the kind of
# `block`, which is varying.)

# %%
def varying_zeros(block):
    return lax.pcast(jnp.zeros(block.shape), "seq", to="varying")


ring_sum = jax.shard_map(partial(sum_around_the_ring, start=varying_zeros), mesh=mesh_seq,
                         in_specs=P("seq"), out_specs=P("seq"))
print(ring_sum(jnp.arange(16.0)))  # each device: the sum of the 8 blocks of 2

# %% [raw]
# # BEGIN QUESTION
# name: q7_ring_attention
# points: 3

# %% [markdown]
# **Task 7** (`q7_ring_attention`). Define `ring_attention(q, k, v)` with `jax.shard_map` on
# `mesh_seq`: `q`, `k`, `v` of shape `(S, d)` split by rows over `'seq'` (in_specs `P('seq')`),
# the result of shape `(S, d)` split the same way. Each device keeps its queries; the key and
# value blocks travel around the ring with `ppermute` over `'seq'`, **`n - 1` moves** of each
# (the last block needs no move), no `all_gather` and no array holding all `S` keys; each block
# is folded in with the online softmax, the causal mask taken from global positions. It must
# equal `attention` for any `S` divisible by 8 (one position per device too) and any `d`, and
# its compiled temporary memory per device must be far below what `attention` needs on one
# device (under 10% of it).

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
@partial(jax.shard_map, mesh=mesh_seq, in_specs=P("seq"), out_specs=P("seq"))
def ring_attention(q, k, v):
    n = lax.axis_size("seq")
    me = lax.axis_index("seq")
    b = q.shape[0]
    q_pos = me * b + jnp.arange(b)
    ring = [(j, (j + 1) % n) for j in range(n)]

    def fold(carry, k_blk, v_blk, t):
        k_pos = ((me - t) % n) * b + jnp.arange(b)
        return online_softmax_step(carry, q, k_blk, v_blk, q_pos, k_pos)

    def step(t, state):
        carry, k_blk, v_blk = state
        carry = fold(carry, k_blk, v_blk, t)
        return carry, lax.ppermute(k_blk, "seq", ring), lax.ppermute(v_blk, "seq", ring)

    start = (lax.pcast(jnp.full((b,), -jnp.inf), "seq", to="varying"),
             lax.pcast(jnp.zeros((b,)), "seq", to="varying"), jnp.zeros_like(q))
    carry, k_blk, v_blk = lax.fori_loop(0, n - 1, step, (start, k, v))
    _, l, o = fold(carry, k_blk, v_blk, n - 1)  # the last block: no move after it
    return o / l[:, None]
# END SOLUTION
""" # BEGIN PROMPT
ring_attention = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q7_form(ring_attention):
    import jaxlab_form as form
    form.expect_callable("ring_attention", form.evidence(ring_attention))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q7_ring_attention(ring_attention):
    import jaxlab_lab6
    jaxlab_lab6.check("q7_ring_attention", ring_attention=ring_attention)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(ring_attention, attention):
    rows = NamedSharding(mesh_seq, P("seq"))
    ring_out = jax.jit(ring_attention)(*(jax.device_put(a, rows) for a in (att_q, att_k, att_v)))
    print("equals attention:", np.allclose(ring_out, attention(att_q, att_k, att_v), atol=1e-5))
    program = str(jax.make_jaxpr(ring_attention)(att_q, att_k, att_v))
    print("ppermute in the program:", program.count("ppermute["), " all_gather:",
          "all_gather" in program)
    ring_temp = jax.jit(ring_attention).lower(*seq_shapes(S_LONG, sharding=rows)).compile(
        ).memory_analysis().temp_size_in_bytes
    print(f"S = {S_LONG}: temporary memory per device {ring_temp / MiB:.2f} MiB (ring) against "
          f"{attention_temp / MiB:.2f} MiB (attention on one device)")

# %% [markdown]
# ## Part D: the cost model
#
# ### FLOPs and bytes of a compiled program
#
# A matrix product `A @ B` of `A` of shape `(I, J)` and `B` of shape `(J, K)` costs `2·I·J·K`
# floating-point operations (a multiply and an add per term). `.cost_analysis()['flops']` of a
# compiled program reads the same count; for a program compiled over several devices it is the
# count **of one device**. The collectives the program runs are in its text,
# `compiled.as_text()` (XLA's HLO): lines such as `%all-gather.1 = f32[512,256]{0,1}
# all-gather(...)`, the type before the name being the collective's **result**.

# %%
COLLECTIVE = re.compile(r"= (\w+\[[\d,]*\])\S* (all-gather|all-reduce|reduce-scatter|"
                        r"collective-permute|all-to-all)(?:-start)?\(")


def hlo_collectives(compiled):
    """(result type, collective) of every collective in a compiled program."""
    return COLLECTIVE.findall(compiled.as_text())


I_DEMO, J_DEMO, K_DEMO = 512, 1024, 256
A_spec = jax.ShapeDtypeStruct((I_DEMO, J_DEMO), jnp.float32)
B_spec = jax.ShapeDtypeStruct((J_DEMO, K_DEMO), jnp.float32)
one_device = jax.jit(jnp.matmul).lower(A_spec, B_spec).compile()
print(f"one device: {one_device.cost_analysis()['flops']:.4g} FLOPs, "
      f"2·I·J·K = {2 * I_DEMO * J_DEMO * K_DEMO:.4g}")

# %% [markdown]
# ### A sharded product, four ways
#
# The [scaling book](https://jax-ml.github.io/scaling-book/sharding/) writes a layout as
# `A[I_X, J]`: `A`'s rows are split over mesh axis `X`, its columns are not. With `n` devices
# on the axis `x`, these are the four cases a sharded matrix product falls into, and the program
# each one needs, written with `shard_map`:
#
# | case | layout | what each device does |
# |---|---|---|
# | 1 | `A[I_X, J] · B[J, K] → C[I_X, K]` | multiplies its rows of `A` by `B`: no communication |
# | 2 | `A[I_X, J] · B[J, K_X] → C[I_X, K]` | needs all of `B`: **all-gathers** `B`, then multiplies its rows |
# | 3 | `A[I, J_X] · B[J_X, K] → C[I, K]` | multiplies its columns of `A` by its rows of `B`: a partial sum of all of `C`; the partial sums are **all-reduced** |
# | 4 | `A[I, J_X] · B[J_X, K] → C[I_X, K]` | the same partial sums, but each device keeps only its rows of `C`: a **reduce-scatter** |
#
# How many bytes a collective moves, per device, with the usual ring algorithms (an array of `N`
# bytes in all, split in `n` blocks; each device sends as much as it receives):
#
# * **all-gather** (the result has `N` bytes): each device receives the `n - 1` blocks it lacks,
#   `(n - 1) / n · N` bytes;
# * **reduce-scatter** (each device starts with a whole array of `N` bytes to be summed):
#   `(n - 1) / n · N` bytes;
# * **all-reduce** (the same): a reduce-scatter then an all-gather, `2 (n - 1) / n · N` bytes.
#
# In float32 an array of `I × K` numbers has `4·I·K` bytes.

# %%
def case_programs(mesh):
    """The shard_map program of each case of the table, on a 1-D mesh with axis 'x'."""
    smap = partial(jax.shard_map, mesh=mesh)
    return {
        1: (smap(lambda a, b: a @ b, in_specs=(P("x", None), P()), out_specs=P("x", None)),
            P("x", None), P()),
        2: (smap(lambda a, b: a @ lax.all_gather(b, "x", axis=1, tiled=True),
                 in_specs=(P("x", None), P(None, "x")), out_specs=P("x", None)),
            P("x", None), P(None, "x")),
        3: (smap(lambda a, b: lax.psum(a @ b, "x"), in_specs=(P(None, "x"), P("x", None)),
                 out_specs=P()),
            P(None, "x"), P("x", None)),
        4: (smap(lambda a, b: lax.psum_scatter(a @ b, "x", scatter_dimension=0, tiled=True),
                 in_specs=(P(None, "x"), P("x", None)), out_specs=P("x", None)),
            P(None, "x"), P("x", None)),
    }


def compile_case(case, I, J, K, n_devices):
    """The compiled program of a case of the table, for A (I, J) and B (J, K) on n devices."""
    mesh = jax.make_mesh((n_devices,), ("x",), axis_types=(AxisType.Auto,),
                         devices=devices[:n_devices])
    program, a_spec, b_spec = case_programs(mesh)[case]
    a = jax.ShapeDtypeStruct((I, J), jnp.float32, sharding=NamedSharding(mesh, a_spec))
    b = jax.ShapeDtypeStruct((J, K), jnp.float32, sharding=NamedSharding(mesh, b_spec))
    return jax.jit(program).lower(a, b).compile()


for case in (1, 2, 3, 4):
    compiled = compile_case(case, I_DEMO, J_DEMO, K_DEMO, N_DEVICES)
    print(f"case {case}: {compiled.cost_analysis()['flops']:.4g} FLOPs per device, "
          f"collectives {hlo_collectives(compiled)}")

# %% [markdown]
# (The compiler also counts the additions an all-reduce does, `I·K` of them: a small extra over
# the product's FLOPs.)
#
# Left to itself, the compiler chooses such a program from the layouts alone. Given `A[I, J_X]`
# and a replicated `B`, with `C` wanted replicated, it can all-gather `A` or all-reduce partial
# sums of `C`; it picks whichever moves fewer bytes:

# %%
def auto_product(I, J, K):
    mesh = jax.make_mesh((N_DEVICES,), ("x",), axis_types=(AxisType.Auto,), devices=devices)
    a = jax.ShapeDtypeStruct((I, J), jnp.float32, sharding=NamedSharding(mesh, P(None, "x")))
    b = jax.ShapeDtypeStruct((J, K), jnp.float32, sharding=NamedSharding(mesh, P()))
    replicated = NamedSharding(mesh, P())
    return jax.jit(jnp.matmul, out_shardings=replicated).lower(a, b).compile()


for I, J, K in ((512, 1024, 64), (512, 64, 1024)):
    print(f"A ({I}, {J}), C ({I}, {K}): {hlo_collectives(auto_product(I, J, K))}")

# %% [raw]
# # BEGIN QUESTION
# name: q8_matmul_costs
# points: 2

# %% [markdown]
# **Task 8** (`q8_matmul_costs`). Define `matmul_costs(case, I, J, K, n_devices)` for the four
# cases of the table (`case` is 1, 2, 3 or 4; float32 arrays `A` of shape `(I, J)` and `B` of
# shape `(J, K)`; the dimensions split over the axis divisible by `n_devices`), returning a tuple
# `(flops, comm_bytes, collective)`:
#
# * `flops`: the FLOPs of the matrix product **one device** computes (a number);
# * `comm_bytes`: the bytes one device sends in the case's collective, by the rules above (a
#   number; 0 when there is none);
# * `collective`: the collective, named as in XLA's program: `"all-gather"`, `"reduce-scatter"`,
#   `"all-reduce"` or `"none"`.
#
# The check compiles the case's program (`compile_case`) for new sizes and numbers of devices, and
# compares your numbers with its `cost_analysis()` and with the collective in its HLO.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def matmul_costs(case, I, J, K, n_devices):
    n = n_devices
    flops = 2 * I * J * K / n  # every case splits the product's work n ways
    if case == 1:
        return flops, 0, "none"
    if case == 2:
        return flops, (n - 1) / n * 4 * J * K, "all-gather"
    if case == 3:
        return flops, 2 * (n - 1) / n * 4 * I * K, "all-reduce"
    return flops, (n - 1) / n * 4 * I * K, "reduce-scatter"
# END SOLUTION
""" # BEGIN PROMPT
matmul_costs = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q8_form(matmul_costs):
    import jaxlab_form as form
    form.expect_callable("matmul_costs", form.evidence(matmul_costs))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q8_matmul_costs(matmul_costs):
    import jaxlab_lab6
    jaxlab_lab6.check("q8_matmul_costs", matmul_costs=matmul_costs)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(matmul_costs):
    for case in (1, 2, 3, 4):
        flops, comm_bytes, collective = matmul_costs(case, I_DEMO, J_DEMO, K_DEMO, N_DEVICES)
        print(f"case {case}: {flops:.4g} FLOPs, {comm_bytes / MiB:.3f} MiB sent, {collective}")

# %% [markdown]
# ### Rooflines
#
# A step is limited by whichever of its resources it uses longest. A chip does at most
# `flop_per_s` floating-point operations per second, reads or writes its memory (HBM) at
# `hbm_bytes_per_s` and sends to another chip at `link_bytes_per_s`. A step that does `F` FLOPs,
# moves `M` bytes to and from memory and `C` bytes over the links needs at least
#
# $$T_\text{compute} = F / \text{flop\_per\_s}, \quad T_\text{memory} = M /
# \text{hbm\_bytes\_per\_s}, \quad T_\text{communication} = C / \text{link\_bytes\_per\_s},$$
#
# and when the three overlap perfectly (the best case, which good programs approach) it takes
# the **largest** of them: the step is **compute-bound**, **memory-bound** or
# **communication-bound** according to which one that is. Only a compute-bound step uses what
# the chip is paid for.
#
# The ratio `F / M` is the **arithmetic intensity** of the step (FLOPs per byte of memory). The
# step is compute-bound (ignoring communication) when its intensity is at least
# `flop_per_s / hbm_bytes_per_s`, the chip's **critical intensity**. The roofline plot shows
# the FLOP/s a step can reach at each intensity: a slope (memory-bound) up to the critical
# intensity, then the flat roof (compute-bound).
#
# A matrix product in bfloat16 (2 bytes a number) of activations `X` of shape `(B, D)` by weights
# `W` of shape `(D, F)` does `2·B·D·F` FLOPs and moves `2·(B·D + D·F + B·F)` bytes (read `X`
# and `W`, write the result). For a small batch `B` its intensity is about `B`: a layer applied
# to a few examples at a time is memory-bound, whatever the chip.
#
# Published peak figures of two chips (bfloat16, dense), rounded:

# %%
CHIPS = {
    "TPU v5e": {"flop_per_s": 1.97e14, "hbm_bytes_per_s": 8.2e11, "link_bytes_per_s": 4.5e10},
    "H100 SXM": {"flop_per_s": 9.9e14, "hbm_bytes_per_s": 3.35e12, "link_bytes_per_s": 4.5e11},
}


def matmul_intensity(B, D, F, bytes_per_number=2):
    return 2 * B * D * F / (bytes_per_number * (B * D + D * F + B * F))


intensity = np.logspace(0, 4, 200)
fig, ax = plt.subplots(figsize=(6.5, 4))
for (name, chip), color in zip(CHIPS.items(), ("tab:blue", "tab:orange")):
    roof = np.minimum(chip["flop_per_s"], intensity * chip["hbm_bytes_per_s"])
    ax.loglog(intensity, roof, color=color, label=name)
    critical = chip["flop_per_s"] / chip["hbm_bytes_per_s"]
    ax.axvline(critical, color=color, linestyle=":", linewidth=1)
for B in (16, 256, 4096):
    x = matmul_intensity(B, 8192, 8192)
    y = min(CHIPS["H100 SXM"]["flop_per_s"], x * CHIPS["H100 SXM"]["hbm_bytes_per_s"])
    ax.plot(x, y, "k.", markersize=9)
    ax.annotate(f"B = {B}", (x, y), textcoords="offset points", xytext=(0, 8), ha="center",
                fontsize=8)
ax.set_xlabel("arithmetic intensity (FLOPs per byte of memory)")
ax.set_ylabel("attainable FLOP/s")
ax.set_ylim(top=5e15)
ax.set_title("Rooflines (dotted: critical intensity)\n"
             "dots: (B, 8192) × (8192, 8192) in bfloat16 on the H100", fontsize=10)
ax.legend(loc="upper left")
fig.tight_layout()
plt.show()

# %% [raw]
# # BEGIN QUESTION
# name: q9_roofline
# points: 1

# %% [markdown]
# **Task 9** (`q9_roofline`). Define
#
# * `roofline_time(flops, hbm_bytes, comm_bytes, chip)`: for a step with those FLOPs, bytes of
#   memory traffic and bytes sent over the links, on `chip` (a dict like the entries of
#   `CHIPS`), the tuple `(seconds, bound)`: the largest of the three times above, and which one
#   it is, `"compute"`, `"memory"` or `"communication"`;
# * `critical_batch(D, F, chip)`: the smallest batch size `B` (an `int`, at least 1) for which the
#   bfloat16 product of `(B, D)` by `(D, F)` above is compute-bound on `chip`, its compute time
#   at least its memory time (communication left out); `None` when no batch size is.
#
# Both take and return plain Python numbers (and strings).

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def roofline_time(flops, hbm_bytes, comm_bytes, chip):
    times = {"compute": flops / chip["flop_per_s"],
             "memory": hbm_bytes / chip["hbm_bytes_per_s"],
             "communication": comm_bytes / chip["link_bytes_per_s"]}
    bound = max(times, key=times.get)
    return times[bound], bound


def critical_batch(D, F, chip):
    # 2BDF / flop_per_s >= 2 (BD + DF + BF) / hbm_bytes_per_s, solved for B
    peak, bandwidth = chip["flop_per_s"], chip["hbm_bytes_per_s"]
    slope = D * F * bandwidth - peak * (D + F)
    if slope <= 0:
        return None
    return max(1, math.ceil(peak * D * F / slope))
# END SOLUTION
""" # BEGIN PROMPT
roofline_time = ...
critical_batch = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q9_form(roofline_time, critical_batch):
    import jaxlab_form as form
    form.expect_callable("roofline_time", form.evidence(roofline_time))
    form.expect_callable("critical_batch", form.evidence(critical_batch))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q9_roofline(roofline_time, critical_batch):
    import jaxlab_lab6
    jaxlab_lab6.check("q9_roofline", roofline_time=roofline_time, critical_batch=critical_batch)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(roofline_time, critical_batch):
    for name, chip in CHIPS.items():
        print(f"{name}: a (B, 8192) × (8192, 8192) product is compute-bound from B = "
              f"{critical_batch(8192, 8192, chip)}; (B, 64) × (64, 64) never: "
              f"{critical_batch(64, 64, chip)}")
    # case 2 of the table in bfloat16 on 8 chips: activations (B, D) split by rows, weights
    # (D, F) by columns and all-gathered
    D, F, n = 8192, 8192, 8
    for B in (64, 65536):
        flops = 2 * B * D * F / n
        hbm_bytes = 2 * (B // n * D + D * F + B // n * F)
        comm_bytes = (n - 1) / n * 2 * D * F
        seconds, bound = roofline_time(flops, hbm_bytes, comm_bytes, CHIPS["TPU v5e"])
        print(f"case 2, B = {B:5d}, on 8 TPU v5e chips: {seconds * 1e3:.3f} ms per product, "
              f"{bound}-bound")

# %% [markdown]
# ## Submitting
#
# Run the whole notebook from the top (*Kernel → Restart & Run All*), check that every
# `grader.check` cell says the public checks passed, then run the cell below.
