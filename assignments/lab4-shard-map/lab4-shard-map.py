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
# name: lab4-shard-map
# environment: environment.yml
# files:
#   - jaxlab_form.py
# autograder_files:
#   - jaxlab_lab4.py
# tests:
#   ok_format: false
# export_cell:
#   pdf: false
#   instructions: "Upload the zip file this cell makes to the course's submission page. On Google Colab, which cannot make the zip, this cell instead tells you to submit the notebook itself: *File → Download → Download .ipynb*, then upload that file."
# check_all_cell: false

# %% [markdown]
# # Lab 4: Manual parallelism with `jax.shard_map` and collectives
#
# Lab 3 ended with one data-parallel layer written by hand with `jax.shard_map`. This lab goes on
# from there: you write the per-device program yourself and decide which **collective**
# (communication between devices) it needs. It follows the JAX guides on
# [`shard_map`](https://docs.jax.dev/en/latest/notebooks/shard_map.html) and on parallel
# evaluation, in four parts:
#
# * **A.** collectives with named axes, under `jax.vmap` and under `jax.shard_map`;
# * **B.** matrix multiplication over 8 devices with `all_gather`, `psum_scatter` and `ppermute`
#   rings;
# * **C.** data-parallel, fully sharded (FSDP) and tensor-parallel losses of a small MLP, whose
#   gradients must equal the single-device ones;
# * **D.** data-parallel training of a linear regression, with `jax.shard_map` replacing the
#   legacy `jax.pmap`.
#
# ## How this lab works
#
# * Every task has one cell that starts with `### Your code here`. Replace the `...` with your
#   answer (usually a `def`) and run it. The cell after it, `grader.check("q…")`, runs the public
#   checks, which only test the form of the answer. Hidden checks run when your notebook is
#   graded: they call your functions on **new random inputs**, compare losses and gradients with
#   the single-device versions, and read the program your function traces (`jax.make_jaxpr`) to
#   see which collectives it uses. So use the collective each task names, and avoid the one it
#   rules out.
# * Do not rename the variables a task asks for, and do not reuse their names later on.
# * Run the notebook from the top (*Kernel → Restart & Run All*) before you submit.

# %% [markdown]
# ## Setup: eight devices
#
# As in Lab 3, the next cell must run **before any other JAX code**. It asks for 8 simulated CPU
# devices (unless the runtime has 8 or more accelerators) and sets `PJRT_NPROC`, which keeps XLA's
# communication threads from starving on machines with few CPU cores (otherwise a loop of
# sharded steps can kill the kernel with "Expected 8 threads to join the rendezvous"). If the
# cell says that JAX is already running, restart the kernel and run from the top. On Linux it also
# tells the C library to give large freed buffers straight back to the operating system, which
# keeps the notebook well inside a 768 MB grading container.
#
# Tested with JAX 0.10.2 (the version this lab is graded with) and JAX 0.8.2, on Python 3.11.
# Newer JAX, such as Colab's, should work too: the lab uses nothing that JAX's changelog lists as
# deprecated or removed up to JAX 0.11 and the changes announced after it.

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


def one_d_mesh(axis_name):
    """A mesh of the 8 devices in a row, with one Auto axis called `axis_name`."""
    return jax.make_mesh((N_DEVICES,), (axis_name,), axis_types=(AxisType.Auto,),
                         devices=devices)

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
# ## Part A: collectives over a named axis
#
# ### From `vmap` to devices
#
# Here is the one-dimensional convolution from the vectorisation tutorial: a window of three
# values slides along `x` and is multiplied with the weights `w`.

# %%
x = np.arange(5.0)
w = np.array([2.0, 3.0, 4.0])


def convolve(x, w):
    output = []
    for i in range(1, len(x) - 1):
        output.append(jnp.dot(x[i - 1:i + 2], w))
    return jnp.array(output)


convolve(x, w)

# %% [markdown]
# To convolve a whole batch of examples, `jax.vmap` maps `convolve` over the first axis of `xs`
# (`in_axes=(0, None)` keeps the same `w` for every example). We take one example per device:

# %%
xs_conv = np.arange(5.0 * N_DEVICES).reshape(-1, 5)
jax.vmap(convolve, in_axes=(0, None))(xs_conv, w)

