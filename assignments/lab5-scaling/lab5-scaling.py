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
# Labs 3 and 4 used one mesh axis at a time, inside one Python process. Large training runs
# combine several kinds of parallelism and run as one program spread over many processes. This
# lab covers the last of these: **one program that spans several processes** (`jax.distributed`).
#
# ## How this lab works
#
# * Every task has one cell that starts with `### Your code here`. Replace the `...` with your
#   answer and run it. The cell after it, `grader.check("q…")`, runs the public checks, which
#   only test the form of the answer. Hidden checks run when your notebook is graded: they run
#   your answer again on **new random data** and compare the result with a reference computed
#   the single-process way.
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
# where this notebook has a GPU.
#
# If every process fails with `enforce fail at …/gloo/transport/tcp/device.cc`, gloo found no
# network address for this machine's host name (`socket.gethostname()`), as on some laptops:
# add the line `127.0.0.1 NAME` (NAME: that host name) to `/etc/hosts`, or work on Colab.

# %%
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import time

PD_TIMEOUT = 120  # seconds; a launch of this part's scripts takes about 5 s on one core
PD_GRACE = 5  # seconds the other processes get to finish once one has failed
# gloo reports every connection it makes, from several threads at once (so its messages can be
# cut in two by other lines); that says nothing here
PD_GLOO_NOISE = re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. ?"
                           r"|Expected number of connected peer ranks is : \d+")


def pd_free_port():
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pd_tail(text, lines=15):
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


def pd_quiet(text):
    """`text` without gloo's connection messages."""
    lines = [(PD_GLOO_NOISE.sub("", line), line) for line in text.splitlines(True)]
    return "".join(kept for kept, line in lines if kept.strip() or not line.strip())


def launch(script, *args, num_processes=2, timeout=PD_TIMEOUT):
    """Run `python SCRIPT COORDINATOR NUM_PROCESSES PROCESS_ID *ARGS` for every process id at once
    and wait for all of them; return what each process printed (a list, by process id)."""
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
#    row `p * N/2` on. The global arrays `x` and `y` (N rows) must be split over the 8 devices by
#    rows;
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
