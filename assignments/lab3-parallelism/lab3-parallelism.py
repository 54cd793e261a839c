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
# name: lab3-parallelism
# environment: environment.yml
# files:
#   - jaxlab_form.py
# autograder_files:
#   - jaxlab_lab3.py
# tests:
#   ok_format: false
# export_cell:
#   pdf: false
#   instructions: "Upload the zip file this cell makes to the course's submission page. On Google Colab, which cannot make the zip, this cell instead tells you to submit the notebook itself: *File → Download → Download .ipynb*, then upload that file."
# check_all_cell: false

# %% [markdown]
# # Lab 3: Introduction to Parallelization in JAX
#
# This lab shows how JAX spreads arrays and computations over several devices. It follows the
# JAX tutorial on [sharded computation](https://docs.jax.dev/en/latest/sharded-computation.html).
#
# ## How this lab works
#
# * Every task has one cell that starts with `### Your code here`. Replace each `...` in it with
#   your answer and run it. The cell right after it, `grader.check("q…")`, runs the public checks
#   of that task and tells you what is still wrong. More (hidden) checks run when your notebook
#   is graded, so a passing public check means "right form", not yet "right answer".
# * Do not rename the variables a task asks for, and do not reuse their names later on: the
#   grader reads them after the whole notebook has run.
# * Run the notebook from the top (*Kernel → Restart & Run All*) before you submit.
#
# ## Three ways to run in parallel
#
# JAX parallelises by **sharding** (partitioning) arrays over several accelerators. It offers
# three ways to program with sharded arrays:
#
# | mode | you write code for | who places the data | who inserts communication |
# |---|---|---|---|
# | automatic (`jax.jit`) | the whole array | you, then the compiler propagates it | the compiler |
# | explicit sharding | the whole array | you: the sharding is part of each array's type | the compiler |
# | manual (`jax.shard_map`) | one device's block | you | you (collectives such as `psum`) |
#
# * **Automatic:** you pass sharded data to a `jax.jit`-compiled function and the XLA compiler
#   decides how to split the work. You hardly notice that several devices take part.
# * **Explicit:** you still write a program for whole arrays, but the sharding of every array is
#   part of its JAX-level type, shardings propagate in a predictable way at trace time, and the
#   compiler must respect them (it still turns, say, a `jnp.sum` into per-device sums plus a
#   collective).
# * **Manual:** with `jax.shard_map` you write what one device does with its block of the data,
#   and you call the communication (collectives) yourself.

# %% [markdown]
# ## Setup: eight devices
#
# JAX fixes the number of devices when it starts, so the next cell must run **before any other
# JAX code**. On a laptop or a CPU-only runtime it asks for 8 simulated CPU devices (the XLA
# option behind this is also known as `--xla_force_host_platform_device_count=8`). If your runtime
# has 8 or more accelerators (for example a TPU runtime), the lab uses them instead; with fewer
# (one GPU, say) it runs on the 8 CPU devices so that every mesh below has the devices it needs.
#
# The cell also sets `PJRT_NPROC`. On machines with only a couple of CPU cores, a long loop of
# sharded steps can starve the threads that XLA uses for communication between the simulated
# devices, and the kernel then dies after about 40 seconds with a message like "Expected 8
# threads to join the rendezvous". Giving XLA more threads avoids that.
#
# Finally, on Linux the cell tells the C library to give large freed buffers straight back to the
# operating system (`mallopt(M_MMAP_THRESHOLD, 128 KiB)`). Without it, the buffers that each
# training step frees stay reserved by the kernel process, and this notebook needs about 1 GB
# instead of about 600 MB: more than the 768 MB of a default Gradescope grading container.
#
# If this cell tells you that JAX is already running, restart the kernel and run the notebook
# from the top.
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
# ## Sharding in JAX
#
# Everything below rests on **data sharding**: a description of how the elements of an array are
# laid out over the available devices.
#
# * A `jax.Array` is an immutable array whose storage may span one device or many.
# * *Every* `jax.Array` has a `sharding` attribute that says which part of the global array each
#   device holds.
# * When you create a `jax.Array`, you can choose its sharding at the same time.
#
# `jax.devices()` lists the devices of the default backend (`gpu` or `tpu` when there is one,
# otherwise `cpu`); the setup cell stored the eight this lab uses in `devices`.

# %%
import jax.numpy as jnp
import numpy as np

devices

# %% [markdown]
# An array created without further instructions lives on the default device (the first one).
# Its `device` attribute names that device, and its `sharding` says the same in the language of
# shardings:

# %%
A = jnp.arange(64.0).reshape(4, 16)
print(f"{A.device = }")
print(f"{A.sharding = }")

