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
#   answer and run it. The cell after it, `grader.check("q…")`, runs the **public checks**: they
#   call your functions on the notebook's own example inputs (the arrays, meshes and sizes built
#   before the task), compare the results with what the notebook itself has (`deep_loss` and
#   `blocks_loss` and their gradients, your own Adam run on one device, the compiled programs of
#   `compile_case`, the formulas of the text worked out for a row or a step), and read your
#   method the way the hidden checks read it: **what it saves for the backward pass**
#   (`print_saved_residuals`), its loops and **collectives** (`jax.make_jaxpr`) and, in Task 1,
#   **how much memory** its compiled gradient needs. Each takes at most a few seconds on a CPU
#   runtime. When one fails, its message says what it expected and what your answer did.
# * **Hidden checks** run when your notebook is graded: they do the same on **new random
#   inputs** and other sizes (where the task says so), against references computed in float64
#   from the lab's own recipe, and compile your functions (`.lower(...).compile()`) to measure
#   their memory. Passing the public checks is not a promise of full marks: follow the method
#   each task describes, for any size it allows, not only its numbers here.
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
# the memory figures it prints are the CPU compiler's. Other backends and versions give other
# numbers, and other ratios too: the checkpointed gradient of Task 1 needs about 40% of the
# plain one's scratch memory with JAX 0.10.2 on CPU, and was measured at 57-63% with JAX 0.12
# (at the sizes the hidden check uses, on CPU too).
# What each program saves for its backward pass, which collectives it runs, and the order of
# the figures (the checkpointed program needs less than the plain one) stay.
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
import contextlib
import io
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

# %% tags=["claim:lab6-layer-residuals"]
def layer(h, W, b):
    return jnp.tanh(h @ W + b)


demo_W, demo_b = jnp.ones((4, 4)) / 4, jnp.zeros(4)
demo_x = jnp.ones((2, 4))
print_saved_residuals(lambda W, x: jnp.sum(layer(x, W, demo_b)), demo_W, demo_x)
print("tanh's derivative, as JAX computes it (the JVP of tanh):")
print(jax.make_jaxpr(lambda x: jax.jvp(jnp.tanh, (x,), (x,)))(demo_x))

# %% [markdown]
# The input `x` and the weights come from the arguments (they are in memory anyway). With JAX
# 0.10.2, the version this lab is graded with, two arrays of shape `(batch, width)` are new
# memory: the `tanh` output `y`, and `1 - y`. JAX writes the derivative `1 - y**2` as
# `(1 + y)(1 - y)` (the `sub 1.0` in the JVP printed above), and `1 - y` is computed in the
# forward pass, so it is kept too: a `tanh` layer keeps **two** activations of shape
# `(batch, width)` besides its input. JAX 0.12 computes the derivative with a primitive of its
# own (`one_minus_square` in the JVP) and keeps `1 - y**2` alone: **one** activation. What is
# kept is each primitive's differentiation rule's choice, and it changes between versions: the
# lists printed here say what your JAX keeps.
#
# ### Deep networks as a `lax.scan`
#
# A deep network made of identical layers is best written with its parameters **stacked**: all
# `L` weight matrices in one array of shape `(L, width, width)`, and a `jax.lax.scan` that runs
# the layer once per slice. The compiler then sees one loop body instead of `L` copies of it:
# the compiled program, and the time it takes to compile, do not grow with `L` (counted below:
# the matrix products in the compiled gradient, the same at every depth). The residuals of the
# iterations come out stacked too: one array of shape `(L, batch, width)` per kind of residual.

# %% tags=["claim:lab6-scan-residuals"]
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
saved_text = io.StringIO()
with contextlib.redirect_stdout(saved_text):
    print_saved_residuals(deep_loss, deep_params, deep_x, deep_y)
print(saved_text.getvalue(), end="")
STACKED = sum(line.startswith(f"f32[{N_LAYERS},{BATCH},{WIDTH}]")
              for line in saved_text.getvalue().splitlines())
print(f"JAX {jax.__version__}: {STACKED} stacked residuals of shape {(N_LAYERS, BATCH, WIDTH)}")

# %% [markdown]
# Arrays of shape `(16, 64, 128)`, for all 16 layers: every layer's input and what the layer
# above keeps, stacked: three with JAX 0.10.2 (the input, the `tanh` output and `1 - tanh` of
# it), two with JAX 0.12 (the input and `1 - tanh**2`). They grow with the depth.
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
# The same for other depths, compiled from shapes only. Each layer adds its residuals, `STACKED`
# arrays of `BATCH × WIDTH` float32 numbers, to the temporary memory; and the compiled
# program holds as many matrix products (`dot` in its text, `compiled.as_text()`) at every
# depth: the forward product and the two of the backward pass, once, in the loop's body.

# %% tags=["claim:lab6-memory-grows-with-depth", "claim:lab6-scan-program-size"]
DEPTHS = [4, 8, 16, 32]


def deep_shapes(n_layers, width=WIDTH, batch=BATCH):
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    return ((spec(n_layers, width, width), spec(n_layers, width)), spec(batch, width),
            spec(batch, width))


def temp_by_depth(loss_fn, products=None):
    """Temporary memory (MiB) of jax.grad(loss_fn) at each of DEPTHS; with a list `products`,
    also append the number of matrix products in each compiled program to it."""
    temps = []
    for n in DEPTHS:
        compiled = compiled_grad(loss_fn, *deep_shapes(n))
        temps.append(compiled.memory_analysis().temp_size_in_bytes / MiB)
        if products is not None:
            products.append(compiled.as_text().count(" dot("))
    return temps


def per_layer_kib(temps):
    """The temporary memory each layer adds (KiB), from the shallowest to the deepest."""
    return (temps[-1] - temps[0]) * 1024 / (DEPTHS[-1] - DEPTHS[0])


plain_products = []
plain_by_depth = temp_by_depth(deep_loss, plain_products)
print("layers:", DEPTHS, " temporary MiB:", [round(m, 2) for m in plain_by_depth])
print(f"each layer adds {per_layer_kib(plain_by_depth):.1f} KiB; its {STACKED} residuals, "
      f"(batch, width) float32 arrays, are {STACKED * BATCH * WIDTH * 4 / 1024:.1f} KiB")
print("matrix products in the compiled program:", plain_products)

# %% [markdown]
# ### `jax.checkpoint`
#
# `jax.checkpoint(fn)` (also spelled `jax.remat`) returns a function that computes the same
# values as `fn` and has the same gradient, but whose only residuals are **its inputs**: when the
# backward pass needs values computed inside `fn`, it computes them again from those inputs.
# Memory goes down; the price is that recomputation. JAX recomputes only what the backward pass
# needs (in the words of `jax.checkpoint`'s documentation, the "linearization points … are
# recomputed from the function's saved inputs"), so the price is **at most** one more forward
# pass through `fn`. For a layer `tanh(x @ W + b)` the whole layer is redone (its gradient needs
# the `tanh` output); since the backward pass of a matrix product costs about twice its forward
# pass, that is about a third more FLOPs in all (measured after Task 1). When `fn` ends in a
# product whose result the backward pass never reads, less (measured on the blocks of Task 2).

# %% tags=["claim:lab6-checkpoint-keeps-inputs"]
print_saved_residuals(lambda W, x: jnp.sum(jax.checkpoint(layer)(x, W, demo_b)), demo_W, demo_x)

# %% [markdown]
# Only the inputs are left (`demo_b` is a constant of the lambda). Put around the **body of the
# scan**, `jax.checkpoint` keeps each layer's input (the carry the scan hands to it) and nothing
# else from inside the layer. Put around the whole scan, it keeps only the network's input, and
# the backward pass then reruns the whole scan, storing every residual of every layer at once:
# no saving at all (the first lines below: about the same temporary memory as `deep_loss`,
# within 5%, and more FLOPs).
#
# The compiler may also undo a checkpoint. In a straight-line program (a Python `for` loop over
# the layers) JAX marks the recomputed values so that the compiler does not merge them with the
# forward pass's (`prevent_cse=True`, the default), yet with JAX 0.10.2 XLA's CPU compiler,
# measured below, computes each product only once and keeps the values: the compiled loop of
# checkpointed layers has exactly the matrix products of the plain loop and needs no less
# memory. (With JAX 0.12 the recomputed products stay, 31 against 23 at 8 layers, and the memory
# is still no less.) Inside a scan the recomputation stays where it is, and saves memory. So
# checkpoint the body of a scan.

# %% tags=["claim:lab6-checkpoint-placement"]
def checkpointed_network_loss(params, x, y):
    """jax.checkpoint around the whole scan."""
    network = jax.checkpoint(lambda params, x: lax.scan(
        lambda h, Wb: (layer(h, *Wb), None), x, params)[0])
    return jnp.mean(jnp.sum((network(params, x) - y) ** 2, axis=-1))


def python_loop_loss(params, x, y, checkpoint=False):
    """The same network as a Python loop over the layers (unrolled: no scan)."""
    h = x
    for W, b in zip(*params):
        h = (jax.checkpoint(layer) if checkpoint else layer)(h, W, b)
    return jnp.mean(jnp.sum((h - y) ** 2, axis=-1))


def memory_row(label, loss_fn, n_layers):
    compiled = compiled_grad(loss_fn, *deep_shapes(n_layers))
    print(f"{label:48} temporary {compiled.memory_analysis().temp_size_in_bytes / MiB:5.2f} MiB,"
          f" {compiled.cost_analysis()['flops'] / 1e6:6.1f} MFLOPs,"
          f" {compiled.as_text().count(' dot('):3d} matrix products")


print(f"JAX {jax.__version__}; {N_LAYERS} layers as a lax.scan (loop bodies counted once):")
memory_row("  deep_loss", deep_loss, N_LAYERS)
memory_row("  jax.checkpoint around the whole scan", checkpointed_network_loss, N_LAYERS)
print(f"{DEPTHS[1]} layers as a Python loop (every product in the program):")
memory_row("  plain layers", python_loop_loss, DEPTHS[1])
memory_row("  checkpointed layers", partial(python_loop_loss, checkpoint=True), DEPTHS[1])

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
# temporary memory than `deep_loss`'s: under 80% of it at 12 layers of width 96 and batch 48
# (the sizes the hidden check compiles; the lab's own checkpointed scan needs about 40% there,
# and at this notebook's sizes). The ratio depends on the sizes: with one layer there is
# nothing to save, and with a batch much smaller than the width (batch 8 at width 1024) the
# weights' own temporaries outweigh the activations and no checkpoint gets under 80%.

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
def test_q1_public(remat_loss, deep_loss, deep_params, deep_x, deep_y, compiled_grad):
    """On the notebook's deep network (and its first 4 layers): the value and gradient of
    deep_loss, each layer's input as the only saved array that grows with the depth, and the
    compiled gradient's temporary memory under 80% of deep_loss's."""
    import contextlib
    import io

    import jax
    import jaxlab_form as form
    from jax.ad_checkpoint import print_saved_residuals

    GRAD_RTOL, GRAD_ATOL, MEMORY_RATIO = 1e-3, 1e-5, 0.8
    form.expect_callable("remat_loss", form.evidence(remat_loss))
    W, b = deep_params
    L, (B, D) = W.shape[0], deep_x.shape
    call = "remat_loss(deep_params, deep_x, deep_y)"
    for n, words in ((L, call), (4, "remat_loss((W[:4], b[:4]), deep_x, deep_y), the first 4 "
                                    "layers of deep_params,")):
        params = (W[:n], b[:n])
        try:
            loss, grads = jax.jit(jax.value_and_grad(remat_loss))(params, deep_x, deep_y)
        except Exception as exc:
            form.fail(f"`{words}` raised {form.exception_line(exc)}; it should work for any "
                      "number of layers, width and batch size.")
        ref_loss, ref_grads = jax.value_and_grad(deep_loss)(params, deep_x, deep_y)
        form.expect_close(f"`{words}`", loss, ref_loss, "deep_loss for the same inputs",
                          rtol=GRAD_RTOL, atol=GRAD_ATOL)
        for grad, ref, what in zip(grads, ref_grads, ("W", "b")):
            form.expect_close(f"the gradient of `{words}` for {what}", grad, ref,
                              f"jax.grad(deep_loss)'s for {what}", rtol=GRAD_RTOL,
                              atol=GRAD_ATOL)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_saved_residuals(remat_loss, deep_params, deep_x, deep_y)
    saved = [line.split()[0] for line in text.getvalue().splitlines() if line.strip()
             and not line.split(" ", 1)[-1].startswith(("from the argument", "from a constant"))]
    wanted = f"f32[{L},{B},{D}]"
    stacked = [shape for shape in saved if shape.startswith(f"f32[{L},")]
    if stacked != [wanted]:
        if not stacked and len(saved) >= L:
            how = (f"{len(saved)} separate arrays (the first {saved[0]}), one or more per "
                   f"layer, and none stacked over the {L} layers: the layers do not run as a "
                   "lax.scan")
        elif not stacked:
            how = ("nothing that grows with the depth: jax.checkpoint around the whole "
                   "network keeps only its input, and its backward pass then stores every "
                   "layer's residuals at once (no saving)")
        elif stacked == [wanted] * 3:
            how = (f"3 arrays {wanted}, the three deep_loss saves (each layer's input, its "
                   "tanh output and 1 - tanh): nothing of the layer is recomputed")
        else:
            how = f"{', '.join(stacked)}, which grow with the depth"
        form.fail(f"`{call}` saves for its backward pass {how}; expected only each layer's "
                  f"input, one array {wanted} (jax.checkpoint, no policy, on the scan's body).")
    try:
        temp = compiled_grad(remat_loss, deep_params, deep_x, deep_y).memory_analysis(
            ).temp_size_in_bytes
    except Exception as exc:
        form.fail(f"`remat_loss`'s gradient could not be compiled: {form.exception_line(exc)}; "
                  "expected jax.jit(jax.grad(remat_loss)) to compile for the notebook's sizes.")
    plain = compiled_grad(deep_loss, deep_params, deep_x, deep_y).memory_analysis(
        ).temp_size_in_bytes
    if temp >= MEMORY_RATIO * plain:
        form.fail(f"compiled for the notebook's {L} layers of width {D} and batch {B}, "
                  f"`remat_loss`'s gradient needs {temp / 2**20:.2f} MiB of temporary memory, "
                  f"{temp / plain:.0%} of deep_loss's {plain / 2**20:.2f} MiB; expected clearly "
                  f"less (under {MEMORY_RATIO:.0%} of it).")

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

