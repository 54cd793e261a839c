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
#   answer (usually a `def`) and run it. The cell after it, `grader.check("q…")`, runs the
#   **public checks** on this notebook's own inputs (the arrays, meshes and batches built above
#   the task): they compare your results with the notebook's own references (`convolve`,
#   `jnp.sum`, `expected_product`, `loss_single` and `grad_single`, `update_single` and
#   `params_single`), check where the result lives (its sharding), and read the program your
#   function traces (`jax.make_jaxpr`) to see which collectives it uses, in which order, and how
#   its `in_specs` split each input. The slowest takes a few seconds on a CPU. **Hidden checks**
#   run when your notebook is graded: they do the same on **new random inputs**, of other sizes
#   where a task says "any", against references computed in float64. So use the collective each
#   task names, and avoid the one it rules out.
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
# Lab 3 needs to stay inside a 768 MB grading container; this lab peaks well below that (the last
# cell prints the kernel's peak memory).
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
# Several of those cells also measure what a program communicates and how much memory it needs,
# from the program XLA compiles for this notebook's devices (`jax.jit(f).lower(*args).compile()`):
# `print_collectives` lists the **collectives** in the compiled program's text (which operation,
# what it returns on one device, and its size in bytes), and `memory` reads `memory_analysis()`:
# the bytes one device holds for the program's arguments, for its outputs, and as **scratch**
# (temporary buffers while it runs). They describe what runs on these devices; XLA may compile
# the same program differently for GPUs or TPUs.

# %%
import math
import re
from collections import Counter

COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
# one collective per line of the compiled text, `%name = TYPE OP(operands), attributes`; TYPE is a
# tuple where XLA combined several arrays into one collective, and GPUs write OP-start / OP-done
_COLLECTIVE = re.compile(r"= (\(.*?\)|\S+) (" + "|".join(COLLECTIVE_OPS) + r")(-start)?\((.*)$",
                         re.M)
_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4,
               "f64": 8, "s64": 8, "u64": 8}


def collectives(fn, *args):
    """The collectives of the program XLA compiles for `fn(*args)`, in program order: for each,
    (operation, what it returns on one device, bytes, its (source, target) device pairs or None)."""
    found = []
    for m in _COLLECTIVE.finditer(jax.jit(fn).lower(*args).compile().as_text()):
        types = re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", m.group(1))
        size = sum(_ITEM_BYTES[t] * math.prod(int(n) for n in dims.split(",") if n)
                   for t, dims in types)
        what = "{}[{}]".format(*types[0]) if len(types) == 1 else f"{len(types)} arrays"
        pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", m.group(4))
        pairs = pairs and tuple(tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}",
                                                                         pairs.group(1)))
        found.append((m.group(2) + (m.group(3) or ""), what, size, pairs))
    free_compiled()
    return found


def _moves(pairs):
    """A collective-permute's (source, target) pairs in words, for a ring of len(pairs) devices."""
    steps = {(target - source) % len(pairs) for source, target in pairs}
    if len(steps) != 1 or len(pairs) != N_DEVICES:
        return f", pairs {list(pairs)}"
    step = steps.pop()
    return {1: ", each device to the next", N_DEVICES - 1: ", each device to the previous"}.get(
        step, f", each device to the one {step} after it")


def print_collectives(label, fn, *args):
    """Print `collectives(fn, *args)`: how many of each, what each returns and its size."""
    found = collectives(fn, *args)
    total = sum(size for _, _, size, _ in found)
    print(f"{label}: " + (f"{len(found)} collective(s), {total:,} bytes in all" if found
                          else "no collective"))
    kinds = Counter((op, what, size, _moves(pairs) if pairs else "")
                    for op, what, size, pairs in found)
    for (op, what, size, moves), n in kinds.items():
        print(f"  {n:2d} x {op} returning {what} ({size:,} bytes){moves}")


def memory(fn, *args):
    """(arguments, outputs, scratch): the bytes one device holds for the program XLA compiles."""
    m = jax.jit(fn).lower(*args).compile().memory_analysis()
    free_compiled()
    return m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes


def free_compiled():
    """Give back the memory of the programs compiled so far. Every measurement compiles one:
    kept, they took this notebook from 350 to 520 MiB (JAX 0.10.2, CPU)."""
    jax.clear_caches()
    try:  # glibc only, as in the setup cell
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass

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
# team recommends `jax.shard_map` (Lab 3) for new code (JAX 0.8.0's changelog: "`jax.pmap` is in
# maintenance mode and we encourage all new code to use `jax.shard_map` directly"; since then
# `jax.pmap` is itself implemented with `jax.jit` and `jax.shard_map`), and this lab uses only
# `shard_map`.
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

# %% tags=["claim:lab4-unbound-axis"]
try:
    lax.psum(jnp.arange(3.0), "p")
except NameError as err:
    print(f"{type(err).__name__}: {err}")

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
def test_q1_public(normalized_convolution, convolve, xs_conv, w, one_d_mesh):
    # the notebook's own inputs and references, read as the hidden checks read new ones
    import re

    import jax
    import numpy as np
    import jaxlab_form as form
    from jax.sharding import PartitionSpec as P

    fail = form.fail

    form.expect_callable("normalized_convolution", form.evidence(normalized_convolution))
    conv = np.stack([np.asarray(convolve(x, w), np.float64) for x in xs_conv])
    expected = conv / conv.sum(axis=0)
    vmapped = jax.vmap(normalized_convolution, in_axes=(0, None), axis_name="p")
    sharded = jax.shard_map(lambda x, w: normalized_convolution(x[0], w)[None],
                            mesh=one_d_mesh("p"), in_specs=(P("p"), P()), out_specs=P("p"))
    for how, fn in (("jax.vmap(normalized_convolution, in_axes=(0, None), axis_name='p')",
                     vmapped),
                    ("jax.shard_map over a mesh axis 'p' (one example per device)", sharded)):
        call = f"normalized_convolution under {how} on xs_conv"
        out = form.call(call, fn, xs_conv, w)
        form.expect_shape(call, out, expected.shape)
        form.expect_close(call, out, expected, "each example's convolution (as `convolve` "
                          "computes it) divided by the sum of the convolutions over all "
                          "examples (a psum over the axis 'p')", rtol=1e-4, atol=1e-5)
    used, _ = form.traced("normalized_convolution", vmapped, xs_conv, w)
    form.expect_collectives("normalized_convolution", used, required=("psum",), shard_map=False)

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
# the leading axis back. The cell prints the type of one device's block, read inside `shard_map`
# with `jax.typeof`: `{V:p}` says that the block **varies** over the mesh axis `'p'` (each device
# holds another one).

# %% tags=["claim:lab4-block-shape"]
mesh_p = one_d_mesh("p")
block_types = []
jax.shard_map(lambda x: block_types.append(jax.typeof(x)) or x, mesh=mesh_p, in_specs=P("p"),
              out_specs=P("p"))(xs_conv)
