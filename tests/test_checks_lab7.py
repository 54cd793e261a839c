"""Lab 7's checks: what the answer corpus cannot show.

The corpus (tests/answers/lab7-transformer) grades student-like answers through the real zip;
this file checks the checks' own machinery: that the module's copy of the lab's model (the
reference of q4-q6) is the notebook's, that the float64 NumPy forward pass (the reference of q2)
computes the same logits, that the step-FLOP formula (q8) counts what the traced training step
multiplies, that the layouts the verdicts expect are the notebook's tables, and that q9's fake
steps tell a fair timing from the two traps the task names.
"""

import ast
import math
import re
import time
from time import perf_counter

import jax
import jax.numpy as jnp
import nbformat
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from labs import release_paths
from jaxlab.checks import form, lab7

RNG = np.random.default_rng(20261203)

# the notebook's model cells and the checks module's copy of them
MODEL_PAIRS = {"rms_norm": "_rms_norm", "attention": "_attention", "block": "_block",
               "forward": "_forward"}
RENAMES = {**{check: notebook for notebook, check in MODEL_PAIRS.items()}, "_loss": "loss_fn"}


def _notebook_cells():
    nb = nbformat.read(release_paths("lab7-transformer")["master"], as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code"]


def _model_cell():
    return next(s for s in _notebook_cells() if "def init_params(" in s and "def loss_fn(" in s)


def _functions(source):
    return {n.name: n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}


class _Normalised(ast.NodeTransformer):
    """A function's body as the comparison sees it: no docstring, no imports (the checks module
    imports JAX inside each function), the checks' names spelled as the notebook's."""

    def visit_Name(self, node):
        return ast.copy_location(ast.Name(id=RENAMES.get(node.id, node.id), ctx=node.ctx), node)


def _body(fn):
    body = [s for s in fn.body if not isinstance(s, (ast.Import, ast.ImportFrom))]
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    module = ast.Module(body=[_Normalised().visit(s) for s in body], type_ignores=[])
    return ast.dump(ast.fix_missing_locations(module), annotate_fields=False)


def _expression(node):
    return ast.dump(_Normalised().visit(node), annotate_fields=False)


def _signature(fn):
    return [a.arg for a in fn.args.args]


# --------------------------------------------------------------------------- the lab's model
@pytest.mark.parametrize("notebook_name", sorted(MODEL_PAIRS))
def test_the_checks_model_is_the_notebooks_model(notebook_name):
    notebook = _functions(_model_cell())[notebook_name]
    checks = _functions(open(lab7.__file__).read())[MODEL_PAIRS[notebook_name]]
    assert _signature(checks) == _signature(notebook)
    assert _body(checks) == _body(notebook), ast.unparse(checks)


def test_the_checks_loss_is_the_notebooks_loss_fn_with_cross_entropy_inlined():
    """``_loss`` is ``loss_fn`` with ``cross_entropy`` written into it: the same call of the
    forward pass on the inputs, the same log-softmax, and the targets ``tokens[:, 1:]`` indexed
    as ``cross_entropy`` indexes ``targets`` (``targets[..., None]`` is ``tokens[:, 1:, None]``)."""
    cell = _functions(_model_cell())
    loss_fn, cross_entropy = cell["loss_fn"], cell["cross_entropy"]
    checks = _functions(open(lab7.__file__).read())["_loss"]
    assert _signature(checks) == _signature(loss_fn)
    mine = [s for s in checks.body if not isinstance(s, (ast.Import, ast.ImportFrom))]
    assert len(mine) == 3
    # logits = forward(params, tokens[:, :-1], n_heads): loss_fn's first argument of cross_entropy
    assert isinstance(mine[0], ast.Assign) and ast.unparse(mine[0].targets[0]) == "logits"
    assert _expression(mine[0].value) == _expression(loss_fn.body[-1].value.args[0])
    # logp = jax.nn.log_softmax(logits, axis=-1): cross_entropy's first line
    assert ast.dump(mine[1]) == ast.dump(cross_entropy.body[0])
    # the last line, with targets[..., None] written as tokens[:, 1:, None]
    target = ast.unparse(loss_fn.body[-1].value.args[1])
    expected = ast.unparse(cross_entropy.body[1]).replace("targets[..., None]",
                                                          f"{target[:-1]}, None]")
    assert ast.unparse(mine[2]) == expected


def _notebook_model():
    namespace = {"jax": jax, "jnp": jnp, "lax": lax, "math": math}
    exec("from typing import NamedTuple", namespace)
    exec(compile(_model_cell(), "model cell", "exec"), namespace)
    return namespace


def _fresh_case(rng, **fixed):
    cfg = lab7._fresh_config(rng, **fixed)
    batch = int(rng.integers(1, 5))
    params = lab7._fresh_params(rng, cfg)
    return cfg, params, lab7._fresh_tokens(rng, cfg, batch, cfg.seq)


def test_the_checks_model_computes_the_notebooks_loss_and_gradient():
    notebook = _notebook_model()
    for _ in range(3):
        cfg, params, tokens = _fresh_case(RNG)
        loss, grads = lab7._reference_loss_and_grad(params, tokens, cfg.n_heads)
        want, want_grads = jax.jit(jax.value_and_grad(notebook["loss_fn"]), static_argnums=2)(
            params, tokens, cfg.n_heads)
        assert loss == pytest.approx(float(want), rel=1e-6)
        for (path, g), (_, w) in zip(lab7._leaves(grads), lab7._leaves(want_grads)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7, err_msg=str(path))


# --------------------------------------------------------------------------- q2's reference
def test_numpy_forward_equals_the_checks_forward():
    for _ in range(4):
        cfg, params, tokens = _fresh_case(RNG)
        with jax.enable_x64(True):
            p64 = lab7._tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
            exact = np.asarray(lab7._forward(p64, jnp.asarray(tokens), cfg.n_heads))
        reference = lab7._np_forward(params, tokens, cfg.n_heads)
        np.testing.assert_allclose(reference, exact, rtol=1e-5, atol=1e-5)
        # and the float32 pass a student's program makes stays well inside the q2 tolerance
        f32 = np.asarray(lab7._forward(params, tokens, cfg.n_heads), np.float64)
        worst = np.max(np.abs(f32 - reference) / (lab7.ATOL + lab7.RTOL * np.abs(reference)))
        assert worst < 0.1, worst


# --------------------------------------------------------------------------- q8's formula
def _dot_flops(jaxpr, times=1):
    """FLOPs of every dot_general under ``jaxpr``, a scan's body counted once per iteration."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += times * 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(
                lhs[d] for d in contract)
        inner = times * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
        for sub in form._sub_jaxprs(eqn.params):
            total += _dot_flops(sub, inner)
    return total


@pytest.mark.parametrize("cfg, batch, seq", [
    (lab7.Config(vocab=24, d_model=16, n_heads=2, d_ff=40, n_layers=3, seq=12), 3, 12),
    (lab7.Config(vocab=50, d_model=12, n_heads=3, d_ff=20, n_layers=1, seq=9), 2, 7),
])
def test_step_flops_counts_the_traced_training_steps_products(cfg, batch, seq):
    params = lab7._fresh_params(RNG, cfg)
    tokens = lab7._fresh_tokens(RNG, cfg, batch, seq)
    step = jax.make_jaxpr(jax.value_and_grad(lab7._loss), static_argnums=2)
    forward = jax.make_jaxpr(lab7._forward, static_argnums=2)
    counted = _dot_flops(step(params, tokens, cfg.n_heads).jaxpr)
    counted_forward = _dot_flops(forward(params, tokens[:, :-1], cfg.n_heads).jaxpr)
    # the loss reads seq - 1 positions: the last token is only a target
    assert counted == lab7._step_flops(cfg, batch, seq - 1) == 3 * counted_forward


# --------------------------------------------------------------------------- layouts
def test_the_verdicts_layouts_are_the_notebooks_tables():
    """``_tp_spec`` and ``_fsdp_spec`` (what q1-q4 and q7 expect) equal the master's solutions
    of Tasks 1 and 3, leaf for leaf, up to trailing Nones."""
    namespace = {"P": jax.sharding.PartitionSpec}
    for source in _notebook_cells():
        if "def tp_specs(" in source or "def fsdp_specs(" in source:
            exec(compile(source, "solution cell", "exec"), namespace)
    params = lab7._fresh_params(RNG, lab7._fresh_config(RNG))
    for solution, spec_of in ((namespace["tp_specs"], lab7._tp_spec),
                              (namespace["fsdp_specs"], lab7._fsdp_spec)):
        got = dict(lab7._leaves(solution(params)))
        assert set(got) == {path for path, _ in lab7._leaves(params)}
        for path, spec in got.items():
            assert lab7._canonical(list(spec)) == lab7._canonical(list(spec_of(path))), path


# --------------------------------------------------------------------------- q9's fake steps
def _q9_solution():
    """The master's solution of Task 9 (``time_step``, ``mfu``), run as the notebook runs it."""
    namespace = {"jax": jax, "time": time}
    source = next(s for s in _notebook_cells() if "def time_step(" in s and "def mfu(" in s)
    exec(compile(source, "solution cell", "exec"), namespace)
    return namespace["time_step"], namespace["mfu"]


def _time_step_without_warm_up(step, args, repeats):
    start = time.perf_counter()
    for _ in range(repeats):
        out = step(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def _time_step_never_blocking(step, args, repeats):
    step(*args)
    start = time.perf_counter()
    for _ in range(repeats):
        step(*args)
    return (time.perf_counter() - start) / repeats


def _q9(time_step):
    ev = lab7._probe_timing({"time_step": time_step, "mfu": _q9_solution()[1]})
    lab7.verdict("q9_utilisation", form.transported(ev))


def test_q9_accepts_the_notebooks_solution():
    _q9(_q9_solution()[0])


@pytest.mark.parametrize("time_step, says", [
    (_time_step_without_warm_up, "once to compile"),
    (_time_step_never_blocking, "block on the result"),
])
def test_q9_rejects_the_two_traps(time_step, says):
    with pytest.raises(AssertionError, match=says):
        _q9(time_step)


def _time_step_fastest_call(step, args, repeats):
    jax.block_until_ready(step(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def _time_step_method_block(step, args, repeats):
    step(*args).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        out = step(*args)
    out.block_until_ready()
    return (time.perf_counter() - start) / repeats


@pytest.mark.parametrize("time_step, says", [
    (_time_step_fastest_call, "as the fastest call or the median is"),
    (_time_step_method_block, "block on the whole result with jax.block_until_ready(out)"),
])
def test_q9_names_the_fastest_call_and_a_method_a_tuple_lacks(time_step, says):
    with pytest.raises(AssertionError, match=re.escape(says)):
        _q9(time_step)


def _time_step_wall_clock(step, args, repeats):
    jax.block_until_ready(step(*args))
    start = time.time()
    for _ in range(repeats):
        out = step(*args)
    jax.block_until_ready(out)
    return (time.time() - start) / repeats


def _time_step_imported_perf_counter(step, args, repeats):
    # `from time import perf_counter` binds the clock before the probe can count its calls; the
    # check reads the name in this function's code (a whole program, not a shared helper, for that)
    jax.block_until_ready(step(*args))
    start = perf_counter()
    for _ in range(repeats):
        out = step(*args)
    jax.block_until_ready(out)
    return (perf_counter() - start) / repeats


def test_q9_wants_the_clock_the_task_names_however_it_is_imported():
    """Task 9 says "time `repeats` calls with `time.perf_counter()`": the wall clock (a blind
    answer's time.time()) loses the question; perf_counter imported by name keeps it."""
    with pytest.raises(AssertionError, match=re.escape("expected the clock the task names")):
        _q9(_time_step_wall_clock)
    _q9(_time_step_imported_perf_counter)


# --------------------------------------------------------------------------- compiled programs
def test_collectives_counts_a_combined_all_reduce():
    text = ("  %all-reduce.80 = (f32[64]{0}, f32[128,64]{1,0}) all-reduce(%a, %b), channel_id=1\n"
            "  %all-gather = f32[1,64,32]{2,0,1} all-gather(%c), channel_id=2\n"
            "  %x = f32[2] add(%all-reduce.80, %y)\n")
    assert lab7.COLLECTIVE.findall(text) == ["all-reduce", "all-gather"]


# --------------------------------------------------------------------------- q6's rows
def test_rows_seen_names_the_rows_of_each_microbatch():
    cfg = lab7.Config(vocab=12, d_model=8, n_heads=2, d_ff=12, n_layers=1, seq=6)
    params = lab7._fresh_params(RNG, cfg)
    tokens = lab7._distinct_rows(RNG, cfg, 6)
    namespace = {"jax": jax, "jnp": jnp, "lax": lax, "loss_fn": lab7._loss}
    exec("def consecutive(params, tokens, n_heads, n):\n"
         "    micro = tokens.reshape(n, -1, tokens.shape[1])\n"
         "    return lax.map(lambda b: jax.value_and_grad(loss_fn)(params, b, n_heads)[0], micro)\n"
         "def strided(params, tokens, n_heads, n):\n"
         "    micro = tokens.reshape(-1, n, tokens.shape[1]).swapaxes(0, 1)\n"
         "    return lax.map(lambda b: jax.value_and_grad(loss_fn)(params, b, n_heads)[0], micro)\n",
         namespace)
    for name, wanted in (("consecutive", [[0, 1, 2], [3, 4, 5]]),
                         ("strided", [[0, 2, 4], [1, 3, 5]])):
        fn = namespace[name]
        with lab7._rows_seen(fn) as seen:
            jax.block_until_ready(jax.jit(lambda p, t: fn(p, t, cfg.n_heads, 2))(params, tokens))
            jax.effects_barrier()
        assert sorted(lab7._row_numbers(seen, tokens, 3)) == wanted, name
        assert namespace["loss_fn"] is lab7._loss  # put back


# --------------------------------------------------------------------------- q7's checkpoint
def test_the_checkpoints_metadata_and_the_restores_reads_are_read(tmp_path):
    """A sharded save records each array's sharding and chunks of one device's block; a save of
    host copies records neither. A restore into a sharded target reads into that layout; a
    replicated one reads whole arrays."""
    import orbax.checkpoint as ocp

    mesh = lab7._mesh((4, 2))
    cfg = lab7.Config(vocab=16, d_model=16, n_heads=2, d_ff=32, n_layers=2, seq=8)
    state = {"params": lab7._shard(lab7._fresh_params(RNG, cfg), mesh, lab7._fsdp_spec),
             "step": lab7._put(np.int32(3), mesh)}
    for name, saved in (("sharded", state), ("host", jax.device_get(state))):
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp_path / name, saved)
            checkpointer.wait_until_finished()
    sharded = lab7._written(ocp, tmp_path / "sharded", state)
    host = lab7._written(ocp, tmp_path / "host", state)
    wq = "params/layers/wq"
    assert sharded["leaves"][wq]["sharding"] == [None, "data", "model"]
    assert sharded["leaves"][wq]["chunks"] == sharded["blocks"][wq] == [2, 4, 8]
    assert host["leaves"][wq]["sharding"] is None and host["leaves"][wq]["chunks"] == [2, 16, 16]
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    small = lab7._mesh((2, 2), 4)
    for spec_of, wanted in ((lambda path: lab7._fsdp_spec(path) if path[0] != "step" else (),
                             [None, "data", "model"]), (lambda path: (), [])):
        target = {"params": {k: (jax.tree_util.tree_map_with_path(
            lambda p, s, k=k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(
                small, P(*spec_of((k,) + tuple(q.key for q in p))))), v)
            if isinstance(v, dict) else jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
                small, P(*spec_of((k,)))))) for k, v in abstract["params"].items()},
            "step": jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(small, P()))}
        with lab7._orbax_reads() as reads, ocp.StandardCheckpointer() as checkpointer:
            checkpointer.restore(tmp_path / "sharded", target)
        read = dict(reads)
        assert read["params.layers.wq"]["spec"] == wanted, read["params.layers.wq"]
        assert read["params.layers.wq"]["mesh_shape"] == [2, 2]
    assert ocp.type_handlers.ArrayHandler.deserialize.__name__ == "deserialize"
