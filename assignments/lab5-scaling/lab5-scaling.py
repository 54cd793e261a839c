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
#   answer and run it. The cell after it, `grader.check("q…")`, runs the **public checks** on
#   this notebook's own inputs (the arrays, meshes and data built above the task): they compare
#   your results with the notebook's own references (`forward`, `mlp_loss`,
#   `sequential_forward`, `moe_dense`, `pd_params_single`, and the definitions the task gives),
#   check where each array lives, and read the program your function traces (`jax.make_jaxpr`)
#   to see **which collectives** it uses, over **which mesh axes**, **in which order**, and how
#   its `in_specs` split each input. Part D's public check runs your training script as two
#   processes on `pd_data.npz` and looks at what each process did. A public check takes about as
#   long as the cell after its task, which computes the same kind of thing. **Hidden checks**
#   run when your notebook is graded: they do the same on **new random inputs** of other sizes
#   too (where the task says "any"), with references computed in float64, and Part D's runs
#   your script again on new data. So follow the method each task describes, not only its
#   numbers.
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
import math
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
# Some of those cells also show what a program communicates: which **collectives** the program
# that XLA compiles runs (`jax.jit(f).lower(*args).compile().as_text()`, the text of the
# compiled program), over which mesh axes, on what shape of data. `print_collectives` below
# reads them from that text. It counts what runs on this notebook's devices; XLA may compile the
# same program differently for GPUs or TPUs.

# %%
import itertools
import re
from collections import Counter

COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# one collective per line of the program's text, `%name = TYPE OP(operands), attributes`: TYPE is
# a tuple for a combined all-reduce or an all-to-all on CPU; GPUs write OP-start and OP-done
COLLECTIVE_LINE = re.compile(r"= (\(.*?\)|\S+) (" + "|".join(COLLECTIVE_OPS)
                             + r")(?:-start)?\((.*)$", re.M)


def _ints(text):
    return [int(n) for n in re.findall(r"\d+", text)]


def _iota(n, dims, perm):
    ids = np.arange(n).reshape(_ints(dims))
    return ids.transpose(_ints(perm)) if perm else ids


def _device_groups(attributes, n):
    """The groups of devices (positions in the program's list of n devices) that one collective
    runs within, in each of the ways XLA writes them; for a collective-permute, its
    (source, target) pairs."""
    if m := re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attributes):
        return [_ints(pair) for pair in re.findall(r"\{(\d+,\d+)\}", m.group(1))]
    if m := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attributes):
        groups = [g for g in map(_ints, re.findall(r"\{([\d,]*)\}", m.group(1))) if g]
        return groups or [list(range(n))]  # {} is one group of all devices
    if m := re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attributes):
        return _iota(n, m.group(2), m.group(3)).reshape(_ints(m.group(1))).tolist()
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\]"
                      r"(?:T\(([\d,]+)\))?\))? \{([^}]*)\}", attributes):
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        ids = _iota(n, m.group(2), m.group(3)) if m.group(2) else np.arange(n)
        ids = ids.reshape([int(size) for _, size in axes])
        names = [name for name, _ in axes]
        over = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
        rest = [i for i in range(ids.ndim) if i not in over]
        return ids.transpose(rest + over).reshape(-1, math.prod(ids.shape[i] for i in over)).tolist()
    return None