print("one device's block of xs_conv inside shard_map:", block_types[0])
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
# sharded over `mesh` (spec `P('i')`), computed with `jax.shard_map` on `mesh`: each device sums
# its own block, and **one** collective adds up the eight partial sums (one number per device).
# The result must be a scalar, replicated on every device (`out_specs=P()`). It should work for
# any length divisible by 8.

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
def test_q2_public(global_sum, v):
    # the notebook's own inputs and references, read as the hidden checks read new ones
    import re

    import jax
    import numpy as np
    import jaxlab_form as form
    from jax.sharding import PartitionSpec as P

    fail = form.fail

    def mesh_axis(name, program, axis, mesh_name):
        for sm in program["shard_maps"]:
            if sm["axis_names"] != [axis]:
                axes = ", ".join(repr(a) for a in sm["axis_names"])
                fail(f"`{name}` runs jax.shard_map on a mesh whose axis is {axes}; expected what "
                     f"the task says: jax.shard_map on `{mesh_name}`, whose axis is '{axis}'.")

    def body(program):
        return [step for sm in program["shard_maps"] for step in sm["body"]]

    form.expect_callable("global_sum", form.evidence(global_sum))
    call = "global_sum(v)"
    out = form.call(call, global_sum, v)
    if isinstance(out, jax.Array) and out.shape == (8,):
        fail(f"`{call}` returned 8 numbers, one per device; add them up with a collective "
             "inside the shard_map and return a scalar replicated on every device "
             "(out_specs=P()).")
    form.expect_shape(call, out, ())
    form.expect_close(call, out, np.sum(np.asarray(v), dtype=np.float64),
                      "jnp.sum(v), the sum of all 32 entries of v", rtol=1e-4, atol=1e-5)
    used, program = form.traced("global_sum", global_sum, v)
    form.expect_collectives("global_sum", used, required=("psum",), forbidden=("all_gather",),
                            why=": each device sums its own block, then one psum adds the "
                                "partial sums")
    mesh_axis("global_sum", program, "i", "mesh")
    form.expect_laid_out(call, out, P(), "replicated", 8)
    form.expect_operands_split("global_sum", program, v.shape, "x", 0,
                               "x is sharded over `mesh` (spec P('i'))")
    moves = ("psum", "psum_invariant", "psum2", "all_gather", "all_gather_invariant",
             "reduce_scatter", "ppermute", "all_to_all", "pmax", "pmin")

    found = [(prim, shapes) for prim, shapes in body(program) if prim in moves]
    if len(found) != 1 or len(found[0][1]) != 1 or np.prod(found[0][1][0]) != 1:
        names = {"psum_invariant": "psum", "psum2": "psum", "reduce_scatter": "psum_scatter",
                 "all_gather_invariant": "all_gather"}
        what = ", ".join(f"`{names.get(p, p)}` of an array of shape "
                         f"{tuple(s[0]) if s else ()}" for p, s in found) or "none"
        fail(f"`global_sum` communicates {len(found)} time(s) inside its shard_map ({what}); "
             "expected what the task says: each device sums its own block, and one collective "
             "adds up the eight partial sums (one number per device).")

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

# %% [markdown]
# Your sum against `jnp.sum`, and what `global_sum` communicates once compiled. Two wrong answers
# print the same number: a `psum` of each device's whole block before summing it (an all-reduce of
# 4 numbers per device instead of one) and an `all_gather` of the blocks (all 32 entries on every
# device). The one collective of the task adds up one scalar per device: 4 bytes.

# %% tags=["claim:lab4-one-scalar-sum"]
if answered(global_sum):
    print(global_sum(v), jnp.sum(v))
    print_collectives("global_sum(v), compiled", global_sum, v)

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
def test_q3_public(matmul_allgather, lhs, rhs, expected_product):
    # the notebook's own inputs and references, read as the hidden checks read new ones
    import re

    import jax
    import numpy as np
    import jaxlab_form as form
    from jax.sharding import PartitionSpec as P

    fail = form.fail

    def mesh_axis(name, program, axis, mesh_name):
        for sm in program["shard_maps"]:
            if sm["axis_names"] != [axis]:
                axes = ", ".join(repr(a) for a in sm["axis_names"])
                fail(f"`{name}` runs jax.shard_map on a mesh whose axis is {axes}; expected what "
                     f"the task says: jax.shard_map on `{mesh_name}`, whose axis is '{axis}'.")

    def body(program):
        return [step for sm in program["shard_maps"] for step in sm["body"]]

    form.expect_callable("matmul_allgather",
                         form.evidence(matmul_allgather))
    call = "matmul_allgather(lhs, rhs)"
    out = form.call(call, matmul_allgather, lhs, rhs)
    form.expect_shape(call, out, expected_product.shape)
    form.expect_close(call, out, expected_product, "`expected_product`, lhs @ rhs of the "
                      "notebook's matrices", rtol=1e-4, atol=1e-4)
    used, program = form.traced("matmul_allgather", matmul_allgather,
                                lhs, rhs)
    form.expect_collectives("matmul_allgather", used, required=("all_gather",),
                            forbidden=(),
                            why=": gather the blocks of rhs, then multiply locally")
    mesh_axis("matmul_allgather", program, "i", "mesh")
    form.expect_laid_out(call, out, P("i", None),
                         "the result sharded by rows (out_specs=P('i', None))", 8)
    form.expect_operands_split("matmul_allgather", program,
                               lhs.shape, "lhs", 0,
                               "lhs is sharded by rows (P('i', None))")
    form.expect_operands_split("matmul_allgather", program,
                               rhs.shape, "rhs", 0, "rhs is sharded by rows (P('i', None))")

    seen = False
    for prim, _ in body(program):
        if prim in ('all_gather', 'all_gather_invariant'):
            seen = True
        elif prim in ('dot_general',) and not seen:
            fail(f"`matmul_allgather` runs a matrix product before any `all_gather` in its "
                 "shard_map; "
                 "expected what the task says: to gather rhs with all_gather, then multiply "
                 "locally.")

    for prim, shapes in body(program):
        if prim in ("all_gather", "all_gather_invariant") and np.prod(shapes[0]) != rhs.size:
            fail(f"`matmul_allgather` gathers an array of shape {tuple(shapes[0])} with "
                 f"all_gather; expected what the task says: gather rhs (shape {rhs.shape}), "
                 "then multiply locally.")

    form.expect_jitted("matmul_allgather", program)

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

# %% [markdown]
# Your product, what it communicates, and the memory one device needs for it. Gathering `lhs`
# too and keeping this device's rows prints `True` as well: the collectives tell it apart (a
# second all-gather, of all of `lhs`). The gathered `rhs` is all of `rhs` (64 × 16 floats,
# 4,096 bytes), and the compiled program's scratch holds it.

# %% tags=["claim:lab4-allgather-holds-rhs"]
if answered(matmul_allgather):
    print(jnp.allclose(matmul_allgather(lhs, rhs), expected_product, atol=1e-4))
    print_collectives("matmul_allgather(lhs, rhs), compiled", matmul_allgather, lhs, rhs)
    print(f"all of rhs: {rhs.nbytes:,} bytes; scratch of one device: "
          f"{memory(matmul_allgather, lhs, rhs)[2]:,} bytes")