# %% tags=["claim:lab6-remat-memory", "claim:lab6-remat-flops"]
if answered(remat_loss):
    print(f"loss {float(remat_loss(deep_params, deep_x, deep_y)):.4f}")
    print_saved_residuals(remat_loss, deep_params, deep_x, deep_y)
    remat_by_depth = temp_by_depth(remat_loss)
    print(f"temporary memory at {N_LAYERS} layers: "
          f"{remat_by_depth[DEPTHS.index(N_LAYERS)]:.2f} MiB with jax.checkpoint, "
          f"{plain_by_depth[DEPTHS.index(N_LAYERS)]:.2f} MiB without")
    print(f"each layer adds {per_layer_kib(remat_by_depth):.1f} KiB with jax.checkpoint, "
          f"{per_layer_kib(plain_by_depth):.1f} KiB without ({STACKED} residuals); one (batch, "
          f"width) float32 array is {BATCH * WIDTH * 4 / 1024:.1f} KiB")
    flops = [compiled_grad(f, deep_params, deep_x, deep_y).cost_analysis()["flops"]
             for f in (deep_loss, remat_loss)]
    print(f"FLOPs of the gradient (the loop body once): {flops[1] / 1e6:.2f} M with "
          f"jax.checkpoint, {flops[0] / 1e6:.2f} M without: {flops[1] / flops[0]:.2f} times")
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
# but only one instead of `STACKED` (three with JAX 0.10.2, two with 0.12: the KiB each layer
# adds, printed above). The FLOPs grow by a
# third: the backward pass runs each layer forward again, and the backward pass of a layer
# costs about twice its forward pass.
#
# ### Counting FLOPs: a trap
#
# The compiled program also estimates its cost: `.cost_analysis()` returns a dict whose `'flops'`
# entry counts floating-point operations (JAX documents it as best effort; on some backends it
# may be missing). It counts **the body of a loop once**, not once per iteration:

# %% tags=["claim:lab6-cost-analysis-loop-once"]
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

# %% tags=["claim:lab6-block-remat-flops"]
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


def saved_residuals(loss_fn, *args):
    """The lines print_saved_residuals prints, except those of the arguments."""
    import contextlib
    import io

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_saved_residuals(loss_fn, *args)
    return [line for line in text.getvalue().splitlines()
            if line and "from the argument" not in line]


def residual_shapes(loss_fn, *args):
    """The shapes of the residuals print_saved_residuals lists, except the arguments."""
    return [line.split()[0] for line in saved_residuals(loss_fn, *args)]


def print_costs(loss_fn, label):
    """A row of the table below: what loss_fn saves, and its gradient's memory and FLOPs."""
    compiled = compiled_grad(loss_fn, block_params, block_x, block_y)
    saved = ", ".join(residual_shapes(loss_fn, block_params, block_x, block_y))
    print(f"{label:27} {saved:46} {compiled.memory_analysis().temp_size_in_bytes / MiB:8.2f} "
          f"{compiled.cost_analysis()['flops'] / 1e6:7.2f}")


block_params, block_x, block_y = init_blocks(jax.random.key(1))
print(f"loss {float(blocks_loss(block_params, block_x, block_y)):.4f}\n")
print(f"{'':27} {'saved (not arguments)':46} {'temp MiB':>8} {'MFLOPs':>7}")
print_costs(blocks_loss, "store everything")
print_costs(full_remat_blocks_loss, "jax.checkpoint, no policy")
print(f"\none product of a block, ({BLOCK_BATCH}, {D_MODEL}) @ ({D_MODEL}, {D_FF}): "
      f"{2 * BLOCK_BATCH * D_MODEL * D_FF / 1e6:.2f} MFLOPs")

# %% [markdown]
# The columns: the residuals saved (besides the arguments), the temporary memory of the
# compiled gradient, and its FLOPs (those of one loop iteration: the scan bodies are counted
# once, as above). Full recomputation saves memory and adds **one** of the block's two products
# (the difference of the two rows is one product's FLOPs, printed last): `h @ W_in`, whose
# `tanh` the backward pass needs. The result of `… @ W_out` is never needed by the backward
# pass, so it is not recomputed. The policy of the task saves `h @ W_in` too, and recomputes
# only `tanh`.

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
def test_q2_public(policy_loss, blocks_loss, block_params, block_x, block_y):
    """On the notebook's blocks (and their first 4): the value and gradient of blocks_loss; a
    lax.scan whose block is checkpointed; h @ W_in named "hidden"; each block's input and its
    "hidden" product as the only saved arrays that grow with the depth; and the policy itself,
    tried on another function, saving exactly the value named "hidden"."""
    import contextlib
    import inspect
    import io

    import jax
    import jax.numpy as jnp
    import jaxlab_form as form
    from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

    GRAD_RTOL, GRAD_ATOL, NAME = 1e-3, 1e-5, "hidden"
    REMAT = ("checkpoint", "remat2")
    form.expect_callable("policy_loss", form.evidence(policy_loss))
    W_in, W_out = block_params
    L, (B, D), F = W_in.shape[0], block_x.shape, W_in.shape[-1]
    call = "policy_loss(block_params, block_x, block_y)"
    for n, words in ((L, call), (4, "policy_loss((W_in[:4], W_out[:4]), block_x, block_y), the "
                                    "first 4 blocks of block_params,")):
        params = (W_in[:n], W_out[:n])
        try:
            loss, grads = jax.jit(jax.value_and_grad(policy_loss))(params, block_x, block_y)
        except Exception as exc:
            form.fail(f"`{words}` raised {form.exception_line(exc)}; it should work for any "
                      "L, D, F and batch size.")
        ref_loss, ref_grads = jax.value_and_grad(blocks_loss)(params, block_x, block_y)
        form.expect_close(f"`{words}`", loss, ref_loss, "blocks_loss for the same inputs",
                          rtol=GRAD_RTOL, atol=GRAD_ATOL)
        for grad, ref, what in zip(grads, ref_grads, ("W_in", "W_out")):
            form.expect_close(f"the gradient of `{words}` for {what}", grad, ref,
                              f"jax.grad(blocks_loss)'s for {what}", rtol=GRAD_RTOL,
                              atol=GRAD_ATOL)

    def saved_besides_arguments(fn, *args):
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            print_saved_residuals(fn, *args)
        return [line for line in text.getvalue().splitlines() if line.strip() and not
                line.split(" ", 1)[-1].startswith(("from the argument", "from a constant"))]

    steps = []  # (equation, primitives it is nested in, the equations making its operands)

    def walk(jaxpr, within=()):
        made = {}
        for eqn in jaxpr.eqns:
            steps.append((eqn, within, [made.get(id(v)) for v in eqn.invars]))
            made.update((id(v), eqn) for v in eqn.outvars)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner, within + (eqn.primitive.name,))

    walk(jax.make_jaxpr(policy_loss)(block_params, block_x, block_y).jaxpr)
    prims = [(eqn.primitive.name, within) for eqn, within, _ in steps]
    if not any(eqn.primitive.name == "scan" and eqn.params["length"] == L
               for eqn, _, _ in steps):
        form.fail(f"`{call}` does not loop over its {L} blocks with lax.scan; expected a "
                  "lax.scan over the stacked blocks, whose body is one block.")
    if not any(p in REMAT and "scan" in within for p, within in prims):
        around = any(p == "scan" and set(within) & set(REMAT) for p, within in prims)
        form.fail(f"`{call}` " + ("puts jax.checkpoint around the whole lax.scan" if around else
                                  "runs no jax.checkpoint inside its lax.scan") +
                  "; expected each block wrapped in jax.checkpoint, inside the scan.")
    named = [(eqn, makers) for eqn, _, makers in steps
             if eqn.primitive.name == "name" and eqn.params.get("name") == NAME]
    if not named:
        names = sorted({str(eqn.params.get("name")) for eqn, _, _ in steps
                        if eqn.primitive.name == "name"})
        form.fail(f"`policy_loss` names {', '.join(map(repr, names)) or 'no value'}; expected "
                  f"the product h @ W_in named {NAME!r} with checkpoint_name.")
    for eqn, makers in named:
        maker = makers[0]
        product = maker is not None and (maker.primitive.name == "dot_general" or any(
            e.primitive.name == "dot_general" for e, within, _ in steps if within[-1:] ==
            (maker.primitive.name,) and e.outvars and
            tuple(e.outvars[0].aval.shape) == (B, F)))
        shape = tuple(eqn.outvars[0].aval.shape)
        if not product or shape != (B, F):
            what = maker.primitive.name if maker is not None else "an input of the block"
            form.fail(f"`policy_loss` gives the name {NAME!r} to the result of `{what}` (shape "
                      f"{shape}); expected it on the product h @ W_in itself, shape ({B}, {F}), "
                      "before tanh.")
    stacked = sorted(line.split()[0] for line in saved_besides_arguments(
        policy_loss, block_params, block_x, block_y) if line.startswith(f"f32[{L},"))
    wanted = sorted([f"f32[{L},{B},{D}]", f"f32[{L},{B},{F}]"])
    if stacked != wanted:
        form.fail(f"`{call}` saves {', '.join(stacked) or 'nothing'} that grow(s) with the "
                  f"depth; expected exactly each block's input f32[{L},{B},{D}] and its "
                  f"{NAME!r} product f32[{L},{B},{F}].")

    def trial(x, W1, W2, W3):
        a = checkpoint_name(x @ W1, NAME)
        b = checkpoint_name(jnp.sin(a) @ W2, "other")
        return jnp.sum(jnp.sin(jnp.sin(b @ W3)))

    args = [jnp.ones(shape) for shape in ((3, 4), (4, 5), (5, 7), (7, 11))]
    for eqn, _, _ in steps:
        if eqn.primitive.name in REMAT:
            policy = eqn.params.get("policy")
            saved = saved_besides_arguments(jax.checkpoint(trial, policy=policy), *args)
            # printed "named 'hidden' from …" (JAX 0.10), "output of reduce_precision from
            # <file>:<line>:<column> of a's checkpoint_name" (JAX 0.8.2)
            lines, first = inspect.getsourcelines(trial)
            where = f":{first + 1}:{lines[1].index('checkpoint_name(')} "
            if len(saved) != 1 or not (f"named {NAME!r}" in saved[0] or (
                    saved[0].startswith("f32[3,5]") and where in saved[0])):
                found = "; ".join(" ".join(line.split()[:4]) for line in saved) or "nothing"
                form.fail(f"the policy of `policy_loss`'s jax.checkpoint ({policy!r}), tried on "
                          f"another function with a product named {NAME!r}, one named 'other' "
                          f"and an unnamed product, saves: {found}; expected exactly the value "
                          f"named {NAME!r}. The task asks for a policy that saves exactly the "
                          f"values named {NAME!r}, not one that happens to save the same values "
                          "in this block.")

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
# Your policy, in the table above's columns: it should save what the backward pass needs from
# inside the block, `h @ W_in`, at about the FLOPs of storing everything, with temporary memory
# between the two other rows. In these blocks the row cannot tell a policy that saves the
# values named `"hidden"` from one that saves every matrix product (`dots_saveable`): the only
# product whose result the backward pass needs is `h @ W_in`, so both save the same arrays. The
# lines under the table try the policy of each `jax.checkpoint` in your `policy_loss` on another
# function, with a product named `"hidden"`, one named `"other"` and an unnamed product: a
# policy that saves exactly the values named `"hidden"` saves the first alone.