# %% [markdown]
# The JAX tutorial this part follows then runs the same function on several devices by writing
# `jax.pmap(convolve)`. `jax.pmap` is the **legacy** way to do that: it still works, but the JAX
# team recommends `jax.shard_map` (Lab 3) for new code, and this lab uses only `shard_map`.
#
# ### Communication: a named axis and `psum`
#
# Suppose each example's output should be divided by the total over **all** examples, so that the
# outputs of the batch sum to 1, position by position. One example alone cannot know that total:
# it needs the others. **Collectives** such as `jax.lax.psum` (sum), `jax.lax.pmean` (mean) or
# `jax.lax.pmax` combine a value over a *named axis*. You name the axis when you map the function:
# `jax.vmap(f, axis_name='p')` vectorises with an axis called `'p'`, and inside `f`,
# `jax.lax.psum(v, 'p')` is the sum of `v` over all the examples along that axis. Under
# `jax.shard_map` the same name refers to a **mesh axis**, and the sum runs over devices.
#
# The axis name is only a label, but a function that calls `psum(..., 'p')` works only where an
# axis named `'p'` exists: called on its own it fails with "unbound axis name".

# %% [raw]
# # BEGIN QUESTION
# name: q1_vmap_collective
# points: 1

# %% [markdown]
# **Task 1** (`q1_vmap_collective`). Define `normalized_convolution(x, w)`: the convolution of
# **one** example `x` with `w`, as in `convolve`, divided by the `jax.lax.psum` of those outputs
# over the axis named `'p'`. It must give the same result
#
# * under `jax.vmap(normalized_convolution, in_axes=(0, None), axis_name='p')`, and
# * under `jax.shard_map` over a mesh axis named `'p'`, one example per device (the cell after
#   the check shows how).
#
# It should work for examples of any length of 3 or more.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def normalized_convolution(x, w):
    output = jnp.array([jnp.dot(x[i - 1:i + 2], w) for i in range(1, len(x) - 1)])
    return output / lax.psum(output, axis_name="p")
# END SOLUTION
""" # BEGIN PROMPT
normalized_convolution = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q1_form(normalized_convolution):
    import jaxlab_form as form
    form.expect_callable("normalized_convolution", form.evidence(normalized_convolution))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q1_vmap_collective(normalized_convolution):
    import jaxlab_lab4
    jaxlab_lab4.check("q1_vmap_collective", normalized_convolution=normalized_convolution)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %% [markdown]
# The same function, vectorised on one device and spread over the 8 devices. Inside `shard_map`
# each device holds a block of shape `(1, 5)` (one example), so the wrapper takes `x[0]` and puts
# the leading axis back:

# %%
mesh_p = one_d_mesh("p")
if answered(normalized_convolution):
    on_devices = jax.shard_map(lambda x, w: normalized_convolution(x[0], w)[None], mesh=mesh_p,
                               in_specs=(P("p"), P()), out_specs=P("p"))

    conv_vmap = jax.vmap(normalized_convolution, in_axes=(0, None), axis_name="p")(xs_conv, w)
    conv_devices = on_devices(xs_conv, w)
    print(conv_vmap)
    print("same on 8 devices:", np.allclose(conv_vmap, conv_devices, rtol=1e-5))
    print("columns sum to 1:", np.allclose(conv_vmap.sum(axis=0), 1.0, rtol=1e-5))

# %% [markdown]
# ## Part B: matrix multiplication over 8 devices
#
# From now on we work on a 1-D mesh of the 8 devices whose axis is called `'i'`. The function
# inside `shard_map` sees one block of each input; `in_specs` says how the inputs are cut, and
# `out_specs` how the blocks that come out are put back together.
#
# Before the matrices, the smallest example of a collective inside `shard_map`.

# %%
mesh = one_d_mesh("i")


def device_put(x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


v = device_put(jnp.arange(32.0), P("i"))
jax.debug.visualize_array_sharding(v, scale=0.5)

# %% [raw]
# # BEGIN QUESTION
# name: q2_global_sum
# points: 1

# %% [markdown]
# **Task 2** (`q2_global_sum`). Define `global_sum(x)`: the sum of all entries of a 1-D array `x`
# sharded over `mesh` (spec `P('i')`), computed with `jax.shard_map`: each device sums its own
# block, and **one** collective adds up the eight partial sums. The result must be a scalar,
# replicated on every device (`out_specs=P()`). It should work for any length divisible by 8.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=P("i"), out_specs=P())
def global_sum(x_block):
    return lax.psum(jnp.sum(x_block), "i")
# END SOLUTION
""" # BEGIN PROMPT
global_sum = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q2_form(global_sum):
    import jaxlab_form as form
    form.expect_callable("global_sum", form.evidence(global_sum))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q2_global_sum(global_sum):
    import jaxlab_lab4
    jaxlab_lab4.check("q2_global_sum", global_sum=global_sum)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(global_sum):
    print(global_sum(v), jnp.sum(v))