# %% [markdown]
# ### Example 2: overlap communication and computation with a ring
#
# In Example 1 no multiplication can start before the `all_gather` has finished, and every device
# briefly holds all of `rhs`. Instead, the blocks of `rhs` can travel around a **ring**: at each
# step, every device multiplies the block of `rhs` it holds right now with the matching columns
# of its `lhs` block, and passes its `rhs` block on to its neighbour with
# `jax.lax.ppermute(x, 'i', perm)`, where `perm` lists `(source, destination)` pairs such as
# `[(k, (k + 1) % 8) for k in range(8)]`. After 8 steps every device has seen every block. On
# accelerators XLA can run the next transfer while the current product is computed (the JAX
# `shard_map` guide shows it in a TPU profile); whether it does depends on the backend and its
# scheduler. On this notebook's CPU devices each transfer is an ordinary step of the program
# (`collective-permute`, not the `collective-permute-start` / `-done` pair of a transfer that runs
# in the background): the cell after the task shows it.
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
def test_q4_public(matmul_allgather_overlapped, lhs, rhs, expected_product):
    # the notebook's own inputs and references, read as the hidden checks read new ones
    import re

    import jax
    import numpy as np
    import jaxlab_form as form
    from jax.sharding import PartitionSpec as P

    fail = form.fail

    def mesh_axis(name, program, axis, mesh_name):
        for sm in program["shard_maps"]:
            if sm["axis_names"] != [axis]:
                axes = ", ".join(repr(a) for a in sm["axis_names"])
                fail(f"`{name}` runs jax.shard_map on a mesh whose axis is {axes}; expected what "
                     f"the task says: jax.shard_map on `{mesh_name}`, whose axis is '{axis}'.")

    form.expect_callable("matmul_allgather_overlapped",
                         form.evidence(matmul_allgather_overlapped))
    call = "matmul_allgather_overlapped(lhs, rhs)"
    out = form.call(call, matmul_allgather_overlapped, lhs, rhs)
    form.expect_shape(call, out, expected_product.shape)
    form.expect_close(call, out, expected_product, "`expected_product`, lhs @ rhs of the "
                      "notebook's matrices", rtol=1e-4, atol=1e-4)
    used, program = form.traced("matmul_allgather_overlapped", matmul_allgather_overlapped,
                                lhs, rhs)
    form.expect_collectives("matmul_allgather_overlapped", used, required=("ppermute",),
                            forbidden=("all_gather", "psum"),
                            why=": blocks of rhs must travel around a ppermute ring instead")
    mesh_axis("matmul_allgather_overlapped", program, "i", "mesh")
    form.expect_laid_out(call, out, P("i", None),
                         "the result sharded by rows (out_specs=P('i', None))", 8)
    form.expect_operands_split("matmul_allgather_overlapped", program,
                               lhs.shape, "lhs", 0,
                               "lhs is sharded by rows (P('i', None))")
    form.expect_operands_split("matmul_allgather_overlapped", program,
                               rhs.shape, "rhs", 0, "rhs is sharded by rows (P('i', None))")

    form.expect_jitted("matmul_allgather_overlapped", program)

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

# %% [markdown]
# Your ring, what it communicates, and its scratch memory against Task 3's. The answer of Task 3
# prints `True` here too, and so does a ring that also gathers: the collectives tell them apart.
# A ring over 8 devices moves 7 blocks of `rhs` (8 × 16 floats, 512 bytes) to each device, one
# `ppermute` at a time (a shift after the last product would move a block nobody uses, and XLA
# drops it), and no device holds all of `rhs` at once.

# %% tags=["claim:lab4-ring-permutes"]
if answered(matmul_allgather_overlapped):
    print(jnp.allclose(matmul_allgather_overlapped(lhs, rhs), expected_product, atol=1e-4))
    print_collectives("matmul_allgather_overlapped(lhs, rhs), compiled",
                      matmul_allgather_overlapped, lhs, rhs)
    print(f"scratch of one device: {memory(matmul_allgather_overlapped, lhs, rhs)[2]:,} bytes")
    if answered(matmul_allgather):
        print(f"scratch of one device with Task 3's all_gather: "
              f"{memory(matmul_allgather, lhs, rhs)[2]:,} bytes (all of rhs: {rhs.nbytes:,})")

# %% [markdown]
# ### Example 3: `psum_scatter` of partial products
#
# Now shard `lhs` by **columns** and `rhs` by rows. Device `k` holds columns block `k` of `lhs`
# and rows block `k` of `rhs`, so its local product `lhs_block @ rhs_block` has the full shape of
# the result but is only one of eight **summands**. `jax.lax.psum` would add them up and give
# every device the whole result. `jax.lax.psum_scatter(x, 'i', tiled=True)` adds them up and
# gives each device only its block of rows of the sum, so the result comes out sharded by rows,
# and there is less to send: an all-reduce can be done as a reduce-scatter followed by an
# all-gather, and is "twice as expensive as an AllGather" (*How to Scale Your Model*, chapter
# "Sharded Matrices and How to Multiply Them"), while a reduce-scatter costs about as much as an
# all-gather. The cell after the task compares what each returns to one device.

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
def test_q5_public(matmul_psumscatter, lhs_by_cols, rhs, expected_product):
    # the notebook's own inputs and references, read as the hidden checks read new ones
    import re

    import jax
    import numpy as np
    import jaxlab_form as form
    from jax.sharding import PartitionSpec as P

    fail = form.fail

    def mesh_axis(name, program, axis, mesh_name):
        for sm in program["shard_maps"]:
            if sm["axis_names"] != [axis]:
                axes = ", ".join(repr(a) for a in sm["axis_names"])
                fail(f"`{name}` runs jax.shard_map on a mesh whose axis is {axes}; expected what "
                     f"the task says: jax.shard_map on `{mesh_name}`, whose axis is '{axis}'.")

    def body(program):
        return [step for sm in program["shard_maps"] for step in sm["body"]]

    form.expect_callable("matmul_psumscatter",
                         form.evidence(matmul_psumscatter))
    call = "matmul_psumscatter(lhs_by_cols, rhs)"
    out = form.call(call, matmul_psumscatter, lhs_by_cols, rhs)
    form.expect_shape(call, out, expected_product.shape)
    form.expect_close(call, out, expected_product, "`expected_product`, lhs @ rhs of the "
                      "notebook's matrices", rtol=1e-4, atol=1e-4)
    used, program = form.traced("matmul_psumscatter", matmul_psumscatter,
                                lhs_by_cols, rhs)
    form.expect_collectives("matmul_psumscatter", used, required=("psum_scatter",),
                            forbidden=(),
                            why=": multiply locally, then psum_scatter the partial products")
    mesh_axis("matmul_psumscatter", program, "i", "mesh")
    form.expect_laid_out(call, out, P("i", None),
                         "the result sharded by rows (out_specs=P('i', None))", 8)
    form.expect_operands_split("matmul_psumscatter", program,
                               lhs_by_cols.shape, "lhs", 1,
                               "lhs is sharded by columns (P(None, 'i'))")
    form.expect_operands_split("matmul_psumscatter", program,
                               rhs.shape, "rhs", 0, "rhs is sharded by rows (P('i', None))")

    seen = False
    for prim, _ in body(program):
        if prim in ('dot_general',):
            seen = True
        elif prim in ('reduce_scatter',) and not seen:
            fail(f"`matmul_psumscatter` runs `psum_scatter` before any matrix product in its "
                 "shard_map; "
                 "expected what the task says: to multiply locally, then combine the partial "
                 "products with psum_scatter.")

    form.expect_jitted("matmul_psumscatter", program)

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

# %% [markdown]
# Your product and what it communicates, beside the same partial products added up with `psum`
# (every device then holds the whole 32 × 16 result). A `psum` followed by keeping this device's
# rows prints `True` too: its all-reduce returns eight times what the reduce-scatter returns.

# %% tags=["claim:lab4-psum-scatter-bytes"]
if answered(matmul_psumscatter):
    print(jnp.allclose(matmul_psumscatter(lhs_by_cols, rhs), expected_product, atol=1e-4))
    print_collectives("matmul_psumscatter(lhs_by_cols, rhs), compiled", matmul_psumscatter,
                      lhs_by_cols, rhs)
    summed = jax.shard_map(lambda lhs_block, rhs_block: lax.psum(lhs_block @ rhs_block, "i"),
                           mesh=mesh, in_specs=(lhs_cols_spec, rhs_spec), out_specs=P())
    print_collectives("the partial products added up with psum, compiled", summed,
                      lhs_by_cols, rhs)

