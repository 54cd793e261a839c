"""The Lab 3 verdicts accept the lab's answers and explain wrong ones in the student's terms."""

import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxlab.checks import lab3


def mesh1d(n=8, kind=AxisType.Auto, name="data"):
    return jax.make_mesh((n,), (name,), axis_types=(kind,), devices=jax.devices()[:n])


def put(value, mesh, *spec):
    return jax.device_put(value, NamedSharding(mesh, P(*spec)))


def layer(x, W, b):
    return jax.nn.softmax(x @ W + b)


def q5_answer(n=8, data_spec=("data",), param_spec=()):
    x, W, b = map(jnp.asarray, lab3._layer_data())
    m = mesh1d(n)
    xa, Wa, ba = put(x, m, *data_spec), put(W, m, *param_spec), put(b, m, *param_spec)
    return dict(x_auto=xa, W_auto=Wa, b_auto=ba, out_auto=jax.jit(layer)(xa, Wa, ba))


def verdict_message(question, **values):
    try:
        lab3.check(question, **values)
    except AssertionError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("n", [4, 8])
def test_q5_accepts_4_or_8_devices(n):
    assert verdict_message("q5_dp_auto", **q5_answer(n)) is None


def test_q5_rejects_replicated_data_naming_the_variable():
    msg = verdict_message("q5_dp_auto", **q5_answer(data_spec=()))
    assert msg.startswith("`x_auto` is replicated on every device")
    assert "expected it split along the batch axis (dimension 0)" in msg


def test_q5_rejects_weights_left_on_one_device():
    answer = q5_answer()
    _, W, _ = lab3._layer_data()
    answer["W_auto"] = jnp.asarray(W)
    msg = verdict_message("q5_dp_auto", **answer)
    assert msg.startswith("`W_auto` is not placed on a mesh: it lives on a single device")


def test_q5_rejects_an_explicit_mesh():
    x, W, b = map(jnp.asarray, lab3._layer_data())
    m = mesh1d(kind=AxisType.Explicit)
    xa, Wa, ba = put(x, m, "data"), put(W, m), put(b, m)
    msg = verdict_message("q5_dp_auto", x_auto=xa, W_auto=Wa, b_auto=ba, out_auto=layer(xa, Wa, ba))
    assert "expected an Auto axis" in msg


def test_q6_reads_typeof_with_the_students_axis_name():
    x, W, b = map(jnp.asarray, lab3._layer_data())
    m = mesh1d(4, AxisType.Explicit, name="rows")
    xe, We, be = put(x, m, "rows"), put(W, m), put(b, m)

    @jax.jit
    def layer_explicit(x, W, b):
        out = layer(x, W, b)
        print(jax.typeof(x), jax.typeof(W), jax.typeof(b), jax.typeof(out))
        return out

    values = dict(x_explicit=xe, W_explicit=We, b_explicit=be, layer_explicit=layer_explicit,
                  out_explicit=layer_explicit(xe, We, be))
    assert verdict_message("q6_dp_explicit", **values) is None
    # graded again (or called on the probe's shapes before): a cached trace prints nothing
    assert verdict_message("q6_dp_explicit", **values) is None

    @jax.jit
    def silent(x, W, b):
        return layer(x, W, b)

    msg = verdict_message("q6_dp_explicit", **{**values, "layer_explicit": silent})
    assert "float32[64@rows,10]" in msg and "should print the jax.typeof" in msg


def test_q7_requires_shard_map_and_fresh_inputs():
    x, W, b = map(jnp.asarray, lab3._layer_data())
    m = mesh1d(8, name="i")
    manual = jax.jit(jax.shard_map(layer, mesh=m, in_specs=(P("i"), P(), P()), out_specs=P("i")))
    assert verdict_message("q7_dp_manual", layer_manual=manual, out_man=manual(x, W, b)) is None

    def auto(x, W, b):
        return jax.jit(layer)(put(x, m, "i"), put(W, m), put(b, m))

    msg = verdict_message("q7_dp_manual", layer_manual=auto, out_man=auto(x, W, b))
    assert "does not go through jax.shard_map" in msg

    fixed = out = manual(x, W, b)
    msg = verdict_message("q7_dp_manual", layer_manual=lambda *a: fixed, out_man=out)
    assert "`layer_manual` gives the right numbers but does not go through" in msg


def test_q7_accepts_shard_map_on_an_explicit_mesh():
    x, W, b = map(jnp.asarray, lab3._layer_data())
    m = mesh1d(8, AxisType.Explicit, name="d")
    block = jax.shard_map(layer, mesh=m, in_specs=(P("d"), P(), P()), out_specs=P("d"))

    @jax.jit
    def manual(x, W, b):
        return block(jax.reshard(x, NamedSharding(m, P("d"))), jax.reshard(W, NamedSharding(m, P())),
                     jax.reshard(b, NamedSharding(m, P())))

    assert verdict_message("q7_dp_manual", layer_manual=manual, out_man=manual(x, W, b)) is None