# %% [markdown]
# ### The matrices
#
# `lhs` (32 × 64) and `rhs` (64 × 16) are sized so that every split below is even on 8 devices,
# including the half blocks of the bidirectional variants at the end of this part.

# %%
lhs_values = jax.random.normal(jax.random.key(0), (32, 64))
rhs_values = jax.random.normal(jax.random.key(1), (64, 16))
expected_product = lhs_values @ rhs_values

lhs_spec = P("i", None)  # sharded by rows
rhs_spec = P("i", None)  # sharded by rows
lhs = device_put(lhs_values, lhs_spec)
rhs = device_put(rhs_values, rhs_spec)
jax.debug.visualize_array_sharding(lhs, scale=0.4)

# %% [markdown]
# ### Example 1: `all_gather` on one side
#
# `lhs` is split by rows: device `k` holds rows block `k` and **all** 64 columns. To compute its
# rows of `lhs @ rhs` it needs all of `rhs`, but it holds only one block of 8 of its rows.
# `jax.lax.all_gather(block, 'i', tiled=True)` gives every device the concatenation of the blocks
# of all devices along the axis `'i'`. After that, a local matrix product gives each device its
# rows of the result, so the output is sharded by rows, like `lhs`.

# %% [raw]
# # BEGIN QUESTION
# name: q3_matmul_allgather
# points: 1

# %% [markdown]
# **Task 3** (`q3_matmul_allgather`). Define `matmul_allgather(lhs, rhs)` with `jax.shard_map` on
# `mesh`: `lhs` sharded by rows, `rhs` sharded by rows, the result sharded by rows
# (`P('i', None)` everywhere). Gather `rhs` with `jax.lax.all_gather`, then multiply locally.
# Wrap it in `jax.jit`.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=(lhs_spec, rhs_spec), out_specs=rhs_spec)
def matmul_allgather(lhs_block, rhs_block):
    rhs_full = lax.all_gather(rhs_block, "i", tiled=True)
    return lhs_block @ rhs_full
# END SOLUTION
""" # BEGIN PROMPT
matmul_allgather = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q3_form(matmul_allgather):
    import jaxlab_form as form
    form.expect_callable("matmul_allgather", form.evidence(matmul_allgather))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q3_matmul_allgather(matmul_allgather):
    import jaxlab_lab4
    jaxlab_lab4.check("q3_matmul_allgather", matmul_allgather=matmul_allgather)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(matmul_allgather):
    print(jnp.allclose(matmul_allgather(lhs, rhs), expected_product, atol=1e-4))

# %% [markdown]
# ### Example 2: overlap communication and computation with a ring
#
# In Example 1 no multiplication can start before the `all_gather` has finished, and every device
# briefly holds all of `rhs`. Instead, the blocks of `rhs` can travel around a **ring**: at each
# step, every device multiplies the block of `rhs` it holds right now with the matching columns
# of its `lhs` block, and passes its `rhs` block on to its neighbour with
# `jax.lax.ppermute(x, 'i', perm)`, where `perm` lists `(source, destination)` pairs such as
# `[(k, (k + 1) % 8) for k in range(8)]`. After 8 steps every device has seen every block. On
# real accelerators the next transfer runs while the current product is computed.
#
# Useful tools inside the function: `jax.lax.axis_index('i')` (this device's position on the
# axis), `jax.lax.axis_size('i')` (the number of devices), and
# `jax.lax.dynamic_slice_in_dim(array, start, size, axis)` to take the columns of `lhs` that
# match a block of `rhs` whose index is only known at run time. Think about which block a device
# holds after `s` shifts.

# %% [raw]
# # BEGIN QUESTION
# name: q4_matmul_ring
# points: 2

# %% [markdown]
# **Task 4** (`q4_matmul_ring`). Define `matmul_allgather_overlapped(lhs, rhs)`: same layout as
# Task 3 (everything sharded by rows, `P('i', None)`), but **without `all_gather`**: blocks of
# `rhs` travel around a `ppermute` ring while each device multiplies what it holds, adding up
# the products. Wrap it in `jax.jit`.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=(lhs_spec, rhs_spec), out_specs=rhs_spec)
def matmul_allgather_overlapped(lhs_block, rhs_block):
    size = lax.axis_size("i")
    idx = lax.axis_index("i")
    shift = partial(lax.ppermute, axis_name="i",
                    perm=[(k, (k + 1) % size) for k in range(size)])
    B = lhs_block.shape[1] // size

    def lhs_cols(k):
        return lax.dynamic_slice_in_dim(lhs_block, k * B, B, 1)

    out_block = lhs_cols(idx) @ rhs_block
    for step in range(1, size):
        rhs_block = shift(rhs_block)
        out_block += lhs_cols((idx - step) % size) @ rhs_block
    return out_block
# END SOLUTION
""" # BEGIN PROMPT
matmul_allgather_overlapped = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q4_form(matmul_allgather_overlapped):
    import jaxlab_form as form
    form.expect_callable("matmul_allgather_overlapped", form.evidence(matmul_allgather_overlapped))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q4_matmul_ring(matmul_allgather_overlapped):
    import jaxlab_lab4
    jaxlab_lab4.check("q4_matmul_ring", matmul_allgather_overlapped=matmul_allgather_overlapped)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(matmul_allgather_overlapped):
    print(jnp.allclose(matmul_allgather_overlapped(lhs, rhs), expected_product, atol=1e-4))