def _over(op, groups, mesh):
    """The mesh axes that groups of devices of `mesh` run over, in words."""
    # a program compiled for arrays on one mesh numbers its devices in the mesh's order
    positions = np.arange(mesh.size).reshape(mesh.devices.shape)
    names = list(mesh.axis_names)
    if groups is None:
        return "devices XLA did not name"
    if op == "collective-permute":
        moves = set()
        for source, target in groups:
            a, b = (np.array(np.unravel_index(d, positions.shape)) for d in (source, target))
            axes = np.flatnonzero(a != b)
            if len(axes) != 1:
                return f"devices {groups}"
            size = positions.shape[axes[0]]
            step = int(b[axes[0]] - a[axes[0]]) % size
            moves.add((names[axes[0]], step if step <= size // 2 else step - size))
        if len(moves) != 1:
            return f"devices {groups}"
        (axis, step), = moves
        return f"'{axis}', each device to the one {abs(step)} {'after' if step > 0 else 'before'} it"
    found = {frozenset(g) for g in groups}
    for k in range(1, len(names) + 1):
        for axes in itertools.combinations(range(len(names)), k):
            rest = [i for i in range(len(names)) if i not in axes]
            size = math.prod(positions.shape[i] for i in axes)
            wanted = positions.transpose(rest + list(axes)).reshape(-1, size).tolist()
            if {frozenset(g) for g in wanted} == found:
                return " and ".join(f"'{names[i]}'" for i in axes)
    return f"devices {groups}"


def _result(text):
    types = re.findall(r"[a-z]+\d*\[[\d,]*\]", text)
    if not text.startswith("("):
        return types[0] if types else text
    if len(set(types)) == 1:
        return f"{len(types)} arrays {types[0]}"
    return f"{len(types)} arrays " + ", ".join(types)


def collectives(fn, *args, mesh):
    """The collectives of the program XLA compiles for `fn(*args)` (jitted or not), in program
    order: a list of (operation, the axes of `mesh` it runs over, what it returns)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return [(m.group(2), _over(m.group(2), _device_groups(m.group(3), mesh.size), mesh),
             _result(m.group(1))) for m in COLLECTIVE_LINE.finditer(text)]


def print_collectives(label, fn, *args, mesh):
    """Print `collectives(fn, *args, mesh=mesh)`: one line per kind, with how many there are."""
    found = Counter(collectives(fn, *args, mesh=mesh))
    print(f"{label}:" + ("" if found else " no collective"))
    for (op, over, result), count in found.items():
        print(f"  {count:3d} {op} over {over}: {result}")


def shard_map_outputs(fn, *args):
    """The types of what each jax.shard_map in fn's traced program returns (nested programs,
    such as a jax.jit inside fn, included)."""
    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "shard_map":
                yield from (v.aval.str_short() for v in eqn.outvars)
                continue
            for param in eqn.params.values():
                for sub in (param if isinstance(param, (tuple, list)) else (param,)):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        yield from walk(sub)
    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


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
# "8 entries, split over `x`". The cell prints, for each spec, the type and how many devices hold
# each block:

# %% tags=["claim:lab5-typeof-split"]
grid_mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2,
                          devices=devices)
grid = np.arange(64.0).reshape(8, 8)
for spec in (P("x", "y"), P("x", None), P(None, "y")):
    placed = jax.device_put(grid, NamedSharding(grid_mesh, spec))
    holders = Counter(str(shard.index) for shard in placed.addressable_shards)
    print(f"{spec}: {jax.typeof(placed)}, {len(holders)} blocks, each on "
          f"{sorted(set(holders.values()))} device(s)")
    jax.debug.visualize_array_sharding(placed, scale=0.4)

# %% [markdown]
# ### Data and tensor parallelism at once
#
# A large model is trained on a mesh `data` × `model`: the batch is split over `data` (each row
# of the mesh sees a quarter of the examples, as in data parallelism), and inside each row the
# weights are split over `model` (tensor parallelism). For a two-layer MLP
# `tanh(x @ W1 + b1) @ W2 + b2`, the Megatron-LM layout (Shoeybi et al., 2019, §3 "Model Parallel
# Transformers") splits the layers so that the **forward pass** needs only one collective per
# MLP:
#
# * `W1` (and `b1`) is split by **columns** over `model`: each device computes its columns of the
#   hidden activations `h = tanh(x @ W1 + b1)` from its own block, with no communication (tanh
#   acts entry by entry);
# * `W2` is split by **rows** over `model`: a device holding columns `k` of `h` and rows `k` of
#   `W2` computes `h_k @ W2_k`, one of the **summands** of `h @ W2`. Adding the summands of the
#   `model` axis is the forward pass's one all-reduce (Megatron's *g*);
# * `b2` is small and replicated.
#
# Training communicates more. The backward pass adds an all-reduce over `model` of the gradient
# with respect to the MLP's input `x` (Megatron's *f*, the identity going forward): each device's
# block of `W1` gives only its summand of that gradient. It is absent only for a first layer,
# whose input needs no gradient. And on a `data` × `model` mesh every parameter's gradient is
# added up over `data`, as in data parallelism (Lab 3). The cells after Tasks 1 and 2 measure
# all three.
#
# With Explicit axes JAX will not guess where the result of that second product should live: a
# product whose contracted dimension is split on both sides could be left split, or summed. It
# asks you to say it with `out_sharding`:

# %% tags=["claim:lab5-out-sharding"]
a = jax.device_put(np.ones((8, 8)), NamedSharding(grid_mesh, P("x", "y")))   # columns over y
b = jax.device_put(np.ones((8, 4)), NamedSharding(grid_mesh, P("y", None)))  # rows over y
try:
    a @ b
except Exception as err:
    print(type(err).__name__, ":", str(err).splitlines()[0][:150], "...")
summed = jnp.dot(a, b, out_sharding=NamedSharding(grid_mesh, P("x", None)))
print("with out_sharding:", jax.typeof(summed))
print_collectives("jnp.dot(a, b, out_sharding=NamedSharding(grid_mesh, P('x', None))), compiled",
                  partial(jnp.dot, out_sharding=NamedSharding(grid_mesh, P("x", None))), a, b,
                  mesh=grid_mesh)

# %% [markdown]
# `out_sharding` takes a `NamedSharding` (the mesh and the spec of the result). Asking for an
# output that is not split over `y` makes XLA add up the summands over `y`: the compiled product
# has one collective, an all-reduce over `y`, and nothing else.
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
#   split over `model` (no `all_gather` of any array: the Megatron layout needs none), and the
#   output must come out split over `data` and replicated over `model`: `jax.typeof` of the
#   output reads `float32[32@data,8]` for 32 examples;
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
def test_q1_public(mesh_2d, x_2d, params_2d, forward_2d, out_2d, mlp_params, x_mlp, forward):
    import re

    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxlab_form as form

    def fail(message):
        raise AssertionError(message)

    def close(name, actual, expected, what):
        form.expect_close(name, np.asarray(actual), np.asarray(expected), what, rtol=1e-4,
                          atol=1e-5)

    def on_mesh_2d(name, array, spec, words):
        sev = form.sharding_evidence(array.sharding)
        if not isinstance(array.sharding, NamedSharding) or array.sharding.mesh.axis_names != \
                mesh_2d.axis_names or array.sharding.mesh.device_ids.tolist() != \
                mesh_2d.device_ids.tolist():
            fail(f"`{name}` lives {form.describe_sharding(sev)}, not on `mesh_2d`; expected it "
                 "placed on `mesh_2d`.")
        if not array.sharding.is_equivalent_to(NamedSharding(mesh_2d, spec), array.ndim):
            fail(f"`{name}` is {form.describe_sharding(sev)}; expected {words}.")

    def dims(aval_text):  # "f32[32@data,64@model]" -> [("32", "data"), ("64", "model")]
        inside = re.search(r"\[([^\]]*)\]", aval_text)
        return [tuple((part.split("@") + [""])[:2]) for part in inside.group(1).split(",")] \
            if inside and inside.group(1) else []

    def steps(jaxpr, inside=False):
        for eqn in jaxpr.eqns:
            yield eqn, inside
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        yield from steps(sub, inside or eqn.primitive.name == "shard_map")

    form.expect_defined("mesh_2d", form.evidence(mesh_2d))
    if type(mesh_2d).__name__ != "Mesh":
        fail(f"`mesh_2d` is {form.describe(form.evidence(mesh_2d))}; expected a jax Mesh "
             "(jax.make_mesh).")
    if tuple(mesh_2d.axis_names) != ("data", "model") or mesh_2d.devices.shape != (4, 2):
        fail(f"`mesh_2d` is a mesh with axes {dict(mesh_2d.shape)}; expected a 4 × 2 mesh with "
             "axes ('data', 'model').")
    kinds = tuple(str(t).rsplit(".", 1)[-1] for t in mesh_2d.axis_types)
    if kinds != ("Explicit", "Explicit"):
        fail(f"the axes of `mesh_2d` are {kinds}; expected both Explicit (pass "
             "axis_types=(AxisType.Explicit, AxisType.Explicit) to jax.make_mesh).")
    form.expect_on_mesh("x_2d", form.evidence(x_2d), shape=x_mlp.shape)
    close("x_2d", x_2d, x_mlp, "the values of `x_mlp`")
    on_mesh_2d("x_2d", x_2d, P("data", None),
               "its rows split over 'data' and copies over 'model' (spec P('data', None))")
    form.expect_defined("params_2d", form.evidence(params_2d))
    if type(params_2d) not in (tuple, list) or len(params_2d) != 4:
        fail(f"`params_2d` is {form.describe(form.evidence(params_2d))}; expected the tuple "
             "(W1, b1, W2, b2) of `mlp_params`.")
    layout = ((P(None, "model"), "W1 split by columns over 'model' (spec P(None, 'model'))"),
              (P("model"), "b1 split over 'model' (spec P('model'))"),
              (P("model", None), "W2 split by rows over 'model' (spec P('model', None))"),
              (P(), "b2 replicated (spec P())"))
    for i, (item, ref, (spec, words)) in enumerate(zip(params_2d, mlp_params, layout)):
        form.expect_on_mesh(f"params_2d[{i}]", form.evidence(item), shape=ref.shape)
        close(f"params_2d[{i}]", item, ref, f"{words.split()[0]} of `mlp_params`")
        on_mesh_2d(f"params_2d[{i}]", item, spec, f"the Megatron layout: {words}")
    form.expect_callable("forward_2d", form.evidence(forward_2d))
    expected = forward(mlp_params, x_mlp)
    wanted = f"float32[{x_mlp.shape[0]}@data,{expected.shape[1]}]"
    try:
        out = forward_2d(params_2d, x_2d)
        program = jax.make_jaxpr(forward_2d)(params_2d, x_2d)
    except Exception as exc:
        fail(f"`forward_2d(params_2d, x_2d)` raised {form.student_error(exc)}; expected the "
             "MLP's forward pass for arrays laid out like `params_2d` and `x_2d`.")
    form.expect_array("forward_2d(params_2d, x_2d)", form.evidence(out), shape=expected.shape)
    close("forward_2d(params_2d, x_2d)", out, expected, "forward(mlp_params, x_mlp)")
    if str(jax.typeof(out)) != wanted:
        fail(f"`forward_2d(params_2d, x_2d)` returned an array of type {jax.typeof(out)}; "
             f"expected {wanted}: the output split over 'data' and replicated over 'model'.")
    form.expect_jitted("forward_2d", form.program_evidence(program))
    shard_maps = [eqn for eqn, _ in steps(program.jaxpr) if eqn.primitive.name == "shard_map"]
    products = [eqn for eqn, inside in steps(program.jaxpr)
                if eqn.primitive.name == "dot_general" and not inside]
    for eqn in products:
        out_type = eqn.outvars[0].aval.str_short()
        if eqn.outvars[0].aval.shape == (x_mlp.shape[0], mlp_params[0].shape[1]) and \
                [axis for _, axis in dims(out_type)] != ["data", "model"]:
            fail(f"in `forward_2d` the first layer's product x @ W1 has type {out_type}; "
                 f"expected float32[{x_mlp.shape[0]}@data,{mlp_params[0].shape[1]}@model]: the "
                 "hidden activations stay split over 'model' (W1 is never gathered) and the "
                 "examples over 'data'.")
        if eqn.outvars[0].aval.shape == expected.shape:
            lhs, rhs = (v.aval.str_short() for v in eqn.invars[:2])
            if dims(lhs)[-1][1] != "model" or dims(rhs)[0][1] != "model":
                fail(f"in `forward_2d` the second layer's product h @ W2 multiplies {lhs} by "
                     f"{rhs}; expected h split over 'model' by columns and W2 by rows, so that "
                     "each device multiplies its own blocks and the summands are added over "
                     "'model' (out_sharding).")
    for eqn in shard_maps:  # a forward pass written by hand inside jax.jit
        for var, spec in zip(eqn.invars, eqn.params["in_specs"]):
            entries = [() if e is None else (e,) if isinstance(e, str) else tuple(e)
                       for e in spec]
            if var.aval.shape == mlp_params[0].shape and (entries + [(), ()])[:2] != \
                    [(), ("model",)]:
                fail(f"`forward_2d` hands W1 to jax.shard_map with in_specs {spec}; expected "
                     "W1 split by columns over 'model'.")
        if any(e.primitive.name.startswith("all_gather") for e, _ in steps(eqn.params["jaxpr"])):
            fail("`forward_2d` uses `all_gather`; expected the hidden activations to stay split "
                 "over 'model' (no weight is gathered).")
    form.expect_on_mesh("out_2d", form.evidence(out_2d), shape=expected.shape)
    close("out_2d", out_2d, expected, "forward(mlp_params, x_mlp)")
    if str(jax.typeof(out_2d)) != wanted:
        fail(f"`out_2d` has type {jax.typeof(out_2d)}; expected {wanted}: split over 'data', "
             "replicated over 'model'.")

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

# %% [markdown]
# Your inputs' layouts against those the task asks for, your forward pass, and what it
# communicates. The output's type and values do not show the inputs' layouts: a batch copied on
# every device, or `b1` replicated, prints the same output and collectives. Two wrong answers print the same type and the
# same values as a right one: all parameters replicated (no tensor parallelism: no collective at
# all) and the Megatron placement with the weights gathered inside `forward_2d` (all-gathers).
# The Megatron layout compiles to one all-reduce over `model`, of the output block of each row
# of the mesh (8 examples × 8 outputs):

# %% tags=["claim:lab5-megatron-forward"]
if answered(out_2d, forward_2d, params_2d, x_2d):
    # each input's layout against the one Task 1 asks for
    W1_2d, b1_2d, W2_2d, b2_2d = params_2d
    for name, value, spec in (("x_2d", x_2d, P("data", None)), ("W1", W1_2d, P(None, "model")),
                              ("b1", b1_2d, P("model")), ("W2", W2_2d, P("model", None)),
                              ("b2", b2_2d, P())):
        sharding = getattr(value, "sharding", None)
        as_asked = sharding is not None and sharding.is_equivalent_to(
            NamedSharding(mesh_2d, spec), value.ndim)
        print(f"{name}: {jax.typeof(value)}, laid out as the task asks: {as_asked}")
    print("output:", jax.typeof(out_2d))
    print("same as one device:", np.allclose(out_2d, forward(mlp_params, x_mlp), atol=1e-5))
    print_collectives("forward_2d(params_2d, x_2d), compiled", forward_2d, params_2d, x_2d,
                      mesh=mesh_2d)
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
#
# The `psum` over `model` and the mean over `data` are the collectives of the loss you write (its
# forward pass). Its gradient adds the backward pass's: an all-reduce over `data` of every
# parameter's gradient, and, where the gradient with respect to `x` is wanted too, an
# all-reduce over `model` of it. The cell after the task measures them.

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
def test_q2_public(loss_2d, mesh_2d, mlp_params, x_mlp, y_mlp, mlp_loss):
    import math

    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import jaxlab_form as form

    def fail(message):
        raise AssertionError(message)

    def ratio(actual, expected):  # actual / expected where the two are proportional
        actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
        k = float(np.sum(actual * expected) / np.sum(expected * expected))
        return k if k and np.allclose(actual, k * expected, rtol=1e-3, atol=1e-5) else None

    def whole(k):  # a sum taken for a mean, or the reverse
        big = k if k and k >= 1 else 1 / k if k else 0
        return round(big) >= 2 and math.isclose(big, round(big), rel_tol=1e-3)

    def steps(jaxpr, times=1, inside=False):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            yield eqn, times, inside
            runs = None if name == "while" or times is None else \
                times * eqn.params["length"] if name == "scan" else times
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        yield from steps(sub, runs, inside or name == "shard_map")

    form.expect_callable("loss_2d", form.evidence(loss_2d))
    mesh = mesh_2d
    if type(mesh).__name__ != "Mesh" or tuple(mesh.axis_names) != ("data", "model") or \
            mesh.devices.shape != (4, 2):
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                             devices=form.check_devices(8))
    specs = (P(None, "model"), P("model"), P("model", None), P())
    params = tuple(jax.device_put(p, NamedSharding(mesh, s)) for p, s in zip(mlp_params, specs))
    batch = tuple(jax.device_put(a, NamedSharding(mesh, P("data", None))) for a in (x_mlp, y_mlp))
    call = "loss_2d(params_2d, (x_2d, y))"
    try:
        value = jax.jit(loss_2d)(params, batch)
        program = jax.make_jaxpr(loss_2d)(params, batch)
    except Exception as exc:
        fail(f"`{call}` raised {form.student_error(exc)}; expected the loss `mlp_loss` written "
             "with jax.shard_map on `mesh_2d`, for params laid out like `params_2d` and a batch "
             "split by rows over 'data'.")
    form.expect_array(call, form.evidence(value), shape=())
    try:
        grads = jax.jit(jax.grad(loss_2d))(params, batch)
    except Exception as exc:
        fail(f"the gradient of `loss_2d` (jax.grad) raised {form.student_error(exc)}; expected "
             "the gradient of `mlp_loss`.")
    ref = float(mlp_loss(mlp_params, (x_mlp, y_mlp)))
    k = ratio(value, ref)
    if whole(k):
        fail(f"`{call}` is {float(value):.6g}, {k:.3g} times the loss {ref:.6g}; expected the "
             "mean over 'data' of the devices' mean losses (jax.lax.pmean, or psum divided by "
             "the size of 'data'), after one psum over 'model' of the output block.")
    form.expect_close(call, float(value), ref, "mlp_loss(mlp_params, (x_mlp, y_mlp))",
                      rtol=1e-3, atol=1e-5)
    grad_call = "the gradient of `loss_2d` (jax.grad)"
    ref_grads = jax.grad(mlp_loss)(mlp_params, (x_mlp, y_mlp))
    if type(grads) not in (tuple, list) or len(grads) != 4:
        fail(f"{grad_call} is {form.describe(form.evidence(grads))}; expected a tuple of four "
             "gradients like `params`.")
    ks = [ratio(g, r) for g, r in zip(grads, ref_grads)]
    if all(whole(k) and math.isclose(k, ks[0], rel_tol=1e-3) for k in ks):
        fail(f"{grad_call} is {ks[0]:.3g} times the gradient of `mlp_loss`. Inside "
             "jax.shard_map, jax.grad already adds up the contributions of a parameter's "
             "copies; take the gradient of the averaged loss and do not average or sum the "
             "gradients yourself (expected the gradient of `mlp_loss`).")
    for name, g, r in zip(("W1", "b1", "W2", "b2"), grads, ref_grads):
        form.expect_close(f"{grad_call} for {name}", np.asarray(g), np.asarray(r),
                          "the gradient of `mlp_loss`", rtol=1e-3, atol=1e-5)
    shard_maps = [eqn for eqn, _, _ in steps(program.jaxpr) if eqn.primitive.name == "shard_map"]
    if not shard_maps:
        fail("`loss_2d` gives the right numbers but does not go through jax.shard_map; expected "
             "what the task asks for: the per-device program written with jax.shard_map on "
             "mesh_2d.")
    operands = {x_mlp.shape: ("x", P("data"), "x split by rows over 'data' (P('data', None))"),
                y_mlp.shape: ("y", P("data"), "y split by rows over 'data' (P('data', None))"),
                mlp_params[0].shape: ("W1", specs[0], "W1 split by columns over 'model'"),
                mlp_params[1].shape: ("b1", specs[1], "b1 split over 'model'"),
                mlp_params[2].shape: ("W2", specs[2], "W2 split by rows over 'model'"),
                mlp_params[3].shape: ("b2", specs[3], "b2 replicated (P())")}
    def entries(spec):  # a spec as tuples of mesh axes, trailing unsplit dimensions dropped
        out = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
        while out and not out[-1]:
            out.pop()
        return out

    moves = []
    for eqn in shard_maps:
        mesh_of = eqn.params["mesh"]
        shape = tuple(mesh_of.shape[a] for a in mesh_of.axis_names)
        if tuple(mesh_of.axis_names) != ("data", "model") or shape != (4, 2):
            fail(f"`loss_2d` runs jax.shard_map on a mesh with axes {dict(mesh_of.shape)}; "
                 "expected mesh_2d (4 × 2, axes ('data', 'model')).")
        for var, spec in zip(eqn.invars, eqn.params["in_specs"]):
            if var.aval.shape in operands:
                what, wanted, words = operands[var.aval.shape]
                if entries(spec) != entries(wanted):
                    fail(f"`loss_2d` hands {what} (shape {var.aval.shape}) to jax.shard_map with "
                         f"in_specs {spec}; expected what the task says: {words}.")
        moves += [(e, times) for e, times, _ in steps(eqn.params["jaxpr"], 1, True)
                  if e.primitive.name in ("psum", "psum_invariant", "psum2", "all_gather",
                                          "all_gather_invariant", "reduce_scatter", "ppermute",
                                          "all_to_all", "pmax", "pmin")]

    def axes(eqn):
        found = eqn.params.get("axes", eqn.params.get("axis_name", ()))
        return list(found) if isinstance(found, (tuple, list)) else [found]

    block = (x_mlp.shape[0] // 4, y_mlp.shape[1])
    psums = ("psum", "psum_invariant", "psum2")
    if not (len(moves) == 2 and all(times == 1 for _, times in moves)
            and moves[0][0].primitive.name in psums and axes(moves[0][0]) == ["model"]
            and moves[0][0].invars[0].aval.shape == block
            and moves[1][0].primitive.name in psums and "data" in axes(moves[1][0])
            and moves[1][0].invars[0].aval.shape == ()):
        found = ", ".join(f"`{e.primitive.name}` over {tuple(axes(e))} of an array of shape "
                          f"{e.invars[0].aval.shape if e.invars else ()}" for e, _ in moves)
        fail(f"inside its shard_map `loss_2d` communicates {len(moves)} time(s) "
             f"({found or 'none'}); expected what the task says: one psum over 'model' of the "
             f"output block (shape {block}), then one mean over 'data' of the devices' losses "
             "(a scalar).")

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

# %% [markdown]
# Your loss, what its `shard_map` hands back (read from the traced program: predictions
# returned and averaged outside it give the same loss, gradient and collectives), its gradient,
# and what each communicates when compiled. The type of a gradient
# follows the parameter's sharding whatever happened inside, and an answer without tensor
# parallelism (the parameters gathered and replicated, no `psum` over `model`) prints the same
# loss, gradient and type: its collectives tell it apart (all-gathers, no all-reduce over
# `model`).

# %% tags=["claim:lab5-megatron-backward"]
if answered(loss_2d, params_2d, x_2d):
    batch_2d = (x_2d, jax.device_put(y_mlp, x_2d.sharding))
    grads_2d = jax.jit(jax.grad(loss_2d))(params_2d, batch_2d)
    grads_1 = jax.grad(mlp_loss)(mlp_params, (x_mlp, y_mlp))
    print(f"loss {float(jax.jit(loss_2d)(params_2d, batch_2d)):.4f}")
    print("what the shard_map returns:", shard_map_outputs(loss_2d, params_2d, batch_2d),
          "(the task's: the loss averaged over data inside it, a scalar: ['float32[]'])")
    print("same gradient:", all(np.allclose(g, h, rtol=1e-3, atol=1e-5)
                                for g, h in zip(grads_2d, grads_1)))
    print("W1's gradient:", jax.typeof(grads_2d[0]))
    print_collectives("loss_2d (the forward pass), compiled", loss_2d, params_2d, batch_2d,
                      mesh=mesh_2d)
    print_collectives("jax.grad(loss_2d), for the parameters", jax.grad(loss_2d), params_2d,
                      batch_2d, mesh=mesh_2d)
    print_collectives("jax.grad for the parameters and x (an MLP after another layer)",
                      jax.grad(lambda params, x, y: loss_2d(params, (x, y)), argnums=(0, 1)),
                      params_2d, *batch_2d, mesh=mesh_2d)

# %% [markdown]
# ## Part B: pipeline parallelism
#
# ### Stages
#
# Tensor parallelism splits every layer; **pipeline parallelism** keeps layers whole and gives
# each device a few consecutive layers, a **stage**. The network below has 16 layers of width 24;
# on 8 devices each stage holds 2 of them. An activation leaves a stage and becomes the input of
# the next stage, on the next device: between stages, the only communication is that hand-over,
# from each device to its neighbour, which is what `jax.lax.ppermute` does (GPipe, Huang et al.,
# 2019). The version in this lab also ends with one `psum` over the stages, which gives every
# device the outputs; a real pipeline leaves them on the last stage. The cells after Tasks 4 and
# 5 measure both, forward and backward.

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
def test_q3_public(mesh_stage, stage_params, layers, devices):
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxlab_form as form

    def fail(message):
        raise AssertionError(message)

    form.expect_defined("mesh_stage", form.evidence(mesh_stage))
    if type(mesh_stage).__name__ != "Mesh":
        fail(f"`mesh_stage` is {form.describe(form.evidence(mesh_stage))}; expected a jax Mesh "
             "(jax.make_mesh).")
    if tuple(mesh_stage.axis_names) != ("stage",) or mesh_stage.devices.shape != (8,):
        fail(f"`mesh_stage` is a mesh with axes {dict(mesh_stage.shape)}; expected a 1-D mesh "
             "of the 8 devices with one axis named 'stage'.")
    if [d.id for d in mesh_stage.devices.flat] != [d.id for d in devices]:
        fail(f"`mesh_stage` holds the devices {[d.id for d in mesh_stage.devices.flat]} in that "
             f"order; expected the 8 `devices` in their order {[d.id for d in devices]}, so "
             "that device k holds layers 2k and 2k + 1.")
    form.expect_defined("stage_params", form.evidence(stage_params))
    if type(stage_params) not in (tuple, list) or len(stage_params) != 2:
        fail(f"`stage_params` is {form.describe(form.evidence(stage_params))}; expected the "
             "tuple (W_stack, b_stack) of the stacked weights and biases.")
    for i, (item, what) in enumerate(zip(stage_params, ("weights", "biases"))):
        ref = np.stack([np.asarray(layer[i]) for layer in layers])
        name = f"stage_params[{i}]"
        form.expect_on_mesh(name, form.evidence(item))
        if tuple(item.shape) != ref.shape:
            fail(f"`{name}` has shape {tuple(item.shape)}; expected {ref.shape}: the {what} of "
                 "the 16 layers stacked along a new leading dimension.")
        value = np.asarray(item, np.float64)
        if not np.allclose(value, ref, rtol=1e-4, atol=1e-5) and \
                np.allclose(value, ref[::-1], rtol=1e-4, atol=1e-5):
            fail(f"`{name}` holds the {what} of `layers` in reverse order; expected layer 0 "
                 "first, so that stage 0 holds the first layers.")
        form.expect_close(name, value, ref, f"the {what} of `layers` stacked in layer order",
                          rtol=1e-4, atol=1e-5)
        sev = form.sharding_evidence(item.sharding)
        if not isinstance(item.sharding, NamedSharding) or \
                item.sharding.mesh.axis_names != mesh_stage.axis_names or \
                item.sharding.mesh.device_ids.tolist() != mesh_stage.device_ids.tolist():
            fail(f"`{name}` lives {form.describe_sharding(sev)}, not on `mesh_stage`; expected "
                 "it placed on `mesh_stage`.")
        if not item.sharding.is_equivalent_to(NamedSharding(mesh_stage, P("stage")), item.ndim):
            fail(f"`{name}` is {form.describe_sharding(sev)}; expected the leading (layer) "
                 "dimension split over 'stage' (spec P('stage')), so that device k holds layers "
                 "2k and 2k + 1.")

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

# %% tags=["claim:lab5-stage-blocks"]
if answered(stage_params):
    for name, stacked in zip(("W_stack", "b_stack"), stage_params):
        print(name, jax.typeof(stacked), "laid out", getattr(stacked.sharding, "spec", None),
              "on mesh axes", getattr(stacked.sharding.mesh, "axis_names", None), "one device holds",
              stacked.addressable_shards[0].data.shape)
    # which of `layers` each device holds, found by the values of its block (not by position:
    # layers stacked in another order would be numbered by where they sit)
    W_layers = [np.asarray(W) for W, _ in layers]
    for shard in sorted(stage_params[0].addressable_shards, key=lambda s: s.device.id):
        held = [next((i for i, W in enumerate(W_layers) if np.array_equal(np.asarray(row), W)),
                     "none of them") for row in shard.data]
        print(f"device {shard.device.id} holds layers {held}")

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


def sequential_loss(layers, x, y):
    """Task 5's loss on one device: the mean over all examples of the squared error summed over
    the outputs."""
    return jnp.mean(jnp.sum((jax.vmap(partial(sequential_forward, layers))(x) - y) ** 2,
                            axis=-1))

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
# steps, each moving the activations one stage on with `ppermute` (the last step's move, which
# no stage reads, may be left out). It must equal `sequential_forward` applied to each
# microbatch, and gather no parameter. Wrap it in `jax.jit`.

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
def test_q4_public(pipeline_forward, mesh_stage, layers, micro_x, expected_outputs):
    import math

    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import jaxlab_form as form

    def fail(message):
        raise AssertionError(message)

    def steps(jaxpr, times=1, inside=False):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            yield eqn, times, inside
            runs = None if name == "while" or times is None else \
                times * eqn.params["length"] if name == "scan" else times
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        yield from steps(sub, runs, inside or name == "shard_map")

    def entries(spec):  # a spec as tuples of mesh axes, trailing unsplit dimensions dropped
        out = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
        while out and not out[-1]:
            out.pop()
        return out

    form.expect_callable("pipeline_forward", form.evidence(pipeline_forward))
    mesh = mesh_stage
    if type(mesh).__name__ != "Mesh" or tuple(mesh.axis_names) != ("stage",) or mesh.size != 8:
        mesh = jax.make_mesh((8,), ("stage",), axis_types=(AxisType.Auto,),
                             devices=form.check_devices(8))
    W = np.stack([np.asarray(W) for W, _ in layers])
    b = np.stack([np.asarray(b) for _, b in layers])
    params = tuple(jax.device_put(a, NamedSharding(mesh, P("stage"))) for a in (W, b))
    microbatches = jax.device_put(micro_x, NamedSharding(mesh, P()))
    M, size, width = micro_x.shape
    L = W.shape[0] // 2
    call = "pipeline_forward(stage_params, micro_x)"
    try:
        out = jax.block_until_ready(pipeline_forward(params, microbatches))
        program = jax.make_jaxpr(pipeline_forward)(params, microbatches)
    except Exception as exc:
        fail(f"`{call}` raised {form.student_error(exc)}; expected the network's outputs for "
             "every microbatch, from stage_params as in Task 3 and replicated microbatches.")
    form.expect_array(call, form.evidence(out), shape=micro_x.shape)
    form.expect_close(call, np.asarray(out), np.asarray(expected_outputs),
                      "sequential_forward of the 16 layers applied to each microbatch "
                      "(expected_outputs)", rtol=1e-4, atol=1e-5)
    if not out.sharding.is_fully_replicated or len(out.sharding.device_set) != 8:
        fail(f"`{call}` returned an array that is "
             f"{form.describe_sharding(form.sharding_evidence(out.sharding))}; expected the "
             "outputs replicated on every device (out_specs=P()).")
    shard_maps = [eqn for eqn, _, _ in steps(program.jaxpr) if eqn.primitive.name == "shard_map"]
    if not shard_maps:
        fail("`pipeline_forward` gives the right numbers but does not go through jax.shard_map; "
             "expected what the task asks for: a pipeline written with jax.shard_map on "
             "mesh_stage.")
    operands = {W.shape: ("W_stack", [("stage",)], "stage_params split over 'stage' (P('stage'))"),
                b.shape: ("b_stack", [("stage",)], "stage_params split over 'stage' (P('stage'))"),
                micro_x.shape: ("the microbatches", [], "the microbatches replicated (P())")}
    communication = ("psum", "psum_invariant", "psum2", "all_gather", "all_gather_invariant",
                     "reduce_scatter", "ppermute", "all_to_all", "pmax", "pmin")
    moves = []
    for eqn in shard_maps:
        for var, spec in zip(eqn.invars, eqn.params["in_specs"]):
            if var.aval.shape in operands and entries(spec) != operands[var.aval.shape][1]:
                what, _, words = operands[var.aval.shape]
                fail(f"`pipeline_forward` hands {what} (shape {var.aval.shape}) to "
                     f"jax.shard_map with in_specs {spec}; expected what the task says: {words}.")
        moves += [(e, times) for e, times, _ in steps(eqn.params["jaxpr"], 1, True)
                  if e.primitive.name in communication]

    def is_param(shape):
        return (len(shape) >= 2 and tuple(shape[-2:]) == W.shape[1:]) or \
            tuple(shape) in ((2, width), b.shape)

    moved = [e for e, _ in moves if any(is_param(v.aval.shape) for v in (*e.invars, *e.outvars))]
    if moved:
        fail(f"`pipeline_forward` moves parameters between devices (`{moved[0].primitive.name}` "
             f"of an array of shape {moved[0].invars[0].aval.shape}); expected what the task "
             "says: in a pipeline the parameters stay on their stage and only activations "
             "travel (no parameter is gathered).")
    shifts = [(e, times) for e, times in moves if e.primitive.name == "ppermute"
              and e.invars and math.prod(e.invars[0].aval.shape) == size * width]
    if any(times is None for _, times in shifts):
        fail("`pipeline_forward` moves its activations inside a while loop, whose number of "
             "steps cannot be read from the traced program; expected a loop of a fixed number "
             "of steps (a Python for loop, lax.fori_loop with fixed bounds, or lax.scan) of "
             f"M + {L} - 1 steps.")
    count = sum(times for _, times in shifts)
    wanted = M + L - 1
    if not shifts or count not in (wanted - 1, wanted):
        fail(f"`pipeline_forward` moves a microbatch's activations (shape ({size}, {width})) "
             f"with ppermute over 'stage' {count} time(s) for {M} microbatches; expected the "
             f"GPipe schedule: M + L - 1 = {wanted} steps, each moving the activations one "
             f"stage on (the last move may be left out: {wanted - 1} or {wanted}).")
    form.expect_jitted("pipeline_forward", form.program_evidence(program))

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

# %% [markdown]
# Your pipeline against the sequential model, the `ppermute`s it traces, and what XLA compiles
# of it. A schedule without overlap (each microbatch crosses all stages before the next starts)
# also equals the sequential model: its number of `ppermute`s tells it apart. An unrolled Python
# loop over the `M + L - 1` steps traces one `ppermute` per step; a `lax.fori_loop` or `lax.scan`
# traces one, in its body, that runs `M + L - 1` times. In the compiled program of a Python
# loop, the last step's send is gone: no later step reads it, so XLA drops it, and `M + L - 2`
# hand-overs run.

# %% tags=["claim:lab5-pipeline-forward"]
if answered(pipeline_forward, stage_params):
    piped = pipeline_forward(stage_params, micro_x)
    print("equals the sequential model:", np.allclose(piped, expected_outputs, atol=1e-5))
    program = str(jax.make_jaxpr(pipeline_forward)(stage_params, micro_x))
    print(f"ppermute equations in the traced program: {program.count('ppermute[')} (the "
          f"schedule has M + L - 1 = {N_MICRO + N_STAGES - 1} steps)  all_gather:",
          "all_gather" in program)
    print_collectives(f"pipeline_forward, compiled (M = {N_MICRO}, L = {N_STAGES})",
                      pipeline_forward, stage_params, micro_x, mesh=mesh_stage)

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
# `mesh_stage`), `targets` having the shape of `microbatches`, for any number of microbatches and
# any microbatch size (as in Task 4). Its value and its gradient `jax.grad(pipeline_loss)` must
# equal those of the sequential model's loss, and the gradient must stay split over `stage` like
# `stage_params` (each device holding only its stage's gradient).

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
def test_q5_public(pipeline_loss, mesh_stage, layers, micro_x, micro_y, sequential_loss):
    import math

    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import jaxlab_form as form

    def fail(message):
        raise AssertionError(message)

    def steps(jaxpr, inside=False):
        for eqn in jaxpr.eqns:
            yield eqn, inside
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        yield from steps(sub, inside or eqn.primitive.name == "shard_map")

    def entries(spec):
        out = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
        while out and not out[-1]:
            out.pop()
        return out

    form.expect_callable("pipeline_loss", form.evidence(pipeline_loss))
    mesh = mesh_stage
    if type(mesh).__name__ != "Mesh" or tuple(mesh.axis_names) != ("stage",) or mesh.size != 8:
        mesh = jax.make_mesh((8,), ("stage",), axis_types=(AxisType.Auto,),
                             devices=form.check_devices(8))
    W = np.stack([np.asarray(W) for W, _ in layers])
    b = np.stack([np.asarray(b) for _, b in layers])
    params = tuple(jax.device_put(a, NamedSharding(mesh, P("stage"))) for a in (W, b))
    x, y = (jax.device_put(a, NamedSharding(mesh, P())) for a in (micro_x, micro_y))
    call = "pipeline_loss(stage_params, micro_x, micro_y)"
    grad_call = "the gradient of `pipeline_loss` (jax.grad)"
    try:  # one compiled program for the value and the gradient: the costliest check of the lab
        value, grads = jax.jit(jax.value_and_grad(pipeline_loss))(params, x, y)
        program = jax.make_jaxpr(jax.grad(pipeline_loss))(params, x, y)
    except Exception as exc:
        try:
            value = jax.jit(pipeline_loss)(params, x, y)
        except Exception as first:
            fail(f"`{call}` raised {form.student_error(first)}; expected the loss of your "
                 "pipeline for stage_params as in Task 3 and replicated microbatches.")
        form.expect_array(call, form.evidence(value), shape=())
        fail(f"{grad_call} raised {form.student_error(exc)}; expected the gradient of the "
             "sequential model's loss.")
    ref = float(sequential_loss(layers, micro_x, micro_y))
    form.expect_array(call, form.evidence(value), shape=())
    k = float(value) / ref
    if round(max(k, 1 / k if k else 0)) >= 2 and math.isclose(
            max(k, 1 / k if k else 0), round(max(k, 1 / k if k else 0)), rel_tol=1e-3):
        fail(f"`{call}` is {float(value):.6g}, {k:.3g} times the sequential model's loss "
             f"{ref:.6g} (sequential_loss); expected the mean over all examples of all "
             "microbatches of the squared error summed over the 24 outputs.")
    form.expect_close(call, float(value), ref, "sequential_loss(layers, micro_x, micro_y)",
                      rtol=1e-3, atol=1e-5)
    ref_grads = jax.grad(sequential_loss)(layers, micro_x, micro_y)
    if type(grads) not in (tuple, list) or len(grads) != 2:
        fail(f"{grad_call} is {form.describe(form.evidence(grads))}; expected a tuple of two "
             "gradients like `stage_params`.")
    for i, (leaf, what) in enumerate(zip(grads, ("W_stack", "b_stack"))):
        form.expect_close(f"{grad_call} for {what}", np.asarray(leaf),
                          np.stack([np.asarray(g[i]) for g in ref_grads]),
                          "the gradient of the sequential model's loss (sequential_loss)",
                          rtol=1e-3, atol=1e-5)
        if not leaf.sharding.is_equivalent_to(NamedSharding(mesh, P("stage")), leaf.ndim):
            sev = form.sharding_evidence(leaf.sharding)
            fail(f"{grad_call} for {what} is {form.describe_sharding(sev)}; expected the "
                 "gradient split over 'stage' like stage_params (each device holding only its "
                 "stage's gradient).")
    shard_maps = [eqn for eqn, _ in steps(program.jaxpr) if eqn.primitive.name == "shard_map"]
    if not shard_maps:
        fail("`pipeline_loss` gives the right numbers but does not go through jax.shard_map; "
             "expected what the task asks for: a pipeline written with jax.shard_map on "
             "mesh_stage.")
    for eqn in shard_maps:
        for var, spec in zip(eqn.invars, eqn.params["in_specs"]):
            if var.aval.shape in (W.shape, b.shape) and entries(spec) != [("stage",)]:
                fail(f"`pipeline_loss` hands stage_params (shape {var.aval.shape}) to "
                     f"jax.shard_map with in_specs {spec}; expected what the task says: "
                     "stage_params split over 'stage' (P('stage')).")
            if var.aval.shape == micro_x.shape and entries(spec) != []:
                fail(f"`pipeline_loss` hands the microbatches (shape {var.aval.shape}) to "
                     f"jax.shard_map with in_specs {spec}; expected what the task says: the "
                     "microbatches replicated (P()).")
    inside = [eqn for eqn, within in steps(program.jaxpr) if within]
    moved = [e for e in inside if e.primitive.name.startswith(("all_gather", "psum", "ppermute",
                                                               "reduce_scatter", "all_to_all"))
             and any(len(v.aval.shape) >= 2 and tuple(v.aval.shape[-2:]) == W.shape[1:]
                     for v in (*e.invars, *e.outvars))]
    if moved:
        fail(f"`pipeline_loss` moves parameters between devices (`{moved[0].primitive.name}` of "
             f"an array of shape {moved[0].invars[0].aval.shape}); expected what the task says: "
             "in a pipeline the parameters stay on their stage and only activations travel (no "
             "parameter is gathered).")
    if not any(e.primitive.name == "ppermute" for e in inside):
        fail("the gradient of `pipeline_loss` moves no activation with ppermute; expected the "
             "loss of the pipeline of Task 4, whose gradient flows back through the stages.")

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

# %% [markdown]
# Your gradient against the sequential model's, where it lives, and what the compiled gradient
# communicates: the forward pipeline's hand-overs, the same number sent back the other way (the
# backward pipeline), and no parameter gathered.

# %% tags=["claim:lab5-pipeline-backward"]
if answered(pipeline_loss, stage_params):
    piped_grads = jax.jit(jax.grad(pipeline_loss))(stage_params, micro_x, micro_y)
    layer_grads = jax.grad(sequential_loss)(layers, micro_x, micro_y)
    print("same gradient:", all(np.allclose(g, jnp.stack(h), rtol=1e-3, atol=1e-5)
                                for g, h in zip(piped_grads, zip(*layer_grads))))
    print("gradient of W_stack:", jax.typeof(piped_grads[0]), piped_grads[0].sharding.spec)
    print_collectives(f"jax.grad(pipeline_loss), compiled (M = {N_MICRO}, L = {N_STAGES})",
                      jax.grad(pipeline_loss), stage_params, micro_x, micro_y, mesh=mesh_stage)

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
# be large enough to keep a device busy). The backward pass is the same schedule run the other
# way (the compiled gradient above sends as many activations back as the forward sends on), so a
# whole training step, forward then backward, has the same idle fraction when each stage's
# backward step takes as long on every stage (GPipe, §2.2, gives the bubble as
# O((K − 1)/(M + K − 1)) for K stages). (Some texts divide the idle time by the *busy* time
# instead, `(L - 1) / M`, as Narayanan et al., 2021, do; that is not the fraction of the
# schedule.)
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
# NumPy or JAX array; a NumPy `float64` or integer scalar counts as one, since it holds the same
# value exactly).

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
def test_q6_public(bubble_fraction, microbatches_needed):
    import math
    import signal
    import threading

    import jaxlab_form as form

    def fail(message):
        raise AssertionError(message)

    class NoReturn(Exception):
        pass

    def call_with_limit(fn, args, seconds=10):  # a call takes microseconds: more is a loop
        if not hasattr(signal, "setitimer") or \
                threading.current_thread() is not threading.main_thread():
            return fn(*args)

        def stop(signum, frame):
            raise NoReturn

        previous = signal.signal(signal.SIGALRM, stop)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return fn(*args)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    def number(call, fn, args, integer=False):
        """(value, what is wrong with its type or None): the type is named only once the
        value is right (a 32-bit float holds about 7 digits)."""
        wanted = "an int" if integer else "a float"
        try:
            ev = form.evidence(call_with_limit(fn, args))
        except NoReturn:
            fail(f"`{call}` did not return within 10 s: a loop that never ends (a count that "
                 "never moves, or a fraction that never falls below the bound); expected "
                 f"{wanted} at once.")
        except Exception as exc:
            fail(f"`{call}` raised {form.student_error(exc)}; it should return {wanted}.")
        exact = ("int", "float", "float64", "int8", "int16", "int32", "int64", "uint8",
                 "uint16", "uint32", "uint64")
        if ev["kind"] == "number" and ev["type"] in exact and (ev["is_int"] or not integer):
            return ev["value"], None
        if ev["kind"] in ("array", "ndarray") and ev["shape"] == [] and "value" in ev:
            return float(ev["value"]), (
                f"`{call}` returned {'a jax.Array' if ev['kind'] == 'array' else 'a NumPy array'}"
                f" of shape () and dtype {ev['dtype']} (value {float(ev['value']):.9g}), not a "
                f"plain Python number; expected {wanted}, as the task asks: both functions take "
                f"and return plain Python numbers (convert with {'int' if integer else 'float'}"
                "(...), or compute with Python numbers).")
        if ev["kind"] == "number":
            return ev["value"], (f"`{call}` returned {form.describe(ev)} (a NumPy "
                                 f"{ev['type']}); expected {wanted}.")
        fail(f"`{call}` returned {form.describe(ev)}; expected {wanted}.")

    def right(value, problem, expected, rel_tol):
        if problem is None:
            return math.isclose(value, expected, rel_tol=rel_tol, abs_tol=1e-12)
        if math.isclose(value, expected, rel_tol=max(rel_tol, 1e-6), abs_tol=1e-12):
            fail(problem)
        return False

    def idle(L, M):  # idle slots over all slots, counted in the schedule
        slots = [(s, t) for s in range(L) for t in range(M + L - 1)]
        return sum(not 0 <= t - s < M for s, t in slots) / len(slots)

    form.expect_callable("bubble_fraction", form.evidence(bubble_fraction))
    for L, M in ((8, 1), (8, 8), (8, 32), (8, 128), (4, 6), (1, 5)):
        call = f"bubble_fraction({L}, {M})"
        value, problem = number(call, bubble_fraction, (L, M))
        if not right(value, problem, idle(L, M), 1e-9):
            extra = (" That is the idle time over the busy time; the task asks for the idle "
                     "slots over all slots of the schedule." if M > 1 and
                     math.isclose(value, (L - 1) / M, rel_tol=1e-9) else "")
            fail(f"`{call}` is {value:.9g}; expected {idle(L, M):.9g}, the idle fraction of {M} "
                 f"microbatch{'es' if M > 1 else ''} through {L} stage{'s' if L > 1 else ''}: "
                 f"idle slots over all slots of the schedule.{extra}")
    form.expect_callable("microbatches_needed", form.evidence(microbatches_needed))
    # the text's example, then ties at the fractions the notebook prints, then one stage
    for L, bound, expected in ((8, 0.1, 64), *((8, 7 / (M + 7), M + 1) for M in (1, 8, 32, 128)),
                               (1, 0.1, 1)):
        call = f"microbatches_needed({L}, {bound!r})"
        value, problem = number(call, microbatches_needed, (L, bound), integer=True)
        if not right(value, problem, expected, 0.0):
            fail(f"`{call}` is {value:g}; expected {expected}, the smallest number of "
                 f"microbatches M (at least 1) whose idle fraction is strictly less than "
                 f"{bound!r}" + (f": {bound!r} is exactly the idle fraction of {expected - 1} "
                                 f"microbatches, so {expected - 1} are not enough" if L > 1
                                 else ": one stage leaves no bubble at all") + ".")

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
# probability the router gave that expert. Each token goes through one expert, so the parameters
# grow with `E` while the expert work per token need not: it stays flat **provided each expert's
# capacity (below) shrinks as `E` grows**, as in the Switch Transformer (Fedus et al., 2021, §2.2:
# capacity = capacity factor × tokens / `E`). The router (`D × E` per token) and this lab's
# one-hot dispatch and combine still grow with `E`, and this lab keeps a fixed capacity per
# device, so its work per device doubles with each doubling of `E`: the cell after Task 8
# measures it.
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
def test_q7_public(route, moe_tokens, moe_router, EXPERT_CAPACITY, TOKENS_PER_DEVICE):
    import jax
    import numpy as np

    import jaxlab_form as form

    def fail(message):
        raise AssertionError(message)

    form.expect_callable("route", form.evidence(route))
    for tokens in (moe_tokens[:TOKENS_PER_DEVICE], moe_tokens):
        T = len(tokens)
        call = (f"route(moe_tokens[:{T}], moe_router, {EXPERT_CAPACITY}) under jax.jit")
        try:
            out = jax.jit(route, static_argnums=2)(tokens, moe_router, EXPERT_CAPACITY)
        except Exception as exc:
            try:
                route(tokens, moe_router, EXPERT_CAPACITY)
                how = ("It works without jax.jit, so some step needs concrete values: use jnp "
                       "operations on the arrays")
            except Exception:
                how = "It fails without jax.jit too"
            fail(f"`{call}` raised {form.student_error(exc)}. {how}; expected it to work under "
                 "jax.jit with capacity a static int.")
        if type(out) not in (tuple, list) or len(out) != 3:
            fail(f"`{call}` returned {form.describe(form.evidence(out))}; expected a tuple "
                 "(expert, gate, slot) of three arrays.")
        for what, item in zip(("expert", "gate", "slot"), out):
            form.expect_array(f"{call}: {what}", form.evidence(item))
        logits = np.asarray(tokens, np.float64) @ np.asarray(moe_router, np.float64)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        expert = logits.argmax(-1)
        slot = np.array([np.sum(expert[:t] == expert[t]) for t in range(T)])
        gate = np.where(slot < EXPERT_CAPACITY, probs[np.arange(T), expert], 0.0)
        for what, item in (("expert", out[0]), ("slot", out[2])):
            if tuple(item.shape) != (T,) or "int" not in str(item.dtype):
                fail(f"`{call}` returned {what} as an array of shape {tuple(item.shape)} and "
                     f"dtype {item.dtype}; expected integers of shape ({T},).")
        if not np.array_equal(np.asarray(out[0]), expert):
            fail(f"`{call}` returned the wrong expert for some tokens: expected the index of the "
                 "largest score tokens @ router_weights.")
        found = np.asarray(out[2])
        if not np.array_equal(found, slot):
            extra = (" (they start at 1; the first token of an expert has slot 0)"
                     if np.array_equal(found, slot + 1) else "")
            fail(f"`{call}` returned the wrong slots{extra}: expected, for each token, how many "
                 "tokens before it chose the same expert.")
        found = np.asarray(out[1], np.float64)
        chosen = probs[np.arange(T), expert]
        if found.shape == gate.shape and np.allclose(found, chosen, rtol=1e-4, atol=1e-5) and \
                np.any(gate != chosen):
            fail(f"`{call}` keeps the gate of tokens whose slot is {EXPERT_CAPACITY} or more; "
                 "expected 0 for those dropped tokens.")
        form.expect_close(f"the gate that `{call}` returned", found, gate,
                          "the softmax probability of the chosen expert, 0 for a dropped token",
                          rtol=1e-4, atol=1e-5)

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
    chosen = [int(e) for e in np.asarray(expert)]
    by_definition = [chosen[:t].count(e) for t, e in enumerate(chosen)]
    print("slots by the definition (earlier tokens with the same expert):", by_definition,
          "- yours follow it:", np.array_equal(np.asarray(slot), by_definition))
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

# %% tags=["claim:lab5-all-to-all-transpose"]
mesh_expert = jax.make_mesh((N_EXPERTS,), ("expert",), axis_types=(AxisType.Auto,),
                            devices=devices)
messages = jnp.arange(64)  # device d starts with 8 messages: 8 d + j is meant for device j


@jax.jit
@partial(jax.shard_map, mesh=mesh_expert, in_specs=P("expert"), out_specs=P("expert"))
def exchange(block):
    return lax.all_to_all(block, "expert", 0, 0, tiled=True)


print("before (row = device):\n", np.asarray(messages).reshape(8, 8))
print("after:\n", np.asarray(exchange(messages)).reshape(8, 8))
print("after is the transpose of before:", np.array_equal(
    np.asarray(exchange(messages)).reshape(8, 8), np.asarray(messages).reshape(8, 8).T))

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
# In the forward pass, two `all_to_all`s and no other communication: the tokens travel, the
# experts stay. Training adds the backward pass's: the all_to_alls carry the gradients back the
# way the tokens came (their transposes are all_to_alls too), and the router's weights, being
# replicated, get their gradient added up over `expert` with an all-reduce (measured after the
# task).
#
# `moe_dense` is the same layer on one device, for comparison: every expert applied to every
# token, then each token's own expert's output kept, with the gates of your `route`.

# %%
def moe_dense(tokens, router_weights, W_in, W_out):
    """The layer on one device: each device's tokens routed with its own capacity, then every
    expert's output computed and each token's own kept, times its gate."""
    rows = []
    for group in jnp.split(tokens, N_EXPERTS):  # the tokens of each device
        expert, gate, _ = route(group, router_weights, EXPERT_CAPACITY)
        all_experts = jax.vmap(expert_mlp, in_axes=(None, 0, 0))(group, W_in, W_out)
        rows.append(gate[:, None] * all_experts[expert, jnp.arange(len(group))])
    return jnp.concatenate(rows)

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
# two `jax.lax.all_to_all`s over `'expert'` and no other collective: the tokens out to the
# experts in buffers of `E × EXPERT_CAPACITY` slots (step 2: shape `(E, EXPERT_CAPACITY,
# D_MODEL)` on each device), and the results back in buffers of the same size. It must work for
# any number of tokens per device.

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
def test_q8_public(moe_layer, mesh_expert, moe_dense, moe_tokens, moe_router, moe_W_in,
                   moe_W_out, EXPERT_CAPACITY):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxlab_form as form

    def fail(message):
        raise AssertionError(message)

    def steps(jaxpr, inside=False):
        for eqn in jaxpr.eqns:
            yield eqn, inside
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        yield from steps(sub, inside or eqn.primitive.name == "shard_map")

    def entries(spec):
        out = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
        while out and not out[-1]:
            out.pop()
        return out

    form.expect_callable("moe_layer", form.evidence(moe_layer))
    specs = (P("expert"), P(), P("expert"), P("expert"))
    inputs = (moe_tokens, moe_router, moe_W_in, moe_W_out)
    args = [jax.device_put(a, NamedSharding(mesh_expert, s)) for a, s in zip(inputs, specs)]
    call = "moe_layer(moe_tokens, moe_router, moe_W_in, moe_W_out)"
    try:
        out = jax.block_until_ready(moe_layer(*args))
        program = jax.make_jaxpr(moe_layer)(*args)
    except Exception as exc:
        fail(f"`{call}` raised {form.student_error(exc)}; expected the layer's output for "
             "tokens split by rows over 'expert' and each device holding its expert.")
    try:
        expected = moe_dense(*inputs)
    except Exception as exc:
        fail(f"`moe_dense`, which calls your `route`, raised {form.student_error(exc)}: "
             "expected `route` of Task 7 to work before `moe_layer` can be compared.")
    form.expect_array(call, form.evidence(out), shape=moe_tokens.shape)
    form.expect_close(call, np.asarray(out), np.asarray(expected),
                      "moe_dense(moe_tokens, moe_router, moe_W_in, moe_W_out): each token's gate "
                      "times its expert's expert_mlp output, 0 for the tokens its device's "
                      "route drops", rtol=1e-4, atol=1e-5)
    if not out.sharding.is_equivalent_to(NamedSharding(mesh_expert, P("expert")), out.ndim):
        fail(f"`{call}` returned an array that is "
             f"{form.describe_sharding(form.sharding_evidence(out.sharding))}; expected it "
             "split by rows like tokens (out_specs=P('expert')).")
    shard_maps = [eqn for eqn, _ in steps(program.jaxpr) if eqn.primitive.name == "shard_map"]
    if not shard_maps:
        fail("`moe_layer` gives the right numbers but does not go through jax.shard_map; "
             "expected what the task asks for: the per-device program written with "
             "jax.shard_map on mesh_expert.")
    words = {moe_tokens.shape: ("tokens", "tokens split by rows over 'expert'"),
             moe_router.shape: ("router_weights", "router_weights replicated (P())"),
             moe_W_in.shape: ("W_in", "W_in split over its leading (expert) dimension"),
             moe_W_out.shape: ("W_out", "W_out split over its leading (expert) dimension")}
    wanted = {a.shape: entries(s) for a, s in zip(inputs, specs)}
    for eqn in shard_maps:
        for var, spec in zip(eqn.invars, eqn.params["in_specs"]):
            if var.aval.shape in wanted and entries(spec) != wanted[var.aval.shape]:
                what, text = words[var.aval.shape]
                fail(f"`moe_layer` hands {what} (shape {var.aval.shape}) to jax.shard_map with "
                     f"in_specs {spec}; expected what the task says: {text}.")
    body = [eqn for eqn, inside in steps(program.jaxpr) if inside]
    communication = ("psum", "psum_invariant", "psum2", "all_gather", "all_gather_invariant",
                     "reduce_scatter", "ppermute", "all_to_all", "pmax", "pmin")
    moves = [i for i, eqn in enumerate(body) if eqn.primitive.name in communication]

    def axes(eqn):
        found = eqn.params.get("axes", eqn.params.get("axis_name", ()))
        return list(found) if isinstance(found, (tuple, list)) else [found]

    if len(moves) != 2 or any(body[i].primitive.name != "all_to_all"
                              or axes(body[i]) != ["expert"] for i in moves):
        found = ", ".join(f"`{body[i].primitive.name}` over {tuple(axes(body[i]))}"
                          for i in moves) or "none"
        fail(f"inside its shard_map `moe_layer` communicates {len(moves)} time(s) ({found}); "
             "expected what the task says: two jax.lax.all_to_all over 'expert' (the tokens out "
             "to their experts, the results back) and no other collective.")
    slots = moe_W_in.shape[0] * EXPERT_CAPACITY * moe_tokens.shape[1]
    for i, what in zip(moves, ("tokens out to the experts", "results back")):
        shape = body[i].invars[0].aval.shape
        if int(np.prod(shape)) != slots:
            fail(f"`moe_layer` sends the {what} with an all_to_all of an array of shape {shape} "
                 f"on each device; expected what the task says: buffers of E × EXPERT_CAPACITY "
                 f"slots, shape ({moe_W_in.shape[0]}, {EXPERT_CAPACITY}, {moe_tokens.shape[1]}), "
                 "whatever the number of tokens: the capacity bounds what each device sends to "
                 "each expert.")
    expert_shapes = (moe_W_in.shape[1:], moe_W_out.shape[1:])
    experts = [i for i, eqn in enumerate(body) if eqn.primitive.name == "dot_general"
               and any(tuple(v.aval.shape[-2:]) in expert_shapes
                       and int(np.prod(v.aval.shape[:-2])) == 1 for v in eqn.invars)]
    if not experts or not all(moves[0] < i < moves[1] for i in experts):
        fail("`moe_layer` does not apply the experts between its two all_to_all; expected what "
             "the task says: the first all_to_all sends the tokens to their experts' devices, "
             "each device applies its expert (W_in, W_out) to what it received, and the second "
             "all_to_all sends the results back.")

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

# %% [markdown]
# Your layer against `moe_dense`, and your `route` against the task's definitions: `moe_dense`
# calls your `route`, so a mistake in `route` (slots counted from 1, a raw score as the gate)
# shows only in the lines after it. Then what the layer communicates, forward and in training.

# %% tags=["claim:lab5-moe-collectives"]
if answered(moe_layer, route):
    moe_args = (jax.device_put(moe_tokens, NamedSharding(mesh_expert, P("expert"))),
                jax.device_put(moe_router, NamedSharding(mesh_expert, P())),
                jax.device_put(moe_W_in, NamedSharding(mesh_expert, P("expert"))),
                jax.device_put(moe_W_out, NamedSharding(mesh_expert, P("expert"))))
    moe_out = moe_layer(*moe_args)
    print("equals the dense layer:",
          np.allclose(moe_out, moe_dense(moe_tokens, moe_router, moe_W_in, moe_W_out),
                      atol=1e-5))
    # by the definitions: each device's tokens go to their best expert, which keeps the first
    # EXPERT_CAPACITY of them; a kept token's gate is its router probability
    scores = np.asarray(moe_tokens @ moe_router, np.float64).reshape(N_EXPERTS, -1, N_EXPERTS)
    choices = scores.argmax(-1)
    over = sum(max(0, n - EXPERT_CAPACITY)
               for row in choices for n in np.bincount(row, minlength=N_EXPERTS))
    print("dropped tokens:", int(np.sum(np.all(np.asarray(moe_out) == 0, axis=1))),
          f"(by the task's definitions: {over})")
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    gates = np.concatenate([np.asarray(route(group, moe_router, EXPERT_CAPACITY)[1])
                            for group in jnp.split(moe_tokens, N_EXPERTS)])
    best = np.take_along_axis(probs, choices[..., None], -1).ravel()
    kept = gates != 0
    print("each kept token's gate is its router probability:",
          bool(np.allclose(gates[kept], best[kept], rtol=1e-4, atol=1e-6)))
    print_collectives("moe_layer (forward), compiled", moe_layer, *moe_args, mesh=mesh_expert)
    print_collectives("its gradient for all four inputs, compiled",
                      jax.grad(lambda *args: jnp.sum(moe_layer(*args) ** 2), argnums=(0, 1, 2, 3)),
                      *moe_args, mesh=mesh_expert)

# %% [markdown]
# **What a mixture of experts costs.** The work one device does in a layer like Task 8's, as
# XLA counts it (`compiled.cost_analysis()["flops"]`), for `E` experts on `E` devices and 8 tokens
# per device: the router, the one-hot dispatch and combine, and its expert applied to the
# `E × capacity` slots it receives. With this lab's fixed capacity of 2 per device, the work
# grows with `E`; with a capacity that shrinks as `16 / E`, it stays nearly flat. Either way it
# is more than one expert's work per token (the last line): the router, the dispatch and
# combine, and the empty slots of the buffers come on top.

# %% tags=["claim:lab5-moe-flops"]
def moe_device_flops(n_experts, capacity, tokens=TOKENS_PER_DEVICE):
    """FLOPs of one device's share of a layer like Task 8's with `n_experts` experts."""
    def device_work(x, router_weights, dispatch, W_in, W_out):
        scores = x @ router_weights                                  # the router
        slots = jnp.einsum("tec,td->ecd", dispatch, x)              # dispatch
        done = expert_mlp(slots.reshape(-1, D_MODEL), W_in, W_out)   # the expert, E x C slots
        return scores, jnp.einsum("tec,ecd->td", dispatch, done.reshape(slots.shape))  # combine

    shapes = [(tokens, D_MODEL), (D_MODEL, n_experts), (tokens, n_experts, capacity),
              (D_MODEL, D_HIDDEN), (D_HIDDEN, D_MODEL)]
    cost = jax.jit(device_work).lower(
        *[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


for n_experts in (2, 4, 8):
    print(f"E = {n_experts}: {moe_device_flops(n_experts, EXPERT_CAPACITY):8,.0f} FLOPs per "
          f"device with capacity {EXPERT_CAPACITY}; "
          f"{moe_device_flops(n_experts, 16 // n_experts):8,.0f} with capacity 16 / E = "
          f"{16 // n_experts}")
one_expert = jax.jit(expert_mlp).lower(
    *[jax.ShapeDtypeStruct(s, jnp.float32) for s in
      ((TOKENS_PER_DEVICE, D_MODEL), (D_MODEL, D_HIDDEN), (D_HIDDEN, D_MODEL))]).compile()
one_expert = one_expert.cost_analysis()
print(f"one expert for each of the {TOKENS_PER_DEVICE} tokens: "
      f"{(one_expert[0] if isinstance(one_expert, list) else one_expert)['flops']:8,.0f} FLOPs")

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
# from the slices of all processes: each process's rows go to the blocks of the array that its
# own devices hold, so where they land in the global array depends on where the sharding's mesh
# puts that process's devices. With a mesh built from `jax.devices()`, which lists the devices
# process by process, that is process order: with 2 processes, process 0's rows come first, then
# process 1's. A mesh that lists process 1's devices first puts process 1's rows first (the
# program below shows both). The sharding also says how the rows are spread over the devices.
#
# **On one machine.** We pretend to be two hosts with 4 devices each: two processes on this
# machine, each with 4 simulated CPU devices. Before `jax.distributed.initialize`, each sets
# `jax.config.update("jax_num_cpu_devices", 4)` and picks gloo for the collectives between
# processes: `jax.config.update("jax_cpu_collectives_implementation", "gloo")`. (JAX 0.5.1 and
# later choose gloo by themselves, as JAX's changelog says and the program below prints; 0.5.0
# and earlier chose none. Set it anyway: a script says what it needs.)
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
# compiled so far (`jax.clear_caches()`: they are compiled again when used), which makes room for
# the two processes on a small machine.
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

PD_TIMEOUT = 120  # seconds; a launch of this part's scripts took 4 to 10 s on 2 busy cores
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
# global array of 8 rows from 4 rows per process, and computes with it; then it makes the same
# array on a mesh that lists process 1's devices first. `%%writefile` saves a cell as a file
# instead of running it.

# %%
# %%writefile pd_hello.py
import sys

import jax
import numpy as np

coordinator, num_processes, process_id = sys.argv[1:4]
default_collectives = jax.config.jax_cpu_collectives_implementation
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator, num_processes=int(num_processes),
                           process_id=int(process_id))

from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

me = jax.process_index()
print(f"process {me} of {jax.process_count()}: devices {[d.id for d in jax.local_devices()]} "
      f"of its own, {jax.device_count()} in all; CPU collectives by default: "
      f"{default_collectives!r}")
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
print(f"process {me}: x gathered, first column:",
      multihost_utils.process_allgather(x, tiled=True)[:, 0].tolist())
# the same local rows on a mesh that lists process 1's devices before process 0's
flipped = Mesh(np.array([d for p in (1, 0) for d in jax.devices() if d.process_index == p]),
               ("batch",), axis_types=(AxisType.Auto,))
z = jax.make_array_from_process_local_data(NamedSharding(flipped, P("batch")), local)
print(f"process {me}: on a mesh with process 1's devices first, gathered:",
      multihost_utils.process_allgather(z, tiled=True)[:, 0].tolist())

# %% tags=["claim:lab5-process-arrays"]
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
#
# **Watching a script.** `pd_watch.py` runs a script of this part as one of its processes and,
# when it ends, prints one line `pd_watch: {...}` saying what it did with JAX: its
# `jax.config.update` calls (and whether `jax.distributed.initialize` came before), what it passed
# to `jax.make_array_from_process_local_data` and the global array it got, where
# `jax.device_put` put things, what it printed and whether it wrote the output file.
# `launch("pd_watch.py", SCRIPT, ARGS...)` runs SCRIPT that way in both processes. Task 9's
# public check and the cell after it use it on your script.


# %%
# %%writefile pd_watch.py
"""Run a script of Part D as one of its processes, and say what it did with JAX.

`python pd_watch.py COORDINATOR NUM_PROCESSES PROCESS_ID SCRIPT ARGS...` runs SCRIPT in this
process as `python SCRIPT COORDINATOR NUM_PROCESSES PROCESS_ID ARGS...` would, and at its end
prints one line `pd_watch: {...}` (JSON): its jax.config.update calls (and whether
jax.distributed.initialize had been called before each), its calls of
jax.make_array_from_process_local_data and jax.device_put (what went in, where it went), what it
printed, whether it wrote to the last of ARGS, and this process's devices."""
import atexit
import json
import os
import runpy
import sys

coordinator, num_processes, process_id, script, *args = sys.argv[1:]
out_file = os.path.realpath(args[-1]) if args else None
seen = {"config": [], "initialized": False, "local_data": [], "device_put": [],
        "printed": "", "wrote": False, "notes": []}

import jax  # noqa: E402
import numpy as np  # noqa: E402


def _placed(array):
    """Where a jax.Array lives: its shape, block shape, devices and their processes."""
    shape = tuple(array.shape)
    return {"shape": list(shape), "block": list(array.sharding.shard_shape(shape)),
            "devices": len(array.sharding.device_set),
            "processes": sorted({d.process_index for d in array.sharding.device_set}),
            "replicated": bool(array.sharding.is_fully_replicated)}


def _watch(owner, name, record):
    original = getattr(owner, name)

    def watched(*a, **k):
        if name == "initialize":
            seen["initialized"] = True
        result = original(*a, **k)
        try:
            record(result, *a, **k)
        except Exception as exc:  # watching must never change what the script does
            seen["notes"].append(f"{name}: {exc!r}")
        return result

    setattr(owner, name, watched)


def _config(result, *a, **k):
    name = a[0] if a else k.get("name")
    value = a[1] if len(a) > 1 else k.get("val")
    seen["config"].append({"name": name, "value": repr(value),
                           "after_initialize": seen["initialized"]})


def _local_data(made, sharding, local_data, *a, **k):
    local = np.asarray(local_data)
    seen["local_data"].append({"rows": int(local.shape[0]) if local.ndim else 0,
                               "first_column": local.reshape(len(local), -1)[:, 0].tolist()
                               if local.ndim and local.size <= 100_000 else None,
                               "made": _placed(made)})


def _device_put(result, *a, **k):
    arrays = [x for x in jax.tree.leaves(result) if isinstance(x, jax.Array)]
    seen["device_put"].append([_placed(x) for x in arrays])


_watch(jax.config, "update", _config)
_watch(jax.distributed, "initialize", lambda *a, **k: None)
_watch(jax, "make_array_from_process_local_data", _local_data)
_watch(jax, "device_put", _device_put)


class _Printed:
    """sys.stdout, remembering what the script prints."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        if len(seen["printed"]) < 2000:
            seen["printed"] += text
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _audit(event, details):
    if event == "open" and out_file and isinstance(details[0], (str, bytes)):
        mode, flags = details[1], details[2]
        writing = any(c in mode for c in "wax+") if isinstance(mode, str) else \
            bool(isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        if writing and os.path.realpath(os.fsdecode(details[0])).startswith(out_file):
            seen["wrote"] = True


def _report():
    try:
        from jax._src import xla_bridge
        if xla_bridge.backends_are_initialized():
            seen["process_index"] = jax.process_index()
            seen["process_count"] = jax.process_count()
            seen["local_devices"] = jax.local_device_count()
            seen["devices"] = jax.device_count()
    except Exception as exc:
        seen["notes"].append(f"at exit: {exc!r}")
    sys.__stdout__.write("\npd_watch: " + json.dumps(seen) + "\n")
    sys.__stdout__.flush()


sys.addaudithook(_audit)
atexit.register(_report)
sys.stdout = _Printed(sys.stdout)
sys.argv = [script, coordinator, num_processes, process_id, *args]
runpy.run_path(script, run_name="__main__")

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
#    gloo CPU collectives (`jax_cpu_collectives_implementation`), both with `jax.config.update`
#    before `jax.distributed.initialize`, as `pd_hello.py` does;
# 2. build one 1-D mesh of all 8 devices of both processes;
# 3. read `x` and `y` from DATA_FILE (`np.load`), and pass **only this process's share** of each to
#    `jax.make_array_from_process_local_data`: with N rows, process `p` takes the N/2 rows from
#    row `p * N/2` on, in order (`x[p * N//2 : (p + 1) * N//2]`), so that the global arrays hold
#    the rows in the data file's order. The global arrays `x` and `y` (N rows) must be split over
#    the 8 devices by rows;
# 4. start from `pd_model.load_params(DATA_FILE)`, placed replicated on the 8 devices with
#    `jax.device_put(params, NamedSharding(mesh, P()))`, and take `pd_model.STEPS` steps of
#    gradient descent with step size `pd_model.STEP_SIZE` on `pd_model.loss` over the global
#    `x`, `y`, as `pd_train_step` does: data parallelism, as in Lab 3 (automatic) or with
#    `jax.shard_map` (Lab 4);
# 5. in process 0 **only**, save the trained parameters with
#    `pd_model.save_params(OUT_FILE, params)`.
#
# Print what you like (the loss, say) to follow the training, **from process 0 only**: the other
# process prints nothing (as with saving, one process speaks for all).
#
# The trained parameters must equal those of training on one process (`pd_params_single`). The
# public check runs your program under `pd_watch.py` on `pd_data.npz`; the hidden check runs it
# again on new data, with another number of rows N (divisible by 8) and new initial parameters.
# Both look at the order of each process's `jax.config.update` and `jax.distributed.initialize`
# calls, what it passed to `jax.make_array_from_process_local_data`, how it placed the
# parameters, and which process printed and wrote OUT_FILE.
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
def test_q9_public(train_script, launch, pd_params_single):
    import json
    import os
    import pathlib
    import re

    import numpy as np

    import jaxlab_form as form

    def fail(message):
        raise AssertionError(message)

    form.expect_kind("train_script", form.evidence(train_script), "str",
                     "a string holding the source of your training script")
    try:
        compile(train_script, "pd_train.py", "exec")
    except SyntaxError as exc:
        fail(f"`train_script` is not a valid Python program: {exc.msg} on line {exc.lineno} of "
             "the script; expected the source of a script that Python can run.")
    pathlib.Path("pd_train.py").write_text(train_script)
    out = "pd_check_params.npz"
    pathlib.Path(out).unlink(missing_ok=True)
    try:
        outputs = launch("pd_watch.py", "pd_train.py", "pd_data.npz", out)
    except RuntimeError as exc:
        text = re.sub(r"pd_watch: \{.*\}", "", str(exc))
        reports = re.split(r"\n\n(?=process \d)", text)
        why = []
        for report in reports[1:]:
            head = report.splitlines()[0]
            error = [ln.strip() for ln in report.splitlines()
                     if re.match(r"\s*[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b", ln)]
            line = re.findall(r'pd_train\.py", line (\d+)', report)
            why.append(head.split(";")[0] + (f", after `{error[-1][:200]}`" if error else "")
                       + (f" (line {line[-1]} of your script)" if line else ""))
        fail("`train_script` did not run to the end as two processes on pd_data.npz: "
             + ("; ".join(why) or text.splitlines()[0]) + ". Expected both processes to run "
             "the 20 steps and exit; run the cell after this check to see each process's output.")
    seen = []
    for i, output in enumerate(outputs):
        watched = re.findall(r"^pd_watch: (\{.*\})$", output, re.M)
        if not watched:
            fail(f"`train_script`: process {i} ended without exiting normally (no report from "
                 "pd_watch.py, e.g. after os._exit); expected it to run to the end.")
        seen.append(json.loads(watched[-1]))
    with np.load("pd_data.npz") as data:
        columns = {"x": data["x"][:, 0], "y": data["y"][:, 0]}
    n = len(columns["x"])
    for i, s in enumerate(seen):
        if not s["initialized"]:
            fail(f"`train_script` never called jax.distributed.initialize in process {i}, so "
                 "each process ran alone with only its own devices; expected both to join one "
                 "program: jax.distributed.initialize(COORDINATOR, num_processes=2, "
                 "process_id=PROCESS_ID), with the script's first three arguments.")
        for name, value in (("jax_num_cpu_devices", "4"),
                            ("jax_cpu_collectives_implementation", "'gloo'")):
            calls = [c for c in s["config"] if c["name"] == name and c["value"] == value]
            if not calls or all(c["after_initialize"] for c in calls):
                fail(f"`train_script`: process {i} "
                     + ("set " if calls else "never set ")
                     + f"{name} to {value}" + (" after jax.distributed.initialize" if calls else "")
                     + f"; expected what step 1 says: jax.config.update('{name}', {value}) "
                     "before jax.distributed.initialize, as pd_hello.py does.")
        if s.get("local_devices") != 4 or s.get("devices") != 8:
            fail(f"`train_script`: process {i} had {s.get('local_devices')} CPU device(s) of its "
                 f"own and saw {s.get('devices')} in all; expected 4 per process, 8 in all.")
    for i, s in enumerate(seen):
        share = slice(i * n // 2, (i + 1) * n // 2)
        for label, column in columns.items():
            calls = [c for c in s["local_data"] if c["first_column"] is not None and
                     len(c["first_column"]) and np.isin(c["first_column"], column).all()]
            if not calls:
                fail(f"`train_script`: process {i} made no array from its rows of `{label}` with "
                     "jax.make_array_from_process_local_data; expected each process to pass its "
                     f"own {n // 2} rows of {label} to it.")
            call = calls[-1]
            rows = [int(np.flatnonzero(column == v)[0]) for v in call["first_column"]]
            made = call["made"]
            if rows != list(range(n))[share]:
                fail(f"`train_script`: process {i} passed {len(rows)} rows of `{label}` (rows "
                     f"{rows[0]}, ..., {rows[-1]}) to jax.make_array_from_process_local_data; "
                     f"expected only its own share: the {n // 2} rows from row {share.start} on, "
                     "in order (process p takes x[p * N//2 : (p + 1) * N//2]).")
            if made["devices"] != 8 or made["processes"] != [0, 1]:
                fail(f"`train_script`: the global `{label}` of process {i} lies on "
                     f"{made['devices']} device(s) of process(es) {made['processes']}; expected "
                     "one mesh of all 8 devices of both processes (jax.devices()).")
            if made["shape"] != [n, 1] or made["block"] != [n // 8, 1]:
                fail(f"`train_script`: the global `{label}` of process {i} has shape "
                     f"{tuple(made['shape'])} in blocks of {tuple(made['block'])}; expected "
                     f"({n}, 1), its rows split over the 8 devices ({n // 8} rows each).")
        shapes = {tuple(a.shape) for pair in pd_params_single for a in pair}
        placed = {tuple(p["shape"]) for call in s["device_put"] for p in call
                  if p["replicated"] and p["devices"] == 8 and p["processes"] == [0, 1]}
        if not shapes <= placed:
            fail(f"`train_script`: process {i} did not place the parameters on the 8 devices "
                 "with jax.device_put; expected what step 4 says: "
                 "jax.device_put(params, NamedSharding(mesh, P())), replicated on the 8 devices.")
    for i, s in enumerate(seen[1:], start=1):
        if s["wrote"]:
            fail(f"`train_script`: process {i} also wrote the output file; expected only "
                 "process 0 to save.")
        if s["printed"].strip():
            fail(f"`train_script`: process {i} printed {s['printed'].strip()[:80]!r}; expected "
                 "only process 0 to print.")
    if not os.path.exists(out):
        fail("`train_script` ran without error, but process 0 did not write the output file "
             "(the last argument, OUT_FILE); expected it to save the trained parameters there "
             "with pd_model.save_params(OUT_FILE, params).")
    try:
        with np.load(out) as saved:
            found = [(saved[f"W{k}"], saved[f"b{k}"]) for k in range(len(pd_params_single))]
    except Exception as exc:
        fail(f"`train_script` saved a file that pd_model.load_params cannot read ({exc!r:.200}); "
             "expected pd_model.save_params(OUT_FILE, params).")
    for k, (w, b) in enumerate(found):
        for name, a in ((f"W{k}", w), (f"b{k}", b)):
            if not np.issubdtype(a.dtype, np.floating):
                raw = (" (raw 2-byte records: what a bfloat16 array saved with np.savez reads "
                       "back as; the parameters were cast to bfloat16 somewhere)"
                       if a.dtype.kind == "V" and a.dtype.itemsize == 2 else "")
                fail(f"`train_script` saved {name} with dtype {str(a.dtype).lstrip('|<>=')}{raw}; "
                     "expected float32, "
                     "the dtype of the parameters pd_model.load_params returns and training "
                     "keeps.")
    worst = max(float(np.max(np.abs(np.asarray(a, np.float64) - b)))
                if np.shape(a) == np.shape(b) else np.inf
                for pair, ref in zip(found, pd_params_single) for a, b in zip(pair, ref))
    if not all(np.shape(a) == np.shape(b) and np.allclose(a, b, rtol=1e-4, atol=1e-5)
               for pair, ref in zip(found, pd_params_single) for a, b in zip(pair, ref)):
        fail(f"`train_script` saved parameters that differ from `pd_params_single` by up to "
             f"{worst:.3g}; expected those of training on one process (tolerance: rtol=1e-4, "
             "atol=1e-5).")

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
# Your program, run as two processes on `pd_data.npz` under `pd_watch.py`, against the
# single-process reference. Two wrong programs also train to the same parameters: every process
# passing all the rows (a global array of the data twice, the same mean loss), and the same with
# a mesh of each process's own 4 devices (each process then trains alone, on all the data). What
# each process passed, and the global array it got, tell them apart.

# %%
if answered(train_script):
    import json

    pathlib.Path("pd_train.py").write_text(train_script)
    pathlib.Path("pd_params.npz").unlink(missing_ok=True)  # no result of an earlier run
    pd_outputs = launch("pd_watch.py", "pd_train.py", "pd_data.npz", "pd_params.npz")
    for pd_i, pd_output in enumerate(pd_outputs):
        pd_printed, _, pd_seen = pd_output.rpartition("pd_watch: ")
        pd_seen = json.loads(pd_seen)
        print(f"process {pd_i} printed:", pd_printed.strip() or "nothing")
        for pd_call in pd_seen["local_data"]:
            pd_made = pd_call["made"]
            print(f"process {pd_i} passed {pd_call['rows']} rows to "
                  f"make_array_from_process_local_data: a global array of shape "
                  f"{tuple(pd_made['shape'])} on {pd_made['devices']} devices of processes "
                  f"{pd_made['processes']}, {pd_made['block'][0]} rows on each")
        print(f"process {pd_i} wrote pd_params.npz:", pd_seen["wrote"])
    pd_params_multi = pd_model.load_params("pd_params.npz")
    print("same parameters as on one process:", all(
        np.allclose(a, b, rtol=1e-4, atol=1e-5)
        for pair, ref in zip(pd_params_multi, pd_params_single) for a, b in zip(pair, ref)))

# %% [markdown]
# ## Submitting
#
# Run the whole notebook from the top (*Kernel → Restart & Run All*), check that every
# `grader.check` cell says the public checks passed, then run the cell below.