# %% tags=["claim:lab6-policy-costs"]
def checkpoint_policies(loss_fn, *args):
    """The policy of every jax.checkpoint in the program loss_fn traces (None: no policy)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("checkpoint", "remat2"):
                found.append(eqn.params.get("policy"))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(loss_fn)(*args).jaxpr)
    return found


def policy_trial(x, W1, W2, W3):
    a = checkpoint_name(x @ W1, "hidden")
    b = checkpoint_name(jnp.sin(a) @ W2, "other")
    return jnp.sum(jnp.sin(b @ W3))


if answered(policy_loss):
    print(f"{'':27} {'saved (not arguments)':46} {'temp MiB':>8} {'MFLOPs':>7}")
    print_costs(blocks_loss, "store everything")
    print_costs(full_remat_blocks_loss, "jax.checkpoint, no policy")
    print_costs(policy_loss, "your policy_loss")
    trial_args = [jnp.ones(shape) for shape in ((3, 4), (4, 5), (5, 7), (7, 11))]
    for policy in checkpoint_policies(policy_loss, block_params, block_x, block_y):
        name = getattr(policy, "__qualname__", repr(policy))
        print(f"\nthe policy {name}, tried on policy_trial, saves:")
        for line in saved_residuals(jax.checkpoint(policy_trial, policy=policy), *trial_args):
            print("  ", line)

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
# Each of `m` and `v` has the size of the parameters, so Adam's state is **twice the model**.
# A training step also holds the gradient: four arrays of the model's size in float32 (the
# parameters, their gradient, `m` and `v`; the data-parallel step after Task 3 measures it).
# Mixed-precision training keeps about 16 bytes per parameter: 16-bit parameters and gradients
# (2 + 2 bytes), and in float32 a master copy of the parameters, `m` and `v` (4 + 4 + 4), as the
# ZeRO paper counts the "model states" (Rajbhandari et al., *ZeRO: Memory Optimizations Toward
# Training Trillion Parameter Models*, 2020).

# %% [markdown]
# Adam's default settings in this lab, and the model of this part, `regression_loss`: one
# `tanh` layer, `W` of shape `(64, 16)`, with three batches of 32 examples to train it on.

# %%
LR, B1, B2, EPS = 1e-2, 0.9, 0.999, 1e-8
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
def test_q3_public(adam_update, reg_W, reg_batches, regression_loss, LR, B1, B2, EPS):
    """Adam's formulas worked out where they are simple, on the notebook's W and the gradient of
    its first batch: with the same gradient g at every step, the bias corrections make
    m_hat = g and v_hat = g**2 exactly, so each step moves param by -lr·g/(|g| + eps), while
    m = (1 - b1**t)·g and v = (1 - b2**t)·g**2; at the defaults and with other settings, with t
    traced under jax.jit, and on NumPy arrays that must not change."""
    import jax
    import jax.numpy as jnp
    import jaxlab_form as form
    import numpy as np

    RTOL, ATOL, MOMENT_ATOL = 1e-4, 1e-6, 1e-8
    form.expect_callable("adam_update", form.evidence(adam_update))
    g = np.asarray(jax.grad(regression_loss)(reg_W, *reg_batches[0]), np.float64)
    W0 = np.asarray(reg_W, np.float64)
    settings = {"lr": 0.05, "b1": 0.8, "b2": 0.99, "eps": 0.1}
    for hyper, how in (({}, "the defaults"), (settings, ", ".join(
            f"{k}={v:g}" for k, v in settings.items()))):
        lr, b1, b2, eps = (hyper.get(k, d) for k, d in zip(("lr", "b1", "b2", "eps"),
                                                           (LR, B1, B2, EPS)))
        state = (jnp.asarray(reg_W), jnp.zeros_like(reg_W), jnp.zeros_like(reg_W))
        for t in (1, 2, 3):
            call = f"adam_update(param, g, m, v, {t}" + (f", {how})" if hyper else ")")
            try:
                out = adam_update(*state[:1], jnp.asarray(g, jnp.float32), *state[1:], t,
                                  **hyper)
            except Exception as exc:
                form.fail(f"`{call}` raised {form.exception_line(exc)} (param: reg_W after "
                          f"{t - 1} step(s), g: the gradient of the first batch at reg_W); "
                          "expected the tuple (new_param, new_m, new_v).")
            if type(out) not in (tuple, list) or len(out) != 3:
                form.fail(f"`{call}` returned {form.describe(form.evidence(out))}; expected the "
                          "tuple (new_param, new_m, new_v).")
            expected = (W0 - t * lr * g / (np.abs(g) + eps), (1 - b1 ** t) * g,
                        (1 - b2 ** t) * g ** 2)
            words = (f"after {t} step(s) from zero moments with the same gradient g at every "
                     f"step ({how}), where the bias corrections make m_hat = g and v_hat = g**2")
            for item, ref, what, atol, formula in zip(
                    out, expected, ("new_param", "new_m", "new_v"),
                    (ATOL, MOMENT_ATOL, MOMENT_ATOL),
                    ("param - t·lr·g/(|g| + eps)", "(1 - b1**t)·g", "(1 - b2**t)·g**2")):
                form.expect_close(f"the {what} of `{call}`", item, ref,
                                  f"Adam's {what} {words}: {formula}", rtol=RTOL, atol=atol)
            state = tuple(out)
    try:
        jitted = jax.jit(lambda p, g_, m, v, t: adam_update(p, g_, m, v, t))(
            *state[:1], jnp.asarray(g, jnp.float32), *state[1:], jnp.int32(4))
    except Exception as exc:
        form.fail(f"`adam_update` under jax.jit, with t a traced integer, raised "
                  f"{form.exception_line(exc)}; expected it to work under jax.jit too: compute "
                  "with t through jnp (for example b1 ** t), never through Python's float(), "
                  "int() or if.")
    eager = adam_update(*state[:1], jnp.asarray(g, jnp.float32), *state[1:], 4)
    for item, ref, what, atol in zip(jitted, eager, ("new_param", "new_m", "new_v"),
                                     (ATOL, MOMENT_ATOL, MOMENT_ATOL)):
        form.expect_close(f"the {what} of `adam_update` under jax.jit with t = jnp.int32(4)", item,
                          ref, "the same call with t = 4", rtol=RTOL, atol=atol)
    inputs = [np.asarray(a, np.float32) for a in (reg_W, g, 0.1 * g, 0.01 * g ** 2)]
    copies = [a.copy() for a in inputs]
    try:
        adam_update(*copies, 2)
    except Exception as exc:
        form.fail(f"`adam_update(param, grad, m, v, 2)` on NumPy arrays raised "
                  f"{form.exception_line(exc)}; expected it to work on any arrays, NumPy's too.")
    changed = [n for n, a, c in zip(("param", "grad", "m", "v"), inputs, copies)
               if not np.array_equal(a, c)]
    if changed:
        form.fail(f"`adam_update(param, grad, m, v, 2)` on NumPy arrays changes its argument(s) "
                  f"{', '.join(changed)} in place; expected a pure function that returns new "
                  "arrays and leaves its arguments as they were.")

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
# Training `regression_loss`'s `W` with your `adam_update` on one device, each step on the mean
# gradient of a whole batch (Task 4's reference: `W_single`, `m_single`, `v_single`):

# %%
if answered(adam_update):
    W_single, m_single, v_single = reg_W, jnp.zeros_like(reg_W), jnp.zeros_like(reg_W)
    for t, (x_t, y_t) in enumerate(reg_batches, start=1):
        g = jax.grad(regression_loss)(W_single, x_t, y_t)
        W_single, m_single, v_single = adam_update(W_single, g, m_single, v_single, t)
        print(f"step {t}: loss {float(regression_loss(W_single, x_t, y_t)):.4f}")

# %% [markdown]
# Adam's update barely changes when every gradient is scaled by the same factor: `m` grows by
# the factor and `sqrt(v)` too, so `m / sqrt(v)` does not (only `eps` notices). `m` and `v`
# themselves do change. The same three steps with every gradient 8 times larger (as a sum over
# 8 devices taken for their mean would give):

# %% tags=["claim:lab6-adam-scale-invariance"]
if answered(adam_update):
    W_8, m_8, v_8 = reg_W, jnp.zeros_like(reg_W), jnp.zeros_like(reg_W)
    for t, (x_t, y_t) in enumerate(reg_batches, start=1):
        g = 8 * jax.grad(regression_loss)(W_8, x_t, y_t)
        W_8, m_8, v_8 = adam_update(W_8, g, m_8, v_8, t)
    print(f"parameters: largest difference {float(jnp.max(jnp.abs(W_8 - W_single))):.2g} "
          f"(they move by about {float(jnp.max(jnp.abs(W_single - reg_W))):.2g})")
    print(f"m: {float(jnp.linalg.norm(m_8) / jnp.linalg.norm(m_single)):.2f} times as large, "
          f"v: {float(jnp.linalg.norm(v_8) / jnp.linalg.norm(v_single)):.2f} times as large")

# %% [markdown]
# ### ZeRO: each device keeps a slice of the state
#
# In plain data parallelism (Lab 3) every device holds the whole model **and** the whole
# optimizer state, and updates all of it, identically: `n` copies of the same work and the same
# memory. **ZeRO** (the Zero Redundancy Optimizer of DeepSpeed, the paper cited above) splits
# them instead. With `W`, `m` and `v` all split by rows over the mesh axis `data`, one training
# step on each device is:
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
# Take care of step 3's division: as measured after Task 3, a sum taken for the mean goes
# unnoticed in `W`; it does not in `m` and `v`.
#
# A reduce-scatter followed by an all-gather moves exactly what one all-reduce moves (an
# all-reduce is usually implemented that way). So this step moves the same bytes as data
# parallelism, which all-reduces the gradient, and divides the optimizer's memory by `n` (both
# measured after Task 4). That holds because the step gathers `W` once and keeps it for the
# forward **and** the backward pass. ZeRO's first two stages work that way (the optimizer state
# split, then the gradients too: "P_os" and "P_os+g" in the paper), and so does PyTorch FSDP's
# `SHARD_GRAD_OP` strategy, which also keeps the parameters split between steps, as here.
# **Fully sharded** training (ZeRO's third stage, "P_os+g+p"; PyTorch FSDP's default
# `FULL_SHARD`; the scaling book's FSDP) goes further: it frees each layer's gathered weights
# after use, so that no device ever holds the whole model, and gathers them again in the
# backward pass. Per layer and step that is an all-gather in the forward pass, another in the
# backward pass and the reduce-scatter: 1.5 times data parallelism's bytes (the paper's
# communication analysis of ZeRO-DP), in exchange for the memory. The cell after the next
# measures it on a scan of layers.
#
# What a compiled program communicates is in its text, `compiled.as_text()` (XLA's HLO): each
# collective is a line such as `%all-gather.1 = f32[512,256]{0,1} all-gather(...)`, the type
# before the collective's name being its **result**, a tuple `(f32[…], f32[…])` when XLA has
# combined several collectives into one. `hlo_collectives(compiled)` lists them, and
# `ring_mib` the MiB one device sends in each, with the usual ring algorithms (Part D explains
# the rule: an all-gather or a reduce-scatter over `n` devices sends `(n - 1) / n` of the whole
# array, an all-reduce twice that).
#
# The devices of this part, with an Explicit axis so that `jax.typeof` shows the split, and
# what one device holds and sends in a data-parallel step that keeps the state replicated
# (`replicated_step`, the automatic data parallelism of Lab 3), for a model with `W` of shape
# `(1024, 512)` (2 MiB), compiled from shapes only:

# %% tags=["claim:lab6-adam-four-copies", "claim:lab6-combined-collective"]
COLLECTIVE = re.compile(r"= (\([^()]*\)|\w+\[[\d,]*\])\S* (all-gather|all-reduce|"
                        r"reduce-scatter|collective-permute|all-to-all)(?:-start)?\(")


def hlo_collectives(compiled):
    """(result type, collective) of every collective in a compiled program."""
    return COLLECTIVE.findall(compiled.as_text())


def ring_mib(collectives, n=N_DEVICES):
    """MiB one device sends in each collective (float32 results) with the ring algorithms."""
    sent = []
    for result, kind in collectives:
        size = sum(4 * math.prod(int(d) for d in dims.split(",") if d)
                   for dims in re.findall(r"f32\[([\d,]*)\]", result))
        whole = size * n if kind == "reduce-scatter" else size  # its result is one block
        sent.append(round(whole * (n - 1) / n * (2 if kind == "all-reduce" else 1) / MiB, 3))
    return sent


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


def two_weights_collectives():
    """The collectives of a data-parallel gradient of two weights, (1024, 256) and (256, 512)."""
    def loss(Ws, x, y):
        return regression_loss(Ws[1], jnp.tanh(x @ Ws[0]), y)

    whole = lambda *shape: jax.ShapeDtypeStruct(  # noqa: E731
        shape, jnp.float32, sharding=NamedSharding(mesh_data, P()))
    _, x, y, _ = step_shapes(P())
    Ws = (whole(1024, 256), whole(256, 512))
    return hlo_collectives(jax.jit(jax.grad(loss)).lower(Ws, x, y).compile())


print("the gradients of two weights, data-parallel:", two_weights_collectives())

if answered(adam_update):
    replicated = replicated_step.lower(*step_shapes(P())).compile()
    replicated_arguments = replicated.memory_analysis().argument_size_in_bytes
    replicated_temp = replicated.memory_analysis().temp_size_in_bytes
    replicated_collectives = hlo_collectives(replicated)
    print(f"replicated: arguments {replicated_arguments / MiB:.2f} MiB per device "
          f"(W, m and v whole, a slice of the batch), temporary {replicated_temp / MiB:.2f} MiB "
          f"(one more array of W's size: the gradient); W itself is {1024 * 512 * 4 / MiB:.2f} MiB")
    print(f"replicated: collectives {replicated_collectives}, MiB sent per device "
          f"{ring_mib(replicated_collectives)}")

# %% [markdown]
# Fully sharded training, measured on a sketch: the gradient of a scan over 4 stacked
# `tanh` layers of `(256, 256)` weights, each layer's weights split by rows over `data` and
# gathered inside the scan's body (so each layer is gathered when it is used, not all at once).
# Differentiating a scan keeps what its body computed for the backward pass, the gathered
# weights too: without `jax.checkpoint` the program gathers each layer once and keeps every
# gathered layer until the backward pass. With the body checkpointed it keeps only the slices,
# and gathers each layer again in the backward pass: two all-gathers and a reduce-scatter per
# layer (the loop bodies of the HLO run once per layer), 1.5 times data parallelism's
# all-reduce of the same gradient.

# %% tags=["claim:lab6-fsdp-regather"]
def fsdp_gradient(checkpoint, n_layers=4, width=256, batch=64):
    """The compiled gradient of a scan of layers whose body all-gathers its own weights."""
    @jax.jit
    @partial(jax.shard_map, mesh=mesh_data, in_specs=(P(None, "data"), P("data"), P("data")),
             out_specs=P(None, "data"))
    def gradient(W_rows, x, y):
        def loss(W_rows):
            def body(h, W_layer_rows):
                W = lax.all_gather(W_layer_rows, "data", tiled=True)
                return jnp.tanh(h @ W), None

            h, _ = lax.scan(jax.checkpoint(body) if checkpoint else body, x, W_rows)
            return jnp.mean(jnp.sum((h - y) ** 2, axis=-1))

        return jax.grad(loss)(W_rows) / lax.axis_size("data")

    spec = lambda shape, s: jax.ShapeDtypeStruct(  # noqa: E731
        shape, jnp.float32, sharding=NamedSharding(mesh_data, s))
    return gradient.lower(spec((n_layers, width, width), P(None, "data")),
                          spec((batch, width), P("data")), spec((batch, width), P("data"))
                          ).compile()


for checkpoint in (False, True):
    compiled = fsdp_gradient(checkpoint)
    found = hlo_collectives(compiled)
    print(f"body checkpointed: {checkpoint!s:5}  temporary "
          f"{compiled.memory_analysis().temp_size_in_bytes / MiB:.2f} MiB, collectives per "
          f"layer {[kind for _, kind in found]}, MiB sent per layer {sum(ring_mib(found)):.3f}")
print(f"data parallelism's all-reduce of one layer's gradient: "
      f"{sum(ring_mib([('f32[256,256]', 'all-reduce')])):.3f} MiB; one gathered layer "
      f"{256 * 256 * 4 / MiB:.2f} MiB")

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
def test_q4_public(zero_init, zero_step, reg_W, reg_batches, mesh_data, W_single, m_single,
                   v_single):
    """On the notebook's regression model and batches: zero_init's state split by rows over
    'data'; three zero_steps equal to your adam_update trained on one device (W_single,
    m_single, v_single, from the cell after Task 3), each array split by rows; and in the traced
    step, a shard_map with one all_gather of W's rows, one psum_scatter of the gradient and no
    psum of it."""
    import jax
    import jaxlab_form as form
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    RTOL, ATOL, MOMENT_ATOL = 1e-4, 2e-5, 1e-6
    form.expect_callable("zero_init", form.evidence(zero_init))
    form.expect_callable("zero_step", form.evidence(zero_step))

    def split_by_rows(name, a):
        sharding = getattr(a, "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if not isinstance(sharding, NamedSharding) or "data" not in mesh.axis_names or \
                mesh.devices.size != 8 or not sharding.is_equivalent_to(
                    NamedSharding(mesh, P("data")), a.ndim):
            where = (f"laid out as {sharding.spec} on a mesh with axes {mesh.axis_names}"
                     if isinstance(sharding, NamedSharding) else
                     f"{type(a).__name__} {getattr(sharding, 'device_set', '')}".strip())
            form.fail(f"{name} is {where}; expected a jax.Array on the 8 devices of `mesh_data`, "
                      "split by rows over 'data' (spec P('data')), each device holding 1/8 of "
                      "it.")
        if mesh != mesh_data:
            form.fail(f"{name} lives on a mesh of its own (axes {mesh.axis_names}, axis types "
                      f"{tuple(str(t) for t in mesh.axis_types)}), not on `mesh_data` (axis "
                      "'data' Explicit, over the notebook's 8 devices in order); expected the "
                      "state on mesh_data, as the task says.")

    try:
        state = zero_init(reg_W)
    except Exception as exc:
        form.fail(f"`zero_init(reg_W)` raised {form.exception_line(exc)}; expected the state "
                  "(W, m, v).")
    if type(state) not in (tuple, list) or len(state) != 3:
        form.fail(f"`zero_init(reg_W)` returned {form.describe(form.evidence(state))}; expected "
                  "the state (W, m, v).")
    for a, ref, what in zip(state, (reg_W, 0 * reg_W, 0 * reg_W), "Wmv"):
        form.expect_close(f"`zero_init(reg_W)` ({what})", a, ref,
                          "reg_W itself" if what == "W" else "zeros", rtol=RTOL, atol=ATOL)
        split_by_rows(f"`zero_init(reg_W)` ({what})", a)
    rows = NamedSharding(mesh_data, P("data"))
    placed = [(jax.device_put(x, rows), jax.device_put(y, rows)) for x, y in reg_batches]
    try:
        closed = jax.make_jaxpr(zero_step)(state, *placed[0], 1)
    except Exception as exc:
        form.fail(f"`zero_step(zero_init(reg_W), x, y, 1)` could not be traced with "
                  f"jax.make_jaxpr: {form.exception_line(exc)}; expected a step that "
                  "jax.make_jaxpr can trace (the checks read its collectives that way).")
    if W_single is None or m_single is None or v_single is None:
        form.fail("`W_single`, `m_single` and `v_single` are not defined: they are the reference "
                  "of `zero_step` (your adam_update trained on one device), expected from the "
                  "cell after Task 3; answer Task 3 and run that cell first.")
    try:
        for t, (x, y) in enumerate(placed, start=1):
            state = zero_step(state, x, y, t)
    except Exception as exc:
        form.fail(f"`zero_step(state, x, y, {t})` raised {form.exception_line(exc)} (state from "
                  "zero_init(reg_W), x and y a batch of reg_batches split by rows over 'data'); "
                  "expected the new state (W, m, v).")
    if type(state) not in (tuple, list) or len(state) != 3:
        form.fail(f"`zero_step(...)` returned {form.describe(form.evidence(state))}; expected the "
                  "new state (W, m, v).")
    words = f"after {len(placed)} steps of `zero_step` on reg_batches"
    for a, single, what, atol in zip(state, (W_single, m_single, v_single), "Wmv",
                                     (ATOL, MOMENT_ATOL, MOMENT_ATOL)):
        found, ref = np.asarray(a, np.float64), np.asarray(single, np.float64)
        if what == "m" and not np.allclose(found, ref, rtol=RTOL, atol=atol):
            for factor in (8, 1 / 8):
                if np.allclose(found, factor * ref, rtol=RTOL, atol=atol):
                    form.fail(f"the state's m {words} is {factor:g} times m_single, m for the "
                              "mean gradient: the gradient each device updates with must be its "
                              "slice of the mean over the whole batch (what psum_scatter adds "
                              "up, divided by the number of devices, of each device's own "
                              "mean-loss gradient).")
        form.expect_close(f"the state's {what} {words}", found, ref, f"{what}_single (your "
                          "adam_update on one device with the mean gradient of each whole "
                          "batch)", rtol=RTOL, atol=atol)
        split_by_rows(f"the state's {what} {words}", a)
    moves, seen = [], set()  # (collective, operand shape) inside shard_map; every primitive

    def walk(jaxpr, inside):
        for eqn in jaxpr.eqns:
            seen.add(eqn.primitive.name)
            if inside and eqn.primitive.name in ("all_gather", "all_gather_invariant",
                                                 "reduce_scatter", "psum", "psum_invariant",
                                                 "psum2"):
                moves.append((eqn.primitive.name, tuple(eqn.invars[0].aval.shape)))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner, inside or eqn.primitive.name == "shard_map")

    walk(closed.jaxpr, False)
    if "shard_map" not in seen:
        form.fail("`zero_step` does not go through jax.shard_map; expected the per-device step "
                  "written with jax.shard_map on mesh_data, as the task says.")
    d_in, d_out = reg_W.shape
    sums = [shape for prim, shape in moves if prim.startswith("psum")
            and int(np.prod(shape)) >= d_in * d_out]
    if sums:
        form.fail(f"`zero_step` adds up an array of shape {sums[0]} over the devices with psum "
                  "(an all-reduce, as in data parallelism); expected one psum_scatter of the "
                  "gradient, so that each device receives only its rows.")
    scatters = [shape for prim, shape in moves if prim == "reduce_scatter"]
    if len(scatters) != 1 or int(np.prod(scatters[0])) != d_in * d_out:
        form.fail(f"`zero_step` runs {len(scatters)} psum_scatter(s) of shape(s) "
                  f"{scatters or 'none'}; expected one psum_scatter of the gradient (shape "
                  f"({d_in}, {d_out})) over 'data'.")
    gathers = [shape for prim, shape in moves if prim.startswith("all_gather")]
    if gathers != [(d_in // 8, d_out)]:
        form.fail(f"`zero_step` all-gathers {len(gathers)} array(s) of shape(s) "
                  f"{gathers or 'none'}; expected exactly one all_gather: of this device's rows "
                  f"of W, shape ({d_in // 8}, {d_out}) (m and v stay split).")

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
    for name, found, single in zip("Wmv", zero_state, (W_single, m_single, v_single)):
        print(f"{name} the same as on one device (your adam_update on the whole batches): "
              f"{np.allclose(found, single, rtol=1e-4, atol=1e-6)!s:5}  (its size against the "
              f"one-device {name}'s: {float(jnp.linalg.norm(found) / jnp.linalg.norm(single)):.3f})")

# %% [markdown]
# What one device holds and sends in a step, for a model with `W` of shape `(1024, 512)`
# (compiled from shapes only): the ZeRO step against the data-parallel step above. The
# arguments are fixed by the layouts the cell passes in; the temporary memory and the
# collectives are what the step's code decides. The cell compiles `jax.jit(zero_step)`, so it
# runs whether or not your `zero_step` is jitted.

# %% tags=["claim:lab6-zero-memory-communication"]
if answered(zero_step, adam_update):
    zero_compiled = jax.jit(zero_step).lower(*step_shapes(P("data"))).compile()
    memory = zero_compiled.memory_analysis()
    zero_collectives = hlo_collectives(zero_compiled)
    print(f"ZeRO:       arguments {memory.argument_size_in_bytes / MiB:5.2f} MiB per device, "
          f"temporary {memory.temp_size_in_bytes / MiB:5.2f} MiB, collectives "
          f"{zero_collectives}, MiB sent {ring_mib(zero_collectives)} = "
          f"{sum(ring_mib(zero_collectives)):.3f}")
    print(f"replicated: arguments {replicated_arguments / MiB:5.2f} MiB per device, "
          f"temporary {replicated_temp / MiB:5.2f} MiB, collectives {replicated_collectives}, "
          f"MiB sent {ring_mib(replicated_collectives)} = {sum(ring_mib(replicated_collectives)):.3f}")

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
# 1. Computed naively, a score above about 88.7 already overflows float32 (the logarithm of
# float32's largest number, 3.4e38, is 88.72: `exp(88.8) = inf`) and the row becomes
# `inf / inf = nan`.
#
# The `(S, S)` score matrix is the problem: for `S = 128 000` tokens it is 65 GB in float32, per
# head. Long sequences never build it.

# %% tags=["claim:lab6-exp-overflow"]
S_DEMO, D_HEAD = 64, 16
att_q, att_k, att_v = jax.random.normal(jax.random.key(3), (3, S_DEMO, D_HEAD))
print("log of float32's largest number:", float(np.log(np.finfo(np.float32).max)))
for score in (88.7, 88.8, 89.0):
    print(f"exp({score}) in float32:", jnp.exp(jnp.float32(score)))
print("exp(89 - 89):", jnp.exp(jnp.float32(89.0) - jnp.float32(89.0)))

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
def test_q5_public(attention, att_q, att_k, att_v):
    """On the notebook's att_q, att_k, att_v (S = 64, d = 16): row 0 is v[0], row 1 the softmax
    of two scaled scores worked out by hand, the causal mask, and finite outputs with scores in
    the thousands."""
    import jaxlab_form as form
    import numpy as np

    RTOL, ATOL = 1e-4, 1e-5
    form.expect_callable("attention", form.evidence(attention))

    def attention_rows(fn, call, q, k, v):
        """fn(q, k, v) checked where causal softmax attention is simple to work out: row 0 is
        v[0] (query 0 sees key 0 only), row 1 weighs keys 0 and 1 by the softmax of their
        scaled scores, rows before S/2 do not change when later keys and values do, and the
        output stays finite with scores in the thousands."""
        S, d = q.shape

        def run(q, k, v, words=""):
            try:
                out = np.asarray(fn(q, k, v), np.float64)
            except Exception as exc:
                form.fail(f"`{call}`{words} raised {form.exception_line(exc)}; expected an "
                          f"array of shape ({S}, {d}).")
            if out.shape != (S, d):
                form.fail(f"`{call}`{words} returned an array of shape {out.shape}; expected "
                          f"({S}, {d}).")
            return out

        def softmax_row(scores, values):
            w = np.exp(scores - scores.max())
            return w / w.sum() @ values

        q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
        out = run(q, k, v)
        if not np.all(np.isfinite(out)):
            form.fail(f"`{call}` returns inf or nan; expected finite values.")
        if not np.allclose(out[0], v64[0], rtol=RTOL, atol=ATOL):
            form.fail(f"row 0 of `{call}` differs from v[0] by up to "
                      f"{np.max(np.abs(out[0] - v64[0])):.3g}; expected v[0]: query 0 may see "
                      "key 0 only (the causal mask: query i sees keys j <= i).")
        expected = softmax_row(q64[1] @ k64[:2].T / np.sqrt(d), v64[:2])
        if not np.allclose(out[1], expected, rtol=RTOL, atol=ATOL):
            if np.allclose(out[1], softmax_row(q64[1] @ k64[:2].T, v64[:2]), rtol=RTOL,
                           atol=ATOL):
                form.fail(f"row 1 of `{call}` is attention without scaling the scores: they "
                          "should be divided by sqrt(d) before the softmax.")
            form.fail(f"row 1 of `{call}` differs by up to "
                      f"{np.max(np.abs(out[1] - expected)):.3g} from what the steps of the text "
                      "give; expected the softmax-weighted mean of v[0] and v[1] with scores "
                      "q[1] @ k[:2].T / sqrt(d) (query 1 sees keys 0 and 1).")
        half = S // 2
        later = run(q, k.at[half:].multiply(-2.0), v.at[half:].add(1.0),
                    f" with the keys and values from position {half} on changed")
        if not np.allclose(later[:half], out[:half], rtol=RTOL, atol=ATOL):
            first = int(np.argmax(~np.all(np.isclose(later[:half], out[:half], rtol=RTOL,
                                                     atol=ATOL), axis=-1)))
            form.fail(f"row {first} of `{call}` changes when the keys and values at positions "
                      f"{half} and later change; expected the causal mask: query i sees only "
                      "keys j <= i.")
        large = run(100 * q, 100 * k, v, " with q and k times 100 (scores in the thousands)")
        if not np.all(np.isfinite(large)):
            first = int(np.argmax(~np.all(np.isfinite(large), axis=-1)))
            form.fail(f"with q and k times 100 (scores in the thousands), `{call}` returns inf "
                      f"or nan (first at query {first}); expected a numerically safe softmax: "
                      "subtract from each query's scores their maximum over the keys it may see "
                      "(apply the causal mask before taking it), so that exp neither overflows "
                      "(above 88.7) nor underflows to 0 for every key the query sees.")
        return out

    attention_rows(attention, "attention(att_q, att_k, att_v)", att_q, att_k, att_v)
    # any S and d: the notebook's arrays cut to their first 40 positions and 8 features
    attention_rows(attention, "attention(att_q[:40, :8], att_k[:40, :8], att_v[:40, :8])",
                   att_q[:40, :8], att_k[:40, :8], att_v[:40, :8])

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

# %% tags=["claim:lab6-attention-memory"]
S_LONG = 2048


def seq_shapes(S, d=D_HEAD, sharding=None):
    return [jax.ShapeDtypeStruct((S, d), jnp.float32, sharding=sharding)] * 3


# Row 1 by the steps above, worked out by hand: query 1 sees keys 0 and 1 only.
row_one_scores = np.asarray(att_q[1] @ att_k[:2].T) / np.sqrt(D_HEAD)
row_one_weights = np.exp(row_one_scores - row_one_scores.max())
row_one = row_one_weights / row_one_weights.sum() @ np.asarray(att_v[:2])

if answered(attention):
    att_out = attention(att_q, att_k, att_v)
    print("output", att_out.shape, " first row equals v[0]:", np.allclose(att_out[0], att_v[0]),
          " second row equals row_one (by hand):", np.allclose(att_out[1], row_one, atol=1e-5))
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
# One detail for the causal mask: a block where a query sees no key at all gives
# `exp(-inf - (-inf)) = nan` if it comes **before** every block where the query sees a key, so
# that the running maximum is still `-inf`. Coming later, it meets a finite maximum and adds
# `exp(-inf - m) = 0`: harmless. In the orders used here (keys in order, and in the ring below
# each device's own block first) every query's first block holds a key it sees, so `-inf` would
# work. Masking with a large finite negative number such as `-1e30` instead makes the result
# right in any order: an early fully masked block adds terms that the next real maximum
# multiplies by `exp(-1e30 - m) = 0`. One query's running sum `l`, for two blocks of two keys
# (one seen, one fully masked) in both orders:

# %% tags=["claim:lab6-mask-order"]
for mask in (-jnp.inf, -1e30):
    for order in ("the seen block first", "the masked block first"):
        blocks = [jnp.array([0.5, 2.0]), jnp.full((2,), mask)]
        m, l = jnp.float32(-jnp.inf), jnp.float32(0.0)
        for s in blocks if order == "the seen block first" else blocks[::-1]:
            m_new = jnp.maximum(m, s.max())
            l, m = jnp.exp(m - m_new) * l + jnp.exp(s - m_new).sum(), m_new
        print(f"mask {float(mask):g}, {order}: l = {float(l):.4f}")
print(f"exact: l = {float(jnp.exp(0.5 - 2.0) + 1):.4f}")

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
def test_q6_public(blocked_attention, att_q, att_k, att_v):
    """On the notebook's att_q, att_k, att_v (S = 64, d = 16), for blocks of 1, 8 and 64 keys,
    and on their first 40 positions and 8 features with blocks of 5: the rows of attention that
    are simple to work out (as for Task 5) and the same output for every block size; traced
    with blocks of 8 and of 1, one (64, block_size) score product per block and nothing of
    64 × 64 entries."""
    import math

    import jax
    import jaxlab_form as form
    import numpy as np

    RTOL, ATOL = 1e-4, 1e-5
    form.expect_callable("blocked_attention", form.evidence(blocked_attention))

    def attention_rows(fn, call, q, k, v):
        """fn(q, k, v) checked where causal softmax attention is simple to work out: row 0 is
        v[0] (query 0 sees key 0 only), row 1 weighs keys 0 and 1 by the softmax of their
        scaled scores, rows before S/2 do not change when later keys and values do, and the
        output stays finite with scores in the thousands."""
        S, d = q.shape

        def run(q, k, v, words=""):
            try:
                out = np.asarray(fn(q, k, v), np.float64)
            except Exception as exc:
                form.fail(f"`{call}`{words} raised {form.exception_line(exc)}; expected an "
                          f"array of shape ({S}, {d}).")
            if out.shape != (S, d):
                form.fail(f"`{call}`{words} returned an array of shape {out.shape}; expected "
                          f"({S}, {d}).")
            return out

        def softmax_row(scores, values):
            w = np.exp(scores - scores.max())
            return w / w.sum() @ values

        q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
        out = run(q, k, v)
        if not np.all(np.isfinite(out)):
            form.fail(f"`{call}` returns inf or nan; expected finite values.")
        if not np.allclose(out[0], v64[0], rtol=RTOL, atol=ATOL):
            form.fail(f"row 0 of `{call}` differs from v[0] by up to "
                      f"{np.max(np.abs(out[0] - v64[0])):.3g}; expected v[0]: query 0 may see "
                      "key 0 only (the causal mask: query i sees keys j <= i).")
        expected = softmax_row(q64[1] @ k64[:2].T / np.sqrt(d), v64[:2])
        if not np.allclose(out[1], expected, rtol=RTOL, atol=ATOL):
            if np.allclose(out[1], softmax_row(q64[1] @ k64[:2].T, v64[:2]), rtol=RTOL,
                           atol=ATOL):
                form.fail(f"row 1 of `{call}` is attention without scaling the scores: they "
                          "should be divided by sqrt(d) before the softmax.")
            form.fail(f"row 1 of `{call}` differs by up to "
                      f"{np.max(np.abs(out[1] - expected)):.3g} from what the steps of the text "
                      "give; expected the softmax-weighted mean of v[0] and v[1] with scores "
                      "q[1] @ k[:2].T / sqrt(d) (query 1 sees keys 0 and 1).")
        half = S // 2
        later = run(q, k.at[half:].multiply(-2.0), v.at[half:].add(1.0),
                    f" with the keys and values from position {half} on changed")
        if not np.allclose(later[:half], out[:half], rtol=RTOL, atol=ATOL):
            first = int(np.argmax(~np.all(np.isclose(later[:half], out[:half], rtol=RTOL,
                                                     atol=ATOL), axis=-1)))
            form.fail(f"row {first} of `{call}` changes when the keys and values at positions "
                      f"{half} and later change; expected the causal mask: query i sees only "
                      "keys j <= i.")
        large = run(100 * q, 100 * k, v, " with q and k times 100 (scores in the thousands)")
        if not np.all(np.isfinite(large)):
            first = int(np.argmax(~np.all(np.isfinite(large), axis=-1)))
            form.fail(f"with q and k times 100 (scores in the thousands), `{call}` returns inf "
                      f"or nan (first at query {first}); expected a numerically safe softmax: "
                      "subtract from each query's scores their maximum over the keys it may see "
                      "(apply the causal mask before taking it), so that exp neither overflows "
                      "(above 88.7) nor underflows to 0 for every key the query sees.")
        return out

    S = att_q.shape[0]
    outputs = {}
    for block in (S, 8, 1):
        outputs[block] = attention_rows(lambda q, k, v: blocked_attention(q, k, v, block),
                                        f"blocked_attention(att_q, att_k, att_v, {block})",
                                        att_q, att_k, att_v)
        if not np.allclose(outputs[block], outputs[S], rtol=RTOL, atol=ATOL):
            form.fail(f"`blocked_attention(att_q, att_k, att_v, {block})` differs from "
                      f"`blocked_attention(att_q, att_k, att_v, {S})` (one block of all {S} keys) "
                      f"by up to {np.max(np.abs(outputs[block] - outputs[S])):.3g}; expected the "
                      "same causal attention for every block size (rescale the running sum and "
                      "output when the maximum grows, and mask with positions in the whole "
                      "sequence).")
    # any S and d: the notebook's arrays cut to their first 40 positions and 8 features
    attention_rows(lambda q, k, v: blocked_attention(q, k, v, 5),
                   "blocked_attention(att_q[:40, :8], att_k[:40, :8], att_v[:40, :8], 5)",
                   att_q[:40, :8], att_k[:40, :8], att_v[:40, :8])

    def walk(jaxpr, times, block, big, scores):
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                shape = tuple(var.aval.shape)
                if len(shape) >= 2 and math.prod(shape) >= S * S and "float" in str(
                        var.aval.dtype):
                    big.append(shape)
            if eqn.primitive.name == "dot_general" and \
                    tuple(eqn.outvars[0].aval.shape) == (S, block):
                scores.append(times)
            inner_times = (None if eqn.primitive.name == "while" or times is None else
                           times * eqn.params["length"] if eqn.primitive.name == "scan" else
                           times)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner, inner_times, block, big, scores)

    for block in (8, 1):
        try:
            closed = jax.make_jaxpr(lambda q, k, v: blocked_attention(q, k, v, block))(
                att_q, att_k, att_v)
        except Exception as exc:
            form.fail(f"`blocked_attention(att_q, att_k, att_v, {block})` could not be traced "
                      f"with jax.make_jaxpr: {form.exception_line(exc)}; expected a function "
                      "jax.make_jaxpr can trace (the checks read its score blocks that way).")
        big, scores = [], []
        walk(closed.jaxpr, 1, block, big, scores)
        if big:
            form.fail(f"traced for S = {S} and block_size = {block}, `blocked_attention` builds "
                      f"an array of shape {big[0]} (at least S × S = {S * S} entries); expected "
                      f"each block's scores of shape ({S}, {block}) and nothing of S × S "
                      "entries.")
        if None in scores:
            form.fail("`blocked_attention` computes its scores inside a while loop, whose number "
                      "of steps cannot be read from the traced program; expected a loop of a "
                      "fixed number of steps over the blocks (a Python for loop, lax.fori_loop "
                      "with fixed bounds, or lax.scan).")
        if sum(scores) != S // block:
            form.fail(f"traced for S = {S} and block_size = {block}, `blocked_attention` "
                      f"computes {sum(scores)} score block(s) of shape ({S}, {block}); expected "
                      f"one per block of keys, {S // block}: a single pass over the blocks with "
                      "a running maximum and sum.")

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
def largest_array(fn, *args):
    """The shape of the largest array fn's traced program builds (nested programs, such as a
    jax.jit or a loop's body, included)."""
    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            yield from (tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars)
            for param in eqn.params.values():
                for sub in (param if isinstance(param, (tuple, list)) else (param,)):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        yield from walk(sub)
    return max(walk(jax.make_jaxpr(fn)(*args).jaxpr), key=math.prod, default=())


