"""`jaxlab mutants`: its operators on small cells, its comparison of evidence, its decisions
file, how it classes a survivor and a mutant stopped by its limit (a stand-in harness, no
kernel), its report and listing, and (slow) one question of a lab analysed with the real checks
in the corpus's kernel."""

import pathlib

import numpy as np
import pytest

from jaxlab.mutants import analysis, operators as ops

ROOT = pathlib.Path(__file__).resolve().parent.parent


def changes(source, operator):
    return {(m.before, m.after) for m in ops.mutants(source, [operator])}


# --------------------------------------------------------------------------- operators
def test_a_comparison_is_made_strict_and_a_guard_removed():
    cell = "def f(s):\n    if s <= 0:\n        return None\n    return 1 / s\n"
    assert ("s <= 0", "s < 0") in changes(cell, "comparison")
    (guard,) = ops.mutants(cell, ["guard"])
    assert guard.after == "(removed)" and "if" not in guard.code and guard.line == 2
    namespace = {}
    exec(guard.code, namespace)
    with pytest.raises(ZeroDivisionError):
        namespace["f"](0)


def test_a_range_is_off_by_one_at_its_end():
    found = {after for _, after in changes("for i in range(1, n):\n    s += i\n", "range")}
    assert found == {"range(1, (n) + 1)", "range(1, (n) - 1)"}
    assert changes("for i in range(8):\n    s += i\n", "range") == set()


def test_a_returned_number_loses_its_python_type():
    cell = "def f(x):\n    return float(np.sum(x)), int(x.size)\n"
    found = changes(cell, "conversion")
    assert ("float(np.sum(x))", "np.sum(x)") in found and ("int(x.size)", "x.size") in found


def test_partition_spec_entries_are_swapped_dropped_and_replaced_by_none():
    found = {after for _, after in changes('s = P("data", "model")', "spec")}
    assert found == {'P("model", "data")', 'P("model")', 'P("data")', 'P(None, "model")',
                     'P("data", None)'}


def test_sharding_collectives_and_rings_have_their_conceptual_mutants():
    cell = ('mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)\n'
            'y = lax.psum(x, "model")\n'
            'z = lax.ppermute(y, "data", perm=[(i, (i + 1) % 4) for i in range(4)])\n'
            'w = lax.psum_scatter(z, "data", scatter_dimension=0, tiled=True)\n')
    assert ('jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)',
            'jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)') \
        in changes(cell, "mesh")
    assert ("AxisType.Explicit", "AxisType.Auto") in changes(cell, "axis-type")
    collective = {after for _, after in changes(cell, "collective")}
    assert {'lax.pmean(x, "model")', 'lax.all_gather(x, "model")', 'lax.psum(z, "data")'} \
        <= collective
    assert ('psum(..., "model")', "psum(..., 'data')") in changes(cell, "axis-name")
    rings = [m for m in ops.mutants(cell, ["ppermute"])]
    assert len(rings) == 2
    for ring, expected in zip(rings, ([(1, 0), (2, 1), (3, 2), (0, 3)],
                                      [(0, 2), (1, 3), (2, 0), (3, 1)])):
        assert ring.before == "perm=[(i, (i + 1) % 4) for i in range(4)]"
        assert [tuple(p) for p in eval(ring.after.split("perm=", 1)[1])] == expected
        assert ring.after in ring.code


def test_jit_and_checkpoint_are_removed_and_the_policy_changed():
    cell = ("@jax.jit\ndef f(x):\n    return x\n\n"
            "g = jax.checkpoint(h, policy=jax.checkpoint_policies.save_only_these_names('a'))\n")
    jit = ops.mutants(cell, ["jit"])
    assert len(jit) == 1 and "@jax.jit" not in jit[0].code
    assert (jit[0].before, jit[0].after, jit[0].line) == ("@jax.jit", "(decorator removed)", 1)
    found = {m.after: m for m in ops.mutants(cell, ["checkpoint"])}
    assert "h" in found and "(no policy)" in found
    assert "jax.checkpoint(h)" in found["(no policy)"].code
    dots = found["policy=jax.checkpoint_policies.dots_saveable"]
    assert "jax.checkpoint(h, policy=jax.checkpoint_policies.dots_saveable)" in dots.code