# %% [markdown]
# ### Example 3: `psum_scatter` of partial products
#
# Now shard `lhs` by **columns** and `rhs` by rows. Device `k` holds columns block `k` of `lhs`
# and rows block `k` of `rhs`, so its local product `lhs_block @ rhs_block` has the full shape of
# the result but is only one of eight **summands**. `jax.lax.psum` would add them up and give
# every device the whole result. `jax.lax.psum_scatter(x, 'i', tiled=True)` adds them up and
# gives each device only its block of rows of the sum: less to send, and the result comes out
# sharded by rows.

# %%
lhs_cols_spec = P(None, "i")  # sharded by columns
lhs_by_cols = device_put(lhs_values, lhs_cols_spec)
jax.debug.visualize_array_sharding(lhs_by_cols, scale=0.4)

# %% [raw]
# # BEGIN QUESTION
# name: q5_matmul_reducescatter
# points: 1

# %% [markdown]
# **Task 5** (`q5_matmul_reducescatter`). Define `matmul_psumscatter(lhs, rhs)` with
# `jax.shard_map` on `mesh`: `lhs` sharded by columns (`P(None, 'i')`), `rhs` by rows
# (`P('i', None)`), the result by rows (`P('i', None)`). Multiply locally, then combine the partial
# products with `jax.lax.psum_scatter`. Wrap it in `jax.jit`.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=(lhs_cols_spec, rhs_spec), out_specs=rhs_spec)
def matmul_psumscatter(lhs_block, rhs_block):
    return lax.psum_scatter(lhs_block @ rhs_block, "i", tiled=True)
# END SOLUTION
""" # BEGIN PROMPT
matmul_psumscatter = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q5_form(matmul_psumscatter):
    import jaxlab_form as form
    form.expect_callable("matmul_psumscatter", form.evidence(matmul_psumscatter))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q5_matmul_reducescatter(matmul_psumscatter):
    import jaxlab_lab4
    jaxlab_lab4.check("q5_matmul_reducescatter", matmul_psumscatter=matmul_psumscatter)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(matmul_psumscatter):
    print(jnp.allclose(matmul_psumscatter(lhs_by_cols, rhs), expected_product, atol=1e-4))

# %% [markdown]
# ### Example 4: a ring of partial sums
#
# `psum_scatter` must wait for the whole local product. A ring again lets communication and
# computation overlap, this time moving **partial sums** instead of inputs: cut the rows of the
# local `lhs` block into 8 row blocks. At each step a device adds the product of one row block
# with its `rhs` block to the running partial sum it holds, then passes that partial sum to its
# neighbour with `ppermute`. Choose the order of the row blocks so that after the last step each
# device holds the complete sum for **its own** block of rows.

# %% [raw]
# # BEGIN QUESTION
# name: q6_matmul_ring_reducescatter
# points: 2

# %% [markdown]
# **Task 6** (`q6_matmul_ring_reducescatter`). Define `matmul_psumscatter_overlapped(lhs, rhs)`:
# same layout as Task 5, but **without `psum_scatter`** (and without `psum` or `all_gather`):
# partial sums travel around a `ppermute` ring. Wrap it in `jax.jit`.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=(lhs_cols_spec, rhs_spec), out_specs=rhs_spec)
def matmul_psumscatter_overlapped(lhs_block, rhs_block):
    size = lax.axis_size("i")
    idx = lax.axis_index("i")
    shift = partial(lax.ppermute, axis_name="i",
                    perm=[(k, (k - 1) % size) for k in range(size)])
    row_blocks = lhs_block.reshape(size, -1, lhs_block.shape[1])
    # the sum started on device idx ends, after size - 1 shifts down, on device idx + 1
    out_summand = row_blocks[(idx + 1) % size] @ rhs_block
    for step in range(1, size):
        out_summand = shift(out_summand)
        out_summand += row_blocks[(idx + step + 1) % size] @ rhs_block
    return out_summand
# END SOLUTION
""" # BEGIN PROMPT
matmul_psumscatter_overlapped = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q6_form(matmul_psumscatter_overlapped):
    import jaxlab_form as form
    form.expect_callable("matmul_psumscatter_overlapped", form.evidence(matmul_psumscatter_overlapped))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q6_matmul_ring_reducescatter(matmul_psumscatter_overlapped):
    import jaxlab_lab4
    jaxlab_lab4.check("q6_matmul_ring_reducescatter", matmul_psumscatter_overlapped=matmul_psumscatter_overlapped)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(matmul_psumscatter_overlapped):
    print(jnp.allclose(matmul_psumscatter_overlapped(lhs_by_cols, rhs), expected_product,
                       atol=1e-4))