# %% [markdown]
# ### Example 4: a ring of partial sums
#
# `psum_scatter` must wait for the whole local product. A ring again lets communication and
# computation overlap (where the backend schedules them so, as in Example 2), this time moving
# **partial sums** instead of inputs: cut the rows of the
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
def test_q6_public(matmul_psumscatter_overlapped, lhs_by_cols, rhs, expected_product):
    # the notebook's own inputs and references, read as the hidden checks read new ones
    import re

    import jax
    import numpy as np
    import jaxlab_form as form
    from jax.sharding import PartitionSpec as P

    fail = form.fail

    def mesh_axis(name, program, axis, mesh_name):
        for sm in program["shard_maps"]:
            if sm["axis_names"] != [axis]:
                axes = ", ".join(repr(a) for a in sm["axis_names"])
                fail(f"`{name}` runs jax.shard_map on a mesh whose axis is {axes}; expected what "
                     f"the task says: jax.shard_map on `{mesh_name}`, whose axis is '{axis}'.")

    form.expect_callable("matmul_psumscatter_overlapped",
                         form.evidence(matmul_psumscatter_overlapped))
    call = "matmul_psumscatter_overlapped(lhs_by_cols, rhs)"
    out = form.call(call, matmul_psumscatter_overlapped, lhs_by_cols, rhs)
    form.expect_shape(call, out, expected_product.shape)
    form.expect_close(call, out, expected_product, "`expected_product`, lhs @ rhs of the "
                      "notebook's matrices", rtol=1e-4, atol=1e-4)
    used, program = form.traced("matmul_psumscatter_overlapped", matmul_psumscatter_overlapped,
                                lhs_by_cols, rhs)
    form.expect_collectives("matmul_psumscatter_overlapped", used, required=("ppermute",),
                            forbidden=("psum_scatter", "psum", "all_gather"),
                            why=": partial sums must travel around a ppermute ring instead")
    mesh_axis("matmul_psumscatter_overlapped", program, "i", "mesh")
    form.expect_laid_out(call, out, P("i", None),
                         "the result sharded by rows (out_specs=P('i', None))", 8)
    form.expect_operands_split("matmul_psumscatter_overlapped", program,
                               lhs_by_cols.shape, "lhs", 1,
                               "lhs is sharded by columns (P(None, 'i'))")
    form.expect_operands_split("matmul_psumscatter_overlapped", program,
                               rhs.shape, "rhs", 0, "rhs is sharded by rows (P('i', None))")

    form.expect_jitted("matmul_psumscatter_overlapped", program)

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

# %% [markdown]
# Your ring and what it communicates. The answer of Task 5 prints `True` here too: the collectives
# tell it apart. A ring of partial sums moves 7 partial sums to each device, each the size of one
# device's block of the result (4 × 16 floats, 256 bytes), and nothing else.

# %% tags=["claim:lab4-ring-partial-sums"]
if answered(matmul_psumscatter_overlapped):
    print(jnp.allclose(matmul_psumscatter_overlapped(lhs_by_cols, rhs), expected_product,
                       atol=1e-4))
    print_collectives("matmul_psumscatter_overlapped(lhs_by_cols, rhs), compiled",
                      matmul_psumscatter_overlapped, lhs_by_cols, rhs)

# %% [markdown]
# ### Extension (not graded): bidirectional rings
#
# A ring that sends in one direction uses only half of a bidirectional interconnect: on TPUs,
# whose links between neighbours carry data both ways, the JAX `shard_map` guide notes that such
# a ring "uses only half the interconnect bandwidth by permuting in only one direction".
# Splitting each block in two halves and sending one half up the ring and the other down uses
# both directions: the same bytes in all, half of them each way. Here is the version of
# Example 2, with what it communicates; try writing the one of Example 4 yourself.

# %% tags=["claim:lab4-bidi-both-directions"]
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
print_collectives("matmul_allgather_overlapped_bidi(lhs, rhs), compiled",
                  matmul_allgather_overlapped_bidi, lhs, rhs)

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
# devices exchange **one scalar**. Its gradient is another matter: every device needs the sum of
# all the devices' gradients, so a training step all-reduces the whole gradient, as large as the
# model (670 KB here), every step. The cell after the task measures both.
#
# **The gradient trap.** The hidden checks take `jax.grad` of your loss function and compare it
# with `jax.grad(loss)`. `jax.grad` of a `shard_map`ped function with respect to replicated
# (`P()`) inputs **sums** the gradient contributions of the devices (the transpose of replicating
# a value is summing it). So take the gradient of the averaged loss (`pmean` inside), and do not
# average gradients again yourself. The same holds for a `jax.grad` taken *inside* the function,
# as long as `shard_map` checks which values vary over the mesh axis (`check_vma=True`, the
# default): the replicated parameters meet each device's own data through an implicit cast to
# "varying" (`pvary` in the traced program, `jax.lax.pcast(..., to='varying')` when written by
# hand), whose transpose is a `psum`. So the older `pmap` recipe "compute local gradients, then
# `pmean` them" gives, inside `shard_map`, **8 times** the true gradient on 8 devices; with
# `check_vma=False` the local gradients stay local and the recipe gives the true gradient. The
# next cell measures both on this part's model and batch. Part D comes back to this.

# %%
mesh_batch = one_d_mesh("batch")
batch_dp = jax.device_put(batch, NamedSharding(mesh_batch, P("batch")))
params_dp = jax.device_put(params, NamedSharding(mesh_batch, P()))

# %% tags=["claim:lab4-grad-trap"]
for check_vma in (True, False):
    pmap_recipe = jax.shard_map(lambda params, batch: lax.pmean(jax.grad(loss)(params, batch),
                                                                "batch"),
                                mesh=mesh_batch, in_specs=(P(), P("batch")), out_specs=P(),
                                check_vma=check_vma)
    ratios = [float(jnp.linalg.norm(g) / jnp.linalg.norm(h)) for g, h in zip(
        jax.tree.leaves(jax.jit(pmap_recipe)(params_dp, batch_dp)), jax.tree.leaves(grad_single))]
    traced = Counter(re.findall(r"\b(pvary|psum\w*)\[", str(jax.make_jaxpr(pmap_recipe)(
        params_dp, batch_dp))))
    print(f"check_vma={check_vma}: local gradients, then pmean: {min(ratios):.3f} to "
          f"{max(ratios):.3f} times the true gradient (parameter by parameter); traced: "
          + ", ".join(f"{n} {p}" for p, n in sorted(traced.items())))
