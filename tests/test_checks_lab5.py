"""The Lab 5 verdicts accept correct answers and explain wrong ones in the student's terms.

Small answers written here go through the lab's real probe and verdict (``lab5.check``); a few
verdicts are fed hand-built evidence directly."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxlab.checks import form, lab5

DEVICES = jax.devices()[:8]
MESH_2D = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                        devices=DEVICES)
MESH_STAGE = jax.make_mesh((8,), ("stage",), axis_types=(AxisType.Auto,), devices=DEVICES)
MESH_EXPERT = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,), devices=DEVICES)
MEGATRON = (P(None, "model"), P("model"), P("model", None), P())


def verdict_message(question, **values):
    try:
        lab5.check(question, **values)
    except AssertionError as exc:
        return str(exc)
    return None


# --------------------------------------------------------------------------- program reading
def test_program_counts_scan_steps_and_records_axes_and_types():
    def f(x):
        def body(c, _):
            return lax.ppermute(c, "i", [(k, (k + 1) % 8) for k in range(8)]), None
        return lax.psum(lax.scan(body, x, None, length=5)[0], "i")

    mesh = jax.make_mesh((8,), ("i",), axis_types=(AxisType.Auto,), devices=DEVICES)
    fn = jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P())
    program = lab5._program(jax.make_jaxpr(fn)(np.ones(16, np.float32)))
    moves = lab5._communication(program)
    assert [(m["prim"], m["times"], m["axes"]) for m in moves] == [
        ("ppermute", 5, ["i"]), ("psum_invariant", 1, ["i"])]
    assert program["shard_maps"][0]["in"] == [[[16], ["i"]]]


def test_type_dims_reads_sharded_types():
    assert lab5._type_dims("f32[48@data,64@model]") == [(48, ("data",)), (64, ("model",))]
    assert lab5._type_dims("f32[48@data,8]") == [(48, ("data",)), (8, ())]


# --------------------------------------------------------------------------- part A
def place(value, spec, mesh=MESH_2D):
    return jax.device_put(value, NamedSharding(mesh, spec))


def lab_q1_values(out_spec=P("data", None), mesh=MESH_2D):
    (W1, b1, W2, b2), (x, _) = lab5._lab_mlp()
    params = tuple(place(p, s, mesh) for p, s in zip((W1, b1, W2, b2), MEGATRON))
    x_2d = place(x, P("data", None), mesh)

    @jax.jit
    def forward_2d(params, x):
        W1, b1, W2, b2 = params
        h = jnp.tanh(x @ W1 + b1)
        return jnp.dot(h, W2, out_sharding=NamedSharding(mesh, out_spec)) + b2

    return dict(mesh_2d=mesh, x_2d=x_2d, params_2d=params, forward_2d=forward_2d,
                out_2d=forward_2d(params, x_2d))


def test_q1_accepts_the_megatron_layout():
    assert verdict_message("q1_mesh_2d", **lab_q1_values()) is None


def test_q1_rejects_an_output_left_split_over_model():
    msg = verdict_message("q1_mesh_2d", **lab_q1_values(out_spec=P("data", "model")))
    assert msg.startswith("`out_2d` has type float32[32@data,8@model]; expected float32[32@data,8]")


def test_q1_rejects_auto_axes_from_the_mesh_evidence():
    auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                         devices=DEVICES)
    with pytest.raises(AssertionError, match="expected both Explicit"):
        lab5._check_mesh_2d(lab5._mesh_evidence(auto))
    with pytest.raises(AssertionError, match="expected a jax Mesh"):
        lab5._check_mesh_2d(form.evidence((4, 2)))


def loss_2d_with(data_collective):
    def loss_2d(params, batch):
        @partial(jax.shard_map, mesh=MESH_2D, in_specs=(MEGATRON, P("data")), out_specs=P())
        def local(params, batch):
            W1, b1, W2, b2 = params
            x, y = batch
            pred = lax.psum(jnp.tanh(x @ W1 + b1) @ W2, "model") + b2
            return data_collective(jnp.mean(jnp.sum((pred - y) ** 2, axis=-1)), "data")
        return local(params, batch)
    return loss_2d


def test_q2_accepts_psum_over_model_and_mean_over_data():
    assert verdict_message("q2_dp_tp_shard_map", loss_2d=loss_2d_with(lax.pmean),
                           mesh_2d=MESH_2D) is None


def test_q2_rejects_a_sum_over_data():
    msg = verdict_message("q2_dp_tp_shard_map", loss_2d=loss_2d_with(lax.psum), mesh_2d=MESH_2D)
    assert msg.startswith("`loss_2d(params, batch) on new data (48 examples)` is")
    assert "4 times the loss" in msg


# --------------------------------------------------------------------------- part B
def test_q3_accepts_stacked_layers_and_names_reversed_ones():
    W, b = lab5._lab_layers()
    put = partial(place, spec=P("stage"), mesh=MESH_STAGE)
    assert verdict_message("q3_stage_params", mesh_stage=MESH_STAGE,
                           stage_params=(put(W), put(b))) is None
    msg = verdict_message("q3_stage_params", mesh_stage=MESH_STAGE,
                          stage_params=(put(W[::-1]), put(b[::-1])))
    assert "in reverse order" in msg


def test_q3_names_a_mesh_whose_devices_are_out_of_order():
    """'device k holds layers 2k and 2k + 1': a mesh of the devices last to first puts layers 0
    and 1 on device 7."""
    W, b = lab5._lab_layers()
    mesh = jax.make_mesh((8,), ("stage",), axis_types=(AxisType.Auto,), devices=DEVICES[::-1])
    put = partial(place, spec=P("stage"), mesh=mesh)
    msg = verdict_message("q3_stage_params", mesh_stage=mesh, stage_params=(put(W), put(b)))
    assert msg.startswith("`mesh_stage` holds the devices [7, 6, 5, 4, 3, 2, 1, 0] in that order")


def gpipe(shift_every_microbatch=False):
    @jax.jit
    @partial(jax.shard_map, mesh=MESH_STAGE, in_specs=(P("stage"), P()), out_specs=P())
    def pipeline_forward(local_params, microbatches):
        n, stage, M = lax.axis_size("stage"), lax.axis_index("stage"), microbatches.shape[0]

        def apply(h):
            for W, b in zip(*local_params):
                h = jnp.tanh(h @ W + b)
            return h

        if shift_every_microbatch:  # each microbatch crosses all stages alone
            results = []
            for m in range(M):
                h = microbatches[m]
                for s in range(n):
                    h = jnp.where(stage == s, apply(h), h)
                    if s < n - 1:
                        h = lax.ppermute(h, "stage", [(i, i + 1) for i in range(n - 1)])
                results.append(jnp.where(stage == n - 1, h, 0.0))
            return lax.psum(jnp.stack(results), "stage")
        received, outputs = jnp.zeros_like(microbatches[0]), jnp.zeros_like(microbatches)
        for t in range(M + n - 1):
            out = apply(jnp.where(stage == 0, microbatches[min(t, M - 1)], received))
            if t >= n - 1:
                outputs = outputs.at[t - (n - 1)].set(out)
            received = lax.ppermute(out, "stage", [(s, s + 1) for s in range(n - 1)])
        return lax.psum(jnp.where(stage == n - 1, outputs, 0.0), "stage")
    return pipeline_forward


def test_q4_accepts_gpipe_and_counts_the_steps_of_a_schedule_without_overlap():
    assert verdict_message("q4_pipeline_forward", pipeline_forward=gpipe(),
                           mesh_stage=MESH_STAGE) is None
    msg = verdict_message("q4_pipeline_forward", pipeline_forward=gpipe(True),
                          mesh_stage=MESH_STAGE)
    assert "ppermute over 'stage' 42 time(s) for 6 microbatches" in msg
    assert "M + L - 1 = 13 steps" in msg


def test_q5_rejects_a_loss_that_averages_every_entry():
    forward = gpipe()
    assert verdict_message("q5_pipeline_grad", mesh_stage=MESH_STAGE, pipeline_loss=lambda p, x, y:
                           jnp.mean(jnp.sum((forward(p, x) - y) ** 2, -1))) is None
    msg = verdict_message("q5_pipeline_grad", mesh_stage=MESH_STAGE,
                          pipeline_loss=lambda p, x, y: jnp.mean((forward(p, x) - y) ** 2))
    assert "0.0417 times the loss" in msg


def bubble_evidence(bubble, needed):
    return {"bubble_fraction": {"kind": "callable", "name": "bubble_fraction", "type": "function"},
            "microbatches_needed": {"kind": "callable", "name": "microbatches_needed",
                                    "type": "function"},
            "fresh": {"bubble": [[L, M, form.evidence(bubble(L, M))] for L, M in
                                 ((8, 8), (8, 1), (4, 100), (1, 3))],
                      "needed": [[L, b, form.evidence(needed(L, b))] for L, b in
                                 ((8, 0.12), (4, 0.9), (16, 0.33))]}}  # no ties, as in the probe


def right_bubble(L, M):
    return (L - 1) / (M + L - 1)


def right_needed(L, b):
    M = 1
    while right_bubble(L, M) >= b:
        M += 1
    return M


def test_q6_verdict_on_hand_built_evidence():
    lab5.verdict("q6_bubble", bubble_evidence(right_bubble, right_needed))
    with pytest.raises(AssertionError, match="idle time over the busy time"):
        lab5.verdict("q6_bubble", bubble_evidence(lambda L, M: (L - 1) / M, right_needed))
    one_short = bubble_evidence(right_bubble, lambda L, b: right_needed(L, b) - 1)
    with pytest.raises(AssertionError,
                       match=r"`microbatches_needed\(8, 0.12\)` is 51; expected 52"):
        lab5.verdict("q6_bubble", one_short)
    with pytest.raises(AssertionError, match="expected an int"):
        lab5.verdict("q6_bubble", bubble_evidence(right_bubble,
                                                  lambda L, b: float(right_needed(L, b))))


def test_needed_cases_say_rightly_which_bounds_are_ties():
    for case in lab5.NEEDED_CASES:
        tie = case.stages > 1 and any(right_bubble(case.stages, M) == case.max_bubble
                                      for M in range(1, 10_000))
        assert case.tie == tie, case
    assert lab5.NeededCase(8, 0.1).tie and lab5.NeededCase(8, 0.28).tie
    assert not lab5.NeededCase(8, 0.12).tie and not lab5.NeededCase(1, 0.5).tie


def test_needed_is_the_first_count_strictly_below_the_bound_ties_and_draws_alike():
    rng = np.random.default_rng(0)
    bounds = [(L, right_bubble(L, M)) for L in range(2, 40) for M in range(1, 60, 7)]
    bounds += [(c.stages, c.max_bubble) for c in lab5._needed_draws(rng)]
    bounds += [(1, 0.3), (1, 0.99), (64, 0.01)]
    for L, b in bounds:
        assert lab5._needed(L, b) == right_needed(L, b), (L, b)
    assert lab5._needed(8, 0.1) == 64 and lab5._needed(8, 0.28) == 19


def test_q6_names_ties_one_stage_and_the_type_of_a_jax_array():
    def at_most(L, b):
        M = 1
        while right_bubble(L, M) > b:
            M += 1
        return M

    ev = lab5.probe("q6_bubble", {"bubble_fraction": right_bubble, "microbatches_needed": at_most})
    with pytest.raises(AssertionError, match=r"`microbatches_needed\(8, 0.1\)` is 63; expected "
                                             r"64.*bubble_fraction\(8, 63\) is exactly 0.1"):
        lab5.verdict("q6_bubble", ev)
    ev = lab5.probe("q6_bubble", {"bubble_fraction": right_bubble,
                                  "microbatches_needed": lambda L, b: right_needed(L, b) - (L == 1)})
    with pytest.raises(AssertionError, match=r"`microbatches_needed\(1, 0.5\)` is 0; expected 1"):
        lab5.verdict("q6_bubble", ev)
    ev = lab5.probe("q6_bubble", {"bubble_fraction": lambda L, M: jnp.float32(L - 1) / (M + L - 1),
                                  "microbatches_needed": right_needed})
    with pytest.raises(AssertionError, match=r"returned a jax.Array of shape \(\) and dtype "
                                             r"float32 .*not a plain Python number"):
        lab5.verdict("q6_bubble", ev)


def test_q6_names_a_wrong_value_before_its_type():
    """Issue 44: a type message only where the value is right; a float32 array of the wrong
    formula is told about the formula."""
    ev = lab5.probe("q6_bubble", {"bubble_fraction": lambda L, M: jnp.float32(L - 1) / M,
                                  "microbatches_needed": right_needed})
    with pytest.raises(AssertionError, match="idle time over the busy time") as info:
        lab5.verdict("q6_bubble", ev)
    assert "plain Python number" not in str(info.value)
    ev = lab5.probe("q6_bubble", {"bubble_fraction": right_bubble,
                                  "microbatches_needed": lambda L, b: float(right_needed(L, b) + 1)})
    with pytest.raises(AssertionError, match=r"is \d+; expected \d+, the smallest number"):
        lab5.verdict("q6_bubble", ev)


def test_q6_stops_a_loop_that_never_ends_and_says_so(monkeypatch):
    """A count that never moves used to hang the probe until the grader's time limit (8 mutants
    killed only by a limit); the call is now stopped and the rest not made."""
    monkeypatch.setattr(lab5, "CALL_SECONDS", 1)

    def never(L, b):
        M = 1
        while right_bubble(L, M) >= b:
            M += 0
        return M

    ev = lab5.probe("q6_bubble", {"bubble_fraction": right_bubble, "microbatches_needed": never})
    assert len(ev["fresh"]["needed"]) == 1  # the first call stopped, the rest never made
    with pytest.raises(AssertionError, match=r"`microbatches_needed\(8, 0.1\)` did not return "
                                             r"within 1 s: a loop that never ends"):
        lab5.verdict("q6_bubble", ev)


# --------------------------------------------------------------------------- part C
def route(tokens, router_weights, capacity, first_slot=0):
    probs = jax.nn.softmax(tokens @ router_weights, axis=-1)
    expert = jnp.argmax(probs, axis=-1)
    chosen = jax.nn.one_hot(expert, router_weights.shape[-1], dtype=jnp.int32)
    slot = jnp.sum((jnp.cumsum(chosen, axis=0) - 1 + first_slot) * chosen, axis=-1)
    gate = jnp.take_along_axis(probs, expert[:, None], axis=-1)[:, 0]
    return expert, jnp.where(slot < capacity, gate, 0.0), slot


def test_q7_accepts_cumsum_routing_and_names_slots_from_one():
    assert verdict_message("q7_router", route=route) is None
    msg = verdict_message("q7_router", route=partial(route, first_slot=1))
    assert "they start at 1" in msg


def test_route_draws_show_what_each_case_is_for():
    rng = np.random.default_rng(1)
    for case in lab5.ROUTE_CASES:
        tokens, router = lab5._route_draw(rng, case)
        assert tokens.shape == (case.T, case.D) and router.shape == (case.D, case.E)
        expert, gate, slot = lab5._route(tokens, router, case.capacity)
        if case.capacity < case.T:
            assert np.any(gate == 0) and np.any(slot >= case.capacity)
        if case.T >= 2:
            assert np.sum(expert == case.E - 1) >= 2
    assert max(c.E for c in lab5.ROUTE_CASES) > lab5.N_EXPERTS


def test_q7_names_a_route_written_for_eight_experts():
    def eight(tokens, router_weights, capacity):
        probs = jax.nn.softmax(tokens @ router_weights, axis=-1)
        expert = jnp.argmax(probs, axis=-1)
        chosen = jax.nn.one_hot(expert, 8, dtype=jnp.int32)
        slot = jnp.sum((jnp.cumsum(chosen, axis=0) - 1) * chosen, axis=-1)
        gate = jnp.take_along_axis(probs, expert[:, None], axis=-1)[:, 0]
        return expert, jnp.where(slot < capacity, gate, 0.0), slot

    msg = verdict_message("q7_router", route=eight)
    assert "11 experts" in msg and "count over all E = 11 experts" in msg


def moe(experts_spec=P("expert")):
    @jax.jit
    @partial(jax.shard_map, mesh=MESH_EXPERT,
             in_specs=(P("expert"), P(), experts_spec, experts_spec), out_specs=P("expert"))
    def moe_layer(tokens, router_weights, W_in, W_out):
        E, C = router_weights.shape[-1], lab5.EXPERT_CAPACITY
        expert, gate, slot = route(tokens, router_weights, C)
        if experts_spec == P():  # every expert local: no communication
            hidden = jax.nn.relu(jnp.einsum("td,tdh->th", tokens, W_in[expert]))
            return gate[:, None] * jnp.einsum("th,thd->td", hidden, W_out[expert])
        dispatch = jax.nn.one_hot(expert, E)[:, :, None] * jax.nn.one_hot(slot, C)[:, None, :]
        received = lax.all_to_all(jnp.einsum("tec,td->ecd", dispatch, tokens), "expert", 0, 0,
                                  tiled=True)
        processed = jax.nn.relu(received @ W_in[0]) @ W_out[0]
        returned = lax.all_to_all(processed, "expert", 0, 0, tiled=True)
        return jnp.einsum("tec,ecd->td", dispatch * gate[:, None, None], returned)
    return moe_layer


def test_q8_accepts_two_all_to_all_and_rejects_replicated_experts():
    assert verdict_message("q8_moe_all_to_all", moe_layer=moe()) is None
    msg = verdict_message("q8_moe_all_to_all", moe_layer=moe(P()))
    assert msg.startswith("`moe_layer` hands W_in (shape (8, 16, 32)) to jax.shard_map with "
                          "in_specs P()")


def test_q8_says_what_a_layer_that_raises_on_new_sizes_raised():
    """The check once lost the student's exception ("could not be checked (KeyError:
    'output')"): it read the list of fresh records as one record."""
    @jax.jit
    @partial(jax.shard_map, mesh=MESH_EXPERT, in_specs=(P("expert"), P(), P("expert"),
                                                        P("expert")), out_specs=P("expert"))
    def moe_layer(tokens, router_weights, W_in, W_out):
        return tokens.reshape(8, 16) @ W_in[0] @ W_out[0]

    msg = verdict_message("q8_moe_all_to_all", moe_layer=moe_layer)
    assert msg.startswith("`moe_layer(tokens, router_weights, W_in, W_out) for 12 new tokens per "
                          "device` on new data raised TypeError: ")
    assert "KeyError" not in msg