def products_of_shape(fn, shape, *args):
    """How many matrix products of this output shape fn's traced program computes, a loop's body
    counted once per step (None inside a while loop, whose number of steps is not in the
    program)."""
    def walk(jaxpr, times):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general" and eqn.outvars[0].aval.shape == shape:
                yield times
            inner = times
            if eqn.primitive.name == "scan":
                inner = None if times is None else times * eqn.params["length"]
            elif eqn.primitive.name == "while":
                inner = None
            for param in eqn.params.values():
                for sub in (param if isinstance(param, (tuple, list)) else (param,)):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        yield from walk(sub, inner)
    counts = list(walk(jax.make_jaxpr(fn)(*args).jaxpr, 1))
    return None if None in counts else sum(counts)


if answered(blocked_attention, attention):
    for block_size in (1, 8, S_DEMO):
        blocked = blocked_attention(att_q, att_k, att_v, block_size)
        same = np.allclose(blocked, attention(att_q, att_k, att_v), atol=1e-5)
        traced = (lambda q, k, v: blocked_attention(q, k, v, block_size), att_q, att_k, att_v)
        biggest = largest_array(*traced)
        score_blocks = products_of_shape(traced[0], (S_DEMO, block_size), *traced[1:])
        finite = bool(jnp.isfinite(blocked_attention(100 * att_q, 100 * att_k, att_v,
                                                     block_size)).all())
        print(f"block size {block_size:2d}: equals attention: {same!s:5}  second row equals "
              f"row_one: {np.allclose(blocked[1], row_one, atol=1e-5)!s:5}  finite for "
              f"100 q, 100 k: {finite!s:5}  largest array: {' × '.join(map(str, biggest))}  "
              f"score blocks computed: {'?' if score_blocks is None else score_blocks} "
              f"(one pass: {S_DEMO // block_size})")
    print(f"(S × S is {S_DEMO} × {S_DEMO}: the task allows no array that large below a block "
          f"size of {S_DEMO})")


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
# online softmax. No device ever holds all `S` keys: besides its own block, it holds the key and
# value block it is using and the pair arriving from its neighbour, and its scores are `b × b`
# (the memory is measured after Task 7). A production ring sends the next block while it
# computes with the current one: the transfer hides behind the computation when a block's
# attention takes longer than its transfer, which needs blocks large enough for the chips'
# FLOP/s and link bandwidth (Liu, Zaharia and Abbeel, *Ring Attention with Blockwise
# Transformers*, 2023, work out how large), and a compiler that runs the `ppermute`
# asynchronously. On CPU, as here, nothing overlaps: the compiled program's
# `collective-permute`s are synchronous (no `-start`/`-done` pair, counted after Task 7).
#
# The causal mask needs **global** positions: at step `t` (`t = 0` before any move) device `i`
# holds the block that started on device `(i - t) mod n`, whose keys are at positions
# `((i - t) mod n)·b + 0, …, b - 1`; its own queries are at `i·b + 0, …, b - 1`.
# `jax.lax.axis_index('seq')` gives `i`. Blocks from later devices are entirely masked. They
# reach a device after its own block, where each of its queries sees at least the block's first
# key, so the running maximum is finite by then and even `-inf` masking gives no `nan` here;
# with `-1e30` the order does not matter at all.
#
# ### Loops inside `shard_map`, and `pcast`
#
# Inside `shard_map` JAX tracks, for every value, whether it can differ between devices
# ("varying" over an axis) or is the same on all of them. A loop (`lax.fori_loop`, `lax.scan`)
# must hand its body a carry of the **same** kind as the body returns. A carry started as
# `jnp.zeros(...)` is the same on every device, but after one step it depends on the device's
# data, so the loop refuses it.
#
# `jax.typeof` shows which kind a value is: in a printed type, `{V:seq}` marks a value that
# varies over `seq`; a type without it is the same on every device. Inside a `shard_map`
# over `seq`:

