"""Hidden checks of Lab 5 (shipped only in the autograder zip, as ``jaxlab_lab5.py``).

Same design as Labs 3 and 4: a probe runs in the student's kernel and records what the
student's answer does as plain data; a verdict judges that data only, recomputing every
reference from the lab's own recipe, and raises AssertionError in the student's terms.
"""

try:
    from . import form
except ImportError:  # in the autograder the checks are flat modules beside the notebook
    import jaxlab_form as form


# ---- Part D: one program, several processes (q9_multi_process)
#
# The answer is a program, not a function: `train_script` holds the source of a training
# script that two processes run together. The probe writes it to a fresh folder beside the
# lab's model module (PD_MODEL_SOURCE, the text the notebook writes to pd_model.py) and runs it
# again, as two processes joined by jax.distributed, on new data: N rows (N divisible by 8,
# another N than the notebook's) and new initial parameters. Each process runs under a small
# boot script (PD_BOOT_SOURCE) that records, as plain data, what the checks cannot read from
# the result alone: the jax.distributed.initialize calls, every jax.make_array_from_process_local
# _data call (its local rows and the array it made: global shape, devices, processes), and every
# file the process opened for writing at the output path. The verdict recomputes the training in
# float64 NumPy on one process and compares.
import json as _pd_json
import os as _pd_os
import re as _pd_re
import shutil as _pd_shutil
import signal as _pd_signal
import subprocess as _pd_subprocess
import sys as _pd_sys
import tempfile as _pd_tempfile
import time as _pd_time

import numpy as _pd_np

PD_PROCESSES = 2
PD_LOCAL_DEVICES = 4  # CPU devices per process: one mesh of 8 across both
PD_LAYER_SIZES = (1, 64, 64, 1)
PD_STEPS = 20
PD_STEP_SIZE = 0.02
# another batch size than the notebook's 256 rows: a script that hard-codes 256 (or 128 per
# process) fails; 320 rows are 160 per process and 40 per device
PD_FRESH_ROWS = 320
# trained parameters, float32 on 8 devices in 2 processes against float64 on one: measured
# 1.2e-7 apart at most; the nearest wrong training (one process's half of the data, 8x the
# step, over 300 draws) lies 2.7e-2 away
PD_TRAIN_RTOL = 1e-4
PD_TRAIN_ATOL = 1e-5
# the re-run takes ~5 s on one core, ~12 s at half a core; a script that waits for a process that
# never comes (jax.distributed.initialize waits 300 s by default) is stopped at PD_TIMEOUT
PD_TIMEOUT = 120
PD_GRACE = 5  # seconds the other process gets to finish once one process failed
PD_LOG_TAIL = 4000  # characters of each process's output kept as evidence
PD_SCRIPT = "pd_train.py"
PD_MODEL = "pd_model.py"
PD_BOOT = "pd_boot.py"
# gloo's report of every connection it makes, written by several threads at once (so other lines
# can cut it in two): not the student's output
PD_GLOO_NOISE = _pd_re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. ?"
                               r"|Expected number of connected peer ranks is : \d+")

# pd_model.py exactly as the notebook writes it (a test compares the two)
PD_MODEL_SOURCE = '''\
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
'''