free_compiled()

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
def test_q7_public(loss_dp, params_dp, batch_dp, loss_single, grad_single):
    # the notebook's own inputs and references, read as the hidden checks read new ones
    import re

    import jax
    import numpy as np
    import jaxlab_form as form
    from jax.sharding import PartitionSpec as P

    fail = form.fail

    def mesh_axis(name, program, axis, mesh_name):
        for sm in program["shard_maps"]:
            if sm["axis_names"] != [axis]:
                axes = ", ".join(repr(a) for a in sm["axis_names"])
                fail(f"`{name}` runs jax.shard_map on a mesh whose axis is {axes}; expected what "
                     f"the task says: jax.shard_map on `{mesh_name}`, whose axis is '{axis}'.")

    def body(program):
        return [step for sm in program["shard_maps"] for step in sm["body"]]

    def loss_and_grad(name, loss_fn, params, batch, loss_single, grad_single):
        call = f"{name}(params, batch)"
        value = form.call(call, jax.jit(loss_fn), params, batch)
        form.expect_shape(call, value, ())
        ref = float(loss_single)
        if np.isclose(float(value), 8 * ref, rtol=1e-3):
            fail(f"`{call}` is {float(value):.6g}, 8 times the loss {ref:.6g}: psum adds up the "
                 "per-device mean losses. Average them with jax.lax.pmean (or divide the psum "
                 "by 8).")
        form.expect_close(call, value, ref, "`loss_single`, the single-device loss of the "
                          "notebook's params and batch", rtol=1e-3, atol=1e-4)
        grad_call = f"jax.grad({name})(params, batch)"
        grads = form.call(grad_call, jax.jit(jax.grad(loss_fn)), params, batch)
        leaves, expected = jax.tree.leaves(grads), jax.tree.leaves(grad_single)
        if len(leaves) != len(expected) or any(np.shape(a) != b.shape
                                               for a, b in zip(leaves, expected)):
            fail(f"`{grad_call}` has {len(leaves)} arrays; expected the 6 (W, b) pairs of "
                 "`params`, shaped like them.")
        if all(np.allclose(a, 8 * np.asarray(b), rtol=1e-3, atol=1e-4)
               for a, b in zip(leaves, expected)):
            fail(f"`{grad_call}` is 8 times the gradient of the single-device loss. Inside "
                 "jax.shard_map, jax.grad with respect to replicated parameters already sums "
                 "the gradient over the devices; check which collective you apply and to what.")
        for i, (a, b) in enumerate(zip(leaves, expected)):
            form.expect_close(f"{grad_call}[{i // 2}][{i % 2}]", a, b, "`grad_single`, the "
                              "gradient of the single-device loss", rtol=1e-3, atol=1e-4)

    form.expect_callable("loss_dp", form.evidence(loss_dp))
    loss_and_grad("loss_dp", loss_dp, params_dp, batch_dp, loss_single, grad_single)
    used, program = form.traced("loss_dp", loss_dp, params_dp, batch_dp)
    form.expect_collectives("loss_dp", used, required=("psum",), forbidden=("all_gather",),
                            why=": each device computes the loss of its part of the batch with the"
                            " full (replicated) parameters, and one pmean/psum combines the "
                            "scalars")
    mesh_axis("loss_dp", program, "batch", "mesh_batch")

    for leaf, what in zip(batch_dp, ("the inputs of the batch", "the targets of the batch")):
        form.expect_operands_split("loss_dp", program, leaf.shape, what, 0,
                                   "the batch is sharded along its first axis (P('batch'))")
    for leaf in jax.tree.leaves(params_dp):
        form.expect_operands_split("loss_dp", program, leaf.shape, "a parameter", None,
                                   "the parameters are replicated (P())")
    moves = ("psum", "psum_invariant", "psum2", "all_gather", "all_gather_invariant",
             "reduce_scatter", "ppermute", "all_to_all", "pmax", "pmin")

    found = [(prim, shapes) for prim, shapes in body(program) if prim in moves]
    if len(found) != 1 or len(found[0][1]) != 1 or np.prod(found[0][1][0]) != 1:
        names = {"psum_invariant": "psum", "psum2": "psum", "reduce_scatter": "psum_scatter",
                 "all_gather_invariant": "all_gather"}
        what = ", ".join(f"`{names.get(p, p)}` of an array of shape "
                         f"{tuple(s[0]) if s else ()}" for p, s in found) or "none"
        fail(f"`loss_dp` communicates {len(found)} time(s) inside its shard_map ({what}); "
             "expected what the task says: the losses of the devices are combined with one "
             "scalar collective (one pmean or psum of the local loss).")

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

# %% [markdown]
# Your loss and gradient against the single-device ones, and what each communicates once
# compiled. Gathering the whole batch onto every device and computing the loss there gives the
# same loss and gradient: its collectives tell it apart (all-gathers of the batch). The loss
# itself needs one all-reduce of a scalar; its gradient, one all-reduce of every parameter's
# gradient (XLA combines them into one collective of 12 arrays), as many bytes as the model.

# %% tags=["claim:lab4-dp-collectives"]
if answered(loss_dp):
    print(f"loss {float(jax.jit(loss_dp)(params_dp, batch_dp)):.4f}, "
          f"single-device {float(loss_single):.4f}")
    print("same gradient:", allclose(jax.jit(jax.grad(loss_dp))(params_dp, batch_dp), grad_single))
    print_collectives("loss_dp, compiled", loss_dp, params_dp, batch_dp)
    print_collectives("jax.grad(loss_dp), compiled", jax.grad(loss_dp), params_dp, batch_dp)
    print(f"the parameters: {sum(p.nbytes for p in jax.tree.leaves(params)):,} bytes")

# %% [markdown]
# ### Fully sharded data parallelism (FSDP)
#
# Data parallelism keeps a full copy of the parameters, and of their gradients, on every device.
# FSDP shards the parameters too (each `W` and `b` along its first axis), so that each device
# stores only its shard of every parameter and of every gradient, and **gathers each weight just
# before it is used**, with `all_gather`. Collectives are now needed in three places: in the
# prediction, to gather each weight; at the end, to combine the losses as before; and in the
# gradient, one `psum_scatter` per parameter (the transpose of its `all_gather`), which adds up
# the devices' gradients of that parameter and hands each device the part for its own shard.
#
# The code gathers each weight just before its layer, but nothing makes XLA free one layer's
# gathered weight before it gathers the next: how many gathered weights are alive at once is up
# to its scheduler. At these sizes the compiled loss holds all six at once, so the loss alone
# needs more memory per device than data parallelism's; its gradient, which FSDP keeps sharded,
# needs less. The cells after the task measure both.
#
# To save memory in the backward pass, the gathered weights need not be kept from the forward
# pass: they can be gathered again. `jax.checkpoint` (also called `jax.remat`) with a policy that
# refuses to save the results of `all_gather` asks JAX for that:
# `@partial(jax.checkpoint, policy=lambda prim, *_, **__: str(prim) != "all_gather")`. Whether
# it saves memory depends on the program XLA makes of it. In a Python loop over the layers, as
# here, the gathers again are in the traced program, but the compiled gradient keeps every
# gathered weight anyway: it needs the same scratch memory with the policy as without it. (With
# JAX 0.10.2, XLA even merges the gathers again with the forward pass's, so the compiled program
# has the same all-gathers too; this depends on XLA's version.) Nor does XLA gather again by
# itself. In a `lax.scan` over stacked layers, whose body runs once per layer, the policy does
# pay off. The cells after the task measure both; the checks do not require a policy.

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
def test_q8_public(loss_fsdp, params_fsdp, batch_fsdp, loss_single, grad_single):
    # the notebook's own inputs and references, read as the hidden checks read new ones
    import re

    import jax
    import numpy as np
    import jaxlab_form as form
    from jax.sharding import PartitionSpec as P

    fail = form.fail

    def mesh_axis(name, program, axis, mesh_name):
        for sm in program["shard_maps"]:
            if sm["axis_names"] != [axis]:
                axes = ", ".join(repr(a) for a in sm["axis_names"])
                fail(f"`{name}` runs jax.shard_map on a mesh whose axis is {axes}; expected what "
                     f"the task says: jax.shard_map on `{mesh_name}`, whose axis is '{axis}'.")

    def body(program):
        return [step for sm in program["shard_maps"] for step in sm["body"]]

    def loss_and_grad(name, loss_fn, params, batch, loss_single, grad_single):
        call = f"{name}(params, batch)"
        value = form.call(call, jax.jit(loss_fn), params, batch)
        form.expect_shape(call, value, ())
        ref = float(loss_single)
        if np.isclose(float(value), 8 * ref, rtol=1e-3):
            fail(f"`{call}` is {float(value):.6g}, 8 times the loss {ref:.6g}: psum adds up the "
                 "per-device mean losses. Average them with jax.lax.pmean (or divide the psum "
                 "by 8).")
        form.expect_close(call, value, ref, "`loss_single`, the single-device loss of the "
                          "notebook's params and batch", rtol=1e-3, atol=1e-4)
        grad_call = f"jax.grad({name})(params, batch)"
        grads = form.call(grad_call, jax.jit(jax.grad(loss_fn)), params, batch)
        leaves, expected = jax.tree.leaves(grads), jax.tree.leaves(grad_single)
        if len(leaves) != len(expected) or any(np.shape(a) != b.shape
                                               for a, b in zip(leaves, expected)):
            fail(f"`{grad_call}` has {len(leaves)} arrays; expected the 6 (W, b) pairs of "
                 "`params`, shaped like them.")
        if all(np.allclose(a, 8 * np.asarray(b), rtol=1e-3, atol=1e-4)
               for a, b in zip(leaves, expected)):
            fail(f"`{grad_call}` is 8 times the gradient of the single-device loss. Inside "
                 "jax.shard_map, jax.grad with respect to replicated parameters already sums "
                 "the gradient over the devices; check which collective you apply and to what.")
        for i, (a, b) in enumerate(zip(leaves, expected)):
            form.expect_close(f"{grad_call}[{i // 2}][{i % 2}]", a, b, "`grad_single`, the "
                              "gradient of the single-device loss", rtol=1e-3, atol=1e-4)

    form.expect_callable("loss_fsdp", form.evidence(loss_fsdp))
    loss_and_grad("loss_fsdp", loss_fsdp, params_fsdp, batch_fsdp, loss_single, grad_single)
    used, program = form.traced("loss_fsdp", loss_fsdp, params_fsdp, batch_fsdp)
    form.expect_collectives("loss_fsdp", used, required=("all_gather", "psum"), forbidden=(),
                            why=": each device gathers every weight with all_gather just before "
                            "using it, and one pmean/psum combines the losses")
    mesh_axis("loss_fsdp", program, "batch", "mesh_batch")

    for leaf, what in zip(batch_fsdp, ("the inputs of the batch", "the targets of the batch")):
        form.expect_operands_split("loss_fsdp", program, leaf.shape, what, 0,
                                   "the batch is sharded along its first axis (P('batch'))")
    for leaf in jax.tree.leaves(params_fsdp):
        form.expect_operands_split("loss_fsdp", program, leaf.shape, "a parameter", 0,
                                   "every W and b is sharded along its first axis "
                                   "(P('batch'))")
    if re.search(r"\ball_gather(?:_invariant)?\[[^\]]*?\btiled=False",
                 str(jax.make_jaxpr(loss_fsdp)(params_fsdp, batch_fsdp))):
        fail("`loss_fsdp` gathers with jax.lax.all_gather(..., tiled=False), which stacks the "
             "devices' blocks along a new axis; expected what the task says: gather each W and "
             "b with jax.lax.all_gather(..., tiled=True), which concatenates them.")
    gathered = products = 0
    for prim, _ in body(program):
        if prim in ("all_gather", "all_gather_invariant"):
            gathered += 1
        elif prim == "dot_general":
            products += 1
            if gathered > 2 * products:
                fail(f"`loss_fsdp` has gathered {gathered} arrays with all_gather before its "
                     f"matrix product number {products}; expected what the task says: gather "
                     "each W and b just before it is used (layer by layer), not all parameters "
                     "up front.")

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