# %% tags=["claim:lab6-vma-types"]
mesh_seq = jax.make_mesh((N_DEVICES,), ("seq",), axis_types=(AxisType.Auto,), devices=devices)


def print_types(block):
    print("block:                  ", jax.typeof(block))
    print("jnp.zeros(block.shape): ", jax.typeof(jnp.zeros(block.shape)))
    print("jnp.zeros_like(block):  ", jax.typeof(jnp.zeros_like(block)))
    print("pcast(..., to='varying'):",
          jax.typeof(lax.pcast(jnp.zeros(block.shape), "seq", to="varying")))
    return block


jax.shard_map(print_types, mesh=mesh_seq, in_specs=P("seq"), out_specs=P("seq"))(
    jnp.arange(16.0));

# %% [markdown]
# A carry started as `jnp.zeros(...)` has the type without `{V:seq}`; after one step it has
# the type with it. The error says what to do:

# %%
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
# value blocks travel around the ring with `ppermute` over `'seq'`, as above (device `j` sends
# to `j + 1`, the last to device 0, every step), **`n - 1` moves** of each (the last block
# needs no move), no `all_gather` and no array holding all `S` keys; each block
# is folded in with the online softmax, the causal mask taken from global positions. It must
# equal `attention` for any `S` divisible by 8 (one position per device too) and any `d`, and
# its compiled temporary memory per device must be far below what `attention` needs on one
# device: under 10% of it at `S = 1024` and `d = 16`, the sizes the hidden check compiles (the
# lab's own ring needs about 1% there). That holds for long sequences only: at `S = 32` and
# `d = 16` the blocks a device holds and receives weigh more than the scores the ring saves.

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
def test_q7_public(ring_attention, attention, mesh_seq, att_q, att_k, att_v):
    """On the notebook's att_q, att_k, att_v split by rows over 'seq' (8 positions a device):
    the rows of attention that are simple to work out (as for Task 5), the whole output against
    your attention where that passes its own public check, the result split by rows, and in the
    traced program a shard_map with no all_gather and no array of all 64 positions, whose
    ppermutes move the key and value blocks n - 1 = 7 times each around the ring."""
    import math

    import jax
    import jaxlab_form as form
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    RTOL, ATOL = 1e-4, 1e-5
    form.expect_callable("ring_attention", form.evidence(ring_attention))

    def attention_rows(fn, call, q, k, v):
        """fn(q, k, v) checked where causal softmax attention is simple to work out: row 0 is
        v[0] (query 0 sees key 0 only), row 1 weighs keys 0 and 1 by the softmax of their
        scaled scores, rows before S/2 do not change when later keys and values do, and the
        output stays finite with scores in the thousands."""
        S, d = q.shape

        def run(q, k, v, words=""):
            try:
                out = np.asarray(fn(q, k, v), np.float64)
            except Exception as exc:
                form.fail(f"`{call}`{words} raised {form.exception_line(exc)}; expected an "
                          f"array of shape ({S}, {d}).")
            if out.shape != (S, d):
                form.fail(f"`{call}`{words} returned an array of shape {out.shape}; expected "
                          f"({S}, {d}).")
            return out

        def softmax_row(scores, values):
            w = np.exp(scores - scores.max())
            return w / w.sum() @ values

        q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
        out = run(q, k, v)
        if not np.all(np.isfinite(out)):
            form.fail(f"`{call}` returns inf or nan; expected finite values.")
        if not np.allclose(out[0], v64[0], rtol=RTOL, atol=ATOL):
            form.fail(f"row 0 of `{call}` differs from v[0] by up to "
                      f"{np.max(np.abs(out[0] - v64[0])):.3g}; expected v[0]: query 0 may see "
                      "key 0 only (the causal mask: query i sees keys j <= i).")
        expected = softmax_row(q64[1] @ k64[:2].T / np.sqrt(d), v64[:2])
        if not np.allclose(out[1], expected, rtol=RTOL, atol=ATOL):
            if np.allclose(out[1], softmax_row(q64[1] @ k64[:2].T, v64[:2]), rtol=RTOL,
                           atol=ATOL):
                form.fail(f"row 1 of `{call}` is attention without scaling the scores: they "
                          "should be divided by sqrt(d) before the softmax.")
            form.fail(f"row 1 of `{call}` differs by up to "
                      f"{np.max(np.abs(out[1] - expected)):.3g} from what the steps of the text "
                      "give; expected the softmax-weighted mean of v[0] and v[1] with scores "
                      "q[1] @ k[:2].T / sqrt(d) (query 1 sees keys 0 and 1).")
        half = S // 2
        later = run(q, k.at[half:].multiply(-2.0), v.at[half:].add(1.0),
                    f" with the keys and values from position {half} on changed")
        if not np.allclose(later[:half], out[:half], rtol=RTOL, atol=ATOL):
            first = int(np.argmax(~np.all(np.isclose(later[:half], out[:half], rtol=RTOL,
                                                     atol=ATOL), axis=-1)))
            form.fail(f"row {first} of `{call}` changes when the keys and values at positions "
                      f"{half} and later change; expected the causal mask: query i sees only "
                      "keys j <= i.")
        large = run(100 * q, 100 * k, v, " with q and k times 100 (scores in the thousands)")
        if not np.all(np.isfinite(large)):
            first = int(np.argmax(~np.all(np.isfinite(large), axis=-1)))
            form.fail(f"with q and k times 100 (scores in the thousands), `{call}` returns inf "
                      f"or nan (first at query {first}); expected a numerically safe softmax: "
                      "subtract from each query's scores their maximum over the keys it may see "
                      "(apply the causal mask before taking it), so that exp neither overflows "
                      "(above 88.7) nor underflows to 0 for every key the query sees.")
        return out

    rows = NamedSharding(mesh_seq, P("seq"))
    ring = jax.jit(ring_attention)
    placed = lambda q, k, v: ring(*(jax.device_put(a, rows) for a in (q, k, v)))  # noqa: E731
    call = "ring_attention(att_q, att_k, att_v)"
    out = attention_rows(placed, call, att_q, att_k, att_v)
    # any S divisible by 8 and any d: the notebook's arrays cut to 32 positions and 8 features
    attention_rows(placed, "ring_attention(att_q[:32, :8], att_k[:32, :8], att_v[:32, :8])",
                   att_q[:32, :8], att_k[:32, :8], att_v[:32, :8])
    try:
        reference = attention_rows(attention, "attention", att_q, att_k, att_v)
    except AssertionError:
        reference = None  # attention fails its own check: Task 5's public check says why
    if reference is not None and not np.allclose(out, reference, rtol=RTOL, atol=ATOL):
        first = int(np.argmax(~np.all(np.isclose(out, reference, rtol=RTOL, atol=ATOL),
                                      axis=-1)))
        form.fail(f"`{call}` differs from your attention(att_q, att_k, att_v) from row {first} on "
                  f"(device {first // (len(out) // 8)}'s queries), by up to "
                  f"{np.max(np.abs(out - reference)):.3g}; expected the same causal attention: "
                  "at step t device i holds the block that started on device (i - t) mod n, "
                  "whose keys are at positions ((i - t) mod n)·b + 0, …, b - 1.")
    result = placed(att_q, att_k, att_v)
    sharding = getattr(result, "sharding", None)
    if not isinstance(sharding, NamedSharding) or not sharding.is_equivalent_to(rows, 2):
        form.fail(f"`{call}` returns an array laid out as "
                  f"{getattr(sharding, 'spec', sharding)}; expected it split by rows over 'seq' "
                  "like q (out_specs=P('seq')).")
    S, d = att_q.shape
    b = S // 8
    try:
        closed = jax.make_jaxpr(ring_attention)(att_q, att_k, att_v)
    except Exception as exc:
        form.fail(f"`{call}` could not be traced with jax.make_jaxpr: "
                  f"{form.exception_line(exc)}; expected a function jax.make_jaxpr can trace (the "
                  "checks read its collectives that way).")
    seen, whole, moves = set(), [], []

    def walk(jaxpr, times, inside):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            seen.add(name if inside else "outside " + name)
            if inside:
                whole.extend(tuple(v.aval.shape) for v in eqn.outvars
                             if len(v.aval.shape) >= 2 and S in v.aval.shape)
            if name == "ppermute":
                moves.append((times, sum(math.prod(v.aval.shape) for v in eqn.invars),
                              eqn.params.get("axis_name"), eqn.params.get("perm")))
            inner_times = (None if name == "while" or times is None else
                           times * eqn.params["length"] if name == "scan" else times)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner, inner_times, inside or name == "shard_map")

    walk(closed.jaxpr, 1, False)
    if "outside shard_map" not in seen:
        form.fail("`ring_attention` does not go through jax.shard_map; expected the per-device "
                  "program written with jax.shard_map on mesh_seq.")
    if seen & {"all_gather", "all_gather_invariant"}:
        form.fail("`ring_attention` uses all_gather; expected the key and value blocks to travel "
                  "around the ring with ppermute, one block at a time.")
    if whole:
        form.fail(f"traced for S = {S}, `ring_attention` builds an array of shape {whole[0]} on "
                  f"each device, holding all {S} positions; expected each device to hold one "
                  f"block of {b} keys and values at a time.")
    if any(times is None for times, *_ in moves):
        form.fail("`ring_attention` moves its blocks inside a while loop, whose number of steps "
                  "cannot be read from the traced program; expected a loop of a fixed number of "
                  "steps (a Python for loop, lax.fori_loop with fixed bounds, or lax.scan).")
    for _, _, axes, perm in moves:
        shifts = {(dst - src) % 8 for src, dst in perm or ()}
        if tuple(np.atleast_1d(axes)) != ("seq",) or len(perm or ()) != 8 or shifts != {1}:
            form.fail(f"`ring_attention` runs a ppermute over {axes!r} with perm {perm}; expected "
                      "the text's ring over 'seq': every device j sending to j + 1, the last to "
                      "device 0, at every step.")
    moved = sum(times * size for times, size, *_ in moves)
    if moved != 2 * 7 * b * d:
        form.fail(f"traced for S = {S} and d = {d}, `ring_attention` moves {moved} numbers per "
                  f"device with ppermute ({moved / (b * d):g} blocks of {b} × {d}); expected the "
                  f"key block and the value block 7 times each (n - 1 moves: the last block needs "
                  f"none), {2 * 7 * b * d} numbers.")

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
def moved_by_ppermute(loss_fn, *args):
    """(primitive names in the traced program, numbers one device sends with ppermute): each
    ppermute counted as often as its loop runs; None for a loop of unknown length (while)."""
    names, moved = set(), 0

    def walk(jaxpr, times):
        nonlocal moved
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            if eqn.primitive.name == "ppermute":
                size = sum(math.prod(v.aval.shape) for v in eqn.invars)
                moved = None if times is None or moved is None else moved + times * size
            inner_times = (times * eqn.params["length"] if eqn.primitive.name == "scan"
                           and times is not None else None if eqn.primitive.name == "while"
                           else times)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner, inner_times)

    walk(jax.make_jaxpr(loss_fn)(*args).jaxpr, 1)
    return names, moved