# %% [markdown]
# Functions that create arrays, such as `jnp.ones` or `jnp.zeros`, take an optional `device`
# argument: `None`, a `Device`, or a `Sharding`. Given a device or a sharding, the new array is
# *committed* to it.

# %%
ones_on_1 = jnp.ones((4, 16), device=devices[1])
print(f"{ones_on_1.device = }")
print(f"{ones_on_1.sharding = }")

# %% [markdown]
# ### Seeing a sharding
#
# `jax.debug.visualize_array_sharding` draws which device holds which block of a (1-D or 2-D)
# array; `scale` makes the picture smaller or larger. For the two arrays above the picture is
# dull: each lives on a single device.

# %%
print("A:")
jax.debug.visualize_array_sharding(A, scale=0.5)
print("ones_on_1:")
jax.debug.visualize_array_sharding(ones_on_1, scale=0.5)

# %% [markdown]
# ### Sharding an array over several devices
#
# To spread an array over devices, describe the layout you want and hand the array and the
# description to `jax.device_put`. The description has two parts.
#
# #### Step 1: a mesh
#
# A **mesh** arranges the devices in a grid with named axes. `jax.make_mesh` maps the logical
# grid you ask for onto the physical devices. That matters on TPUs, which are wired as a 2-D or
# 3-D torus, and on GPUs, where some pairs are linked by fast NVLink: a grid lets you keep, for
# example, a `data` axis for data parallelism and a `model` axis for model parallelism on the
# links that suit them.
#
# The mesh below is a 2 × 4 grid whose first axis is named `x` and second `y`. Since JAX 0.9 a
# new mesh's axes are *explicit* unless you say otherwise, so we ask for `Auto` axes here; the
# explicit kind comes later in the lab.

# %%
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto, AxisType.Auto),
                     devices=devices)
print(mesh)

# %% [markdown]
# #### Step 2: a sharding
#
# A `NamedSharding` pairs a mesh with a `PartitionSpec`. The spec has one entry per dimension of
# the array: the name of the mesh axis that dimension is split over, or `None` to keep that
# dimension whole. `P('x', 'y')` splits the rows over `x` and the columns over `y`.

# %%
sharding = NamedSharding(mesh, P("x", "y"))
print(sharding)

# %% [raw]
# # BEGIN QUESTION
# name: q1_device_put
# points: 1

# %% [markdown]
# **Task 1** (`q1_device_put`). Place the array `A` on the devices with `jax.device_put` and the
# sharding `sharding` defined above, and store the result as `A_sharded`. Then draw its sharding
# with `jax.debug.visualize_array_sharding`.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
A_sharded = jax.device_put(A, sharding)  # SOLUTION
# BEGIN SOLUTION NO PROMPT
jax.debug.visualize_array_sharding(A_sharded)
# END SOLUTION

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q1_form(A_sharded):
    import jaxlab_form as form
    form.expect_on_mesh("A_sharded", form.evidence(A_sharded), shape=(4, 16))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q1_device_put(A_sharded):
    import jaxlab_lab3
    jaxlab_lab3.check("q1_device_put", A_sharded=A_sharded)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %% [raw]
# # BEGIN QUESTION
# name: q2_inspect
# points: 1

# %% [markdown]
# **Task 2** (`q2_inspect`). Find out where `A_sharded` lives:
#
# * `A_sharded_devices`: the set of devices that hold a part of `A_sharded`;
# * `A_shard_shape`: the shape (a tuple) of the block that one device holds.
#
# Hint: look at the methods `devices()` and `addressable_shards` of the array, and at the
# method `shard_shape` of its sharding.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
A_sharded_devices = A_sharded.devices()  # SOLUTION
A_shard_shape = A_sharded.sharding.shard_shape(A_sharded.shape)  # SOLUTION
# BEGIN SOLUTION NO PROMPT
print(sorted(A_sharded_devices, key=lambda d: d.id))  # a set prints in no fixed order
print(A_shard_shape)
print(A_sharded.sharding)
# END SOLUTION

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q2_form(A_sharded_devices, A_shard_shape):
    import jaxlab_form as form
    form.expect_kind("A_sharded_devices", form.evidence(A_sharded_devices), "set",
                     "a set of devices (for example what `A_sharded.devices()` returns)")
    form.expect_kind("A_shard_shape", form.evidence(A_shard_shape), "tuple",
                     "a tuple such as (rows, columns)")

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q2_inspect(A_sharded_devices, A_shard_shape):
    import jaxlab_lab3
    jaxlab_lab3.check("q2_inspect", A_sharded_devices=A_sharded_devices,
                      A_shard_shape=A_shard_shape)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %% [markdown]