def test_moe_reference_drops_tokens_per_device():
    rng = np.random.default_rng(0)
    tokens = rng.normal(size=(8 * 12, 16))
    router = rng.normal(size=(16, 8))
    gates = lab5._moe_reference_gates(tokens, router)
    # each device's 12 tokens: at most EXPERT_CAPACITY kept per expert
    for group, g in zip(np.split(tokens, 8), np.split(gates, 8)):
        expert = (group @ router).argmax(-1)
        kept = np.bincount(expert[g > 0], minlength=8)
        assert kept.max() <= lab5.EXPERT_CAPACITY
        assert (kept == np.minimum(np.bincount(expert, minlength=8), lab5.EXPERT_CAPACITY)).all()


# --------------------------------------------------------------------------- the notebook's tools
def notebook_collectives():
    """The notebook's `collectives` helpers (the cell that defines print_collectives)."""
    import math
    import re
    from collections import Counter

    import nbformat

    from labs import release_paths

    cells = nbformat.read(release_paths("lab5-scaling")["master"], as_version=4).cells
    source = next(c.source for c in cells if "def print_collectives" in c.source)
    scope = {"np": np, "jax": jax, "math": math, "re": re, "Counter": Counter}
    exec(source, scope)
    return scope


@pytest.mark.parametrize("attributes, groups", [
    ("replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true",
     [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("replica_groups=[2,4]<=[4,2]T(1,0), use_global_device_ids=true",
     [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, use_global_device_ids=true",
     [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}, "
     "dimensions={0}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("replica_groups={}, to_apply=%add", [list(range(8))]),
    ("source_target_pairs={{0,1},{1,2}}, metadata={}", [[0, 1], [1, 2]]),
])
def test_the_notebook_reads_each_way_xla_writes_device_groups(attributes, groups):
    assert notebook_collectives()["_device_groups"](attributes, 8) == groups


def test_the_notebook_names_the_mesh_axes_a_collective_runs_over():
    over = notebook_collectives()["_over"]
    assert over("all-reduce", [[0, 1], [2, 3], [4, 5], [6, 7]], MESH_2D) == "'model'"
    assert over("all-reduce", [[0, 2, 4, 6], [1, 3, 5, 7]], MESH_2D) == "'data'"
    assert over("all-reduce", [list(range(8))], MESH_2D) == "'data' and 'model'"
    assert over("collective-permute", [[k, k + 1] for k in range(7)], MESH_STAGE) == \
        "'stage', each device to the one 1 after it"
    assert over("collective-permute", [[k + 1, k] for k in range(7)], MESH_STAGE) == \
        "'stage', each device to the one 1 before it"