# %% [markdown]
# Your loss and gradient against the single-device ones, and what each communicates once
# compiled: the loss gathers each of the 12 parameters and all-reduces one scalar. The gradient's
# program runs the forward pass's 12 all-gathers once (its backward pass uses the weights they
# gathered) and reduce-scatters each parameter's gradient: 12 reduce-scatters, each returning one
# device's shard.

# %% tags=["claim:lab4-fsdp-collectives"]
if answered(loss_fsdp):
    print(f"loss {float(jax.jit(loss_fsdp)(params_fsdp, batch_fsdp)):.4f}, "
          f"single-device {float(loss_single):.4f}")
    print("same gradient:",
          allclose(jax.jit(jax.grad(loss_fsdp))(params_fsdp, batch_fsdp), grad_single))
    print_collectives("loss_fsdp, compiled", loss_fsdp, params_fsdp, batch_fsdp)
    print_collectives("jax.grad(loss_fsdp), compiled", jax.grad(loss_fsdp), params_fsdp,
                      batch_fsdp)

# %% [markdown]
# The memory one device needs for the loss and for its gradient, with data parallelism (Task 7)
# and with FSDP: the bytes of the arguments (parameters and batch), of the outputs (for the
# gradient: the gradient itself), and scratch.

# %% tags=["claim:lab4-fsdp-memory"]
if answered(loss_fsdp, loss_dp):
    print("bytes per device      arguments    outputs    scratch")
    for label, fn, args in (("loss_dp", loss_dp, (params_dp, batch_dp)),
                            ("loss_fsdp", loss_fsdp, (params_fsdp, batch_fsdp)),
                            ("grad of loss_dp", jax.grad(loss_dp), (params_dp, batch_dp)),
                            ("grad of loss_fsdp", jax.grad(loss_fsdp), (params_fsdp, batch_fsdp))):
        print(f"{label:18s}" + "".join(f"{n:>12,}" for n in memory(fn, *args)))
    print(f"all six layers' W and b, gathered: "
          f"{sum(p.nbytes for p in jax.tree.leaves(params)):,} bytes")

# %% [markdown]
# The checkpoint policy: your `loss_fsdp` as you wrote it, and the same wrapped in `jax.checkpoint`
# with the policy. The traced gradient gathers again with the policy; the compiled one needs the
# same scratch either way.

# %% tags=["claim:lab4-fsdp-policy"]
print(f"JAX {jax.__version__}")
no_gather_saved = lambda prim, *_, **__: str(prim) != "all_gather"  # noqa: E731
if answered(loss_fsdp):
    for label, fn in (("as written", loss_fsdp),
                      ("in jax.checkpoint with the policy",
                       jax.checkpoint(loss_fsdp, policy=no_gather_saved))):
        traced = str(jax.make_jaxpr(jax.grad(fn))(params_fsdp, batch_fsdp)).count("all_gather[")
        compiled_gathers = sum(op.startswith("all-gather") for op, *_ in
                               collectives(jax.grad(fn), params_fsdp, batch_fsdp))
        print(f"gradient of loss_fsdp {label}: {traced} all_gather traced, "
              f"{compiled_gathers} all-gather compiled, scratch "
              f"{memory(jax.grad(fn), params_fsdp, batch_fsdp)[2]:,} bytes")

# %% [markdown]
# The same policy on layers in a `lax.scan`: the four hidden 128 × 128 layers of `params`, stacked
# and split over `batch` by rows, applied to this part's batch of hidden activations. The
# compiled program has one loop body that runs once per layer, so its all-gathers are counted
# once: with the policy the backward loop gathers again, and the scratch memory shrinks.

# %% tags=["claim:lab4-fsdp-scan-policy"]
hidden_W = jax.device_put(jnp.stack([W for W, _ in params[1:5]]),
                          NamedSharding(mesh_batch, P(None, "batch")))
hidden_x = jax.device_put(jax.nn.relu(batch[0] @ params[0][0] + params[0][1]),
                          NamedSharding(mesh_batch, P("batch")))


def scanned_layers(policy):
    def layer(h, W_frag):
        return jax.nn.relu(h @ lax.all_gather(W_frag, "batch", tiled=True)), None

    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy)

    @partial(jax.shard_map, mesh=mesh_batch, in_specs=(P(None, "batch"), P("batch")),
             out_specs=P())
    def mean_square(W_frags, h):
        h, _ = lax.scan(layer, h, W_frags)
        return lax.pmean(jnp.mean(h ** 2), "batch")

    return mean_square


for label, policy in (("without a policy", None), ("with the policy", no_gather_saved)):
    scan_grad = jax.grad(scanned_layers(policy))
    gathers = sum(op.startswith("all-gather") for op, *_ in
                  collectives(scan_grad, hidden_W, hidden_x))
    print(f"layers in a lax.scan, {label}: {gathers} all-gather(s) in the compiled gradient, "
          f"scratch {memory(scan_grad, hidden_W, hidden_x)[2]:,} bytes")