# Printing an array shows its values, not where they live: `A` and `A_sharded` look the same.

# %%
print(A)
print(A_sharded)

# %% [raw]
# # BEGIN QUESTION
# name: q3_partition_specs
# points: 2

# %% [markdown]
# **Task 3** (`q3_partition_specs`). Explore what other partition specs do to `A` on `mesh`:
# `P('x', None)`, `P(None, 'y')`, `P(None, None)` and `P(None, 'x')`. Place `A` with each of them
# (and draw the result), then record what you found in two dictionaries keyed by these four
# specs:
#
# * `shard_shapes[spec]`: the shape (a tuple) of the block each device holds;
# * `replicas[spec]`: how many devices hold each distinct block (an int).
#
# For `P('x', 'y')` these would be `(2, 4)` and `1`.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
specs = [P("x", None), P(None, "y"), P(None, None), P(None, "x")]
shard_shapes = {}
replicas = {}
for spec in specs:
    # BEGIN SOLUTION
    placed = jax.device_put(A, NamedSharding(mesh, spec))
    print(spec)
    jax.debug.visualize_array_sharding(placed, scale=0.5)
    shard_shapes[spec] = placed.sharding.shard_shape(placed.shape)
    blocks = placed.sharding.devices_indices_map(placed.shape).values()
    replicas[spec] = len(devices) // len({str(index) for index in blocks})
    # END SOLUTION

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q3_form(shard_shapes, replicas):
    import jaxlab_form as form
    form.expect_kind("shard_shapes", form.evidence(shard_shapes), "dict",
                     "a dict keyed by the four partition specs")
    form.expect_kind("replicas", form.evidence(replicas), "dict",
                     "a dict keyed by the four partition specs")
    assert len(shard_shapes) == 4 and len(replicas) == 4, (
        f"`shard_shapes` and `replicas` should have 4 entries each, one per spec; they have "
        f"{len(shard_shapes)} and {len(replicas)}.")

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q3_partition_specs(shard_shapes, replicas):
    import jaxlab_lab3
    jaxlab_lab3.check("q3_partition_specs", shard_shapes=shard_shapes, replicas=replicas)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %% [markdown]
# ## 1st way: automatic parallelisation with `jax.jit`
#
# Once the data is sharded, the simplest way to compute in parallel is to pass the sharded data
# to a `jax.jit`-compiled function:
#
# * the XLA compiler behind `jax.jit` has heuristics that split a computation over devices;
# * it inserts the communication between devices for you;
# * you may still state the shardings you want for inputs and outputs.
#
# For simple functions the result is "computation follows data": each device works on the
# block it already holds.

# %%
@jax.jit
def f_elementwise(a):
    return 2 * jnp.sin(a) ** 2 + 1


if answered(A_sharded):
    Z = f_elementwise(A_sharded)
    jax.debug.visualize_array_sharding(Z, scale=0.3)

# %% [markdown]
# For an elementwise function the output keeps the input's sharding, whether the input is
# sharded or sits on one device:

# %%
if answered(A_sharded):
    print(Z.sharding == A_sharded.sharding)
print(f_elementwise(A).sharding == A.sharding)

# %% [markdown]
# In less simple computations the compiler decides how the sharding propagates. Take the sum
# over the first axis, i.e. the column sums:

# %%
@jax.jit
def column_sums(a):
    return a.sum(axis=0)


if answered(A_sharded):
    Z = column_sums(A_sharded)
    print("input:")
    jax.debug.visualize_array_sharding(A_sharded, scale=0.5)
    print("output:")
    jax.debug.visualize_array_sharding(Z, scale=0.5)
    print(Z)
    print(Z.sharding)

# %% [markdown]
# The result is *partially replicated*: the first four column sums are held by both devices 0
# and 4, the next four by devices 1 and 5, and so on. Each pair first summed its own rows, then
# the compiler added a communication step between the two rows of the mesh.

# %% [raw]
# # BEGIN QUESTION
# name: q4_propagation
# points: 2