if answered(ring_attention, attention):
    rows = NamedSharding(mesh_seq, P("seq"))
    ring_out = jax.jit(ring_attention)(*(jax.device_put(a, rows) for a in (att_q, att_k, att_v)))
    print("equals attention:", np.allclose(ring_out, attention(att_q, att_k, att_v), atol=1e-5),
          " second row equals row_one (by hand):", np.allclose(ring_out[1], row_one, atol=1e-5))
    names, moved = moved_by_ppermute(ring_attention, att_q, att_k, att_v)
    block = S_DEMO // N_DEVICES * D_HEAD
    print(f"numbers one device sends with ppermute: {moved} = "
          f"{moved / block if moved is not None else '?'} blocks of {S_DEMO // N_DEVICES} × "
          f"{D_HEAD} (the keys and the values n - 1 = {N_DEVICES - 1} times each: "
          f"{2 * (N_DEVICES - 1)} blocks);  all_gather: {'all_gather' in names}")

# %% [markdown]
# Its memory at `S = 2048`, against `attention` on one device, and what the temporary memory of
# one device holds: the `b × b` scores and a few blocks of `b × d` (the one in use and the one
# arriving, for keys and for values), never all `S` keys. And the compiled program's
# `collective-permute`s: synchronous on CPU (a `-start`/`-done` pair would let the transfer
# overlap the computation).

