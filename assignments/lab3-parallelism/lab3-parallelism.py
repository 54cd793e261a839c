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
#   of that task and tells you what is still wrong: on the notebook's own inputs (its `A`, `mesh`,
#   `x`, `W`, `b`, training data, `layer` and `params_single`) they check your values against the
#   notebook's own single-device results, how your arrays are laid out over the devices (mesh,
#   axis types, which dimension is split), what your functions print and how they are built (a
#   `shard_map` and its `in_specs`, `jax.jit`), and your timing function on a stand-in whose
#   every call takes a known time. When your graded notebook runs, hidden checks do the same on
#   new inputs of other sizes, so a function that only works for the notebook's own arrays still
#   loses its points.
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
#   collective: a cell of the explicit section counts the collectives in the compiled sum).
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
# The cell also sets `PJRT_NPROC`, which sets the size of the thread pool that XLA's CPU backend
# runs the simulated devices on (otherwise one thread per core). On machines with only a couple
# of CPU cores, a long queue of sharded steps can hold up those threads: XLA then waits for a
# collective that some device never reaches, and may abort the kernel with a message like
# "Expected 8 threads to join the rendezvous". On a 2-core machine, a loop of 100 sharded steps
# queued without waiting aborted this way after about 40 seconds in 3 runs of 3 when the machine
# was idle, and in 1 run of 9 when it was busy; with `PJRT_NPROC` set it finished every time.
#
# Finally, on Linux the cell tells the C library to give large freed buffers straight back to the
# operating system (`mallopt(M_MMAP_THRESHOLD, 128 KiB)`). Without it, memory that the training
# steps free can stay reserved by the kernel process. How much depends on the machine (the C
# library keeps a pool of memory per thread, up to 8 per core): this notebook, run whole with its
# solutions on a 2-core machine, peaked at 588 MiB without the setting and 528 MiB with it. A
# default Gradescope grading container has 768 MB; the last cell of the notebook prints this
# kernel's peak.
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
# JAX has started now, so asking for another number of CPU devices is refused:

# %% tags=["claim:lab3-devices-fixed-at-start"]
try:
    jax.config.update("jax_num_cpu_devices", 4)
    print("asking for 4 CPU devices now: accepted")
except RuntimeError as exc:
    print(f"asking for 4 CPU devices now: RuntimeError: {str(exc)[:90]}")
print(f"CPU devices: {len(jax.devices('cpu'))}")

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
# shardings. Such an array is not *committed* to its device: JAX may move it to wherever the
# other arguments of a computation live.

# %% tags=["claim:lab3-default-device"]
A = jnp.arange(64.0).reshape(4, 16)
print(f"{A.device = }")
print(f"{A.sharding = }")
print(f"{A.committed = }")

# %% [markdown]
# Functions that create arrays, such as `jnp.ones` or `jnp.zeros`, take an optional `device`
# argument: `None`, a `Device`, or a `Sharding`. Given a device or a sharding, the new array is
# *committed* to it: computations with it run there, and mixing it with an array committed to
# other devices is an error rather than a silent copy.

# %% tags=["claim:lab3-committed"]
ones_on_1 = jnp.ones((4, 16), device=devices[1])
print(f"{ones_on_1.device = }")
print(f"{ones_on_1.sharding = }")
print(f"{ones_on_1.committed = }")
print(f"(ones_on_1 + A).device = {(ones_on_1 + A).device}   (A, not committed, was moved)")
try:
    ones_on_1 + jnp.ones((4, 16), device=devices[2])
    print("ones_on_1 + an array committed to device 2: computed")
except ValueError as exc:
    print(f"ones_on_1 + an array committed to device 2: ValueError: {str(exc)[:60]}...")

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
# The mesh below is a 2 × 4 grid whose first axis is named `x` and second `y`. Since JAX 0.9
# (announced in the changelog of JAX 0.8.1) a new mesh's axes are *explicit* unless you say
# otherwise, as the cell prints, so we ask for `Auto` axes here; the explicit kind comes later in
# the lab.

# %% tags=["claim:lab3-make-mesh-default-explicit"]
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto, AxisType.Auto),
                     devices=devices)