def test_q3_wants_the_four_specs_as_keys_and_rejects_wrong_counts():
    shapes = {P("x", None): (2, 16), P(None, "y"): (4, 4), P(None, None): (4, 16),
              P(None, "x"): (4, 8)}
    counts = {P("x", None): 4, P(None, "y"): 2, P(None, None): 8, P(None, "x"): 4}
    assert verdict_message("q3_partition_specs", shard_shapes=shapes, replicas=counts) is None
    msg = verdict_message("q3_partition_specs", shard_shapes=shapes,
                          replicas={**counts, P(None, "y"): 4})
    assert msg.startswith("`replicas[P(None, 'y')]` is the number 4")
    short = {P("x") if k == P("x", None) else k: v for k, v in shapes.items()}
    msg = verdict_message("q3_partition_specs", shard_shapes=short, replicas=counts)
    assert msg.startswith("`shard_shapes` has no entry for P('x', None)")
    assert "raises KeyError" in msg


def test_q1_wants_A_itself_on_the_labs_auto_mesh():
    A = jnp.arange(64.0).reshape(4, 16)
    auto = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:8])
    assert verdict_message("q1_device_put", A_sharded=put(A, auto, "x", "y")) is None
    msg = verdict_message("q1_device_put", A_sharded=put(A.astype(jnp.int32), auto, "x", "y"))
    assert msg.startswith("`A_sharded` holds int32 values")
    explicit = jax.make_mesh((2, 4), ("x", "y"), devices=jax.devices()[:8])
    msg = verdict_message("q1_device_put", A_sharded=put(A, explicit, "x", "y"))
    assert "whose axes are both Auto" in msg