# %% [markdown]
# ### Extension (not graded): bidirectional rings
#
# A ring that sends in one direction uses only half of a bidirectional interconnect (as on TPUs).
# Splitting each block in two halves and sending one half up the ring and the other down uses
# both directions. Here is the version of Example 2; try writing the one of Example 4 yourself.

# %%
@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=(lhs_spec, rhs_spec), out_specs=rhs_spec)
def matmul_allgather_overlapped_bidi(lhs_block, rhs_block):
    size = lax.axis_size("i")
    idx = lax.axis_index("i")
    shift_up = partial(lax.ppermute, axis_name="i",
                       perm=[(k, (k + 1) % size) for k in range(size)])
    shift_down = partial(lax.ppermute, axis_name="i",
                         perm=[(k, (k - 1) % size) for k in range(size)])
    B = lhs_block.shape[1] // size // 2  # half blocks

    def lhs_cols(k, half):
        return lax.dynamic_slice_in_dim(lhs_block, (2 * k + half) * B, B, 1)

    rhs_lo, rhs_hi = jnp.split(rhs_block, 2, axis=0)
    out_block = lhs_cols(idx, 0) @ rhs_lo + lhs_cols(idx, 1) @ rhs_hi
    for step in range(1, size):
        rhs_lo, rhs_hi = shift_up(rhs_lo), shift_down(rhs_hi)
        out_block += lhs_cols((idx - step) % size, 0) @ rhs_lo
        out_block += lhs_cols((idx + step) % size, 1) @ rhs_hi
    return out_block


print(jnp.allclose(matmul_allgather_overlapped_bidi(lhs, rhs), expected_product, atol=1e-4))

# %% [markdown]
# ## Part C: parallel losses of a neural network
#
# A small MLP with ReLU activations and a squared-error loss. `init` draws the parameters (a
# list of `(W, b)` pairs) and one batch of inputs and targets.

# %%
def predict(params, inputs):
    for W, b in params:
        outputs = jnp.dot(inputs, W) + b
        inputs = jax.nn.relu(outputs)
    return outputs


def loss(params, batch):
    inputs, targets = batch
    predictions = predict(params, inputs)
    return jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))


def init_layer(key, n_in, n_out):
    k1, k2 = jax.random.split(key)
    W = jax.random.normal(k1, (n_in, n_out)) / jnp.sqrt(n_in)
    b = jax.random.normal(k2, (n_out,))
    return W, b


def init(key, layer_sizes, batch_size):
    key, *keys = jax.random.split(key, len(layer_sizes))
    params = list(map(init_layer, keys, layer_sizes[:-1], layer_sizes[1:]))
    key, *keys = jax.random.split(key, 3)
    inputs = jax.random.normal(keys[0], (batch_size, layer_sizes[0]))
    targets = jax.random.normal(keys[1], (batch_size, layer_sizes[-1]))
    return params, (inputs, targets)


layer_sizes = [784, 128, 128, 128, 128, 128, 8]
batch_size = 32
params, batch = init(jax.random.key(0), layer_sizes, batch_size)

loss_single = jax.jit(loss)(params, batch)
grad_single = jax.jit(jax.grad(loss))(params, batch)
print(f"single-device loss: {float(loss_single):.4f}")


def allclose(a, b):
    """Whether two pytrees (for example two gradients) agree leaf by leaf."""
    return jax.tree.all(jax.tree.map(partial(jnp.allclose, rtol=1e-3, atol=1e-4), a, b))

