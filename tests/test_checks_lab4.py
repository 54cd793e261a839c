"""The Lab 4 verdicts accept correct answers and explain wrong ones in the student's terms."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxlab.checks import lab4


def mesh1d(name):
    return jax.make_mesh((8,), (name,), axis_types=(AxisType.Auto,), devices=jax.devices()[:8])


MESH = mesh1d("i")
ROWS, COLS = P("i", None), P(None, "i")


def verdict_message(question, **values):
    try:
        lab4.check(question, **values)
    except AssertionError as exc:
        return str(exc)
    return None


def smap(in_specs, out_specs, mesh=MESH, **kwargs):
    return lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                           **kwargs))


# --------------------------------------------------------------------------- part A
def conv(x, w):
    return jnp.array([jnp.dot(x[i - 1:i + 2], w) for i in range(1, len(x) - 1)])


def test_q1_accepts_psum_over_p():
    def normalized_convolution(x, w):
        out = conv(x, w)
        return out / lax.psum(out, "p")

    assert verdict_message("q1_vmap_collective", normalized_convolution=normalized_convolution) is None


def test_q1_rejects_normalising_each_example_alone():
    def normalized_convolution(x, w):
        out = conv(x, w)
        return out / jnp.sum(out)

    msg = verdict_message("q1_vmap_collective", normalized_convolution=normalized_convolution)
    assert msg.startswith("`normalized_convolution under jax.vmap")
    assert "has the wrong values" in msg


# --------------------------------------------------------------------------- part B
def test_q2_accepts_psum_of_block_sums():
    global_sum = smap(P("i"), P())(lambda x: lax.psum(jnp.sum(x), "i"))
    assert verdict_message("q2_global_sum", global_sum=global_sum) is None


def test_q2_rejects_one_partial_sum_per_device():
    global_sum = smap(P("i"), P("i"))(lambda x: jnp.sum(x, keepdims=True))
    msg = verdict_message("q2_global_sum", global_sum=global_sum)
    assert msg.startswith("`global_sum(x) for x of length 96` returned 8 numbers, one per device")


def test_q2_rejects_all_gather():
    global_sum = smap(P("i"), P(), check_vma=False)(
        lambda x: jnp.sum(lax.all_gather(x, "i", tiled=True)))
    msg = verdict_message("q2_global_sum", global_sum=global_sum)
    assert msg.startswith("`global_sum` uses `all_gather`")


@smap((ROWS, ROWS), ROWS)
def matmul_allgather(lhs, rhs):
    return lhs @ lax.all_gather(rhs, "i", tiled=True)


@smap((ROWS, ROWS), ROWS)
def ring(lhs, rhs):
    size, idx = lax.axis_size("i"), lax.axis_index("i")
    B = lhs.shape[1] // size
    out = lax.dynamic_slice_in_dim(lhs, idx * B, B, 1) @ rhs
    for step in range(1, size):
        rhs = lax.ppermute(rhs, "i", [(k, (k + 1) % size) for k in range(size)])
        out += lax.dynamic_slice_in_dim(lhs, ((idx - step) % size) * B, B, 1) @ rhs
    return out


def test_q3_and_q4_accept_gather_and_ring():
    assert verdict_message("q3_matmul_allgather", matmul_allgather=matmul_allgather) is None
    assert verdict_message("q4_matmul_ring", matmul_allgather_overlapped=ring) is None


def test_q4_rejects_all_gather_in_the_ring_question():
    msg = verdict_message("q4_matmul_ring", matmul_allgather_overlapped=matmul_allgather)
    assert msg.startswith("`matmul_allgather_overlapped` uses `all_gather`, which this task "
                          "rules out: blocks of rhs must travel around a ppermute ring")

    @smap((ROWS, ROWS), ROWS)
    def both(lhs, rhs):
        rhs = lax.ppermute(rhs, "i", [(k, k) for k in range(8)])
        return lhs @ lax.all_gather(rhs, "i", tiled=True)

    msg = verdict_message("q4_matmul_ring", matmul_allgather_overlapped=both)
    assert msg.startswith("`matmul_allgather_overlapped` uses `all_gather`")


def test_q3_rejects_a_replicated_result_naming_out_specs():
    @smap((ROWS, ROWS), P(), check_vma=False)
    def replicated(lhs, rhs):
        return lax.all_gather(lhs, "i", tiled=True) @ lax.all_gather(rhs, "i", tiled=True)

    msg = verdict_message("q3_matmul_allgather", matmul_allgather=replicated)
    assert msg.startswith("`matmul_allgather(lhs, rhs)` returned an array replicated")
    assert "check `out_specs`" in msg


def test_q5_accepts_psum_scatter_and_rejects_psum():
    good = smap((COLS, ROWS), ROWS)(lambda l, r: lax.psum_scatter(l @ r, "i", tiled=True))
    assert verdict_message("q5_matmul_reducescatter", matmul_psumscatter=good) is None

    @smap((COLS, ROWS), ROWS)
    def via_psum(l, r):
        full = lax.psum(l @ r, "i")
        n = full.shape[0] // 8
        return lax.dynamic_slice_in_dim(full, lax.axis_index("i") * n, n, 0)

    msg = verdict_message("q5_matmul_reducescatter", matmul_psumscatter=via_psum)
    assert "has no `jax.lax.psum_scatter`" in msg


def test_q6_accepts_a_ring_of_partial_sums_and_rejects_psum_scatter():
    @smap((COLS, ROWS), ROWS)
    def ring_rs(lhs, rhs):
        size, idx = lax.axis_size("i"), lax.axis_index("i")
        blocks = lhs.reshape(size, -1, lhs.shape[1])
        out = blocks[(idx + 1) % size] @ rhs
        for step in range(1, size):
            out = lax.ppermute(out, "i", [(k, (k - 1) % size) for k in range(size)])
            out += blocks[(idx + step + 1) % size] @ rhs
        return out

    assert verdict_message("q6_matmul_ring_reducescatter",
                           matmul_psumscatter_overlapped=ring_rs) is None
    scatter = smap((COLS, ROWS), ROWS)(lambda l, r: lax.psum_scatter(l @ r, "i", tiled=True))
    msg = verdict_message("q6_matmul_ring_reducescatter", matmul_psumscatter_overlapped=scatter)
    assert msg.startswith("`matmul_psumscatter_overlapped` uses `psum_scatter`, which this task")


# --------------------------------------------------------------------------- part C
BATCH = mesh1d("batch")


def dp_loss(reduce):
    def loss_dp(params, batch):
        f = jax.shard_map(lambda p, b: reduce(lab4._loss(p, b), "batch"), mesh=BATCH,
                          in_specs=(P(), P("batch")), out_specs=P())
        return f(params, batch)
    return loss_dp


def test_q7_accepts_pmean_of_local_losses():
    assert verdict_message("q7_loss_dp", loss_dp=dp_loss(lax.pmean)) is None


def test_q7_rejects_psum_of_mean_losses_explaining_the_factor():
    msg = verdict_message("q7_loss_dp", loss_dp=dp_loss(lax.psum))
    assert msg.startswith("`loss_dp(params, batch)` is")
    assert "8 times the loss" in msg and "pmean" in msg


def test_q7_rejects_a_loss_without_shard_map():
    msg = verdict_message("q7_loss_dp", loss_dp=lab4._loss)
    assert msg.startswith("`loss_dp` gives the right numbers but does not go through jax.shard_map")


@pytest.mark.slow  # hundreds of fresh cases: ~25 s
def test_fresh_mlp_inputs_keep_every_relu_input_clear_of_float32_noise():
    for i in range(10):
        seed = lab4._kink_free_seed(np.random.default_rng(i))
        params, (inputs, _) = lab4._fresh_init(seed)
        assert lab4._kink_margin(params, inputs) >= lab4.KINK_MARGIN
        h = np.asarray(inputs, np.float64)
        h32 = inputs
        for W, b in params[:-1]:
            z = h @ np.asarray(W, np.float64) + np.asarray(b, np.float64)
            z32 = jax.jit(lambda h, W, b: jnp.dot(h, W) + b)(h32, W, b)
            noise = np.max(np.abs(np.asarray(z32, np.float64) - z)) / z.std()
            assert noise < lab4.KINK_MARGIN / 10, f"seed {seed}: float32 noise {noise:.3g}"
            h, h32 = np.maximum(z, 0.0), jax.nn.relu(z32)


def test_q8_requires_all_gather_of_the_weights():
    msg = verdict_message("q8_loss_fsdp", loss_fsdp=dp_loss(lax.pmean))
    assert msg.startswith("`loss_fsdp` gives the right numbers but its traced program has no "
                          "`jax.lax.all_gather`")


def test_q9_accepts_the_tensor_parallel_loss():
    feats = mesh1d("feats")

    @partial(jax.shard_map, mesh=feats, in_specs=(P(None, "feats"), P("feats", None),
                                                  P("feats")), out_specs=P(None, "feats"))
    def gemm(x, W, b):
        return lax.psum_scatter(x @ W, "feats", scatter_dimension=1, tiled=True) + b

    def loss_tp(params, batch):
        x, targets = batch
        for W, b in params:
            out = gemm(x, W, b)
            x = jax.nn.relu(out)
        return jnp.mean(jnp.sum((out - targets) ** 2, axis=-1))

    assert verdict_message("q9_loss_tp", loss_tp=loss_tp) is None


# --------------------------------------------------------------------------- part D
def make_update(pmean_grads):
    def loss_fn(params, xs, ys):
        return jnp.mean((params.weight * xs + params.bias - ys) ** 2)

    @jax.jit
    @partial(jax.shard_map, mesh=BATCH, in_specs=(P(), P("batch"), P("batch")),
             out_specs=(P(), P()))
    def update(params, xs, ys):
        if pmean_grads:  # the pmap recipe, copied unchanged
            loss, grads = jax.value_and_grad(loss_fn)(params, xs, ys)
            grads = lax.pmean(grads, "batch")
            loss = lax.pmean(loss, "batch")
        else:
            loss, grads = jax.value_and_grad(
                lambda p: lax.pmean(loss_fn(p, xs, ys), "batch"))(params)
        return jax.tree.map(lambda p, g: p - lab4.LEARNING_RATE * g, params, grads), loss
    return update


def trained(replicated=True):
    w, b = lab4._trained_reference()
    params = lab4.Params(jnp.float32(w), jnp.float32(b))
    return jax.device_put(params, NamedSharding(BATCH, P())) if replicated else params


def test_q10_accepts_the_grad_of_pmean():
    assert verdict_message("q10_dp_training", update=make_update(False),
                           params_trained=trained()) is None


def test_q10_rejects_the_8x_gradient_of_pmean_grads_and_explains_it():
    msg = verdict_message("q10_dp_training", update=make_update(True), params_trained=trained())
    assert msg.startswith("`update(params, xs, ys)` takes a step 8 times too large")
    assert "already sums the per-device gradients" in msg


def test_q10_rejects_untrained_params():
    xs, ys, w, b = lab4._regression_data()
    msg = verdict_message("q10_dp_training", update=make_update(False),
                          params_trained=lab4.Params(jnp.float32(w), jnp.float32(b)))
    assert msg.startswith("`params_trained.weight` has the wrong values")


def test_q10_rejects_a_copy_of_the_single_device_result():
    msg = verdict_message("q10_dp_training", update=make_update(False),
                          params_trained=trained(replicated=False))
    assert msg.startswith("`params_trained.weight` lives on a single device")
    assert "output of the sharded run" in msg


def test_q10_requires_jit():
    msg = verdict_message("q10_dp_training", update=make_update(False).__wrapped__,
                          params_trained=trained())
    assert msg.startswith("`update` is not wrapped in jax.jit")


# --------------------------------------------------------------------------- requirements
def test_q7_rejects_a_replicated_batch():
    def loss_dp(params, batch):
        f = jax.shard_map(lambda p, b: lax.pmean(lab4._loss(p, b), "batch"), mesh=BATCH,
                          in_specs=(P(), P()), out_specs=P())
        return f(params, batch)

    msg = verdict_message("q7_loss_dp", loss_dp=loss_dp)
    assert msg.startswith("`loss_dp` hands the inputs of the batch (shape (64, 784)) to "
                          "jax.shard_map replicated on every device (in_specs P())")


def fsdp_loss(up_front):
    def local(params, batch):
        gather = partial(lax.all_gather, axis_name="batch", tiled=True)
        if up_front:
            return lax.pmean(lab4._loss(jax.tree.map(gather, params), batch), "batch")
        x, targets = batch
        for W, b in params:
            out = x @ gather(W) + gather(b)
            x = jax.nn.relu(out)
        return lax.pmean(jnp.mean(jnp.sum((out - targets) ** 2, axis=-1)), "batch")

    return lambda params, batch: jax.shard_map(local, mesh=BATCH, in_specs=P("batch"),
                                               out_specs=P())(params, batch)


def test_q8_accepts_gathering_each_layer_just_before_use():
    assert verdict_message("q8_loss_fsdp", loss_fsdp=fsdp_loss(up_front=False)) is None


def test_q8_rejects_gathering_all_parameters_up_front():
    msg = verdict_message("q8_loss_fsdp", loss_fsdp=fsdp_loss(up_front=True))
    assert msg.startswith("`loss_fsdp` has gathered 12 arrays with all_gather before its matrix "
                          "product number 1")


def test_q3_rejects_a_shard_map_without_jit():
    @partial(jax.shard_map, mesh=MESH, in_specs=(ROWS, ROWS), out_specs=ROWS)
    def matmul_allgather(lhs, rhs):
        return lhs @ lax.all_gather(rhs, "i", tiled=True)

    msg = verdict_message("q3_matmul_allgather", matmul_allgather=matmul_allgather)
    assert msg.startswith("`matmul_allgather` is not wrapped in jax.jit: traced as you wrote "
                          "it, its program runs `shard_map` at the top level")
    assert verdict_message("q3_matmul_allgather",
                           matmul_allgather=jax.jit(matmul_allgather)) is None


def test_every_contract_question_is_registered_with_its_names():
    """The graded names (the contract) first, then the notebook's own names its public check
    reads (lab4.NOTEBOOK)."""
    extra = {q: tuple(lab4.NOTEBOOK[q.split("_")[0]].split()) for q in lab4.QUESTIONS}
    assert {q: spec.names[len(spec.names) - len(extra[q]):]
            for q, spec in lab4.QUESTIONS.items()} == extra
    assert {q: spec.names[:len(spec.names) - len(extra[q])]
            for q, spec in lab4.QUESTIONS.items()} == {
        "q1_vmap_collective": ("normalized_convolution",),
        "q2_global_sum": ("global_sum",),
        "q3_matmul_allgather": ("matmul_allgather",),
        "q4_matmul_ring": ("matmul_allgather_overlapped",),
        "q5_matmul_reducescatter": ("matmul_psumscatter",),
        "q6_matmul_ring_reducescatter": ("matmul_psumscatter_overlapped",),
        "q7_loss_dp": ("loss_dp",),
        "q8_loss_fsdp": ("loss_fsdp",),
        "q9_loss_tp": ("loss_tp",),
        "q10_dp_training": ("update", "params_trained"),
    }


@pytest.mark.parametrize("question", sorted(lab4.QUESTIONS))
def test_blank_answers_are_not_defined_yet(question):
    values = dict.fromkeys(lab4.QUESTIONS[question].names, ...)
    assert "is not defined yet" in verdict_message(question, **values)