# %% [markdown]
# **Task 4** (`q4_propagation`). Create two arrays `B` and `C` of shape 4 × 8 (any values) on
# `mesh`: `B` split along the mesh axis `x` and replicated along `y`, `C` split along `y` and
# replicated along `x` (you choose which dimension of each array is the split one). Then
# compute `B_plus_C = B + C` and `BtC = B.T @ C`.
#
# Before you look at the result: what sharding do you expect for `B + C`, and for the matrix
# product `B.T @ C`? Check your guess with `visualize_array_sharding` or the `sharding`
# attribute.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
B = jax.device_put(jnp.arange(32.0).reshape(4, 8), NamedSharding(mesh, P("x", None)))  # SOLUTION
C = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P(None, "y")))  # SOLUTION
B_plus_C = B + C  # SOLUTION
BtC = B.T @ C  # SOLUTION
# BEGIN SOLUTION NO PROMPT
print("B + C:", B_plus_C.sharding.spec)
jax.debug.visualize_array_sharding(B_plus_C, scale=0.5)
print("B.T @ C:", BtC.sharding.spec)
jax.debug.visualize_array_sharding(BtC, scale=0.5)
# END SOLUTION

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q4_form(B, C, B_plus_C, BtC):
    import jaxlab_form as form
    form.expect_on_mesh("B", form.evidence(B), shape=(4, 8))
    form.expect_on_mesh("C", form.evidence(C), shape=(4, 8))
    form.expect_array("B_plus_C", form.evidence(B_plus_C), shape=(4, 8))
    form.expect_array("BtC", form.evidence(BtC), shape=(8, 8))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q4_propagation(B, C, B_plus_C, BtC):
    import jaxlab_lab3
    jaxlab_lab3.check("q4_propagation", B=B, C=C, B_plus_C=B_plus_C, BtC=BtC)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %% [markdown]
# ### A data-parallel layer of a neural network, automatic mode
#
# Our running example is one (vectorised) layer of a feedforward network, such as the last layer
# of a classifier. Its inputs are
#
# * `x`, the data, of shape `(n_data, n_features)`,
# * `W`, the weights, of shape `(n_features, n_out)`,
# * `b`, the bias, of shape `(n_out,)`.

# %%
@jax.jit
def layer(x, W, b):
    return jax.nn.softmax(x @ W + b)


n_features = 10
n_data = 128
n_out = 2

key = jax.random.key(0)
key, *keys = jax.random.split(key, 4)
x = jax.random.normal(keys[0], shape=(n_data, n_features))
W = jax.random.normal(keys[1], shape=(n_features, n_out))
b = jax.random.normal(keys[2], shape=(n_out,))

# %% [markdown]
# None of these arrays was given a sharding, so they live on the default device, and so does
# the layer's output:

# %%
out = layer(x, W, b)
print(out.shape)
jax.debug.visualize_array_sharding(out)

# %% [raw]
# # BEGIN QUESTION
# name: q5_dp_auto
# points: 2

# %% [markdown]
# **Task 5** (`q5_dp_auto`). In a data-parallel model the data is split over the devices along
# the batch dimension, while the parameters are replicated on every device. Do this for the
# layer:
#
# * make a 1-D mesh of 4 or 8 devices with an `Auto` axis (any name you like);
# * `x_auto`: the data `x`, split along its first (batch) dimension over that axis;
# * `W_auto`, `b_auto`: `W` and `b`, replicated on the mesh;
# * `out_auto = layer(x_auto, W_auto, b_auto)`.
#
# Check that `out_auto` is split the same way as the data.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
mesh_data = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=devices)
# END SOLUTION
x_auto = jax.device_put(x, NamedSharding(mesh_data, P("data", None)))  # SOLUTION
W_auto = jax.device_put(W, NamedSharding(mesh_data, P()))  # SOLUTION
b_auto = jax.device_put(b, NamedSharding(mesh_data, P()))  # SOLUTION
out_auto = layer(x_auto, W_auto, b_auto)  # SOLUTION
# BEGIN SOLUTION NO PROMPT
jax.debug.visualize_array_sharding(out_auto)
print(out_auto.sharding.is_equivalent_to(x_auto.sharding, 2))
# END SOLUTION

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q5_form(x_auto, W_auto, b_auto, out_auto):
    import jaxlab_form as form
    form.expect_on_mesh("x_auto", form.evidence(x_auto), shape=(128, 10))
    form.expect_on_mesh("W_auto", form.evidence(W_auto), shape=(10, 2))
    form.expect_on_mesh("b_auto", form.evidence(b_auto), shape=(2,))
    form.expect_array("out_auto", form.evidence(out_auto), shape=(128, 2))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q5_dp_auto(x_auto, W_auto, b_auto, out_auto):
    import jaxlab_lab3
    jaxlab_lab3.check("q5_dp_auto", x_auto=x_auto, W_auto=W_auto, b_auto=b_auto,
                      out_auto=out_auto)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %% [markdown]
# ## 2nd way: explicit sharding
#
# * Here the JAX-level *type* of an array records how it is sharded.
# * `jax.typeof` returns that type for any JAX value, and also for NumPy arrays and Python
#   scalars.
#
# The `~` in front of the scalar's type marks a *weak* type: a Python number adapts to the dtype
# of the arrays it meets.