# %% [markdown]
# With automatic partitioning (Lab 3) the model code stays the same whatever the sharding. With
# `shard_map` we usually adapt it to each parallelisation strategy: the loss now describes what
# **one device** computes.
#
# ### Data parallelism
#
# Shard the batch of inputs and targets over the devices and replicate the parameters. Each
# device computes the mean loss of its part of the batch; to get the loss of the whole batch the
# devices only need to exchange **one scalar**.
#
# **The gradient trap.** The hidden checks take `jax.grad` of your loss function and compare it
# with `jax.grad(loss)`. Since JAX 0.6.1, `jax.grad` of a `shard_map`ped function with respect to
# replicated (`P()`) inputs already **sums** the gradient contributions of the devices (the
# transpose of replicating a value is summing it). So take the gradient of the averaged loss
# (`pmean` inside), and do not average gradients again yourself. The older `pmap` recipe "compute
# local gradients, then `pmean` them" gives, inside `shard_map`, **8 times** the true gradient on
# 8 devices. Part D comes back to this.

# %%
mesh_batch = one_d_mesh("batch")
batch_dp = jax.device_put(batch, NamedSharding(mesh_batch, P("batch")))
params_dp = jax.device_put(params, NamedSharding(mesh_batch, P()))

# %% [raw]
# # BEGIN QUESTION
# name: q7_loss_dp
# points: 2

# %% [markdown]
# **Task 7** (`q7_loss_dp`). Define `loss_dp(params, batch)` with `jax.shard_map` on
# `mesh_batch`: the batch (inputs and targets) sharded along its first axis, the parameters
# replicated, the loss of each device's part combined with **one scalar collective**. It must
# return the same loss as `loss`, and `jax.grad(loss_dp)` the same gradient as `jax.grad(loss)`,
# for any batch size divisible by 8.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
def loss_dp(params, batch):
    @partial(jax.shard_map, mesh=mesh_batch, in_specs=(P(), P("batch")), out_specs=P())
    def loss_spmd(params, local_batch):
        return lax.pmean(loss(params, local_batch), "batch")

    return loss_spmd(params, batch)
# END SOLUTION
""" # BEGIN PROMPT
loss_dp = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q7_form(loss_dp):
    import jaxlab_form as form
    form.expect_callable("loss_dp", form.evidence(loss_dp))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q7_loss_dp(loss_dp):
    import jaxlab_lab4
    jaxlab_lab4.check("q7_loss_dp", loss_dp=loss_dp)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(loss_dp):
    print(f"loss {float(jax.jit(loss_dp)(params_dp, batch_dp)):.4f}, "
          f"single-device {float(loss_single):.4f}")
    print("same gradient:", allclose(jax.jit(jax.grad(loss_dp))(params_dp, batch_dp), grad_single))

# %% [markdown]
# ### Fully sharded data parallelism (FSDP)
#
# Data parallelism keeps a full copy of the parameters on every device. FSDP shards the
# parameters too (each `W` and `b` along its first axis) and **gathers each weight just before
# it is used**, with `all_gather`. Collectives are now needed in two places: in the prediction,
# to gather the parameters, and at the end, to combine the losses as before.
#
# To save memory the gathered weights should not be kept from the forward pass for the backward
# pass, but gathered again. `jax.checkpoint` (also called `jax.remat`) with a policy that refuses
# to save the results of `all_gather` says so:
# `@partial(jax.checkpoint, policy=lambda prim, *_, **__: str(prim) != "all_gather")`. XLA often
# does this by itself; the checks do not require it.

# %%
batch_fsdp = jax.device_put(batch, NamedSharding(mesh_batch, P("batch")))
params_fsdp = jax.device_put(params, NamedSharding(mesh_batch, P("batch")))
print("a weight matrix, sharded by rows:", params_fsdp[0][0].sharding.shard_shape((784, 128)))

# %% [raw]
# # BEGIN QUESTION
# name: q8_loss_fsdp
# points: 2

# %% [markdown]
# **Task 8** (`q8_loss_fsdp`). Define `loss_fsdp(params, batch)` with `jax.shard_map` on
# `mesh_batch`: parameters **and** batch sharded along their first axis (`P('batch')`); inside,
# gather each `W` and `b` with `jax.lax.all_gather(..., tiled=True)` just before using it, and
# combine the per-device losses with a collective as in Task 7. Same loss and gradient as
# `loss`, for any batch size divisible by 8.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
@partial(jax.checkpoint, policy=lambda prim, *_, **__: str(prim) != "all_gather")
def predict_fsdp(params_frag, inputs):
    for W_frag, b_frag in params_frag:
        W = lax.all_gather(W_frag, "batch", tiled=True)
        b = lax.all_gather(b_frag, "batch", tiled=True)
        outputs = jnp.dot(inputs, W) + b
        inputs = jax.nn.relu(outputs)
    return outputs


def loss_fsdp(params, batch):
    @partial(jax.shard_map, mesh=mesh_batch, in_specs=P("batch"), out_specs=P())
    def loss_spmd(local_params, local_batch):
        inputs, targets = local_batch
        predictions = predict_fsdp(local_params, inputs)
        local_loss = jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))
        return lax.pmean(local_loss, "batch")

    return loss_spmd(params, batch)
# END SOLUTION
""" # BEGIN PROMPT
loss_fsdp = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q8_form(loss_fsdp):
    import jaxlab_form as form
    form.expect_callable("loss_fsdp", form.evidence(loss_fsdp))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q8_loss_fsdp(loss_fsdp):
    import jaxlab_lab4
    jaxlab_lab4.check("q8_loss_fsdp", loss_fsdp=loss_fsdp)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(loss_fsdp):
    print(f"loss {float(jax.jit(loss_fsdp)(params_fsdp, batch_fsdp)):.4f}, "
          f"single-device {float(loss_single):.4f}")
    print("same gradient:",
          allclose(jax.jit(jax.grad(loss_fsdp))(params_fsdp, batch_fsdp), grad_single))