def good_timer(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeats


def timer_without_warmup(fn, *args, repeats=10):
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeats


def timer_without_block(fn, *args, repeats=10):
    fn(*args)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return (time.perf_counter() - start) / repeats


def timer_blocking_last_result_only(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def timer_one_call_too_many(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats + 1):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeats


def timer_twice_the_calls(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(2 * repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeats


def timer_fastest(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        runs.append(time.perf_counter() - start)
    return min(runs)


def _timed(fn, args, repeats):
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeats


def timer_two_warmups(fn, *args, repeats=10):
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    return _timed(fn, args, repeats)


def timer_warmup_not_waited(fn, *args, repeats=10):
    fn(*args)
    return _timed(fn, args, repeats)


@pytest.mark.parametrize("timer", [good_timer, timer_blocking_last_result_only,
                                   timer_two_warmups, functools.partial(good_timer, repeats=2),
                                   functools.partial(good_timer, repeats=100)])
def test_q9_timing_method_accepts_the_mean_of_warm_waited_calls(timer):
    assert lab3._timing_method(lab3._timing_run(timer)) is None


@pytest.mark.parametrize("timer, words", [
    (timer_without_warmup, "counts the first (compiling) call"),
    (functools.partial(timer_without_warmup, repeats=60), "counts the first (compiling) call"),
    (timer_without_block, "jax.block_until_ready inside the timed region"),
    (functools.partial(good_timer, repeats=1), "then time at least 2 calls"),
    (timer_one_call_too_many, "divided by one call fewer than were timed"),
    (functools.partial(timer_one_call_too_many, repeats=60),
     "divided by one call fewer than were timed"),
    (timer_twice_the_calls, "divided by half the number of calls that were timed"),
    (timer_fastest, "not the mean of the timed calls"),
    (timer_warmup_not_waited, "the work of the first call, whose result was not waited for"),
    (functools.partial(good_timer, repeats=101), "more than 101 times"),
])
def test_q9_timing_method_recognises_each_slip(timer, words):
    with pytest.raises(AssertionError, match=re.escape(words)):
        lab3._timing_method(lab3._timing_run(timer))


def test_q9_rejects_timings_without_block_until_ready():
    msg = verdict_message("q9_timing", seconds_per_call=good_timer, time_unsharded=2e-5,
                          time_sharded=3e-5)
    assert msg.startswith("`time_unsharded` is 2e-05 s per call")
    assert "jax.block_until_ready" in msg


def q4_values(b_spec, c_spec):
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:8])
    B = put(jnp.arange(32.0).reshape(4, 8), mesh, *b_spec)
    C = put(jnp.ones((4, 8)), mesh, *c_spec)
    return dict(B=B, C=C, B_plus_C=B + C, BtC=B.T @ C)


@pytest.mark.parametrize("b_spec", [("x", None), (None, "x")])
@pytest.mark.parametrize("c_spec", [(None, "y"), ("y", None)])
def test_q4_accepts_either_dimension_split(b_spec, c_spec):
    assert verdict_message("q4_propagation", **q4_values(b_spec, c_spec)) is None


def test_q4_rejects_an_array_split_over_both_axes():
    msg = verdict_message("q4_propagation", **q4_values(("x", "y"), (None, "y")))
    assert msg.startswith("`B` is dimension 0 split 2 ways over mesh axis 'x'")


def test_q7_rejects_replicated_rows_read_from_the_program():
    m = mesh1d(8, name="batch")

    def per_device(x, W, b):  # every device holds all of x and picks its rows itself
        i = jax.lax.axis_index("batch")
        rows = x.shape[0] // 8
        return layer(jax.lax.dynamic_slice_in_dim(x, i * rows, rows), W, b)

    layer_manual = jax.jit(jax.shard_map(per_device, mesh=m, in_specs=(P(), P(), P()),
                                         out_specs=P("batch")))
    x, W, b = map(jnp.asarray, lab3._layer_data())
    msg = verdict_message("q7_dp_manual", layer_manual=layer_manual,
                          out_man=layer_manual(x, W, b))
    assert msg.startswith("`layer_manual` hands x (shape (64, 10)) to jax.shard_map replicated")


def test_every_contract_question_is_registered_with_its_names():
    """The graded names (the contract) first, then the notebook's own names its public check
    reads (lab3.NOTEBOOK)."""
    graded = {q: spec.names[:len(spec.names) - len(lab3.NOTEBOOK.get(q.split("_")[0], "").split())]
              for q, spec in lab3.QUESTIONS.items()}
    extra = {q: spec.names[len(graded[q]):] for q, spec in lab3.QUESTIONS.items()}
    assert extra == {q: tuple(lab3.NOTEBOOK.get(q.split("_")[0], "").split())
                     for q in lab3.QUESTIONS}
    assert graded == {
        "q1_device_put": ("A_sharded",),
        "q2_inspect": ("A_sharded_devices", "A_shard_shape"),
        "q3_partition_specs": ("shard_shapes", "replicas"),
        "q4_propagation": ("B", "C", "B_plus_C", "BtC"),
        "q5_dp_auto": ("x_auto", "W_auto", "b_auto", "out_auto"),
        "q6_dp_explicit": ("x_explicit", "W_explicit", "b_explicit", "layer_explicit",
                           "out_explicit"),
        "q7_dp_manual": ("layer_manual", "out_man"),
        "q8_sharded_training": ("x_train_sharded", "y_train_sharded", "params_replicated",
                                "params_trained_sharded"),
        "q9_timing": ("seconds_per_call", "time_unsharded", "time_sharded"),
    }


def test_trained_reference_is_kept_for_later_workers_where_the_grader_says(tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv(lab3.REFERENCE_DIR, str(tmp_path))
    lab3._trained_reference.cache_clear()
    first = lab3._trained_reference(16, (1, 4, 1), epochs=3)
    assert len(list(tmp_path.glob("*.npz"))) == 1
    lab3._trained_reference.cache_clear()  # a later worker: loads it, trains nothing

    def no_training(*args):
        raise AssertionError("trained again")

    monkeypatch.setattr(lab3, "_train_reference", no_training)
    again = lab3._trained_reference(16, (1, 4, 1), epochs=3)
    assert [(W.shape, b.shape) for W, b in again] == [((1, 4), (4,)), ((4, 1), (1,))]
    for (W, b), (W0, b0) in zip(again, first):
        np.testing.assert_array_equal(W, W0)
        np.testing.assert_array_equal(b, b0)
    lab3._trained_reference.cache_clear()


def test_q9_times_grad_loss_on_the_notebooks_own_cpu_training_problem():
    """The probe's reference timing must be of the problem the student timed: the CPU branch of
    the notebook's data cell (n, layer_sizes) is the probe's CPU_TRAINING."""
    import ast

    import nbformat

    from labs import release_paths

    nb = nbformat.read(release_paths("lab3-parallelism")["master"], as_version=4)
    cell = next(c.source for c in nb.cells if "layer_sizes = [" in c.source)
    branch = next(n for n in ast.walk(ast.parse(cell)) if isinstance(n, ast.If)
                  and "cpu" in ast.unparse(n.test))
    values = {t.id: ast.literal_eval(s.value) for s in branch.body for t in s.targets}
    assert (values["n"], tuple(values["layer_sizes"])) == lab3.CPU_TRAINING