# %%
np_array = np.arange(8)
print(f"JAX-level type of a NumPy array: {jax.typeof(np_array)}")
print(f"JAX-level type of a JAX array:   {jax.typeof(A)}")
print(f"JAX-level type of a Python float: {jax.typeof(4.2)}")

# %% [markdown]
# The type is what `jax.jit` knows about a value while it traces a function, and you can print
# it during tracing:

# %%
@jax.jit
def show_type(a):
    print(f"JAX-level type of the argument during tracing: {jax.typeof(a)}")
    return a


show_type(A);

# %% [markdown]
# On a mesh with `Auto` axes the type says nothing about sharding: `A_sharded` is sharded, yet its
# type is just `float32[4,16]`.

# %%
if answered(A_sharded):
    show_type(A_sharded);

# %% [markdown]
# Explicit sharding needs a mesh whose axes are *explicit*:

# %%
mesh_explicit = jax.make_mesh((2, 4), ("x", "y"),
                              axis_types=(AxisType.Explicit, AxisType.Explicit),
                              devices=devices)
print(mesh_explicit)

# %% [markdown]
# Now place an 8 × 4 array on it, split along `x` and replicated along `y`, and compare the types
# of the plain and the placed array:

# %%
A_np = np.arange(32.0).reshape(8, 4)
A_explicit = jax.device_put(A_np, NamedSharding(mesh_explicit, P("x", None)))
print(f"type of A_np:       {jax.typeof(A_np)}")
print(f"type of A_explicit: {jax.typeof(A_explicit)}")

# %% [markdown]
# Read `float32[8@x,4]` as "an 8 × 4 array of 32-bit floats whose first dimension is split over
# mesh axis `x`". Mesh axes that the type does not mention (here `y`) replicate the array.

# %%
jax.debug.visualize_array_sharding(A_explicit)

# %% [markdown]
# Two more arrays: `col` is split along `x` (and replicated along `y`), `row` is split along `y`
# (and replicated along `x`).

# %%
col = jax.device_put(np.arange(4).reshape(4, 1), NamedSharding(mesh_explicit, P("x", None)))
row = jax.device_put(np.arange(8).reshape(1, 8), NamedSharding(mesh_explicit, P(None, "y")))
print("col:")
jax.debug.visualize_array_sharding(col)
print("row:")
jax.debug.visualize_array_sharding(row, scale=0.2)

# %% [markdown]
# The next function multiplies its arguments elementwise (with broadcasting) and prints the
# JAX-level types of its inputs and output while it is traced:

# %%
@jax.jit
def multiply_arrays(a, c):
    product = a * c
    print(f"a:       {jax.typeof(a)}")
    print(f"c:       {jax.typeof(c)}")
    print(f"product: {jax.typeof(product)}")
    return product


product = multiply_arrays(col, row)
jax.debug.visualize_array_sharding(product, scale=0.4)
product

# %% [markdown]
# Shardings propagate **deterministically at trace time**: the types printed above are known
# before anything runs.
#
# ### The data-parallel layer, explicit mode
#
# We reuse `layer`, `x`, `W` and `b` from the automatic section.

# %% [raw]
# # BEGIN QUESTION
# name: q6_dp_explicit
# points: 2

# %% [markdown]
# **Task 6** (`q6_dp_explicit`). Run the layer data-parallel in **explicit** mode:
#
# * make a 1-D mesh of 4 or 8 devices with an `Explicit` axis;
# * `x_explicit` (the data `x`, split along the batch dimension), `W_explicit` and `b_explicit`
#   (`W` and `b`, replicated) on that mesh;
# * `layer_explicit(x, W, b)`: a `jax.jit`-compiled wrapper that computes the layer and, while it
#   is traced, prints the `jax.typeof` of its three inputs and of its output;
# * `out_explicit = layer_explicit(x_explicit, W_explicit, b_explicit)`.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
mesh_data_explicit = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,),
                                   devices=devices)
# END SOLUTION
x_explicit = jax.device_put(x, NamedSharding(mesh_data_explicit, P("data", None)))  # SOLUTION
W_explicit = jax.device_put(W, NamedSharding(mesh_data_explicit, P()))  # SOLUTION
b_explicit = jax.device_put(b, NamedSharding(mesh_data_explicit, P()))  # SOLUTION


@jax.jit
def layer_explicit(x, W, b):
    # BEGIN SOLUTION
    out = layer(x, W, b)
    print(f"x: {jax.typeof(x)}")
    print(f"W: {jax.typeof(W)}")
    print(f"b: {jax.typeof(b)}")
    print(f"out: {jax.typeof(out)}")
    return out
    # END SOLUTION