# %% tags=["claim:lab6-ring-memory", "claim:lab6-ring-sync-on-cpu"]
if answered(ring_attention, attention):
    ring_compiled = jax.jit(ring_attention).lower(*seq_shapes(S_LONG, sharding=rows)).compile()
    ring_temp = ring_compiled.memory_analysis().temp_size_in_bytes
    b = S_LONG // N_DEVICES
    print(f"S = {S_LONG}: temporary memory per device {ring_temp / MiB:.3f} MiB (ring) against "
          f"{attention_temp / MiB:.2f} MiB (attention on one device): "
          f"{ring_temp / attention_temp:.1%}")
    print(f"of which the {b} × {b} scores: {b * b * 4 / MiB:.3f} MiB, the rest "
          f"{(ring_temp - b * b * 4) / (b * D_HEAD * 4):.1f} blocks of {b} × {D_HEAD}; all "
          f"{S_LONG} keys would be {S_LONG * D_HEAD * 4 / MiB:.3f} MiB")
    text = ring_compiled.as_text()
    print("collective-permute in the compiled program:",
          len(re.findall(r" collective-permute\(", text)), " as -start/-done pairs:",
          len(re.findall(r" collective-permute-start\(", text)))

# %% [markdown]
# ## Part D: the cost model
#
# ### FLOPs and bytes of a compiled program
#
# A matrix product `A @ B` of `A` of shape `(I, J)` and `B` of shape `(J, K)` costs `2·I·J·K`
# floating-point operations (a multiply and an add per term). `.cost_analysis()['flops']` of a
# compiled program reads the same count; for a program compiled over several devices it is the
# count **of one device** (the cases below). The collectives the program runs are in its text,
# read with `hlo_collectives` as in Part B.

# %%
I_DEMO, J_DEMO, K_DEMO = 512, 1024, 256
A_spec = jax.ShapeDtypeStruct((I_DEMO, J_DEMO), jnp.float32)
B_spec = jax.ShapeDtypeStruct((J_DEMO, K_DEMO), jnp.float32)
one_device = jax.jit(jnp.matmul).lower(A_spec, B_spec).compile()
print(f"one device: {one_device.cost_analysis()['flops']:.4g} FLOPs, "
      f"2·I·J·K = {2 * I_DEMO * J_DEMO * K_DEMO:.4g}")