# %% [markdown]
# ### Tensor parallelism
#
# Now shard over **features** instead of examples: the activations (and inputs) are split along
# their feature axis, each weight matrix along its input-feature axis (rows) and each bias along
# its features. A layer is then a local matrix product, which gives a partial sum of the full
# output, followed by a `psum_scatter` that adds the partial sums **and** splits the result over
# its feature axis again (`scatter_dimension=1`), ready for the next layer. The bias is added to
# the scattered block. The loss itself can be computed outside `shard_map` from the sharded
# predictions: `jax.jit` then adds the communication it needs (an all-reduce of the partial
# sums of the squared errors). The gradient communicates too: the transpose of each
# `psum_scatter` is an `all_gather`, so the backward pass gathers, layer by layer, the gradient
# of the activations (never a weight). The cell after the task measures both.

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
def test_q9_public(loss_tp, params_tp, batch_tp, loss_single, grad_single):
    # the notebook's own inputs and references, read as the hidden checks read new ones
    import re

    import jax
    import numpy as np
    import jaxlab_form as form
    from jax.sharding import PartitionSpec as P

    fail = form.fail

    def mesh_axis(name, program, axis, mesh_name):
        for sm in program["shard_maps"]:
            if sm["axis_names"] != [axis]:
                axes = ", ".join(repr(a) for a in sm["axis_names"])
                fail(f"`{name}` runs jax.shard_map on a mesh whose axis is {axes}; expected what "
                     f"the task says: jax.shard_map on `{mesh_name}`, whose axis is '{axis}'.")

    def body(program):
        return [step for sm in program["shard_maps"] for step in sm["body"]]

    def loss_and_grad(name, loss_fn, params, batch, loss_single, grad_single):
        call = f"{name}(params, batch)"
        value = form.call(call, jax.jit(loss_fn), params, batch)
        form.expect_shape(call, value, ())
        ref = float(loss_single)
        if np.isclose(float(value), 8 * ref, rtol=1e-3):
            fail(f"`{call}` is {float(value):.6g}, 8 times the loss {ref:.6g}: psum adds up the "
                 "per-device mean losses. Average them with jax.lax.pmean (or divide the psum "
                 "by 8).")
        form.expect_close(call, value, ref, "`loss_single`, the single-device loss of the "
                          "notebook's params and batch", rtol=1e-3, atol=1e-4)
        grad_call = f"jax.grad({name})(params, batch)"
        grads = form.call(grad_call, jax.jit(jax.grad(loss_fn)), params, batch)
        leaves, expected = jax.tree.leaves(grads), jax.tree.leaves(grad_single)
        if len(leaves) != len(expected) or any(np.shape(a) != b.shape
                                               for a, b in zip(leaves, expected)):
            fail(f"`{grad_call}` has {len(leaves)} arrays; expected the 6 (W, b) pairs of "
                 "`params`, shaped like them.")
        if all(np.allclose(a, 8 * np.asarray(b), rtol=1e-3, atol=1e-4)
               for a, b in zip(leaves, expected)):
            fail(f"`{grad_call}` is 8 times the gradient of the single-device loss. Inside "
                 "jax.shard_map, jax.grad with respect to replicated parameters already sums "
                 "the gradient over the devices; check which collective you apply and to what.")
        for i, (a, b) in enumerate(zip(leaves, expected)):
            form.expect_close(f"{grad_call}[{i // 2}][{i % 2}]", a, b, "`grad_single`, the "
                              "gradient of the single-device loss", rtol=1e-3, atol=1e-4)

    form.expect_callable("loss_tp", form.evidence(loss_tp))
    loss_and_grad("loss_tp", loss_tp, params_tp, batch_tp, loss_single, grad_single)
    used, program = form.traced("loss_tp", loss_tp, params_tp, batch_tp)
    form.expect_collectives("loss_tp", used, required=("psum_scatter",), forbidden=("all_gather",),
                            why=": weights stay sharded over features; each layer multiplies "
                            "locally and psum_scatter sums and re-shards the result")
    mesh_axis("loss_tp", program, "feats", "mesh_feats")

    inputs = batch_tp[0]
    for shape, what in ((inputs.shape, "the inputs"), ((inputs.shape[0], 128), "activations")):
        form.expect_operands_split("loss_tp", program, shape, what, 1,
                                   "inputs and activations are sharded over features "
                                   "(P(None, 'feats'))")
    for W, b in params_tp:
        form.expect_operands_split("loss_tp", program, W.shape, "a weight matrix", 0,
                                   "each W is sharded by rows (P('feats', None))")
        form.expect_operands_split("loss_tp", program, b.shape, "a bias", 0,
                                   "each b is sharded over its features (P('feats'))")
    pending = False
    for prim, _ in body(program):
        if prim == "dot_general":
            if pending:
                break
            pending = True
        elif prim == "reduce_scatter":
            pending = False
    if pending:
        fail("`loss_tp` has a matrix product inside jax.shard_map that is not followed by "
             "psum_scatter before the next one; expected what the task says: every layer is a "
             "local matrix product followed by jax.lax.psum_scatter.")

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

# %% [markdown]
# Your loss and gradient against the single-device ones, and what each communicates once
# compiled. A `psum` of each partial product followed by keeping this device's features gives
# the same numbers: its collectives tell it apart (all-reduces of the whole activations, eight
# times the bytes of the reduce-scatters).

# %% tags=["claim:lab4-tp-collectives"]
if answered(loss_tp):
    print(f"loss {float(jax.jit(loss_tp)(params_tp, batch_tp)):.4f}, "
          f"single-device {float(loss_single):.4f}")
    print("same gradient:", allclose(jax.jit(jax.grad(loss_tp))(params_tp, batch_tp), grad_single))
    print_collectives("loss_tp, compiled", loss_tp, params_tp, batch_tp)
    print_collectives("jax.grad(loss_tp), compiled", jax.grad(loss_tp), params_tp, batch_tp)

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
    if not hasattr(update, "lower"):  # what jax.jit returns has .lower; a plain function not
        # (run op by op, a shard_map step of Task 10 took 5 s here: 1000 steps, over an hour)
        raise TypeError("`update` is not wrapped in jax.jit, so every step would run op by op "
                        "and 1000 steps would take far too long. Decorate it with @jax.jit.")
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
# `pmap` maps over a leading axis of its inputs, so the tutorial reshapes the data to
# `(n_devices, batch_per_device, …)` and stacks one copy of the parameters per device. With
# `shard_map` the data keeps its shape and is simply sharded, and the parameters are replicated
# (`P()`).
#
# Careful: copying the `pmap` body into `shard_map` unchanged is the gradient trap from Part C.
# Inside `shard_map` (with its default `check_vma=True`), `jax.grad` with respect to the
# replicated `params` already sums the gradients of the devices, so `pmean` of those gradients
# is 8 times the true gradient, and the model trains with a learning rate 8 times too large.
# Here it still converges, to the same parameters, which is what makes the bug easy to miss:
# this loss is quadratic in `(weight, bias)`, and gradient descent on it converges for every
# learning rate below 2 / λ, where λ is the largest eigenvalue of the loss's Hessian (the next
# cell computes it); `8 * LEARNING_RATE` = 0.04 is far below. So after 1000 steps the wrong
# update matches `params_single` as well as the right one does. One step does not: a step 8 times
# too large shows at once, which is why Task 10 asks for one step equal to `update_single`.