def test_the_unrolled_scan_computes_what_lax_scan_does():
    import jax.numpy as jnp

    cell = ("def body(c, x):\n    return c + x, c * x\n\n"
            "carry, ys = lax.scan(body, 1.0, jnp.arange(5.0))\n")
    (mutant,) = ops.mutants(cell, ["scan"])
    namespace = {"jnp": jnp, "lax": __import__("jax").lax}
    exec(cell, namespace)
    expected = namespace["carry"], namespace["ys"]
    exec(mutant.code, namespace)
    assert "lax.scan" not in mutant.code.split("carry, ys =")[1]
    np.testing.assert_allclose(namespace["carry"], expected[0])
    np.testing.assert_allclose(namespace["ys"], expected[1])


def test_a_script_held_in_a_string_is_mutated_inside_and_stays_a_string():
    cell = ('script = r"""\nimport sys\nn = int(sys.argv[1])\nm = n + 1\n'
            'k = n * 2\n"""\n')
    found = ops.mutants(cell, ["arithmetic"])
    assert {m.after for m in found} == {"n - 1", "n / 2"}
    for m in found:
        namespace = {}
        exec(m.code, namespace)
        assert isinstance(namespace["script"], str) and m.after in namespace["script"]
        assert m.line == 4 + (m.after == "n / 2")


def test_mutants_are_distinct_programs_and_keys_survive_edits_elsewhere():
    cell = "a = x + y\nb = a * 2\n"
    found = ops.mutants(cell)
    assert len({m.code for m in found}) == len(found)
    assert all(ops._normal(m.code) != ops._normal(cell) for m in found)
    edited = ops.mutants("# a comment\nz = 0\n" + cell)
    keys = {m.key: m.change for m in edited}
    assert all(keys.get(m.key) == m.change for m in found)


def test_an_unknown_operator_is_refused():
    with pytest.raises(ValueError, match="unknown mutation operators"):
        ops.mutants("x = 1", ["no-such-thing"])


# --------------------------------------------------------------------------- evidence
def test_values_beyond_the_tolerance_are_behaviour_and_programs_are_method():
    base = {"fresh": [{"output": {"kind": "array", "value": np.ones(3, np.float32),
                                  "dtype": "float32"}}],
            "program": {"top": ["jit"]}, "name": "<function f at 0x7f00aa11bb22>"}
    noise = {**base, "fresh": [{"output": {**base["fresh"][0]["output"],
                                           "value": np.ones(3, np.float32) + 1e-7}}],
             "name": "<function f at 0x7f00cc33dd44>"}
    assert analysis.differences(base, noise) == ([], [])
    changed = {**base, "fresh": [{"output": {**base["fresh"][0]["output"],
                                             "value": np.ones(3, np.float32) * 1.01}}]}
    behaviour, method = analysis.differences(base, changed)
    assert len(behaviour) == 1 and behaviour[0].startswith("fresh/0/output/value") and not method
    unjitted = {**base, "program": {"top": ["mul"]}}
    assert analysis.differences(base, unjitted)[0] == []
    assert analysis.differences(base, unjitted)[1] == ["program/top/0: 'jit' -> 'mul'"]
    retyped = {**base, "fresh": [{"output": {**base["fresh"][0]["output"],
                                             "dtype": "bfloat16"}}]}
    assert analysis.differences(base, retyped)[0] == [
        "fresh/0/output/dtype: 'float32' -> 'bfloat16'"]