print(mesh)
print(f"JAX {jax.__version__}: axis types of a mesh made without axis_types: "
      f"{jax.make_mesh((2, 4), ('x', 'y'), devices=devices).axis_types}")

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
# **Task 1** (`q1_device_put`). Place the array `A` on the devices with the sharding `sharding`
# defined above and store the result as `A_sharded` (`jax.device_put` does this; any other way
# that gives `A_sharded` the values of `A` and that sharding is fine too). Then draw its sharding
# with `jax.debug.visualize_array_sharding`: the drawing is for you, the checks read `A_sharded`.

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
def test_q1_public(A_sharded, A):
    import numpy as np
    from jax.sharding import PartitionSpec as P
    import jaxlab_form as form
    a = form.evidence(A_sharded)
    if a["kind"] == "none" and form.kernel_fault("A_sharded") is None:
        raise AssertionError("`A_sharded` holds None; expected A placed with `sharding`. "
                             "jax.debug.visualize_array_sharding draws an array and returns None: "
                             "store what jax.device_put returns, then draw that.")
    form.expect_on_mesh("A_sharded", a, shape=(4, 16))
    form.expect_close("A_sharded", a["value"], np.asarray(A), "the values of A", rtol=0, atol=0)
    if a["dtype"] != "float32":
        raise AssertionError(f"`A_sharded` holds {a['dtype']} values; expected the float32 "
                             "array A itself placed on the devices (place A, not a new array).")
    sev = a["sharding"]
    axes = dict(zip(sev["axis_names"], zip(sev["mesh_shape"], sev["axis_types"])))
    if axes != {"x": (2, "Auto"), "y": (4, "Auto")}:
        found = ", ".join(f"'{n}': {k} ({t})" for n, (k, t) in axes.items())
        raise AssertionError(f"`A_sharded` lives on a mesh with axes {{{found}}}; expected the "
                             "lab's `mesh` (2 × 4, axes 'x' and 'y', both Auto): place it with "
                             "`sharding`.")
    if not form.is_laid_out_as(sev, 2, P("x", "y")):
        raise AssertionError(f"`A_sharded` is {form.describe_sharding(sev)}; expected rows split "
                             "over 'x' and columns over 'y', as `sharding` = "
                             "NamedSharding(mesh, P('x', 'y')) says.")

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
def test_q2_public(A_sharded_devices, A_shard_shape, devices):
    import jaxlab_form as form
    found = form.evidence(A_sharded_devices)
    form.expect_kind("A_sharded_devices", found, "set",
                     "a set of devices (for example what `A_sharded.devices()` returns)")
    if not all(d["kind"] == "device" for d in found["items"]):
        raise AssertionError("`A_sharded_devices` should hold jax devices only; it holds "
                             + ", ".join(form.describe(d) for d in found["items"]) + ".")
    held = {(d["platform"], d["id"]) for d in found["items"]}
    if held != {(d.platform, d.id) for d in devices}:
        raise AssertionError(f"`A_sharded_devices` holds {len(held)} device(s); `A_sharded` is "
                             "spread over all 8 devices of `mesh`.")
    shape = form.evidence(A_shard_shape)
    form.expect_kind("A_shard_shape", shape, "tuple", "a tuple such as (rows, columns)")
    numbers = [s.get("value") for s in shape["items"] if s["kind"] == "number" and s["is_int"]]
    # the (4, 16) array A, rows split over 'x' (2) and columns over 'y' (4)
    if len(numbers) != len(shape["items"]) or tuple(numbers) != (2, 4):
        shown = tuple(int(n) for n in numbers) if len(numbers) == len(shape["items"]) \
            else form.describe(shape)
        raise AssertionError(f"`A_shard_shape` is {shown}; each device holds a block of shape "
                             "(2, 4) of the (4, 16) array A.")

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
def test_q3_public(shard_shapes, replicas):
    import math
    from jax.sharding import PartitionSpec as P
    import jaxlab_form as form
    mesh_sizes, shape = {"x": 2, "y": 4}, (4, 16)  # the lab's `mesh` and A
    specs = [P("x", None), P(None, "y"), P(None, None), P(None, "x")]
    for name, table in (("shard_shapes", shard_shapes), ("replicas", replicas)):
        ev = form.evidence(table)
        form.expect_kind(name, ev, "dict", "a dict keyed by the four partition specs")
        keys = [k for k, _ in ev["items"]]
        odd = [k for k in keys if k["kind"] != "spec"]
        if odd:
            raise AssertionError(f"`{name}` should be keyed by PartitionSpec objects such as "
                                 f"P('x', None); one key is {form.describe(odd[0])}.")
        for spec in specs:
            if spec not in table:
                shown = ", ".join(form.spec_repr(k["entries"]) for k in keys) or "none"
                trim = lambda e: list(e)[:max([i + 1 for i, a in enumerate(e) if a is not None],
                                              default=0)]
                alike = [k for k in keys if trim(k["entries"]) == trim(spec)]
                hint = (f" {form.spec_repr(alike[0]['entries'])} lays A out as "
                        f"{form.spec_repr(list(spec))} does, but it is another key: "
                        f"`{name}[{form.spec_repr(list(spec))}]` raises KeyError. Key the dict "
                        "by the four specs as the task writes them." if alike else "")
                raise AssertionError(f"`{name}` has no entry for {form.spec_repr(list(spec))}; "
                                     f"its keys are: {shown}.{hint}")
    for spec in specs:
        used = [e for e in spec if e is not None]
        blocks = tuple(n // (mesh_sizes[e] if e else 1) for n, e in zip(shape, spec))
        copies = math.prod(k for a, k in mesh_sizes.items() if a not in used)
        got = form.evidence(shard_shapes[spec])
        ints = [i["value"] for i in got.get("items", []) if i["kind"] == "number" and i["is_int"]]
        if got["kind"] != "tuple" or len(ints) != len(got["items"]) or tuple(ints) != blocks:
            shown = tuple(int(i) for i in ints) if got["kind"] == "tuple" and \
                len(ints) == len(got["items"]) else form.describe(got)
            raise AssertionError(f"`shard_shapes[{form.spec_repr(list(spec))}]` is {shown}; with {form.spec_repr(list(spec))} on the "
                                 f"2 × 4 `mesh` each device holds a block of shape {blocks} of "
                                 "the (4, 16) array A (a tuple).")
        count = form.evidence(replicas[spec])
        if count["kind"] != "number" or not count["is_int"] or count["value"] != copies:
            raise AssertionError(f"`replicas[{form.spec_repr(list(spec))}]` is {form.describe(count)}; with {form.spec_repr(list(spec))} "
                                 f"each distinct block of A is held by {copies} device(s) "
                                 "(an int).")

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
# To see what the compiler made of a function, ask `jax.jit` for the compiled program:
# `jax.jit(fn).lower(*args).compile().as_text()` is the program (in XLA's language, HLO) that
# each device runs. The helper below counts the communication operations, the *collectives*, in
# it, and a second one lists which devices hold the same block of an array:

# %%
import collections
import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(fn, *args):
    """How many of each collective the compiled program of jax.jit(fn)(*args) runs."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    found = re.findall(r"\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", text)
    return dict(collections.Counter(found))


def holders(array):
    """For each distinct block of `array`, the devices (positions in `devices`) that hold it."""
    found = collections.defaultdict(list)
    for device, index in array.sharding.devices_indices_map(array.shape).items():
        found[str(index)].append(devices.index(device))
    return sorted(sorted(ids) for ids in found.values())

# %% [markdown]
# For an elementwise function the output keeps the input's sharding, whether the input is
# sharded or sits on one device, and the compiled program needs no communication (`{}`: no
# collectives):

# %% tags=["claim:lab3-elementwise-keeps-sharding"]
if answered(A_sharded):
    print(f"same sharding as A_sharded: {Z.sharding == A_sharded.sharding}")
    print(f"collectives: {collectives(f_elementwise, A_sharded)}")
print(f"same sharding as A: {f_elementwise(A).sharding == A.sharding}")

# %% [markdown]
# In less simple computations the compiler decides how the sharding propagates. Take the sum
# over the first axis, i.e. the column sums:

# %% tags=["claim:lab3-column-sums-allreduce"]
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
    print(f"devices holding the same column sums: {holders(Z)}")
    print(f"collectives: {collectives(column_sums, A_sharded)}")

# %% [markdown]
# The result is *partially replicated*: the first four column sums are held by both devices 0
# and 4, the next four by devices 1 and 5, and so on. Each device first summed the two rows of
# its block; then the compiler added one all-reduce (a collective that adds up a value over a
# group of devices and gives every device of the group the total) between the two devices that
# hold the same columns, i.e. over mesh axis `x`.

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
def test_q4_public(B, C, B_plus_C, BtC):
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P
    import jaxlab_form as form
    ev = {name: form.evidence(value) for name, value in
          (("B", B), ("C", C), ("B_plus_C", B_plus_C), ("BtC", BtC))}
    for name, axis, other in (("B", "x", "y"), ("C", "y", "x")):
        form.expect_on_mesh(name, ev[name], shape=(4, 8))
        sev = ev[name]["sharding"]
        axes = dict(zip(sev["axis_names"], zip(sev["mesh_shape"], sev["axis_types"])))
        if axes != {"x": (2, "Auto"), "y": (4, "Auto")}:
            found = ", ".join(f"'{n}': {k} ({t})" for n, (k, t) in axes.items())
            raise AssertionError(f"`{name}` lives on a mesh with axes {{{found}}}; expected the "
                                 "lab's `mesh` (2 × 4, axes 'x' and 'y', both Auto).")
        if not any(form.is_laid_out_as(sev, 2, spec) for spec in (P(axis, None), P(None, axis))):
            raise AssertionError(
                f"`{name}` is {form.describe_sharding(sev)}; expected one of its dimensions split "
                f"along mesh axis '{axis}' and the array replicated along '{other}' (spec "
                f"P('{axis}', None) or P(None, '{axis}')).")
    if ev["B"]["sharding"]["device_ids"] != ev["C"]["sharding"]["device_ids"]:
        raise AssertionError("`C` is on other devices than `B`; put both on `mesh`.")
    b, c = ev["B"]["value"].astype(np.float64), ev["C"]["value"].astype(np.float64)
    for name, op, ref, shape, fn in (
            ("B_plus_C", "B + C", b + c, (4, 8), lambda u, v: u + v),
            ("BtC", "B.T @ C", b.T @ c, (8, 8), lambda u, v: u.T @ v)):
        form.expect_array(name, ev[name], shape=shape)
        form.expect_close(name, ev[name]["value"], ref, f"{op} of your B and C", rtol=1e-4,
                          atol=1e-5)
        propagated = jax.jit(fn)(B, C).sharding  # what propagation gives from your B and C
        actual = form.rebuild_sharding(ev[name]["sharding"])
        if actual is None or not actual.is_equivalent_to(propagated, 2):
            raise AssertionError(
                f"`{name}` is {form.describe_sharding(ev[name]['sharding'])}, but {op} of the "
                f"sharded B and C comes out as "
                f"{form.describe_sharding(form.sharding_evidence(propagated))}; compute it "
                f"directly as `{op}` from the sharded arrays.")

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

# %% tags=["claim:lab3-unsharded-layer-default-device"]
out = layer(x, W, b)
print(out.shape)
print(out.sharding)
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
def test_q5_public(x_auto, W_auto, b_auto, out_auto, x, W, b, layer):
    import numpy as np
    from jax.sharding import PartitionSpec as P
    import jaxlab_form as form
    RTOL, ATOL = 1e-4, 1e-5  # float32 sums in another order
    ev = {n: form.evidence(v) for n, v in
          (("x_auto", x_auto), ("W_auto", W_auto), ("b_auto", b_auto), ("out_auto", out_auto))}
    form.expect_on_mesh("x_auto", ev["x_auto"], shape=(128, 10))
    sev = ev["x_auto"]["sharding"]
    mesh_words = ", ".join(f"'{n}': {k}" for n, k in zip(sev["axis_names"], sev["mesh_shape"]))
    if len(sev["mesh_shape"]) != 1 or sev["mesh_shape"][0] not in (4, 8):
        raise AssertionError(f"`x_auto` lives on a mesh with axes {{{mesh_words}}}; expected a "
                             "1-D mesh of 4 or 8 devices.")
    axis = sev["axis_names"][0]
    if sev["axis_types"][0] != "Auto":
        raise AssertionError(f"the mesh axis '{axis}' of `x_auto` is {sev['axis_types'][0]}; "
                             "expected an Auto axis (pass axis_types=(AxisType.Auto,) to "
                             "jax.make_mesh).")
    form.expect_close("x_auto", ev["x_auto"]["value"], np.asarray(x), "the lab's data `x`",
                      rtol=RTOL, atol=ATOL)
    if not form.is_laid_out_as(sev, 2, P(axis)):
        raise AssertionError(f"`x_auto` is {form.describe_sharding(sev)}; expected it split along "
                             f"the batch axis (dimension 0) across the mesh axis '{axis}' (spec "
                             f"P('{axis}')).")
    for name, value, shape in (("W_auto", W, (10, 2)), ("b_auto", b, (2,))):
        form.expect_on_mesh(name, ev[name], shape=shape)
        form.expect_close(name, ev[name]["value"], np.asarray(value), f"the lab's `{name[0]}`",
                          rtol=RTOL, atol=ATOL)
        if ev[name]["sharding"]["device_ids"] != sev["device_ids"] or \
                ev[name]["sharding"]["axis_names"] != sev["axis_names"]:
            raise AssertionError(f"`{name}` is on another mesh than `x_auto`; put them on the "
                                 "same mesh.")
        if not form.is_laid_out_as(ev[name]["sharding"], len(shape), P()):
            raise AssertionError(f"`{name}` is {form.describe_sharding(ev[name]['sharding'])}; "
                                 "expected it replicated on every device of the mesh (spec P()).")
    out = ev["out_auto"]
    form.expect_array("out_auto", out, shape=(128, 2))
    form.expect_close("out_auto", out["value"], np.asarray(layer(x, W, b)),
                      "layer(x, W, b) computed on one device", rtol=RTOL, atol=ATOL)
    if out["sharding"]["kind"] != "NamedSharding" or \
            out["sharding"]["device_ids"] != sev["device_ids"] or \
            not form.is_laid_out_as(out["sharding"], 2, P(axis)):
        raise AssertionError(f"`out_auto` is {form.describe_sharding(out['sharding'])}; expected "
                             f"it split like the data, along dimension 0 across the mesh axis "
                             f"'{axis}' of `x_auto`: compute it as layer(x_auto, W_auto, b_auto) "
                             "from the placed arrays.")

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
# of the arrays it meets (the last line multiplies a bfloat16 array by it).

# %% tags=["claim:lab3-typeof-host-values"]
np_array = np.arange(8)
print(f"JAX-level type of a NumPy array: {jax.typeof(np_array)}")
print(f"JAX-level type of a JAX array:   {jax.typeof(A)}")
print(f"JAX-level type of a Python float: {jax.typeof(4.2)}")
print(f"bfloat16 array times that float:  {jax.typeof(jnp.ones(2, jnp.bfloat16) * 4.2)}")

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

# %% tags=["claim:lab3-auto-type-says-nothing"]
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
# mesh axis `x`". Mesh axes that the type does not mention (here `y`) replicate the array: the
# four devices of each row of the mesh hold the same block.

# %% tags=["claim:lab3-explicit-type-replicates-unnamed-axes"]
jax.debug.visualize_array_sharding(A_explicit)
print(f"type of A_explicit: {jax.typeof(A_explicit)}")
print(f"devices holding the same block: {holders(A_explicit)}")

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
# before anything runs. `jax.jit(fn).trace(*args)` only traces `fn` (it compiles and runs
# nothing) and already gives the type of the result, sharding included:

# %% tags=["claim:lab3-types-known-at-trace-time"]
traced = jax.jit(lambda a, c: a * c).trace(col, row)
print(f"type of the product, from tracing alone: {traced.jaxpr.out_avals[0]}")

# %% [markdown]
# Explicit sharding fixes where arrays live; the compiler still inserts the communication a
# computation needs. The sum of all elements of `A_explicit` is a sum on each device of the block
# it holds, then one all-reduce of those partial sums:

# %% tags=["claim:lab3-explicit-sum-collective"]
print(f"type of the sum: {jax.typeof(jnp.sum(A_explicit))}")
print(f"collectives: {collectives(jnp.sum, A_explicit)}")

# %% [markdown]
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
def test_q6_public(x_explicit, W_explicit, b_explicit, layer_explicit, out_explicit, x, W, b,
                   layer):
    import contextlib
    import io
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P
    import jaxlab_form as form
    RTOL, ATOL = 1e-4, 1e-5  # float32 sums in another order
    ev = {n: form.evidence(v) for n, v in
          (("x_explicit", x_explicit), ("W_explicit", W_explicit), ("b_explicit", b_explicit),
           ("layer_explicit", layer_explicit), ("out_explicit", out_explicit))}
    form.expect_on_mesh("x_explicit", ev["x_explicit"], shape=(128, 10))
    sev = ev["x_explicit"]["sharding"]
    mesh_words = ", ".join(f"'{n}': {k}" for n, k in zip(sev["axis_names"], sev["mesh_shape"]))
    if len(sev["mesh_shape"]) != 1 or sev["mesh_shape"][0] not in (4, 8):
        raise AssertionError(f"`x_explicit` lives on a mesh with axes {{{mesh_words}}}; "
                             "expected a 1-D mesh of 4 or 8 devices.")
    axis = sev["axis_names"][0]
    if sev["axis_types"][0] != "Explicit":
        raise AssertionError(f"the mesh axis '{axis}' of `x_explicit` is "
                             f"{sev['axis_types'][0]}; expected an Explicit axis (pass "
                             "axis_types=(AxisType.Explicit,) to jax.make_mesh).")
    form.expect_close("x_explicit", ev["x_explicit"]["value"], np.asarray(x),
                      "the lab's data `x`", rtol=RTOL, atol=ATOL)
    if not form.is_laid_out_as(sev, 2, P(axis)):
        raise AssertionError(f"`x_explicit` is {form.describe_sharding(sev)}; expected it split "
                             f"along the batch axis (dimension 0) across the mesh axis '{axis}' "
                             f"(spec P('{axis}')).")
    for name, value, shape in (("W_explicit", W, (10, 2)), ("b_explicit", b, (2,))):
        form.expect_on_mesh(name, ev[name], shape=shape)
        form.expect_close(name, ev[name]["value"], np.asarray(value), f"the lab's `{name[0]}`",
                          rtol=RTOL, atol=ATOL)
        if ev[name]["sharding"]["device_ids"] != sev["device_ids"] or \
                ev[name]["sharding"]["axis_names"] != sev["axis_names"]:
            raise AssertionError(f"`{name}` is on another mesh than `x_explicit`; put them on "
                                 "the same mesh.")
        if not form.is_laid_out_as(ev[name]["sharding"], len(shape), P()):
            raise AssertionError(f"`{name}` is {form.describe_sharding(ev[name]['sharding'])}; "
                                 "expected it replicated on every device of the mesh (spec P()).")
    out = ev["out_explicit"]
    form.expect_array("out_explicit", out, shape=(128, 2))
    form.expect_close("out_explicit", out["value"], np.asarray(layer(x, W, b)),
                      "layer(x, W, b) computed on one device", rtol=RTOL, atol=ATOL)
    if out["typeof"] != f"float32[128@{axis},2]":
        raise AssertionError(f"the type of `out_explicit` is {out['typeof']}; expected "
                             f"float32[128@{axis},2] (rows split over '{axis}'): compute it as "
                             "layer_explicit(x_explicit, W_explicit, b_explicit).")
    form.expect_callable("layer_explicit", ev["layer_explicit"])
    if ev["layer_explicit"]["type"] != "PjitFunction":
        raise AssertionError("`layer_explicit` should be compiled with jax.jit (decorate it with "
                             f"@jax.jit); it is {form.describe(ev['layer_explicit'])}.")
    layer_explicit.clear_cache()  # traced again, so that it prints again
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            again = layer_explicit(x_explicit, W_explicit, b_explicit)
    except Exception as exc:
        raise AssertionError(f"`layer_explicit(x_explicit, W_explicit, b_explicit)` raised "
                             f"{form.student_error(exc)}.") from None
    form.expect_close("layer_explicit(x_explicit, W_explicit, b_explicit)", np.asarray(again),
                      np.asarray(layer(x, W, b)), "layer(x, W, b) computed on one device",
                      rtol=RTOL, atol=ATOL)
    wanted = {"x": str(jax.typeof(x_explicit)), "W": str(jax.typeof(W_explicit)),
              "b": str(jax.typeof(b_explicit)), "the output": f"float32[128@{axis},2]"}
    missing = [f"{what} ({t})" for what, t in wanted.items() if t not in printed.getvalue()]
    if missing:
        shown = printed.getvalue().strip().replace("\n", " | ")[:300] or "nothing"
        raise AssertionError("while tracing, `layer_explicit` should print the jax.typeof of x, "
                             "W, b and of the output. Traced again on x_explicit, W_explicit, "
                             f"b_explicit it printed: {shown}. Missing: " + ", ".join(missing)
                             + ".")

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
# which JAX 0.8.0 deprecated, as using it says:)

# %% tags=["claim:lab3-experimental-shard-map-deprecated"]
import warnings

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        from jax.experimental.shard_map import shard_map as old_shard_map
        warned = " | ".join(f"{w.category.__name__}: {w.message}" for w in caught)
        print(f"JAX {jax.__version__}: {warned or 'no warning'}")
    except ImportError as exc:
        print(f"JAX {jax.__version__}: removed ({exc})")

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

# %% tags=["claim:lab3-shard-map-sees-one-block"]
def show_block(block):
    print(f"shape of the block on one device: {block.shape}")
    print(f"type of the block: {jax.typeof(block)}")
    return block * 2


doubled = jax.shard_map(show_block, mesh=mesh_1d, in_specs=P("x"), out_specs=P("x"))(v)
print(f"global shape: {doubled.shape}")

# %% [markdown]
# The `{V:x}` in the block's type means *varying over mesh axis `x`*: the four devices may hold
# different values there. Inside `shard_map` JAX tracks, in each value's type, the mesh axes it
# varies over (the JAX docs explain it in "Tracking how values vary over manual mesh axes, and
# `check_vma=True`", in the `shard_map` tutorial); a value that is the same on every device of an
# axis is *invariant* over it, and its type does not name the axis.
#
# Since each device sees only its block, reductions such as a sum no longer mean what they mean
# for the whole array. Summing inside `shard_map` gives one partial sum per device, a value that
# still varies over `x`:

# %% tags=["claim:lab3-partial-sums-vary"]
def block_sum(block):
    partial = jnp.sum(block, keepdims=True)
    print(f"type of the block's sum: {jax.typeof(partial)}")
    return partial


print(jax.shard_map(block_sum, mesh=mesh_1d, in_specs=P("x"), out_specs=P("x"))(v))

# %% [markdown]
# To sum over all blocks, ask for communication with a **collective** such as `jax.lax.psum`,
# which adds up a value over a mesh axis. The result is the same on every device (its type no
# longer names `x`), so the output spec is `P()`, which means replicated:

# %% tags=["claim:lab3-psum-invariant"]
def total_sum(block):
    total = jax.lax.psum(block.sum(), "x")
    print(f"type after psum: {jax.typeof(total)}")
    return total


print(jax.shard_map(total_sum, mesh=mesh_1d, in_specs=P("x"), out_specs=P())(v))

# %% [markdown]
# `shard_map` reads these types: asked to return as replicated (`out_specs=P()`) a value that
# still varies over `x`, it refuses instead of returning one device's partial sum:

# %% tags=["claim:lab3-out-specs-checked"]
try:
    jax.shard_map(lambda block: block.sum(), mesh=mesh_1d, in_specs=P("x"), out_specs=P())(v)
    print("partial sums returned with out_specs=P(): accepted")
except ValueError as exc:
    print(f"partial sums returned with out_specs=P(): ValueError: {str(exc)[:110]}...")

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
def test_q7_public(layer_manual, out_man, x, W, b, layer):
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P
    import jaxlab_form as form
    RTOL, ATOL = 1e-4, 1e-5  # float32 sums in another order
    form.expect_callable("layer_manual", form.evidence(layer_manual))
    out = form.evidence(out_man)
    form.expect_array("out_man", out, shape=(128, 2))
    if out["sharding"]["kind"] != "NamedSharding":
        raise AssertionError(f"`out_man` lives {form.describe_sharding(out['sharding'])}; "
                             "expected it on the mesh of `layer_manual`: compute it as "
                             "layer_manual(x, W, b), whose shard_map puts the blocks together "
                             "on its mesh.")
    sev = out["sharding"]
    if len(sev["mesh_shape"]) != 1 or sev["mesh_shape"][0] not in (4, 8):
        mesh_words = ", ".join(f"'{n}': {k}" for n, k in zip(sev["axis_names"], sev["mesh_shape"]))
        raise AssertionError(f"`out_man` lives on a mesh with axes {{{mesh_words}}}; expected a "
                             "1-D mesh of 4 or 8 devices.")
    form.expect_close("out_man", out["value"], np.asarray(layer(x, W, b)),
                      "layer(x, W, b) computed on one device", rtol=RTOL, atol=ATOL)
    axis = sev["axis_names"][0]
    if not form.is_laid_out_as(sev, 2, P(axis)):
        raise AssertionError(f"`out_man` is {form.describe_sharding(sev)}; expected it split "
                             f"along the batch axis (dimension 0) across the mesh axis '{axis}' "
                             f"(spec P('{axis}')).")
    try:
        program = form.program_evidence(jax.make_jaxpr(layer_manual)(x, W, b))
    except Exception as exc:
        raise AssertionError(f"`layer_manual(x, W, b)` could not be traced: "
                             f"{form.student_error(exc)}.") from None
    if not program["shard_maps"]:
        raise AssertionError("`layer_manual` gives the right numbers but does not go through "
                             "jax.shard_map; this task asks you to write the per-device "
                             "computation with jax.shard_map.")
    for shape, what, dim, words in (
            ((128, 10), "x", 0, "each device handles its block of rows of x (in_specs P(axis))"),
            ((10, 2), "W", None, "each device uses the full W (in_specs P())"),
            ((2,), "b", None, "each device uses the full b (in_specs P())")):
        form.expect_operands_split("layer_manual", program, shape, what, dim, words)

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
# see a real speedup from sharding you need several GPUs or TPUs. On a CPU, XLA already runs the
# operations of one program on a pool of threads, one per core (watch a resource monitor such as
# `htop` while it trains), so 8 simulated devices only share out the same cores. Splitting the
# batch does not change the arithmetic (the cell after Task 8 counts the FLOPs of one gradient
# computation both ways); it adds an all-reduce of the whole gradient at every step, and the work
# of running 8 device programs in step on those cores. The task is worth doing on a CPU all the
# same: the code is the same on a TPU.
#
# `train` waits for each step to finish (`jax.block_until_ready`) before it queues the next one:
# a long queue of sharded steps can hold up XLA's threads on a small machine (see the setup
# cell), and the progress bar then also shows real progress.

# %%
from tqdm import tqdm


def f(x):
    """The curve the data is drawn around."""
    return jnp.sin(6 * x) - 0.5 * x**2


def gen_data(key, f, n=100, sigma=0.1, xmin=0.0, xmax=2.0):
    keys = jax.random.split(key, 2)
    inputs = jax.random.uniform(keys[0], shape=(n, 1), minval=xmin, maxval=xmax)
    targets = f(inputs) + sigma * jax.random.normal(keys[1], shape=(n, 1))
    return inputs, targets


def random_layer_params(n_in, n_out, key, scale=1e-1):
    w_key, b_key = jax.random.split(key)
    return (scale * jax.random.normal(w_key, (n_in, n_out)),
            scale * jax.random.normal(b_key, (n_out,)))


def init_network_params(sizes, key):
    keys = jax.random.split(key, len(sizes) - 1)
    return [random_layer_params(m, n, k) for m, n, k in zip(sizes[:-1], sizes[1:], keys)]


def forward(params, inputs):
    h = inputs
    for w, bias in params[:-1]:
        h = jnp.tanh(jnp.dot(h, w) + bias)
    final_w, final_b = params[-1]
    return jnp.dot(h, final_w) + final_b


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

# %% [markdown]
# The initial parameters `params` are committed to the first device (see "Sharding in JAX"): a
# computation never moves them to other devices by itself, so sharded training has to start
# from a copy placed on the mesh.

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
params = jax.device_put(init_network_params(layer_sizes, keys[1]), devices[0])

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
# The result should match `params_single` and still be replicated. So would training that never
# split the data (on one device, or with the data copied to every device): the cell after the
# plot prints what tells them apart.

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
def test_q8_public(x_train_sharded, y_train_sharded, params_replicated, params_trained_sharded,
                   x_train, y_train, params, params_single, devices):
    import numpy as np
    from jax.sharding import PartitionSpec as P
    import jaxlab_form as form
    RTOL, ATOL = 1e-4, 1e-5  # float32 sums in another order
    TRAIN_RTOL, TRAIN_ATOL = 1e-3, 1e-5  # 100 steps of float32 sums in another order
    xs = form.evidence(x_train_sharded)
    form.expect_on_mesh("x_train_sharded", xs)
    sev = xs["sharding"]
    if len(sev["devices"]) != len(devices):
        mesh_words = ", ".join(f"'{n}': {k}" for n, k in zip(sev["axis_names"], sev["mesh_shape"]))
        raise AssertionError(f"`x_train_sharded` lives on a mesh with axes {{{mesh_words}}}, i.e. "
                             f"on {len(sev['devices'])} devices; expected it split over all "
                             f"{len(devices)} devices.")
    explicit = [a for a, t in zip(sev["axis_names"], sev["axis_types"]) if t != "Auto"]
    if explicit:
        raise AssertionError(f"the mesh of `x_train_sharded` has axes of type Explicit "
                             f"({', '.join(repr(a) for a in explicit)}); expected automatic "
                             "parallelisation, as the task says: a mesh whose axes are Auto "
                             "(pass axis_types=(AxisType.Auto,) to jax.make_mesh, as in Task 5).")
    for name, value, label in (("x_train_sharded", x_train, "x_train"),
                               ("y_train_sharded", y_train, "y_train")):
        ev = xs if name == "x_train_sharded" else form.evidence(y_train_sharded)
        form.expect_on_mesh(name, ev, shape=tuple(value.shape))
        form.expect_close(name, ev["value"], np.asarray(value), f"the training data `{label}`",
                          rtol=RTOL, atol=ATOL)
        if ev["sharding"]["device_ids"] != sev["device_ids"]:
            raise AssertionError(f"`{name}` is on another mesh than `x_train_sharded`; put them "
                                 "on the same mesh.")
        if not form.is_laid_out_as(ev["sharding"], 2, P(tuple(sev["axis_names"]))):
            raise AssertionError(f"`{name}` is {form.describe_sharding(ev['sharding'])}; expected "
                                 "it split along the batch axis (dimension 0) over all the "
                                 "devices of the mesh.")
    for name, value, reference, what, rtol, atol in (
            ("params_replicated", params_replicated, params, "the initial `params`", RTOL, ATOL),
            ("params_trained_sharded", params_trained_sharded, params_single,
             "`params_single`, the parameters trained on one device", TRAIN_RTOL, TRAIN_ATOL)):
        ev = form.evidence(value)
        form.expect_kind(name, ev, "list", "a list of (W, b) pairs like `params`")
        if len(ev["items"]) != len(reference):
            raise AssertionError(f"`{name}` has {len(ev['items'])} layers; expected "
                                 f"{len(reference)} (W, b) pairs.")
        for i, (pair, ref) in enumerate(zip(ev["items"], reference)):
            if pair["kind"] not in ("tuple", "list") or len(pair["items"]) != 2:
                raise AssertionError(f"`{name}[{i}]` is {form.describe(pair)}; expected a (W, b) "
                                     "pair.")
            for j, (part, expected) in enumerate(zip(pair["items"], ref)):
                label = f"{name}[{i}][{j}]"
                form.expect_array(label, part, shape=tuple(expected.shape))
                form.expect_close(label, part["value"], np.asarray(expected), what, rtol=rtol,
                                  atol=atol)
                where = part["sharding"]
                if where["kind"] != "NamedSharding" or where["device_ids"] != sev["device_ids"] \
                        or not form.is_laid_out_as(where, len(expected.shape), P()):
                    raise AssertionError(
                        f"`{label}` is {form.describe_sharding(where)}; expected it replicated "
                        "on every device of the mesh of `x_train_sharded` (spec P())"
                        + (": train `params_replicated` on `x_train_sharded` and "
                           "`y_train_sharded`." if name == "params_trained_sharded" else "."))

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

# %% [markdown]
# The two fits agree, but that alone does not show that the data was split: training on one
# device, or with the whole data copied to every device, fits the same curve. What splitting
# changed is in the compiled gradient: the block of the data each device holds, how many devices
# share the work, the FLOPs (floating-point operations) each of them does, read from
# `compiled.cost_analysis()`, and the all-reduce that adds up the devices' gradients. The same
# arithmetic, in eighths, plus one all-reduce of the whole gradient:

# %% tags=["claim:lab3-sharded-gradient-step"]
import math


def gradient_costs(*args):
    """(FLOPs per device, collectives, bytes all-reduced) of one call of grad_loss on these
    arguments, read from its compiled program."""
    compiled = jax.jit(jax.grad(loss)).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # a list of one dict before JAX 0.4.36
    text = compiled.as_text()
    reduced = 0
    for line in text.splitlines():
        result = re.search(r"=\s*(.*?)\sall-reduce(?:-start)?\(", line)
        for dims in re.findall(r"f32\[([\d,]*)\]", result.group(1) if result else ""):
            reduced += 4 * math.prod(int(d) for d in dims.split(",") if d)
    found = re.findall(r"\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", text)
    return cost["flops"], dict(collections.Counter(found)), reduced


if answered(x_train_sharded, y_train_sharded, params_replicated) and all(
        isinstance(a, jax.Array) for a in jax.tree.leaves([x_train_sharded, params_replicated])):
    n_split = len(x_train_sharded.sharding.device_set)
    block = x_train_sharded.sharding.shard_shape(x_train_sharded.shape)
    print(f"x_train_sharded: a block of {block} of {x_train_sharded.shape} on each of "
          f"{n_split} devices")
    flops_one, _, _ = gradient_costs(params, x_train, y_train)
    flops_each, found, reduced = gradient_costs(params_replicated, x_train_sharded,
                                                y_train_sharded)
    print(f"one device: {flops_one:.4g} FLOPs per gradient")
    print(f"sharded:    {flops_each:.4g} FLOPs per device x {n_split} devices = "
          f"{flops_each * n_split:.4g}")
    print(f"collectives of the sharded gradient: {found}; all-reduced: {reduced:,} bytes, "
          f"the whole gradient is {sum(4 * p.size for p in jax.tree.leaves(params)):,}")

# %% [markdown]
# Whether the sharded call is faster depends on how much work one call holds. The cell below
# compiles (without running it) one gradient computation at this notebook's CPU sizes and at the
# sizes it uses when it runs on 8 accelerators (n = 16384, three hidden layers of 8192):

# %% tags=["claim:lab3-accelerator-sizes"]
mesh_costs = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,), devices=devices)


def abstract_problem(rows, sizes):
    """Shapes and shardings (no values) of the training problem: data split, params replicated."""
    replicated, split = NamedSharding(mesh_costs, P()), NamedSharding(mesh_costs, P("batch"))
    shaped = lambda shape, where: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=where)
    weights = [(shaped((m, k), replicated), shaped((k,), replicated))
               for m, k in zip(sizes[:-1], sizes[1:])]
    return weights, shaped((rows, 1), split), shaped((rows, 1), split)


for label, rows, sizes in (("CPU sizes", 1024, [1, 256, 256, 1]),
                           ("accelerator sizes", 16384, [1, 8192, 8192, 8192, 1])):
    flops_each, found, reduced = gradient_costs(*abstract_problem(rows, sizes))
    print(f"{label} (n = {rows}, layers {sizes}): {8 * flops_each:.3g} FLOPs per call, "
          f"{flops_each:.3g} per device; all-reduce of {reduced / 2**20:.3g} MiB")

# %% [markdown]
# At the accelerator sizes each of 8 GPUs does an eighth of 1.3e13 FLOPs and then all-reduces a
# 512 MiB gradient. This notebook cannot time 8 GPUs, but an estimate from nominal figures (an
# H100's 67 TFLOP/s in float32, about 450 GB/s between GPUs) gives about 25 ms of arithmetic plus
# 2 ms of all-reduce, against about 200 ms on one GPU: several times faster. At the CPU sizes (4.1e8 FLOPs) an accelerator finishes the
# arithmetic in microseconds and the all-reduce's fixed cost dominates. On a CPU, where the 8
# devices share the same cores, the sharded call is usually slower.

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
#   * call `fn` once before timing and wait for its result, so that neither compilation nor the
#     work of that call is counted;
#   * JAX returns before the computation has finished (asynchronous dispatch), so wait for the
#     result with `jax.block_until_ready` inside the timed region;
#   * average over several calls, at most 100: return their mean, the total time of the timed
#     calls divided by their number (`time.perf_counter` or `timeit`).
#
#   The public and hidden checks try it on a stand-in whose first call is slow, whose result is
#   ready only some time after the call returns, and whose calls do not all take the same time.
# * `time_unsharded`, `time_sharded`: the seconds per call of `grad_loss` on the unsharded and
#   on the sharded data, measured with your `seconds_per_call`.
#
# Compare the two times: at the CPU sizes the sharded call is usually the slower one (above the
# training code and the cells after Task 8 say why).

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
def test_q9_public(seconds_per_call, time_unsharded, time_sharded, grad_loss, params, x_train,
                   y_train, params_replicated, x_train_sharded, y_train_sharded):
    import math
    import time
    import numpy as np
    import jaxlab_form as form
    # a stand-in for a jitted function whose every duration is known: its first call blocks
    # FIRST s (compiling); then each call's work takes WORK steps of STEP s, one after the other
    # (one device), and its result is ready only then (asynchronous dispatch)
    FIRST, STEP, WORK, MAX_TIMED = 0.25, 0.03, (3, 1, 2, 1), 100
    TOLERANCE = 0.5  # steps on the total time of the timed calls; any usual slip is off by 1+
    TIMING_FACTOR = 10  # your two times, against your function run again here
    form.expect_callable("seconds_per_call", form.evidence(seconds_per_call))
    log = {"entered": [], "ready": [], "waits": [], "busy": 0.0}

    class Result:
        def __init__(self, index):
            self.index = index

        def block_until_ready(self):
            time.sleep(max(0.0, log["ready"][self.index] - time.perf_counter()))
            log["waits"].append((self.index, time.perf_counter()))
            return self

        def __array__(self, dtype=None, copy=None):
            self.block_until_ready()
            return np.zeros((), dtype or np.float32)

    def f(*args, **kwargs):
        k = len(log["entered"])
        if k > MAX_TIMED:
            log["too_many"] = True
            raise RuntimeError(f"f was called more than {MAX_TIMED + 1} times")
        log["entered"].append(time.perf_counter())
        if k == 0:
            time.sleep(FIRST)
        steps = WORK[0] if k == 0 else WORK[1 + (k - 1) % (len(WORK) - 1)]
        log["busy"] = max(log["busy"], time.perf_counter()) + steps * STEP
        log["ready"].append(log["busy"])
        return Result(k)

    test = (f"`seconds_per_call(f, x)` was tried on a function f whose first call takes {FIRST} s "
            "(as compiling does) and whose every call returns at once with a result that is "
            f"ready only when its work is done, {STEP * 1e3:.0f} to {2 * STEP * 1e3:.0f} ms after "
            "the previous call's (as JAX's asynchronous dispatch does)")
    try:
        t = seconds_per_call(f, np.float32(1.0))
    except Exception as exc:
        if log.get("too_many"):
            raise AssertionError(f"{test}; it called f more than {MAX_TIMED + 1} times. It should "
                                 "call f once before the clock starts, then time several calls, "
                                 f"at most {MAX_TIMED} as the task says.") from None
        raise AssertionError(f"{test}; it raised {form.student_error(exc)}. It should call f once, "
                             f"then time a few calls (at most {MAX_TIMED}) and return the seconds "
                             "per call.") from None
    ev = form.evidence(t)
    if ev["kind"] != "number" or not math.isfinite(ev["value"]):
        raise AssertionError(f"{test}; it returned {form.describe(ev)}; expected the seconds per "
                             "call (a float).")
    t, entered, waits, n = ev["value"], log["entered"], log["waits"], len(log["entered"])
    if n < 3:
        raise AssertionError(f"{test}; it called f {n} time(s), so at most {n - 1} call(s) after "
                             "the first (compiling) one can have been timed; expected an average "
                             "over at least 2 timed calls.")
    if not waits or t < STEP / 2:
        raise AssertionError(f"{test}. It returned {t:.3g} s per call; expected the mean time of "
                             f"the calls after the first, each of which works {STEP} s or more: "
                             "the clock stopped before the results were ready. Wait for them "
                             "with jax.block_until_ready inside the timed region.")
    end = max(w for _, w in waits)
    totals = []
    for warm in (1, 2):  # calls before the clock: once, as the task says (twice does no harm)
        waited = [w for i, w in waits if i == warm - 1 and w <= entered[warm]] if n > warm else []
        totals.append((n - warm, end - min(waited, default=log["ready"][warm - 1])))
    if not any(2 <= m <= MAX_TIMED and abs(t * m - total) <= TOLERANCE * STEP
               for m, total in totals):
        m, total = totals[0]
        raise AssertionError(
            f"{test}. It called f {n} times; the {m} calls after the first took {total:.4g} s in "
            f"all, so expected their mean, {total / m:.4g} s per call, but it returned {t:.4g} s "
            "per call. Call f once and wait for its result before starting the clock (so that neither "
            "compiling nor that call's work is counted), then time several calls (at most "
            f"{MAX_TIMED}), waiting for each result inside the timed region, and return their "
            "total time divided by their number.")
    for name, value, args, data in (
            ("time_unsharded", time_unsharded, (params, x_train, y_train), "unsharded"),
            ("time_sharded", time_sharded, (params_replicated, x_train_sharded, y_train_sharded),
             "sharded")):
        ev = form.evidence(value)
        form.expect_number(name, ev)
        try:
            again = float(seconds_per_call(grad_loss, *args))
        except Exception as exc:
            raise AssertionError(f"`{name}` could not be compared: seconds_per_call(grad_loss, ...) "
                                 f"on the {data} data raised {form.student_error(exc)}.") from None
        if not again / TIMING_FACTOR < ev["value"] < again * TIMING_FACTOR:
            raise AssertionError(f"`{name}` is {ev['value']:.3g} s per call, but your "
                                 f"seconds_per_call, run again here on grad_loss and the {data} "
                                 f"data, measures {again:.3g} s; expected about the same: time "
                                 "grad_loss on exactly the arguments the task names.")

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
# **Question (written, graded by hand).** If the sharded version was slower than the unsharded
# one on your CPU (it usually is), why? And why would it be faster on 8 TPUs or GPUs at the
# accelerator sizes? Answer in two or three sentences in the cell below.

# %% [markdown]
# *Your answer here.*

# %% [markdown]
# This kernel's peak memory so far (the setup cell says why it matters: a default Gradescope
# grading container has 768 MB):

# %% tags=["claim:lab3-peak-memory"]
import sys


def peak_mib():
    """This kernel's peak resident memory in MiB, or None where the system does not say."""
    if sys.platform.startswith("linux"):
        # VmHWM belongs to this process's own memory. ru_maxrss would not do on Linux: it keeps
        # the peak of the process the kernel was started from (a Jupyter server, a grader).
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10  # kB
    try:
        import resource
    except ImportError:  # Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # bytes on macOS


peak = peak_mib()
print("peak memory of this kernel: " + ("not available on this system" if peak is None else f"{peak:.0f} MiB"))