# %% [markdown]
# ### A sharded product, four ways
#
# The scaling book (*How to Scale Your Model*, Part 3, ["Sharded Matrices and How to Multiply
# Them"](https://jax-ml.github.io/scaling-book/sharding/)) writes a layout as `A[I_X, J]`:
# `A`'s rows are split over mesh axis `X`, its columns are not. It sorts sharded products into
# four cases by where the contracting dimension `J` is split: its Case 1, neither input split
# along `J`; Case 2, one input split along `J` (it is all-gathered); Case 3, both split along
# `J` (partial sums, then an all-reduce or a reduce-scatter); Case 4, both split along a
# non-contracting dimension over the same axis (one is all-gathered first). This lab's table
# numbers four programs 1 to 4 (Task 8 uses these numbers); the last column gives the book's
# case of each. The book's Case 2 comes in the next cell, where the compiler chooses the program.
# With `n` devices on the axis `x`, written with `shard_map`:
#
# | case | layout | what each device does | scaling book |
# |---|---|---|---|
# | 1 | `A[I_X, J] · B[J, K] → C[I_X, K]` | multiplies its rows of `A` by `B`: no communication | Case 1 |
# | 2 | `A[I_X, J] · B[J, K_X] → C[I_X, K]` | needs all of `B`: **all-gathers** `B`, then multiplies its rows | Case 4 |
# | 3 | `A[I, J_X] · B[J_X, K] → C[I, K]` | multiplies its columns of `A` by its rows of `B`: a partial sum of all of `C`; the partial sums are **all-reduced** | Case 3 |
# | 4 | `A[I, J_X] · B[J_X, K] → C[I_X, K]` | the same partial sums, but each device keeps only its rows of `C`: a **reduce-scatter** | Case 3 |
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

# %% tags=["claim:lab6-flops-per-device", "claim:lab6-allreduce-flops"]
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
    flops = compiled.cost_analysis()["flops"]
    print(f"case {case}: {flops:.4g} FLOPs per device "
          f"({flops / one_device.cost_analysis()['flops']:.4f} of the one-device product's; "
          f"{flops - one_device.cost_analysis()['flops'] / N_DEVICES:g} more than 1/{N_DEVICES} "
          f"of it), collectives {hlo_collectives(compiled)}")
print(f"I·K = {I_DEMO * K_DEMO}")

# %% [markdown]
# (The compiler also counts the additions an all-reduce does, `I·K` of them: a small extra over
# the product's FLOPs, case 3's.)
#
# Left to itself, the compiler chooses such a program from the layouts alone. Given `A[I, J_X]`
# and a replicated `B`, with `C` wanted replicated (the book's Case 2), it can all-gather `A`
# (`4·I·J·(n-1)/n` bytes sent per device) or all-reduce partial sums of `C` (`2·4·I·K·(n-1)/n`).
# Measured on CPU with JAX 0.10.2, it picks by comparing the sizes of `A` and `C`: the
# all-reduce while `C` is the smaller (`K < J`), the all-gather otherwise. That is not always
# the choice that moves fewer bytes: an all-reduce moves twice its array, so for `J/2 < K < J`
# the all-reduce it picks moves more than the all-gather would (the last line):

# %% tags=["claim:lab6-auto-product-choice"]
def auto_product(I, J, K):
    mesh = jax.make_mesh((N_DEVICES,), ("x",), axis_types=(AxisType.Auto,), devices=devices)
    a = jax.ShapeDtypeStruct((I, J), jnp.float32, sharding=NamedSharding(mesh, P(None, "x")))
    b = jax.ShapeDtypeStruct((J, K), jnp.float32, sharding=NamedSharding(mesh, P()))
    replicated = NamedSharding(mesh, P())
    return jax.jit(jnp.matmul, out_shardings=replicated).lower(a, b).compile()


for I, J, K in ((512, 1024, 64), (512, 64, 1024), (512, 256, 192)):
    gather, reduce = (4 * I * J * (N_DEVICES - 1) / N_DEVICES / MiB,
                      2 * 4 * I * K * (N_DEVICES - 1) / N_DEVICES / MiB)
    print(f"A ({I}, {J}), C ({I}, {K}): {hlo_collectives(auto_product(I, J, K))}; an "
          f"all-gather of A would send {gather:.3f} MiB, an all-reduce of C {reduce:.3f} MiB")

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
# * `flops`: the FLOPs of the matrix product **one device** computes (a number): the product's
#   alone, without the additions of the all-reduce that `cost_analysis()` also counts in case 3;
# * `comm_bytes`: the bytes one device sends in the case's collective, by the rules above (a
#   number; 0 when there is none);
# * `collective`: the collective, named as in XLA's program: `"all-gather"`, `"reduce-scatter"`,
#   `"all-reduce"` or `"none"`.
#
# The check compiles the case's program (`compile_case`) for new sizes and numbers of devices
# (from 2 to 8), and compares your numbers with its `cost_analysis()` (less an all-reduce's
# additions) and with the collective in its HLO.

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
def test_q8_public(matmul_costs, compile_case, hlo_collectives, I_DEMO, J_DEMO, K_DEMO,
                   N_DEVICES):
    """At the notebook's sizes (I_DEMO, J_DEMO, K_DEMO) on N_DEVICES and on 4 devices: each
    case's FLOPs against its compiled program's cost_analysis() (less an all-reduce's I·K
    additions), its collective against the program's HLO, and the bytes sent by the table's
    rules for that collective."""
    import math
    import numbers

    import jaxlab_form as form

    NAMES = ("none", "all-gather", "reduce-scatter", "all-reduce")
    form.expect_callable("matmul_costs", form.evidence(matmul_costs))
    I, J, K = I_DEMO, J_DEMO, K_DEMO
    for n in (N_DEVICES, 4):
        for case in (1, 2, 3, 4):
            call = f"matmul_costs({case}, {I}, {J}, {K}, {n})"
            try:
                result = matmul_costs(case, I, J, K, n)
            except Exception as exc:
                form.fail(f"`{call}` raised {form.exception_line(exc)}; expected a tuple "
                          "(flops, comm_bytes, collective).")
            if type(result) not in (tuple, list) or len(result) != 3:
                form.fail(f"`{call}` returned {form.describe(form.evidence(result))}; expected "
                          "a tuple (flops, comm_bytes, collective).")
            flops, comm_bytes, collective = result
            compiled = compile_case(case, I, J, K, n)
            found = hlo_collectives(compiled)
            kind = found[0][1] if found else "none"
            if collective != kind:
                form.fail(f"`{call}` names the collective {collective!r}; expected {kind!r}, the "
                          f"one compile_case({case}, …, {n})'s program runs (the names are "
                          f"{', '.join(map(repr, NAMES))}).")
            shape = [int(x) for x in found[0][0].split("[")[1].split("]")[0].split(",") if x] \
                if found else []
            cost = compiled.cost_analysis()["flops"]
            additions = math.prod(shape) if kind == "all-reduce" else 0
            if isinstance(flops, bool) or not isinstance(flops, numbers.Real) or \
                    not math.isclose(flops, cost - additions, rel_tol=1e-9):
                also = (f", of which {additions} are the all-reduce's additions (I·K), not the "
                        "product's" if additions else "")
                form.fail(f"`{call}` says one device does {flops!r} FLOPs; the compiled "
                          f"program's cost_analysis() says {cost:.6g}{also}; expected the FLOPs "
                          f"of the product one device computes, {cost - additions:.6g}.")
            size = 4 * math.prod(shape) if found else 0
            expected = {"none": 0, "all-gather": (n - 1) / n * size,
                        "reduce-scatter": (n - 1) * size,  # the result is one device's block
                        "all-reduce": 2 * (n - 1) / n * size}[kind]
            if isinstance(comm_bytes, bool) or not isinstance(comm_bytes, numbers.Real) or \
                    not math.isclose(comm_bytes, expected, rel_tol=1e-9, abs_tol=1e-9):
                what = (f"the compiled program's {kind} has result {found[0][0]}, and the "
                        "table's rule for it gives that many bytes per device" if found else
                        "the compiled program runs no collective")
                form.fail(f"`{call}` says one device sends {comm_bytes!r} bytes; expected "
                          f"{expected:.6g}: {what}.")

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
# `hbm_bytes_per_s` and sends to another chip at `link_bytes_per_s` (here one link in one
# direction; the scaling book times collectives with both directions of a ring, which halves
# the time). A step that does `F` FLOPs,
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
def test_q9_public(roofline_time, critical_batch, CHIPS, matmul_intensity):
    """On the notebook's CHIPS: steps whose compute, memory and communication times are known
    (each the largest once, and one without links), and the critical batch of the notebook's
    (B, 8192) × (8192, 8192) product checked with matmul_intensity (compute-bound there, not one
    smaller), and None for (B, 64) × (64, 64)."""
    import math
    import numbers

    import jaxlab_form as form

    form.expect_callable("roofline_time", form.evidence(roofline_time))
    form.expect_callable("critical_batch", form.evidence(critical_batch))
    chip = CHIPS["TPU v5e"]
    rates = ("flop_per_s", "hbm_bytes_per_s", "link_bytes_per_s")
    for times, bound in (((2e-3, 1e-3, 5e-4), "compute"), ((1e-4, 3e-3, 2e-3), "memory"),
                         ((1e-3, 2e-3, 4e-3), "communication"), ((5e-4, 2e-3, 0.0), "memory")):
        flops, hbm, comm = (t * chip[r] for t, r in zip(times, rates))
        call = f"roofline_time({flops:.4g}, {hbm:.4g}, {comm:.4g}, CHIPS['TPU v5e'])"
        try:
            result = roofline_time(flops, hbm, comm, chip)
        except Exception as exc:
            form.fail(f"`{call}` raised {form.exception_line(exc)}; expected a tuple (seconds, "
                      "bound).")
        if type(result) not in (tuple, list) or len(result) != 2:
            form.fail(f"`{call}` returned {form.describe(form.evidence(result))}; expected a "
                      "tuple (seconds, bound).")
        seconds, name = result
        words = (f"its compute, memory and communication times are {times[0]:g}, {times[1]:g} "
                 f"and {times[2]:g} s")
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or \
                not math.isclose(float(seconds), max(times), rel_tol=1e-9):
            extra = (" That is the sum of the three times; with perfect overlap the step takes "
                     "the largest." if isinstance(seconds, numbers.Real) and
                     math.isclose(float(seconds), sum(times), rel_tol=1e-9) else "")
            form.fail(f"`{call}` is {seconds!r} s; {words}, so expected {max(times):g} s, the "
                      f"largest.{extra}")
        if type(seconds) not in (int, float):
            form.fail(f"`{call}` returned its seconds as a {type(seconds).__name__} "
                      f"({seconds:g}); the value is right, but expected a plain Python number, "
                      "as the task says (convert with float()).")
        if name != bound:
            form.fail(f"`{call}` names the bound {name!r}; {words}, so expected {bound!r}, the "
                      "resource whose time is largest.")
    for chip_name, chip in CHIPS.items():
        critical = chip["flop_per_s"] / chip["hbm_bytes_per_s"]
        call = f"critical_batch(8192, 8192, CHIPS[{chip_name!r}])"
        try:
            B = critical_batch(8192, 8192, chip)
        except Exception as exc:
            form.fail(f"`{call}` raised {form.exception_line(exc)}; expected an int.")
        if isinstance(B, bool) or not isinstance(B, numbers.Real) or not float(B).is_integer() \
                or B < 1 or matmul_intensity(B, 8192, 8192) < critical or (
                    B > 1 and matmul_intensity(B - 1, 8192, 8192) >= critical):
            form.fail(f"`{call}` is {B!r}; expected the smallest batch size B (at least 1) whose "
                      "product is compute-bound, its intensity matmul_intensity(B, 8192, 8192) at "
                      f"least the chip's critical intensity {critical:.6g} (and that of B - 1 "
                      "below it).")
        if type(B) is not int:
            form.fail(f"`{call}` returned {B!r}, a {type(B).__name__}; the value is right, but "
                      "expected an int, a plain Python number, as the task says (convert with "
                      "int()).")
        call = f"critical_batch(64, 64, CHIPS[{chip_name!r}])"
        try:
            never = critical_batch(64, 64, chip)
        except Exception as exc:
            form.fail(f"`{call}` raised {form.exception_line(exc)}; expected None.")
        if never is not None:
            form.fail(f"`{call}` is {never!r}; expected None: the intensity of (B, 64) × (64, 64) "
                      f"never reaches the chip's critical intensity {critical:.6g}, however large "
                      "B is.")

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