def test_what_two_runs_of_the_solution_disagree_on_is_left_out():
    first = {"seconds": 0.0123, "value": 1.0}
    second = {"seconds": 0.0456, "value": 1.0}
    volatile = analysis.volatile_paths(first, second)
    assert volatile == {("seconds",)}
    mutant = {"seconds": 0.9, "value": 2.0}
    assert analysis.differences(first, mutant, volatile)[0] == ["value: 1.0 -> 2.0"]


# --------------------------------------------------------------------------- mistakes students make
# (issue 45) each operator on a small cell; ``scope`` is the notebook's code before the cell
SCOPE = ('mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)\n'
         'mesh_auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)\n'
         'mesh_same = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)\n'
         'mesh_seq = jax.make_mesh((8,), ("seq",))\n'
         'rows = NamedSharding(mesh, P("data"))\ncolumns = NamedSharding(mesh, P(None, "model"))\n',)


def test_another_mesh_of_the_notebook_is_passed_where_one_is_used():
    cell = ('x = jax.device_put(a, NamedSharding(mesh, P("data")))\n'
            'f = jax.shard_map(g, mesh=mesh, in_specs=P("data"), out_specs=P())\n'
            'y = jax.device_put(b, rows)\n')
    found = {m.after for m in ops.mutants(cell, ["wrong-mesh"], SCOPE)}
    # a mesh with the axes used, not the one built by the same call, nor one without the axes
    assert found == {"NamedSharding(... mesh_auto ...)", "shard_map(... mesh=mesh_auto ...)",
                     "device_put(... columns ...)"}
    assert not ops.mutants(cell, ["wrong-mesh"])  # no other mesh in scope: nothing to pass
    # a replicated spec names no axis: any other mesh places the array without an error
    replicated = 'w = jax.device_put(c, NamedSharding(mesh, P()))\n'
    assert {m.after for m in ops.mutants(replicated, ["wrong-mesh"], SCOPE)} == {
        "NamedSharding(... mesh_auto ...)", "NamedSharding(... mesh_seq ...)"}


def test_one_mesh_axis_for_another_and_two_operands_specs_exchanged():
    assert changes('s = P("data", None)', "mesh-axis") == set()  # no mesh in scope: no axis
    found = {m.after for m in ops.mutants('s = P("data", None)\nt = P(("data", "model"))\n',
                                          ["mesh-axis"], SCOPE)}
    assert found == {'P("model", None)'}  # an axis the spec holds already is not put twice
    cell = 'f = jax.shard_map(g, mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=P())\n'
    assert {m.after for m in ops.mutants(cell, ["swap-specs"])} == {
        'in_specs=(P(), P("data"), P("data"))', 'in_specs=(P("data"), P("data"), P())'}


def test_keywords_are_dropped_or_flipped_where_the_call_does_not_need_them():
    cell = ('g = lax.all_gather(x, "i", tiled=True)\n'
            'y = jnp.einsum("ij,jk->ik", a, b, preferred_element_type=jnp.float32)\n'
            'f = jax.jit(h, static_argnums=(1,), donate_argnums=0)\n'
            's = lax.psum(x, axis_name="i")\nv = jax.vmap(k, axis_name="i")\n')
    found = changes(cell, "keyword")
    assert {("tiled=True", "(dropped)"), ("tiled=True", "tiled=False"),
            ("preferred_element_type=jnp.float32", "(dropped)"),
            ("static_argnums=(1,)", "(dropped)"), ("donate_argnums=0", "(dropped)"),
            ('axis_name="i"', "(dropped)")} == found
    (vmap,) = [m for m in ops.mutants(cell, ["keyword"]) if m.before == 'axis_name="i"']
    assert "jax.vmap(k)" in vmap.code and 'lax.psum(x, axis_name="i")' in vmap.code


def _ring(mutant):
    namespace = {}
    exec(mutant.code.replace("y = lax.ppermute(x, \"i\", ", "perm = (").replace(
        "lax.ppermute(", "("), namespace)
    return [tuple(p) for p in namespace["perm"]]