out_explicit = layer_explicit(x_explicit, W_explicit, b_explicit)  # SOLUTION

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q6_form(x_explicit, W_explicit, b_explicit, layer_explicit, out_explicit):
    import jaxlab_form as form
    form.expect_on_mesh("x_explicit", form.evidence(x_explicit), shape=(128, 10))
    form.expect_on_mesh("W_explicit", form.evidence(W_explicit), shape=(10, 2))
    form.expect_on_mesh("b_explicit", form.evidence(b_explicit), shape=(2,))
    form.expect_callable("layer_explicit", form.evidence(layer_explicit))
    form.expect_array("out_explicit", form.evidence(out_explicit), shape=(128, 2))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q6_dp_explicit(x_explicit, W_explicit, b_explicit, layer_explicit, out_explicit):
    import jaxlab_lab3
    jaxlab_lab3.check("q6_dp_explicit", x_explicit=x_explicit, W_explicit=W_explicit,
                      b_explicit=b_explicit, layer_explicit=layer_explicit,
                      out_explicit=out_explicit)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %% [markdown]
# ## 3rd way: manual parallelisation with `jax.shard_map`
#
# In the first two ways we wrote a program for the whole array and let `jax.jit` split it. In the
# third way we write what **one device** does with **its block** of the data, and
# `jax.shard_map` runs that function on every device of a mesh. This gives the most control over
# how work is split and which communication happens.
#
# (`jax.shard_map` is the current name; older code imports it from `jax.experimental.shard_map`,
# which is deprecated.)

# %%
mesh_1d = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,), devices=devices[:4])

f_blockwise = jax.shard_map(f_elementwise, mesh=mesh_1d, in_specs=P("x"), out_specs=P("x"))

v = jnp.arange(32.0)
Z = f_blockwise(v)
print("sharding of f_blockwise(v):")
jax.debug.visualize_array_sharding(Z, scale=0.2)

# %% [markdown]
# * the mesh says precisely which devices take part;
# * `in_specs` says how the inputs are cut into blocks;
# * `out_specs` says how the blocks that come out are put back together.
#
# The function inside `shard_map` only ever sees one block, as printing its shape shows:

# %%
def show_block(block):
    print(f"shape of the block on one device: {block.shape}")
    print(f"type of the block: {jax.typeof(block)}")
    return block * 2


doubled = jax.shard_map(show_block, mesh=mesh_1d, in_specs=P("x"), out_specs=P("x"))(v)
print(f"global shape: {doubled.shape}")

# %% [markdown]
# Since each device sees only its block, reductions such as a sum no longer mean what they mean
# for the whole array. Summing inside `shard_map` gives one partial sum per device:

# %%
def block_sum(block):
    return jnp.sum(block, keepdims=True)


jax.shard_map(block_sum, mesh=mesh_1d, in_specs=P("x"), out_specs=P("x"))(v)

# %% [markdown]
# To sum over all blocks, ask for communication with a **collective** such as `jax.lax.psum`,
# which adds up a value over a mesh axis. The result is the same on every device, so the output
# spec is `P()`, which means replicated:

# %%
def total_sum(block):
    return jax.lax.psum(block.sum(), "x")


jax.shard_map(total_sum, mesh=mesh_1d, in_specs=P("x"), out_specs=P())(v)

# %% [markdown]
# ### The data-parallel layer, manual mode
#
# Once more we reuse `layer`, `x`, `W` and `b`.

# %% [raw]
# # BEGIN QUESTION
# name: q7_dp_manual
# points: 2

# %% [markdown]
# **Task 7** (`q7_dp_manual`). Make the layer data-parallel by hand:
#
# * `layer_manual(x, W, b)`: computes the layer with `jax.shard_map` on a 1-D mesh of 4 or 8
#   devices, each device handling its block of rows of `x` with the full `W` and `b`;
# * `out_man = layer_manual(x, W, b)`.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
mesh_manual = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,), devices=devices)
layer_manual = jax.jit(jax.shard_map(layer, mesh=mesh_manual, in_specs=(P("batch"), P(), P()),
                                     out_specs=P("batch")))
# END SOLUTION
""" # BEGIN PROMPT
layer_manual = ...
""" # END PROMPT
out_man = layer_manual(x, W, b)  # SOLUTION

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q7_form(layer_manual, out_man):
    import jaxlab_form as form
    form.expect_callable("layer_manual", form.evidence(layer_manual))
    form.expect_on_mesh("out_man", form.evidence(out_man), shape=(128, 2))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q7_dp_manual(layer_manual, out_man):
    import jaxlab_lab3
    jaxlab_lab3.check("q7_dp_manual", layer_manual=layer_manual, out_man=out_man)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %%
