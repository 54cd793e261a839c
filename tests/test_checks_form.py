"""Unit tests of the evidence and form helpers shipped as jaxlab_form.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxlab.checks import form


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto, AxisType.Auto))


def test_evidence_of_a_sharded_array_records_values_and_layout(mesh):
    a = jax.device_put(jnp.arange(8.0).reshape(2, 4), NamedSharding(mesh, P("x", "y")))
    ev = form.evidence(a)
    assert ev["kind"] == "array" and ev["shape"] == [2, 4]
    np.testing.assert_allclose(ev["value"], np.arange(8.0).reshape(2, 4))
    sev = ev["sharding"]
    assert sev["kind"] == "NamedSharding" and sev["spec"] == ["x", "y"]
    assert sev["mesh_shape"] == [2, 4] and sev["axis_types"] == ["Auto", "Auto"]


def test_objects_that_claim_equality_are_not_mistaken_for_arrays():
    class Liar:
        shape = (4, 16)
        __eq__ = lambda self, other: True  # noqa: E731
        __class__ = jax.Array  # noqa: F811 -- fools isinstance, not the exact type check

    assert form.evidence(Liar())["kind"] == "other"
    with pytest.raises(AssertionError, match="should be a jax.Array"):
        form.expect_array("A_sharded", form.evidence(Liar()))


def test_placeholder_and_none_are_reported_as_not_defined():
    for value in (..., None):
        with pytest.raises(AssertionError, match="`q` is not defined yet"):
            form.expect_array("q", form.evidence(value))


def test_p_x_and_p_x_none_describe_the_same_layout(mesh):
    a = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P("x")))
    sev = form.evidence(a)["sharding"]
    assert form.is_laid_out_as(sev, 2, P("x", None))
    assert form.is_laid_out_as(sev, 2, P("x"))
    assert not form.is_laid_out_as(sev, 2, P(None, "x"))


def test_describe_sharding_names_split_and_replicated_axes(mesh):
    a = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P("x", None)))
    text = form.describe_sharding(form.evidence(a)["sharding"])
    assert "dimension 0 split 2 ways over mesh axis 'x'" in text
    assert "replicated over mesh axis 'y'" in text
    assert text.endswith("(spec P('x', None) on the 2 × 4 mesh)"), text
    r = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P()))
    assert form.describe_sharding(form.evidence(r)["sharding"]) == \
        "replicated on every device of the 2 × 4 mesh"
    line = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    r = jax.device_put(jnp.ones((8, 2)), NamedSharding(line, P()))
    assert form.describe_sharding(form.evidence(r)["sharding"]) == \
        "replicated on every device of the 8-device mesh"
    d = jax.device_put(jnp.ones((8, 2)), NamedSharding(line, P("data")))
    assert form.describe_sharding(form.evidence(d)["sharding"]).endswith(
        "(spec P('data') on the 8-device mesh)")
    single = form.evidence(jnp.ones(3))["sharding"]
    assert form.describe_sharding(single).startswith("on a single device")


def test_rebuilt_sharding_is_equivalent_to_the_original(mesh):
    a = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P(None, "y")))
    rebuilt = form.rebuild_sharding(form.evidence(a)["sharding"])
    assert rebuilt.is_equivalent_to(a.sharding, 2)


def test_evidence_survives_the_json_and_npz_round_trip(tmp_path, mesh):
    value = {P("x", None): (2, 16), "t": [float("nan"), 1.5],
             "a": jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("y")))}
    ev = form.evidence(value)
    form.dump_evidence(ev, tmp_path / "ev.json")
    back = form.load_evidence(tmp_path / "ev.json")
    assert back["items"][0][0] == {"kind": "spec", "entries": ["x", None]}
    np.testing.assert_array_equal(back["items"][2][1]["value"], np.arange(4.0))
    assert np.isnan(back["items"][1][1]["items"][0]["value"])


def test_numpy_scalars_in_raw_evidence_cross_to_the_grader_as_0d_arrays(tmp_path):
    # seen: Lab 6 q3's probe keeps the inputs it drew, one of them a float32 scalar (shape ());
    # the kernel could not write it, and jaxlab grade scored the solution's q3 as unreadable
    ev = {"inputs": [np.float32(0.25), np.int64(3), np.arange(2.0)], "t": (1, 2)}
    form.dump_evidence(ev, tmp_path / "ev.json")
    back = form.load_evidence(tmp_path / "ev.json")
    assert back["inputs"][0].shape == () and back["inputs"][0].dtype == np.float32
    assert back["inputs"][0] == np.float32(0.25) and back["inputs"][1] == 3
    assert back["t"] == [1, 2]
    # what otter's in-kernel check judges is the same as what the grader loads
    same = form.transported(ev)
    assert same["inputs"][0].dtype == np.float32 and same["t"] == [1, 2]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int8", "int32", "bool",
                                   "float8_e4m3fn", "uint8"])
def test_arrays_of_every_dtype_the_labs_use_reach_the_grader_intact(tmp_path, mesh, dtype):
    # seen: a bfloat16 loss crossed as raw void bytes and the check read b'j@' as its value
    values = (np.arange(-3, 5) * 0.75).astype(jnp.dtype(dtype))
    ev = form.evidence(jax.device_put(jnp.asarray(values), NamedSharding(mesh, P("y"))))
    assert ev["dtype"] == dtype
    form.dump_evidence({"a": ev, "scalar": np.asarray(values)[1]}, tmp_path / "ev.json")
    for back in (form.load_evidence(tmp_path / "ev.json"), form.transported({"a": ev})):
        got = back["a"]["value"]
        assert got.dtype == jnp.dtype(dtype) and got.shape == values.shape
        np.testing.assert_array_equal(got.astype(np.float64), values.astype(np.float64))
        assert back["a"]["dtype"] == dtype
    scalar = form.load_evidence(tmp_path / "ev.json")["scalar"]
    assert scalar.dtype == jnp.dtype(dtype) and scalar.shape == ()  # a loss stays 0-d
    assert float(scalar) == float(np.asarray(values)[1])


def test_an_unknown_dtype_name_in_the_evidence_is_refused(tmp_path):
    form.dump_evidence({"a": np.zeros(2, jnp.bfloat16)}, tmp_path / "ev.json")
    text = (tmp_path / "ev.json").read_text().replace("bfloat16", "__class__")
    (tmp_path / "ev.json").write_text(text)
    with pytest.raises(ValueError, match="unknown array dtype"):
        form.load_evidence(tmp_path / "ev.json")


def test_numbers_devices_and_functions_have_their_own_kinds():
    assert form.evidence(3)["is_int"] and not form.evidence(3.0)["is_int"]
    assert form.evidence(np.float32(2.5))["kind"] == "number"
    assert form.evidence(jax.devices()[0])["kind"] == "device"
    assert form.evidence(jax.jit(lambda v: v))["type"] == "PjitFunction"
    assert form.evidence(True)["kind"] == "bool"


def test_probe_order_puts_marked_questions_first_and_keeps_the_rest_in_order():
    from types import SimpleNamespace

    from jaxlab.checks import lab3, lab5

    order = form.probe_order(lab5.QUESTIONS)
    assert order[0] == "q9_multi_process"
    assert order[1:] == [q for q in lab5.QUESTIONS if q != "q9_multi_process"]
    assert form.probe_order(lab3.QUESTIONS) == list(lab3.QUESTIONS)
    # a checks module from before the mark: its questions have no such attribute
    old = {"q1": SimpleNamespace(), "q2": SimpleNamespace()}
    assert form.probe_order(old) == ["q1", "q2"]


def test_otters_test_judges_the_graders_probe_instead_of_probing_again(tmp_path):
    """In the grading kernel the probe cell runs first; the claim (otter's own test, the same
    check) then reads that evidence file while the graded names hold the same objects."""
    from IPython.core.interactiveshell import InteractiveShell

    calls, judged = [], []

    def probe(values):
        calls.append(1)
        return {"x": form.evidence(values["x"])}

    # x is graded; inputs is the notebook's own, read by the public check only (the hidden test
    # passes x alone)
    questions = {"q": form.question("x inputs", lambda ev: judged.append(ev["x"]["value"]),
                                    probe)}
    probe_q, _, check = form.entry_points(questions)
    shell = InteractiveShell.instance()
    try:
        x, other, inputs = np.arange(3.0), np.arange(3.0), np.ones(2)
        form.dump_evidence({"evidence": probe_q("q", {"x": x, "inputs": inputs})},
                           tmp_path / "ev.json")
        form.remember_probe("q", [x, inputs], tmp_path / "ev.json")
        check("q", x=x)
        assert len(calls) == 1 and len(judged) == 1  # judged from the file, not probed again
        check("q", x=other)  # another object: probed afresh
        assert len(calls) == 2 and len(judged) == 2
        check("q", x=x, inputs=np.ones(2))  # another input object: probed afresh
        assert len(calls) == 3 and len(judged) == 3
    finally:
        shell.__dict__.pop("_jaxlab_probed", None)
        InteractiveShell.clear_instance()
    check("q", x=x)  # outside a kernel: always probes
    assert len(calls) == 4


def test_public_check_helpers_speak_the_hidden_checks_words(mesh):
    one = jax.make_mesh((8,), ("i",), axis_types=(AxisType.Auto,))
    x = jnp.arange(64.0)
    total = jax.shard_map(lambda b: jax.lax.psum(jnp.sum(b), "i"), mesh=one, in_specs=P("i"),
                          out_specs=P())
    gathered = jax.shard_map(lambda b: jnp.sum(jax.lax.all_gather(b, "i")), mesh=one,
                             in_specs=P("i"), out_specs=P(), check_vma=False)
    prims, program = form.traced("global_sum", total, x)
    form.expect_collectives("global_sum", prims, required=("psum",), forbidden=("all_gather",))
    assert program["shard_maps"][0]["in"][0] == [[64], ["i"]]
    with pytest.raises(AssertionError, match="`g` uses `all_gather`, which this task rules out"):
        form.expect_collectives("g", form.traced("g", gathered, x)[0], required=("psum",),
                                forbidden=("all_gather",))
    with pytest.raises(AssertionError, match="has no `jax.lax.psum`"):
        form.expect_collectives("g", form.traced("g", gathered, x)[0], required=("psum",))
    with pytest.raises(AssertionError, match="does not go through jax.shard_map"):
        form.expect_collectives("s", form.traced("s", jnp.sum, x)[0])
    out = form.call("global_sum(x)", total, x)
    form.expect_shape("global_sum(x)", out, ())
    form.expect_laid_out("global_sum(x)", out, P(), "replicated", 8)
    with pytest.raises(AssertionError, match=r"returned an array of shape \(\); expected \(8,\)"):
        form.expect_shape("global_sum(x)", out, (8,))
    split = jax.device_put(x, NamedSharding(one, P("i")))
    with pytest.raises(AssertionError, match="expected replicated"):
        form.expect_laid_out("f(x)", split, P(), "replicated", 8)
    with pytest.raises(AssertionError, match=r"`bad\(x\)` raised TypeError: .*line \d+ of your"):
        form.call("bad(x)", lambda a: a @ jnp.ones(3), x)
    with pytest.raises(AssertionError, match="could not be traced"):
        form.traced("bad", lambda a: a @ jnp.ones(3), x)


def test_a_psum_of_values_every_device_holds_is_counted(mesh):
    """``sums_of_copies``: an all-reduce whose operand pvary made from an invariant value (the
    pmean of a gradient jax.grad has already all-reduced), not the psum a gradient needs."""
    one = jax.make_mesh((8,), ("i",), axis_types=(AxisType.Explicit,))
    xs = jax.device_put(jnp.arange(16.0), NamedSharding(one, P("i")))

    def step(extra, **kw):
        def body(w, x):
            g = jax.grad(lambda w: jax.lax.pmean(jnp.sum(w * x), "i"))(w)
            return jax.lax.pmean(g, "i") if extra else g
        return jax.shard_map(body, mesh=one, in_specs=(P(), P("i")), out_specs=P(), **kw)

    def copies(fn):
        _, program = form.traced("step", fn, jnp.float32(1.0), xs)
        return program["shard_maps"][0]["sums_of_copies"]

    assert copies(step(False)) == 0  # the gradient's own all-reduce (the transpose of pvary)
    assert copies(step(True)) == 1  # pmean of that gradient: the devices' copies added again
    # without shard_map's replication checks nothing is marked invariant: not counted
    assert copies(step(True, check_vma=False)) == 0