# %% tags=["claim:lab4-trap-converges"]
hessian = jax.jit(jax.hessian(lambda wb: loss_fn(Params(wb[0], wb[1]), xs, ys)))(jnp.zeros(2))
largest = float(jnp.linalg.eigvalsh(hessian).max())
print(f"largest eigenvalue of the Hessian: {largest:.3f}; gradient descent converges for a "
      f"learning rate below 2 / {largest:.3f} = {2 / largest:.3f}; "
      f"8 * LEARNING_RATE = {8 * LEARNING_RATE:.3f}")

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
#   gradient averaged correctly over the devices (one step must equal `update_single`) and
#   all-reduced once, and returning `(new_params, loss)` with both replicated
#   (`out_specs=(P(), P())`). Wrap it in `jax.jit`.
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
def test_q10_public(update, params_trained, update_single, params_init, xs, ys, xs_sharded,
                    ys_sharded, params_replicated, params_single):
    # the notebook's own inputs and references, read as the hidden checks read new ones
    import re

    import jax
    import numpy as np
    import jaxlab_form as form
    from jax.sharding import PartitionSpec as P

    fail = form.fail

    def mesh_axis(name, program, axis, mesh_name):
        for sm in program["shard_maps"]:
            if sm["axis_names"] != [axis]:
                axes = ", ".join(repr(a) for a in sm["axis_names"])
                fail(f"`{name}` runs jax.shard_map on a mesh whose axis is {axes}; expected what "
                     f"the task says: jax.shard_map on `{mesh_name}`, whose axis is '{axis}'.")

    def scalar_pair(name, value):
        items = list(value) if isinstance(value, (tuple, list)) and len(value) == 2 else None
        if items is None:
            fail(f"`{name}` is {form.describe(form.evidence(value))}; expected Params(weight, "
                 "bias).")
        for field, item in zip(("weight", "bias"), items):
            if np.shape(item) != () or not np.issubdtype(np.asarray(item).dtype, np.number):
                fail(f"`{name}.{field}` is {form.describe(form.evidence(item))}; expected a "
                     "scalar.")
        return items

    form.expect_callable("update", form.evidence(update))
    call = "update(params_replicated, xs_sharded, ys_sharded)"
    out = form.call(call, update, params_replicated, xs_sharded, ys_sharded)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        fail(f"`{call}` returned {form.describe(form.evidence(out))}; expected (new_params, "
             "loss) as `update_single` does.")
    new = scalar_pair(f"{call}[0]", out[0])
    ref_new, ref_loss = update_single(params_init, xs, ys)
    start = np.array([float(p) for p in params_init])
    step = np.array([float(p) for p in new]) - start
    ref_step = np.array([float(p) for p in ref_new]) - start
    if np.allclose(step, 8 * ref_step, rtol=1e-3, atol=1e-7):
        fail(f"`{call}` takes a step 8 times too large: its gradient is 8x the true one. "
             "Inside jax.shard_map (with its default check_vma=True), jax.grad with respect "
             "to replicated params already sums the per-device gradients, so the pmap recipe "
             "'pmean the grads' multiplies them by the number of devices. Take the gradient "
             "of jax.lax.pmean(loss, axis) instead, or do not average the gradients again.")
    form.expect_close(f"{call}[0]", step, ref_step, "the step of `update_single(params_init, "
                      "xs, ys)`: -LEARNING_RATE × the gradient of the mean squared error over "
                      "the whole batch", rtol=1e-3, atol=1e-7)
    loss = out[1]
    if np.shape(loss) != ():
        fail(f"`{call}[1]` (the loss) is {form.describe(form.evidence(loss))}; expected a "
             "scalar.")
    form.expect_close(f"{call}[1]", float(loss), float(ref_loss), "the loss `update_single` "
                      "returns: the mean squared error over the whole batch before the step",
                      rtol=1e-3, atol=1e-6)
    for field, item in zip(("weight", "bias"), new):
        if isinstance(item, jax.Array):
            form.expect_laid_out(f"{call}[0].{field}", item, P(),
                                 "replicated (out_specs=P())", 8)
    if isinstance(loss, jax.Array):
        form.expect_laid_out(f"{call}[1]", loss, P(), "replicated (out_specs=P())", 8)
    used, program = form.traced("update", update, params_replicated, xs_sharded, ys_sharded)
    form.expect_collectives("update", used, required=("psum",), forbidden=("jax.pmap",),
                            why=": average over the devices inside jax.shard_map, not with "
                                "jax.pmap")
    mesh_axis("update", program, "batch", "mesh_dp")
    # the equation that makes the loss update returns (a gradient's residuals leave a
    # shard_map split over the devices too): through jit, a shard_map returning it replicated
    jaxpr = jax.make_jaxpr(update)(params_replicated, xs_sharded, ys_sharded).jaxpr
    var, origin, spec = jaxpr.outvars[-1], "an input or a constant", None
    while True:
        found = [(e, i) for e in jaxpr.eqns for i, o in enumerate(e.outvars) if o is var]
        if not found:
            break
        eqn, i = found[0]
        if eqn.primitive.name not in ("jit", "pjit"):
            origin = eqn.primitive.name
            spec = eqn.params["out_specs"][i] if origin == "shard_map" else None
            break
        jaxpr = eqn.params["jaxpr"].jaxpr
        var = jaxpr.outvars[i]
    if origin != "shard_map" or any(e is not None for e in spec):
        where = (f"jax.shard_map returns it split over the devices (out_specs {spec})"
                 if origin == "shard_map" else
                 f"it is computed outside jax.shard_map (by `{origin}`)")
        fail(f"`update` returns a loss that no jax.shard_map returns replicated: {where}; "
             "expected what the task says: (new_params, loss) both replicated "
             "(out_specs=(P(), P())), the loss averaged over the devices inside the shard_map "
             "(jax.lax.pmean).")
    form.expect_operands_split("update", program, xs_sharded.shape, "xs or ys", 0,
                               "xs and ys are sharded along the batch axis (P('batch'))")
    if any(sm["sums_of_copies"] for sm in program["shard_maps"]):
        fail("`update` all-reduces a value that every device already holds, such as "
             "jax.lax.pmean of the gradient of the averaged loss (inside jax.shard_map, "
             "jax.grad with respect to replicated params already all-reduces the gradient). The "
             "step is right, but that all-reduce is one too many; expected what the task says: "
             "the gradient averaged over the devices and all-reduced once. Average the loss "
             "with jax.lax.pmean and use its gradient as it is.")
    form.expect_jitted("update", program)
    form.expect_defined("params_trained", form.evidence(params_trained))
    trained = scalar_pair("params_trained", params_trained)
    for field, item, expected in zip(("weight", "bias"), trained, params_single):
        form.expect_close(f"params_trained.{field}", float(item), float(expected),
                          f"`params_single.{field}`, the {field} after 1000 steps of "
                          "single-device training", rtol=1e-3, atol=1e-4)
        sev = form.evidence(item).get("sharding", {})
        if not isinstance(item, jax.Array) or sev.get("kind") != "NamedSharding" \
                or len(sev["devices"]) != 8 or not form.is_laid_out_as(sev, 0, P()):
            where = (f"lives {form.describe_sharding(sev)}" if isinstance(item, jax.Array)
                     else f"is {form.describe(form.evidence(item))}, not a jax.Array")
            fail(f"`params_trained.{field}` {where}; expected it replicated on the 8 devices "
                 "of mesh_dp, as the task defines `params_trained`: what train(update, "
                 "params_replicated, xs_sharded, ys_sharded) returns. A copy of the "
                 "single-device result is not the output of the sharded run.")

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

# %% [markdown]
# Your trained parameters against single-device training, and one step of your `update` against
# one step of `update_single` from the same parameters. The `pmap` body copied unchanged prints
# `True` for the trained parameters (see above): its first step is 8 times too large.

# %%
if answered(params_trained):
    print(params_trained)
    print("matches single-device training:",
          np.allclose(np.array(params_trained), np.array(params_single), rtol=1e-3, atol=1e-4))
if answered(update):
    start = np.array(params_init)
    one_step = np.array(update(params_replicated, xs_sharded, ys_sharded)[0]) - start
    one_step_single = np.array(update_single(params_init, xs, ys)[0]) - start
    print("one step, as a multiple of update_single's step (weight, bias):",
          np.round(one_step / one_step_single, 3))

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

# %% [markdown]
# The most memory this kernel has held so far (its peak resident memory, as the operating system
# counts it), for the setup cell's 768 MB grading container:

# %% tags=["claim:lab4-peak-memory"]
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