# %% [markdown]
# ### Tensor parallelism
#
# Now shard over **features** instead of examples: the activations (and inputs) are split along
# their feature axis, each weight matrix along its input-feature axis (rows) and each bias along
# its features. A layer is then a local matrix product, which gives a partial sum of the full
# output, followed by a `psum_scatter` that adds the partial sums **and** splits the result over
# its feature axis again (`scatter_dimension=1`), ready for the next layer. The bias is added to
# the scattered block. The loss itself can be computed outside `shard_map` from the sharded
# predictions.

# %%
mesh_feats = one_d_mesh("feats")
batch_tp = jax.device_put(batch, NamedSharding(mesh_feats, P(None, "feats")))
params_tp = jax.device_put(params, NamedSharding(mesh_feats, P("feats")))

# %% [raw]
# # BEGIN QUESTION
# name: q9_loss_tp
# points: 2

# %% [markdown]
# **Task 9** (`q9_loss_tp`). Define `loss_tp(params, batch)` on `mesh_feats`: inputs and
# activations sharded over features (`P(None, 'feats')`), each `W` by rows (`P('feats', None)`),
# each `b` over its features (`P('feats')`); every layer is a local matrix product followed by
# `jax.lax.psum_scatter` (no `all_gather` of the weights). Same loss and gradient as `loss`.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
@partial(jax.shard_map, mesh=mesh_feats,
         in_specs=(P(None, "feats"), P("feats", None), P("feats")), out_specs=P(None, "feats"))
def gemm_tp(inputs, W, b):
    block_result = jnp.dot(inputs, W)
    return lax.psum_scatter(block_result, "feats", scatter_dimension=1, tiled=True) + b


def predict_tp(params, inputs):
    for W, b in params:
        outputs = gemm_tp(inputs, W, b)
        inputs = jax.nn.relu(outputs)
    return outputs


def loss_tp(params, batch):
    inputs, targets = batch
    predictions = predict_tp(params, inputs)
    return jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))
# END SOLUTION
""" # BEGIN PROMPT
loss_tp = ...
""" # END PROMPT

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q9_form(loss_tp):
    import jaxlab_form as form
    form.expect_callable("loss_tp", form.evidence(loss_tp))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q9_loss_tp(loss_tp):
    import jaxlab_lab4
    jaxlab_lab4.check("q9_loss_tp", loss_tp=loss_tp)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(loss_tp):
    print(f"loss {float(jax.jit(loss_tp)(params_tp, batch_tp)):.4f}, "
          f"single-device {float(loss_single):.4f}")
    print("same gradient:", allclose(jax.jit(jax.grad(loss_tp))(params_tp, batch_tp), grad_single))

# %% [markdown]
# ## Part D: data-parallel training, from `pmap` to `shard_map`
#
# A linear regression `y ≈ weight · x + bias` fitted by plain gradient descent. First on one
# device:

# %%
from typing import NamedTuple


class Params(NamedTuple):
    weight: jnp.ndarray
    bias: jnp.ndarray


def init_regression(rng):
    """The initial model parameters."""
    weights_key, bias_key = jax.random.split(rng)
    weight = jax.random.normal(weights_key, ())
    bias = jax.random.normal(bias_key, ())
    return Params(weight, bias)


def loss_fn(params, xs, ys):
    """Mean squared error of the model's predictions on xs against ys."""
    pred = params.weight * xs + params.bias
    return jnp.mean((pred - ys) ** 2)


LEARNING_RATE = 0.005


@jax.jit
def update_single(params, xs, ys):
    """One SGD step on one device; returns the new params and the loss before the step."""
    loss, grads = jax.value_and_grad(loss_fn)(params, xs, ys)
    new_params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return new_params, loss