def test_a_ring_is_left_open_at_its_wrap_around_pair_or_one_pair_turned():
    literal = ops.mutants('y = lax.ppermute(x, "i", [(0, 1), (1, 2), (2, 3), (3, 0)])\n',
                          ["ring-fault"])
    assert [m.after for m in literal] == ["perm=[(0, 1), (1, 2), (2, 3)]",
                                          "perm=[(1, 0), (1, 2), (2, 3), (3, 0)]"]
    comprehension = ops.mutants(
        'n = 4\ny = lax.ppermute(x, "i", [(k, (k - 1) % n) for k in range(n)])\n', ["ring-fault"])
    assert [_ring(m) for m in comprehension] == [
        [(1, 0), (2, 1), (3, 2)], [(3, 0), (1, 0), (2, 1), (3, 2)]]
    chain = ops.mutants('to_next = [(s, s + 1) for s in range(3)]\n'
                        'y = lax.ppermute(x, "i", to_next)\n', ["ring-fault"])
    assert [m.after for m in chain] == ["perm=__mutant_turn_pair(to_next)"]  # no wrap to drop
    # Lab 4's shift: partial(lax.ppermute, ...), for this operator and the older ring one
    shift = 'shift = partial(lax.ppermute, axis_name="i", perm=[(k, (k + 1) % 4) for k in range(4)])\n'
    assert len(ops.mutants(shift, ["ring-fault"])) == 2 and len(ops.mutants(shift, ["ppermute"])) == 2


def _shard_mapped(cell, names, mesh):
    """Run ``cell`` (its functions ``shard_map``ped on ``mesh``): the values of ``names``, then
    its namespace."""
    from functools import partial

    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    namespace = {"jax": jax, "jnp": jnp, "lax": lax, "P": P, "partial": partial, "mesh": mesh,
                 "np": np}
    exec(cell, namespace)
    return [np.asarray(namespace[n]) for n in names] + [namespace]