if answered(out_man):
    print(out_man.shape)
    jax.debug.visualize_array_sharding(out_man)

# %% [markdown]
# ## Training a network with automatic parallelisation
#
# Below is a small feedforward network for a regression problem, much like the one of Lab 2. To
# see a real speedup from sharding you need several GPUs or TPUs: on a CPU, `jax.jit` already
# spreads such a program over all cores by itself (watch a resource monitor such as `htop` while
# it trains), so splitting it into 8 simulated devices adds work rather than saving it. The task
# is worth doing on a CPU all the same: the code is the same on a TPU.
#
# `train` waits for each step to finish (`jax.block_until_ready`) before it queues the next one:
# queuing a hundred sharded steps at once is what can starve XLA's communication threads on a
# small machine (see the setup cell), and the progress bar then also shows real progress.

# %%
from tqdm import tqdm


def f(x):
    """The curve the data is drawn around."""
    return jnp.sin(6 * x) - 0.5 * x**2


def gen_data(key, f, n=100, sigma=0.1, xmin=0.0, xmax=2.0):
    keys = jax.random.split(key, 2)
    x = jax.random.uniform(keys[0], shape=(n, 1), minval=xmin, maxval=xmax)
    y = f(x) + sigma * jax.random.normal(keys[1], shape=(n, 1))
    return x, y


def random_layer_params(n_in, n_out, key, scale=1e-1):
    w_key, b_key = jax.random.split(key)
    return (scale * jax.random.normal(w_key, (n_in, n_out)),
            scale * jax.random.normal(b_key, (n_out,)))


def init_network_params(sizes, key):
    keys = jax.random.split(key, len(sizes) - 1)
    return [random_layer_params(m, n, k) for m, n, k in zip(sizes[:-1], sizes[1:], keys)]


def forward(params, x):
    for w, b in params[:-1]:
        x = jnp.tanh(jnp.dot(x, w) + b)
    final_w, final_b = params[-1]
    return jnp.dot(x, final_w) + final_b


def loss(params, x, y):
    return jnp.mean(jnp.square(forward(params, x) - y))


grad_loss = jax.jit(jax.grad(loss, argnums=0))


def train(params, x, y, epochs=100, step_size=1e-3):
    for _ in tqdm(range(epochs), desc="training"):
        grads = grad_loss(params, x, y)
        params = [(W - step_size * dW, b - step_size * db)
                  for (W, b), (dW, db) in zip(params, grads)]
        params = jax.block_until_ready(params)
    return params

# %%
global_key = jax.random.key(seed=0)
gen_key, *keys = jax.random.split(global_key, 3)

if devices[0].platform == "cpu":  # 8 simulated devices share a few cores: keep it small
    n = 1024
    layer_sizes = [1, 256, 256, 1]
else:
    n = 8192 * 2
    layer_sizes = [1, 8192, 8192, 8192, 1]

x_train, y_train = gen_data(keys[0], f, n=n)
params = init_network_params(layer_sizes, keys[1])

grad_loss(params, x_train, y_train);  # compile once before training

# %%
params_single = train(params, x_train, y_train)

# %% [raw]
# # BEGIN QUESTION
# name: q8_sharded_training
# points: 2

# %% [markdown]
# **Task 8** (`q8_sharded_training`). Train the same network data-parallel with automatic
# parallelisation (a mesh whose axes are `Auto`, as in Task 5):
#
# * `x_train_sharded`, `y_train_sharded`: the training data, split along the batch dimension
#   over **all** the devices;
# * `params_replicated`: the initial `params` (a list of `(W, b)` pairs), replicated on the same
#   devices;
# * `params_trained_sharded = train(params_replicated, x_train_sharded, y_train_sharded)`.
#
# The result should match `params_single` and still be replicated.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
# BEGIN SOLUTION NO PROMPT
mesh_train = jax.make_mesh((len(devices),), ("batch",), axis_types=(AxisType.Auto,),
                           devices=devices)
data_sharding = NamedSharding(mesh_train, P("batch"))
# END SOLUTION
x_train_sharded = jax.device_put(x_train, data_sharding)  # SOLUTION
y_train_sharded = jax.device_put(y_train, data_sharding)  # SOLUTION
params_replicated = jax.device_put(params, NamedSharding(mesh_train, P()))  # SOLUTION
params_trained_sharded = train(params_replicated, x_train_sharded, y_train_sharded)  # SOLUTION

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q8_form(x_train_sharded, y_train_sharded, params_replicated, params_trained_sharded):
    import jaxlab_form as form
    form.expect_on_mesh("x_train_sharded", form.evidence(x_train_sharded))
    form.expect_on_mesh("y_train_sharded", form.evidence(y_train_sharded))
    form.expect_kind("params_replicated", form.evidence(params_replicated), "list",
                     "a list of (W, b) pairs like `params`")
    form.expect_kind("params_trained_sharded", form.evidence(params_trained_sharded), "list",
                     "the list of (W, b) pairs that `train` returns")

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q8_sharded_training(x_train_sharded, y_train_sharded, params_replicated,
                             params_trained_sharded):
    import jaxlab_lab3
    jaxlab_lab3.check("q8_sharded_training", x_train_sharded=x_train_sharded,
                      y_train_sharded=y_train_sharded, params_replicated=params_replicated,
                      params_trained_sharded=params_trained_sharded)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %% [markdown]