# Runs in each process of the re-run: `python pd_boot.py RECORD SCRIPT ARGS...`. It records
# what the script does with JAX (see above) into RECORD when the process exits, then runs the
# script as __main__ with sys.argv = [SCRIPT, *ARGS]. The last of ARGS is the output file.
PD_BOOT_SOURCE = r'''
import atexit
import json
import os
import runpy
import sys

record_path, script, *args = sys.argv[1:]
out_path = os.path.realpath(args[-1])
record = {"initialize": [], "local_data": [], "writes": [], "notes": []}


def _writing(mode, flags):
    if isinstance(mode, str):
        return any(c in mode for c in "waxX+")
    return isinstance(flags, int) and bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))


def _audit(event, details):
    try:
        if event == "open" and isinstance(details[0], (str, bytes)) \
                and _writing(details[1], details[2]):
            path = os.path.realpath(os.fsdecode(details[0]))
        elif event in ("os.rename", "os.replace", "os.link", "os.symlink", "shutil.move",
                       "shutil.copyfile"):
            path = os.path.realpath(os.fsdecode(details[1]))
        else:
            return
        if path.startswith(out_path) and path not in record["writes"]:
            record["writes"].append(path)
    except Exception:
        pass


sys.addaudithook(_audit)

import jax
import numpy as np

_initialize = jax.distributed.initialize
_make = jax.make_array_from_process_local_data


def initialize(*a, **k):
    record["initialize"].append({"args": [repr(v) for v in a],
                                 "kwargs": {n: repr(v) for n, v in k.items()}})
    return _initialize(*a, **k)


def _facts():
    return {"process_index": jax.process_index(), "process_count": jax.process_count(),
            "device_count": jax.device_count(), "local_device_count": jax.local_device_count()}


def make_array_from_process_local_data(sharding, local_data, *a, **k):
    made = _make(sharding, local_data, *a, **k)
    try:
        local = np.asarray(local_data)
        shape = tuple(int(n) for n in made.shape)
        record["local_data"].append({
            "shape": list(local.shape), "dtype": str(local.dtype),
            "values": local.ravel().tolist() if local.size <= 100_000 else None,
            "global_shape": list(shape),
            "shard_shape": [int(n) for n in made.sharding.shard_shape(shape)],
            "devices": len(made.sharding.device_set),
            "processes": sorted({int(d.process_index) for d in made.sharding.device_set}),
            **_facts()})
    except Exception as exc:
        record["notes"].append(f"recording make_array_from_process_local_data: {exc!r}")
    return made


jax.distributed.initialize = initialize
jax.make_array_from_process_local_data = make_array_from_process_local_data


def _write_record():
    try:
        from jax._src import xla_bridge
        if xla_bridge.backends_are_initialized():
            record["at_exit"] = _facts()
    except Exception as exc:
        record["notes"].append(f"at exit: {exc!r}")
    with open(record_path, "w") as f:
        json.dump(record, f)


atexit.register(_write_record)  # after jax's own atexit hooks: it runs before them
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
'''


def _pd_reference(init, x, y, step_size=PD_STEP_SIZE, steps=PD_STEPS):
    """Single-process training of Lab 3's network in float64: ``steps`` steps of gradient
    descent on the mean squared error over all of ``x``, ``y`` (backpropagation by hand)."""
    params = [(_pd_np.asarray(W, _pd_np.float64), _pd_np.asarray(b, _pd_np.float64))
              for W, b in init]
    x, y = _pd_np.asarray(x, _pd_np.float64), _pd_np.asarray(y, _pd_np.float64)
    for _ in range(steps):
        acts = [x]
        for W, b in params[:-1]:
            acts.append(_pd_np.tanh(acts[-1] @ W + b))
        delta = 2 * (acts[-1] @ params[-1][0] + params[-1][1] - y) / y.size
        grads = []
        for i in reversed(range(len(params))):
            grads.append((acts[i].T @ delta, delta.sum(axis=0)))
            if i:
                delta = (delta @ params[i][0].T) * (1 - acts[i] ** 2)
        params = [(W - step_size * dW, b - step_size * db)
                  for (W, b), (dW, db) in zip(params, reversed(grads))]
    return params


# --------------------------------------------------------------------------- Part D probe
def _pd_fresh_data(rng, rows=PD_FRESH_ROWS):
    """New data around Lab 3's curve, sorted by x: each process's share covers another part of
    the curve, so training on one share alone ends far from training on all rows."""
    x = _pd_np.sort(rng.uniform(0.0, 2.0, size=(rows, 1)), axis=0).astype(_pd_np.float32)
    y = (_pd_np.sin(6 * x) - 0.5 * x ** 2 + 0.1 * rng.normal(size=x.shape)).astype(_pd_np.float32)
    init = {}
    for i, (n_in, n_out) in enumerate(zip(PD_LAYER_SIZES[:-1], PD_LAYER_SIZES[1:])):
        init[f"W{i}"] = (0.1 * rng.normal(size=(n_in, n_out))).astype(_pd_np.float32)
        init[f"b{i}"] = (0.1 * rng.normal(size=(n_out,))).astype(_pd_np.float32)
    return x, y, init