def test_the_same_values_moved_another_way():
    import jax
    from jax.sharding import AxisType

    mesh = jax.make_mesh((4,), ("i",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    cell = ('@partial(jax.shard_map, mesh=mesh, in_specs=P(None, "i"), out_specs=P("i"))\n'
            'def rs(x):\n    return lax.psum_scatter(x, "i", scatter_dimension=0, tiled=True)\n\n'
            '@partial(jax.shard_map, mesh=mesh, in_specs=P("i"), out_specs=P("i"))\n'
            'def ring(x):\n    return lax.ppermute(x, "i", [(k, (k + 1) % 4) for k in range(3)])\n\n'
            '@partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("i")), out_specs=P())\n'
            'def update(w, xs):\n'
            '    def loss(w):\n        return lax.psum(jnp.sum(w * xs), "i")\n'
            '    value, grads = jax.value_and_grad(loss)(w)\n'
            '    return w - 0.1 * grads\n\n'
            'a = rs(np.arange(32.0).reshape(8, 4))\nb = ring(np.arange(8.0))\n'
            'c = update(np.ones(2, np.float32), np.arange(8.0).reshape(4, 2))\n')
    *expected, _ = _shard_mapped(cell, "abc", mesh)
    found = {m.after: m for m in ops.mutants(cell, ["communication"])}
    own = found['__mutant_own_block(lax.psum(x, "i"), "i", 0, True)']
    gathered = found['__mutant_gathered_permute(x, "i", [(k, (k + 1) % 4) for k in range(3)])']
    for mutant, name, used, instead in ((own, "rs", "psum", "reduce_scatter"),
                                        (gathered, "ring", "all_gather", "ppermute")):
        a, b, namespace = _shard_mapped(mutant.code, "ab", mesh)
        np.testing.assert_array_equal(a, expected[0])  # the same values ...
        np.testing.assert_array_equal(b, expected[1])
        x = np.arange(32.0).reshape(8, 4) if name == "rs" else np.arange(8.0)
        program = str(jax.make_jaxpr(namespace[name])(x))  # ... by another collective
        assert used in program and instead not in program, program
    twice = [m for m in found.values() if "pmean(_g, 'i')" in m.after]
    assert len(twice) == 1 and "psum(_g, 'i')" in " ".join(found)
    # the gradient, already summed over the devices, averaged again: the same value here
    np.testing.assert_allclose(_shard_mapped(twice[0].code, "c", mesh)[0], expected[2])
    assert str(jax.make_jaxpr(_shard_mapped(twice[0].code, "c", mesh)[1]["update"])(
        np.ones(2, np.float32), np.arange(8.0).reshape(4, 2))).count("psum") > \
        str(jax.make_jaxpr(_shard_mapped(cell, "c", mesh)[1]["update"])(
            np.ones(2, np.float32), np.arange(8.0).reshape(4, 2))).count("psum")


def test_a_cast_is_removed_or_inserted_where_precision_matters():
    cell = ('def f(a, b, xs, params, grads):\n'
            '    acc = jnp.zeros(4, dtype=jnp.float32)\n'
            '    for x in xs:\n        acc += x @ b\n'
            '    h, _ = lax.scan(body, a.astype(jnp.bfloat16), xs)\n'
            '    w = jax.nn.softmax(h)\n'
            '    new_params = jax.tree.map(lambda p, g: p - g, params, grads)\n'
            '    return new_params, w\n')
    found = changes(cell, "cast")
    assert {("a.astype(jnp.bfloat16)", "a"), ("dtype=jnp.float32", "(dropped)"),
            ("acc += x @ b", "acc = __mutant_cast(acc + (x @ b), 'bfloat16')"),
            ("jax.nn.softmax(h)", "jax.nn.softmax(__mutant_cast(h, 'bfloat16'))")} <= found
    afters = {after for _, after in found}
    # float32 too, where the cell computes in bfloat16 (a product meant in bfloat16)
    assert any("'float32'" in a for a in afters) and any("scan(body, __mutant_cast(" in a
                                                         for a in afters)
    assert any(a.startswith("new_params = __mutant_cast(") for a in afters)
    assert not any("'float32'" in a for _, a in changes("acc += x @ b\n", "cast"))
    assert changes("n += 1\n", "cast") == set()  # a counter has no precision to lose
    (cast,) = [m for m in ops.mutants("acc = 0.0\nacc += x\n", ["cast"])]
    namespace = {"x": np.float32(1 / 3)}
    exec(cast.code, namespace)
    assert str(namespace["acc"].dtype) == "bfloat16"
    update = 'def adam_update(p, g):\n    return p - g, g\n'
    assert changes(update, "cast") == {("return p - g, g",
                                        "return __mutant_cast((p - g, g), 'bfloat16')")}


def test_an_argument_left_out_of_an_api_call():
    cell = ('def restore_state(path, target):\n'
            '    return ocp.StandardCheckpointer().restore(path, target)\n\n'
            'x_local, y_local = data["x"][mine], data["y"][mine]\n'
            'x = jax.make_array_from_process_local_data(rows, x_local)\n'
            'z = jax.device_put(a, rows)\n'
            'def scaled(v, factor=2):\n    return v * factor\n\n'
            'u = scaled(a, 3)\nw = jnp.where(a > 0, a, 0.0)\nj = jax.jit(f)\n')
    found = changes(cell, "drop-arg")
    assert found == {
        ("ocp.StandardCheckpointer().restore(path, target)",
         "ocp.StandardCheckpointer().restore(path)"),
        ('data["x"][mine]', 'data["x"]'),  # the whole data where this process's share is asked
        ("jax.device_put(a, rows)", "jax.device_put(a)"),
        ("scaled(a, 3)", "scaled(a)")}  # where's and jit's defaults select another form


def test_old_mutants_keep_their_keys_where_a_new_operator_makes_the_same_program():
    cell = "y = jax.device_put(x, s)\nz = f(y.astype(jnp.float32))\n"
    everything = ops.mutants(cell)
    older = ops.mutants(cell, [o for o in ops.OPERATORS if o in ops.ESTABLISHED])
    assert {m.key for m in older} <= {m.key for m in everything}
    assert len({ops._normal(m.code) for m in everything}) == len(everything)


def test_every_operator_says_what_it_does_in_the_help():
    from click.testing import CliRunner

    from jaxlab.cli import main

    result = CliRunner().invoke(main, ["mutants", "--help"])
    assert result.exit_code == 0
    help_text = " ".join(result.output.split())
    for name, what in ops.describe().items():
        assert what and f"{name}: {' '.join(what.split()[:4])}" in help_text, name


def test_list_prints_the_mutants_without_grading_them(capsys):
    from jaxlab import mutants

    pairs = mutants.listing("lab4-shard-map", root=ROOT, questions=["q5_matmul_reducescatter"],
                            operators=["communication", "keyword"])
    out = capsys.readouterr().out.splitlines()
    assert len(pairs) == 3 and len(out) == 3 + 3
    assert out[-1] == "per operator: keyword 2, communication 1"
    assert any("__mutant_own_block(lax.psum(lhs_block @ rhs_block" in line for line in out)


# --------------------------------------------------------------------------- classes
class _Harness:
    """A stand-in for the corpus harness: each grade() takes the next of ``replies`` (a
    Verdict-like object, or an exception to raise)."""

    def __init__(self, replies):
        self.replies, self.timeouts = list(replies), []

    def grade(self, answer, *, only=None, evidence_seed=None, timeout=300):
        self.timeouts.append(timeout)
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


class _Runner:
    def __init__(self, replies, dies=()):
        self.harness, self.dies, self.restarts = _Harness(replies), list(dies), 0

    def alive(self):
        return not (self.dies and self.dies.pop(0))

    def restart(self):
        self.restarts += 1


class _Verdict:
    def __init__(self, full_marks, evidence=None, message="expected 3, found 4"):
        self.full_marks, self.evidence, self.message = full_marks, evidence, message

    def failure_messages(self):
        return [] if self.full_marks else [self.message]


def _classify(replies, decisions=None, dies=(), reference=None):
    runner = _Runner(replies, dies)
    mutant = ops.mutants("y = x + 1\n", ["arithmetic"])[0]
    outcome = analysis._classify(runner, "lab", "q1", mutant, 20, reference or {"v": 1.0},
                                 frozenset(), decisions or analysis.Decisions({}, {}))
    return outcome, runner


def test_a_mutant_stopped_by_its_limit_is_run_again_with_three_times_the_limit():
    from jaxlab import corpus

    timeout = corpus.KernelError("timed out after 20s running: ...")
    outcome, runner = _classify([timeout, timeout])
    assert outcome.status == "limit" and outcome.limit == 60
    assert runner.harness.timeouts == [20, 60]
    assert outcome.detail == "ran past its 20 s limit; run again, ran past its 60 s limit"
    # on a busy machine: it finishes with more time, and the check's message decides
    outcome, runner = _classify([timeout, _Verdict(False)])
    assert (outcome.status, outcome.detail) == ("killed", "expected 3, found 4")
    assert outcome.rerun == "first it ran past its 20 s limit; with 60 s it finished"
    # ... or it keeps full marks: a survivor like any other, probed with the longer limit
    outcome, runner = _classify([timeout, _Verdict(True), _Verdict(True, {"v": 1.0})])
    assert outcome.status == "undecided" and runner.harness.timeouts == [20, 60, 60]
    assert outcome.rerun
    # a kernel killed twice is a kill by a limit too (the kernel is started again each time)
    outcome, runner = _classify([corpus.KernelError("x"), corpus.KernelError("x")],
                                dies=[True, True])
    assert outcome.status == "limit" and runner.restarts == 2
    assert outcome.detail.startswith("killed the kernel (limit 20 s)")


def test_a_free_entry_frees_values_but_decides_no_mutant():
    decisions = analysis.Decisions({}, {"q1": [{"evidence": "logs", "text": "t", "why": "w"}]})
    reference = {"logs": "step 0", "v": 1.0, "program": {"top": ["psum"]}}
    # differs only in the free evidence: not a gap, and undecided until decided by key
    outcome, _ = _classify([_Verdict(True), _Verdict(True, {**reference, "logs": "step 1"})],
                           decisions, reference=reference)
    assert outcome.status == "undecided" and len(outcome.why) == 1
    assert outcome.why[0].startswith("it differs only in evidence the text leaves free (logs:")
    # its method differs too: that is said first
    other = {**reference, "logs": "step 1", "program": {"top": ["all_gather"]}}
    outcome, _ = _classify([_Verdict(True), _Verdict(True, other)], decisions,
                           reference=reference)
    assert outcome.status == "undecided" and outcome.why[0].startswith(
        "its method differs from the solution's (program/top/0: 'psum' -> 'all_gather')")
    # a value outside the free evidence is a gap; a decision by key makes it equivalent
    outcome, _ = _classify([_Verdict(True), _Verdict(True, {**reference, "v": 2.0})],
                           decisions, reference=reference)
    assert outcome.status == "gap"
    mutant = ops.mutants("y = x + 1\n", ["arithmetic"])[0]
    decisions.equivalent["q1", mutant.key] = {"key": mutant.key, "change": "", "text": "t",
                                              "why": "w"}
    outcome, _ = _classify([_Verdict(True), _Verdict(True, other)], decisions,
                           reference=reference)
    assert outcome.status == "equivalent"
    # with the same evidence: undecided, and said so
    outcome, _ = _classify([_Verdict(True), _Verdict(True, {"v": 1.0})])
    assert outcome.why == ("the same evidence as the solution on the seeded inputs: no check "
                           "and no probe tells it apart",)


def test_free_patterns_never_hide_a_method():
    reference = {"source": "a", "fresh": {"source": "x"}}
    other = {"source": "b", "fresh": {"source": "y"}}
    behaviour, method = analysis.differences(reference, other, free=[("*",), ("fresh", "*")])
    assert behaviour == [] and len(method) == 2


def test_the_report_counts_kills_by_a_limit_apart_and_says_why_each_survivor_is_undecided():
    from jaxlab.mutants import report

    mutant = ops.mutants("y = x + 1\n", ["arithmetic"])[0]
    outcomes = [analysis.Outcome("q1", mutant, "killed", 2.0, "expected 3"),
                analysis.Outcome("q1", mutant, "limit", 80.0, "ran past its 20 s limit; run "
                                 "again, ran past its 60 s limit", limit=60),
                analysis.Outcome("q1", mutant, "undecided", 3.0, "the same evidence",
                                 why=("the same evidence as the solution",),
                                 rerun="first it ran past its 20 s limit; with 60 s it finished")]
    result = analysis.Analysis("lab", outcomes, 100.0, 10.0, [])
    text = report.markdown(result, "jaxlab mutants lab")
    assert "| question | mutants | killed by a check | killed by a limit | equivalent | gaps | " \
           "undecided | score | time |" in text
    assert "| q1 | 3 | 1 | 1 | 0 | 0 | 1 | 66.7% | 1 min 25 s |" in text
    assert "| **all** | 3 | 1 | 1 | 0 | 0 | 1 | 66.7% | 1 min 40 s |" in text
    assert "## Killed by a limit (1)" in text and "run again, ran past its 60 s limit" in text
    assert "  - undecided: the same evidence as the solution\n" \
           "  - first it ran past its 20 s limit; with 60 s it finished" in text
    # the decisions to fill in follow the undecided, before the kills by a limit
    assert text.index("## Undecided") < text.index("```yaml") < text.index("## Killed by a limit")


def test_the_decisions_file_takes_equivalents_and_free_evidence_with_their_sentence(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text("q1:\n  equivalent:\n  - key: spec-0123abcd\n"
                    "    change: 'P(\"x\")  ->  P(\"x\", None)'\n"
                    "    text: 'split it along the rows'\n    why: a trailing None adds nothing\n"
                    "  free:\n  - evidence: timing_runs/*/calls\n"
                    "    text: 'average over several calls, at most 100'\n"
                    "    why: how many is the student's choice\n")
    decisions = analysis.load_decisions(path)
    assert decisions.equivalent[("q1", "spec-0123abcd")]["why"] == "a trailing None adds nothing"
    assert decisions.free_paths("q1") == [("timing_runs", "*", "calls")]
    first = {"timing_runs": [{"calls": 11, "seconds": 1.0}]}
    other = {"timing_runs": [{"calls": 12, "seconds": 1.0}]}
    assert analysis.differences(first, other, free=decisions.free_paths("q1")) == ([], [])
    assert analysis.differences(first, other)[0] == ["timing_runs/0/calls: 11 -> 12"]
    path.write_text("q1:\n  accepted:\n  - key: spec-0123abcd\n")
    with pytest.raises(ValueError, match="unknown sections"):
        analysis.load_decisions(path)
    path.write_text("q1:\n  equivalent:\n  - key: spec-0123abcd\n")
    with pytest.raises(ValueError, match="missing"):
        analysis.load_decisions(path)
    assert analysis.load_decisions(tmp_path / "absent.yaml").equivalent == {}


def test_independent_assignments_are_not_swapped_but_dependent_ones_are():
    cell = "a = x + 1\nb = y * 2\nc = a + b\n"
    swaps = {m.before for m in ops.mutants(cell, ["swap-statements"])}
    assert swaps == {"b = y * 2; c = a + b"}


def test_math_and_numpy_trade_places():
    assert changes("n = math.ceil(x / y)", "math-numpy") == {("math.ceil(x / y)",
                                                              "np.ceil(x / y)")}


def test_what_a_cell_only_prints_is_not_mutated():
    found = ops.mutants('t = f(x) * 2\nprint(f"{t * 1e3:.1f} ms", t / 2)\n')
    assert found and all(m.line == 1 for m in found)


# --------------------------------------------------------------------------- the tool, for real
@pytest.mark.slow
def test_one_question_analysed_with_the_shipped_checks_kills_or_decides_every_mutant(graded):
    """`jaxlab mutants` on Lab 6's q9, in the corpus's own kernel: every mutant is graded by
    the shipped checks, and the issue's known kinds are killed (a comparison made strict, a
    guard removed, a plain Python number turned into a NumPy one)."""
    from jaxlab import corpus

    lab, question = "lab6-memory", "q9_roofline"
    graded(corpus.load_answers(lab)[0])  # starts the lab's kernel (the corpus shares it)
    harness = graded.harnesses[lab]
    result = analysis.analyse(lab, questions=[question], harness=harness)
    assert len(result.outcomes) >= 30 and {o.question for o in result.outcomes} == {question}
    assert result.of("gap") == [] and result.of("undecided") == [], [
        (o.mutant.change, o.detail) for o in result.of("gap") + result.of("undecided")]
    killed = {o.mutant.change: o.detail for o in result.of("killed")}
    assert "raised ZeroDivisionError" in killed["slope <= 0  ->  slope < 0"]
    assert "expected None" in killed["if slope <= 0: return None  ->  (removed)"]
    assert "expected an int" in killed["math.ceil(peak * D * F / slope)  ->  "
                                       "np.ceil(peak * D * F / slope)"]
    # the kernel holds the solution again: the corpus goes on from there
    assert harness.run_tests([question])[question]["score"] == \
        harness.solution_results[question]["score"]