def train(update, params, xs, ys, steps=1000):
    for step in range(steps):
        params, loss = update(params, xs, ys)
        params = jax.block_until_ready(params)  # one step at a time (see the setup cell)
        if step % 200 == 0:
            print(f"step {step:4d}, loss {float(loss):.3f}")
    return params


# data drawn around y = 2 x - 1
rng = np.random.default_rng(0)
xs = rng.normal(size=(128, 1)).astype(np.float32)
noise = 0.5 * rng.normal(size=(128, 1)).astype(np.float32)
ys = (xs * 2 - 1 + noise).astype(np.float32)

params_init = init_regression(jax.random.PRNGKey(123))
params_single = train(update_single, params_init, xs, ys)
print(params_single)

# %% [markdown]
# The tutorial this part follows makes `update` data-parallel with the legacy `jax.pmap`:
#
# ```python
# @partial(jax.pmap, axis_name="num_devices")
# def update(params, xs, ys):
#     loss, grads = jax.value_and_grad(loss_fn)(params, xs, ys)
#     grads = jax.lax.pmean(grads, axis_name="num_devices")   # average the gradients
#     loss = jax.lax.pmean(loss, axis_name="num_devices")
#     new_params = jax.tree.map(lambda p, g: p - g * LEARNING_RATE, params, grads)
#     return new_params, loss
# ```
#
# `pmap` needs the data reshaped to `(n_devices, batch_per_device, …)` and a copy of the
# parameters stacked per device. With `shard_map` the data keeps its shape and is simply
# sharded, and the parameters are replicated (`P()`).
#
# Careful: copying the `pmap` body into `shard_map` unchanged is the gradient trap from Part C.
# Inside `shard_map`, `jax.grad` with respect to the replicated `params` already sums the
# gradients of the devices, so `pmean` of those gradients is 8 times the true gradient, and the
# model trains with a learning rate 8 times too large. (Here it would still converge, which is
# what makes the bug easy to miss.)

# %%
mesh_dp = one_d_mesh("batch")
xs_sharded = jax.device_put(xs, NamedSharding(mesh_dp, P("batch")))
ys_sharded = jax.device_put(ys, NamedSharding(mesh_dp, P("batch")))
params_replicated = jax.device_put(params_init, NamedSharding(mesh_dp, P()))

# %% [raw]
# # BEGIN QUESTION
# name: q10_dp_training
# points: 3

# %% [markdown]
# **Task 10** (`q10_dp_training`).
#
# * `update(params, xs, ys)`: one data-parallel SGD step with `jax.shard_map` on `mesh_dp` in
#   place of `pmap`: `xs` and `ys` sharded along the batch axis, `params` replicated, the
#   gradient averaged correctly over the devices (one step must equal `update_single`), and
#   returning `(new_params, loss)` with both replicated (`out_specs=(P(), P())`). Wrap it in
#   `jax.jit`.
# * `params_trained`: the parameters after `train(update, params_replicated, xs_sharded,
#   ys_sharded)` (1000 steps), which must match `params_single`.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
@jax.jit
@partial(jax.shard_map, mesh=mesh_dp, in_specs=(P(), P("batch"), P("batch")),
         out_specs=(P(), P()))
def update(params, xs, ys):
    def global_loss(params):
        return lax.pmean(loss_fn(params, xs, ys), "batch")

    loss, grads = jax.value_and_grad(global_loss)(params)
    new_params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return new_params, loss


# END SOLUTION
""" # BEGIN PROMPT
update = ...
""" # END PROMPT
params_trained = train(update, params_replicated, xs_sharded, ys_sharded)  # SOLUTION

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q10_form(update, params_trained):
    import jaxlab_form as form
    form.expect_callable("update", form.evidence(update))
    form.expect_defined("params_trained", form.evidence(params_trained))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q10_dp_training(update, params_trained):
    import jaxlab_lab4
    jaxlab_lab4.check("q10_dp_training", update=update, params_trained=params_trained)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(params_trained):
    print(params_trained)
    print("matches single-device training:",
          np.allclose(np.array(params_trained), np.array(params_single), rtol=1e-3, atol=1e-4))

# %%
import matplotlib.pyplot as plt

grid = np.linspace(xs.min(), xs.max(), 50)
fig, ax = plt.subplots(figsize=(6, 4))
ax.scatter(xs, ys, s=8, alpha=0.5, label="data")
ax.plot(grid, params_single.weight * grid + params_single.bias, "r", label="one device")
if isinstance(params_trained, tuple):
    ax.plot(grid, params_trained.weight * grid + params_trained.bias, "k:", lw=3,
            label="8 devices, shard_map")
ax.legend()
plt.show()