# The fitted curves, single-device and sharded, next to the data and the true curve:

# %%
import matplotlib.pyplot as plt

grid = jnp.linspace(0.0, 2.0, 200).reshape(-1, 1)
fig, ax = plt.subplots(figsize=(7, 4))
ax.scatter(np.asarray(x_train), np.asarray(y_train), s=4, alpha=0.3, label="training data")
ax.plot(grid, f(grid), "k--", label="true curve f")
ax.plot(grid, forward(params_single, grid), label="fit on one device")
if isinstance(params_trained_sharded, list):
    ax.plot(grid, forward(params_trained_sharded, grid), ":", lw=3, label="fit, sharded data")
ax.set_xlabel("x")
ax.set_ylabel("y")
ax.legend()
plt.show()

# %% [raw]
# # BEGIN QUESTION
# name: q9_timing
# points: 1

# %% [markdown]
# **Task 9** (`q9_timing`). How long does one call of `grad_loss` take on the unsharded data
# (`params`, `x_train`, `y_train`) and on the sharded data (`params_replicated`,
# `x_train_sharded`, `y_train_sharded`)?
#
# * `seconds_per_call(fn, *args)`: a function that returns the seconds one call `fn(*args)`
#   takes (a float), timed properly:
#   * call `fn` once before timing, so that compilation is not counted;
#   * JAX returns before the computation has finished (asynchronous dispatch), so wait for the
#     result with `jax.block_until_ready` inside the timed region;
#   * average over several calls, at most 100 (`time.perf_counter` or `timeit`).
#
#   The hidden checks also try it on other functions whose first call is slow and whose result
#   is ready only some time after the call returns.
# * `time_unsharded`, `time_sharded`: the seconds per call of `grad_loss` on the unsharded and
#   on the sharded data, measured with your `seconds_per_call`.
#
# With 8 TPUs or GPUs the sharded call is several times faster. On a CPU it is usually slower,
# for the reason given above the training code.

# %% [raw]
# # BEGIN SOLUTION

# %%
### Your code here
import time


def seconds_per_call(fn, *args, repeats=10):
    # BEGIN SOLUTION
    jax.block_until_ready(fn(*args))  # compile and warm up
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeats
    # END SOLUTION


time_unsharded = seconds_per_call(grad_loss, params, x_train, y_train)  # SOLUTION
time_sharded = seconds_per_call(grad_loss, params_replicated, x_train_sharded, y_train_sharded)  # SOLUTION
# BEGIN SOLUTION NO PROMPT
print(f"unsharded: {time_unsharded * 1e3:.1f} ms per call")
print(f"sharded:   {time_sharded * 1e3:.1f} ms per call")
print(f"speedup:   {time_unsharded / time_sharded:.2f}x")
# END SOLUTION

# %% [raw]
# # END SOLUTION

# %% [raw]
# # BEGIN TESTS

# %%
""" # BEGIN TEST CONFIG
points: 0
""" # END TEST CONFIG
def test_q9_form(seconds_per_call, time_unsharded, time_sharded):
    import jaxlab_form as form
    form.expect_callable("seconds_per_call", form.evidence(seconds_per_call))
    form.expect_number("time_unsharded", form.evidence(time_unsharded))
    form.expect_number("time_sharded", form.evidence(time_sharded))

# %%
""" # BEGIN TEST CONFIG
hidden: true
""" # END TEST CONFIG
def test_q9_timing(seconds_per_call, time_unsharded, time_sharded):
    import jaxlab_lab3
    jaxlab_lab3.check("q9_timing", seconds_per_call=seconds_per_call,
                      time_unsharded=time_unsharded, time_sharded=time_sharded)

# %% [raw]
# # END TESTS

# %% [raw]
# # END QUESTION

# %% [markdown]
# **Question (written, graded by hand).** Why is the sharded version slower than the unsharded
# one on this CPU, while it is faster on 8 TPUs? Answer in two or three sentences in the cell
# below.

# %% [markdown]
# *Your answer here.*