def _pd_free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pd_env():
    """The kernel's environment for the processes: CPU devices only, no device count forced
    from outside (the script sets its own), output unbuffered."""
    env = {k: v for k, v in _pd_os.environ.items() if k not in ("XLA_FLAGS", "FORCE_COLOR")}
    # plain tracebacks: Python 3.13 colours them where a kernel's environment asks for colour
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PYTHON_COLORS="0", NO_COLOR="1")
    # XLA's CPU collective threads starve without it on a core or two: 300 unblocked steps of a
    # correct script hung in 3 of 3 runs on one core, and finished in 3 of 3 with it
    env.setdefault("PJRT_NPROC", "16")
    return env


def _pd_run_processes(argvs, cwd, logs, timeout=PD_TIMEOUT):
    """Start one process per argv, all at once; wait until all exit, one fails (the others get
    PD_GRACE seconds more) or ``timeout`` passes; kill what is left. Returns plain data."""
    procs = []
    try:
        for argv, log in zip(argvs, logs):
            with open(log, "w") as out:
                procs.append(_pd_subprocess.Popen(
                    argv, cwd=cwd, env=_pd_env(), stdout=out, stderr=_pd_subprocess.STDOUT,
                    stdin=_pd_subprocess.DEVNULL, start_new_session=True))
        start = _pd_time.monotonic()
        deadline, first_failed = start + timeout, None
        # poll every process each round (any() would stop at the first one still running)
        while None in [p.poll() for p in procs] and _pd_time.monotonic() < deadline:
            if first_failed is None:
                failed = [i for i, p in enumerate(procs) if p.returncode]
                if failed:
                    first_failed = failed[0]
                    deadline = min(deadline, _pd_time.monotonic() + PD_GRACE)
            _pd_time.sleep(0.05)
        if first_failed is None:
            failed = [i for i, p in enumerate(procs) if p.poll()]
            first_failed = failed[0] if failed else None
        running = [i for i, p in enumerate(procs) if p.poll() is None]
        seconds = _pd_time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    _pd_os.killpg(p.pid, _pd_signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
                p.wait()
    return {"returncodes": [p.returncode for p in procs], "still_running": running,
            "timed_out": bool(running) and first_failed is None, "first_failed": first_failed,
            "seconds": round(seconds, 2)}


def _pd_read_log(path):
    try:
        text = open(path, errors="replace").read()
    except OSError:
        return ""
    text = _pd_re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = [(PD_GLOO_NOISE.sub("", line), line) for line in text.splitlines(True)]
    return "".join(kept for kept, line in lines if kept.strip() or not line.strip())[-PD_LOG_TAIL:]


def _pd_rerun(script):
    """Run ``script`` as the task says, on new data, under the recording boot script."""
    rng = _pd_np.random.default_rng(int.from_bytes(_pd_os.urandom(8), "little"))
    x, y, init = _pd_fresh_data(rng)
    folder = _pd_tempfile.mkdtemp(prefix="jaxlab-q9-")
    try:
        paths = {name: _pd_os.path.join(folder, name) for name in
                 (PD_SCRIPT, PD_MODEL, PD_BOOT, "data.npz", "params.npz")}
        for name, text in ((PD_SCRIPT, script), (PD_MODEL, PD_MODEL_SOURCE),
                           (PD_BOOT, PD_BOOT_SOURCE)):
            with open(paths[name], "w") as f:
                f.write(text)
        _pd_np.savez(paths["data.npz"], x=x, y=y, **init)
        coordinator = f"127.0.0.1:{_pd_free_port()}"
        records = [_pd_os.path.join(folder, f"record-{i}.json") for i in range(PD_PROCESSES)]
        logs = [_pd_os.path.join(folder, f"log-{i}.txt") for i in range(PD_PROCESSES)]
        argvs = [[_pd_sys.executable, paths[PD_BOOT], records[i], paths[PD_SCRIPT], coordinator,
                  str(PD_PROCESSES), str(i), paths["data.npz"], paths["params.npz"]]
                 for i in range(PD_PROCESSES)]
        fresh = {"x": x, "y": y, "init": init, "folder": folder,
                 "timeout": PD_TIMEOUT, **_pd_run_processes(argvs, folder, logs, PD_TIMEOUT),
                 "logs": [_pd_read_log(log) for log in logs], "records": []}
        for path in records:
            try:
                with open(path) as f:
                    fresh["records"].append(_pd_json.load(f))
            except (OSError, ValueError):
                fresh["records"].append(None)
        fresh["saved"] = None
        if _pd_os.path.exists(paths["params.npz"]):
            try:
                with _pd_np.load(paths["params.npz"], allow_pickle=False) as saved:
                    fresh["saved"] = {k: _pd_np.array(saved[k]) for k in saved.files}
            except Exception as exc:
                fresh["saved_error"] = f"{type(exc).__name__}: {exc}"[:300]
        return fresh
    finally:
        _pd_shutil.rmtree(folder, ignore_errors=True)


def _pd_probe(values):
    ev = form.evidence_of(values)
    script = values.get("train_script")
    if type(script) is str and script.strip():
        ev["fresh"] = _pd_rerun(script)
    return ev


# --------------------------------------------------------------------------- Part D verdict
def _pd_fail(message):
    raise AssertionError(message)


def _pd_error_of(log, folder):
    """The exception a process's output ends with, and the line of the script it came from."""
    lines = log.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if not starts:
        last = [ln.strip() for ln in lines if ln.strip()]
        return (f"`{last[-1][:300]}`" if last else "no message"), None
    block = lines[starts[-1]:]
    exception = next((ln for ln in reversed(block) if ln and not ln[0].isspace()
                      and not ln.startswith(("Traceback", "The above exception",
                                             "During handling", "---"))), "an exception")
    where = None
    script = _pd_re.escape(_pd_os.path.join(folder, PD_SCRIPT)) if folder else PD_SCRIPT
    for line in lines:
        match = _pd_re.search(rf'"{script}", line (\d+)', line)
        if match:
            where = int(match.group(1))
    return f"`{exception.strip()[:300]}`", where


def _pd_ran(fresh):
    rows = len(fresh["x"])
    if fresh["timed_out"]:
        last = [next((ln.strip() for ln in reversed(log.splitlines()) if ln.strip()), None)
                for log in fresh["logs"]]
        printed = "; ".join(f"process {i} last printed {text[:160]!r}" if text
                            else f"process {i} printed nothing" for i, text in enumerate(last))
        _pd_fail(f"`train_script` was still running after {fresh['timeout']:g} s on new data "
                 f"({rows} rows) and was stopped ({printed}); expected it to train {PD_STEPS} "
                 "steps and exit within seconds. A process that waits for ever is usually "
                 "waiting for the other one: both must call jax.distributed.initialize with the "
                 "same coordinator address and num_processes=2, each with its own process_id.")
    i = fresh["first_failed"]
    if i is not None:
        code = fresh["returncodes"][i]
        error, line = _pd_error_of(fresh["logs"][i], fresh.get("folder"))
        how = (f"was killed by signal {-code}, last printing {error}" if code < 0 else
               f"stopped with {error}")
        where = f" (line {line} of your script)" if line else ""
        _pd_fail(f"`train_script` failed on new data ({rows} rows): process {i} (started as "
                 f"`python {PD_SCRIPT} COORDINATOR 2 {i} DATA_FILE OUT_FILE`) {how}{where}; "
                 "expected both processes to run to the end, for any number of rows divisible "
                 "by 8.")


def _pd_joined(records):
    for i, record in enumerate(records):
        if record is None:
            _pd_fail(f"`train_script`: process {i} ended without exiting normally (the checks "
                     "saw no normal exit of Python, e.g. os._exit or a crash); expected it to "
                     "run to the end.")
        if not record["initialize"]:
            _pd_fail(f"`train_script` never called jax.distributed.initialize in process {i}, so "
                     "each process ran alone with only its own devices; expected both to join "
                     "one program: jax.distributed.initialize(COORDINATOR, num_processes=2, "
                     "process_id=PROCESS_ID), with the script's first three arguments, before "
                     "any other JAX call.")
    facts = [r.get("at_exit") or next(iter(r["local_data"]), None) for r in records]
    for i, seen in enumerate(facts):
        if seen is None:
            _pd_fail(f"`train_script` did not use the devices of the joined processes in process "
                     f"{i} (it made no jax.Array there); expected it to train on the global mesh.")
        if seen["process_count"] != PD_PROCESSES:
            _pd_fail(f"`train_script`: process {i} saw jax.process_count() == "
                     f"{seen['process_count']}; expected the {PD_PROCESSES} processes to join "
                     "one program (jax.distributed.initialize with num_processes=2).")
        if seen["local_device_count"] != PD_LOCAL_DEVICES or \
                seen["device_count"] != PD_PROCESSES * PD_LOCAL_DEVICES:
            _pd_fail(f"`train_script`: process {i} had {seen['local_device_count']} CPU "
                     f"device(s) of its own and saw {seen['device_count']} in all; expected "
                     f"{PD_LOCAL_DEVICES} per process, {PD_PROCESSES * PD_LOCAL_DEVICES} in all "
                     "(jax.config.update('jax_num_cpu_devices', 4) before "
                     "jax.distributed.initialize).")
    indices = sorted(f["process_index"] for f in facts)
    if indices != list(range(PD_PROCESSES)):
        _pd_fail(f"`train_script`: the processes saw jax.process_index() values {indices}; "
                 "expected 0 and 1: pass each process its own PROCESS_ID as process_id.")


def _pd_rows_of(call, column):
    """Which rows of ``column`` (N×1) a recorded make_array call's local data holds, or None."""
    if not call["values"]:
        return None
    where = {float(v): r for r, v in enumerate(column[:, 0])}
    rows = [where.get(float(v)) for v in call["values"]]
    return None if any(r is None for r in rows) else rows


def _pd_global_data(records, fresh):
    n = len(fresh["x"])
    share = n // PD_PROCESSES
    for label, column in (("x", fresh["x"]), ("y", fresh["y"])):
        rows_by_process = {}
        for i, record in enumerate(records):
            calls = [(c, _pd_rows_of(c, column)) for c in record["local_data"]]
            calls = [(c, rows) for c, rows in calls if rows is not None]
            if not calls:
                _pd_fail(f"`train_script`: process {i} made no array from its rows of `{label}` "
                         "with jax.make_array_from_process_local_data; expected each process to "
                         f"read its own {share} rows of {label} from the data file and pass them "
                         "to it, to make the global array of all rows.")
            call, rows = calls[-1]
            if call["processes"] != list(range(PD_PROCESSES)) or \
                    call["devices"] != PD_PROCESSES * PD_LOCAL_DEVICES:
                _pd_fail(f"`train_script`: the global `{label}` of process {i} lies on "
                         f"{call['devices']} device(s) of process(es) {call['processes']}; "
                         "expected one mesh of all 8 devices of both processes (jax.devices(), "
                         "not jax.local_devices()).")
            if len(rows) != share:
                _pd_fail(f"`train_script`: process {i} passed {len(rows)} rows of `{label}` to "
                         f"jax.make_array_from_process_local_data; expected only its own share: "
                         f"{share} of the {n} rows (rows {i * share} to {(i + 1) * share - 1} "
                         "for this process). Each process reads only its slice of the data; the "
                         "global array is made of the slices of both.")
            if call["global_shape"] != [n, 1]:
                _pd_fail(f"`train_script`: the global `{label}` that process {i} made has shape "
                         f"{tuple(call['global_shape'])}; expected ({n}, 1), all rows of both "
                         "processes.")
            if call["shard_shape"] != [n // (PD_PROCESSES * PD_LOCAL_DEVICES), 1]:
                _pd_fail(f"`train_script`: the global `{label}` is split into blocks of shape "
                         f"{tuple(call['shard_shape'])}; expected its rows split over the 8 "
                         f"devices ({n // 8} rows each, a PartitionSpec naming the mesh axis for "
                         "dimension 0): data parallelism.")
            rows_by_process[i] = rows
        every = sorted(r for rows in rows_by_process.values() for r in rows)
        if every != list(range(n)):
            _pd_fail(f"`train_script`: processes 0 and 1 passed overlapping rows of `{label}` "
                     "to jax.make_array_from_process_local_data (some rows twice, others never); "
                     "expected each process to pass its own share, so that together they pass "
                     f"every row once: process p the {share} rows from row p*{share} on.")


def _pd_writes(records):
    for record in records:
        index = (record.get("at_exit") or record["local_data"][-1])["process_index"]
        if index != 0 and record["writes"]:
            _pd_fail(f"`train_script`: process {index} (jax.process_index() == {index}) also "
                     "wrote the output file; expected only process 0 to save. Every process "
                     "holds the same replicated parameters, and processes writing one file at "
                     "once can leave it half written.")


def _pd_saved(fresh):
    names = [f"{k}{i}" for i in range(len(PD_LAYER_SIZES) - 1) for k in ("W", "b")]
    saved = fresh["saved"]
    if saved is None:
        problem = (f"could not be read ({fresh['saved_error']})" if fresh.get("saved_error")
                   else "was not written")
        _pd_fail(f"`train_script` ran without error, but the output file (the last argument, "
                 f"OUT_FILE) {problem}; expected process 0 to save the trained parameters there "
                 "with pd_model.save_params(OUT_FILE, params).")
    if sorted(saved) != sorted(names):
        _pd_fail(f"`train_script` saved arrays named {sorted(saved)}; expected "
                 f"{sorted(names)}, as pd_model.save_params writes the list of (W, b) pairs.")
    shapes = dict(zip(names, [s for a, b in zip(PD_LAYER_SIZES[:-1], PD_LAYER_SIZES[1:])
                              for s in ((a, b), (b,))]))
    for name in names:
        if tuple(saved[name].shape) != shapes[name]:
            _pd_fail(f"`train_script` saved {name} with shape {tuple(saved[name].shape)}; "
                     f"expected {shapes[name]}.")
    return [(saved[f"W{i}"], saved[f"b{i}"]) for i in range(len(PD_LAYER_SIZES) - 1)]


def _pd_close_to(found, expected):
    return all(_pd_np.allclose(f, e, rtol=PD_TRAIN_RTOL, atol=PD_TRAIN_ATOL)
               for pair, ref in zip(found, expected) for f, e in zip(pair, ref))


def _pd_trained(found, fresh):
    init = [(fresh["init"][f"W{i}"], fresh["init"][f"b{i}"])
            for i in range(len(PD_LAYER_SIZES) - 1)]
    x, y = fresh["x"], fresh["y"]
    expected = _pd_reference(init, x, y)
    if _pd_close_to(found, expected):
        return
    what = (f"the parameters after {PD_STEPS} steps of gradient descent with step size "
            f"pd_model.STEP_SIZE = {PD_STEP_SIZE:g} on all {len(x)} rows, from the initial "
            "parameters in the data file, as training on one process gives")
    if not all(_pd_np.all(_pd_np.isfinite(a)) for pair in found for a in pair):
        _pd_fail(f"`train_script` saved parameters with NaN or infinite values; expected {what}.")
    if _pd_close_to(found, _pd_reference(init, x, y, step_size=8 * PD_STEP_SIZE)):
        _pd_fail("`train_script` trains with gradients 8 times too large: its parameters are "
                 f"those of training with step size {8 * PD_STEP_SIZE:g}. Inside jax.shard_map, "
                 "jax.grad with respect to replicated parameters already sums the gradients of "
                 "the 8 devices, so a pmean of those gradients is 8 times the true one; expected "
                 f"{what}.")
    worst = max(float(_pd_np.max(_pd_np.abs(_pd_np.asarray(f, _pd_np.float64) - e)))
                for pair, ref in zip(found, expected) for f, e in zip(pair, ref))
    _pd_fail(f"`train_script` saved the wrong parameters: expected {what}, but they differ "
             f"by up to {worst:.3g} (tolerance: rtol={PD_TRAIN_RTOL:g}, atol={PD_TRAIN_ATOL:g}).")


def _pd_q9(ev):
    form.expect_kind("train_script", ev["train_script"], "str",
                     "a string holding the source of your training script")
    if not ev["train_script"]["value"].strip():
        _pd_fail("`train_script` is an empty string; expected the source of your training "
                 "script.")
    fresh = ev.get("fresh")
    if fresh is None:
        _pd_fail("`train_script` could not be run on new data.")
    _pd_ran(fresh)
    records = fresh["records"]
    _pd_joined(records)
    _pd_global_data(records, fresh)
    _pd_writes(records)
    _pd_trained(_pd_saved(fresh), fresh)


PART_D_QUESTIONS = {
    "q9_multi_process": form.question("train_script", _pd_q9, _pd_probe),
}
# ---- end of Part D


QUESTIONS = {**PART_D_QUESTIONS}

probe, verdict, check = form.entry_points(QUESTIONS)
JAXLAB_CHECKS = 1  # declares the probe/verdict contract `jaxlab grade` relies on
