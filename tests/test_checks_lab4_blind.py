"""Lab 4's checks on what its blind corpus's first run found (tests/answers/lab4-shard-map/blind):
a convolution normalised by a psum of absolute values, a one-element partial sum, another of the
notebook's meshes, an untiled gather, and a loss averaged outside the shard_map."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxlab.checks import lab4
from test_checks_lab4 import (BATCH, MESH, ROWS, conv, dp_loss, fsdp_loss, make_update, mesh1d,
                              smap, trained, verdict_message)


def test_q1_examples_have_negative_convolutions_and_totals_clear_of_zero():
    rng = np.random.default_rng(0)
    w = rng.uniform(0.5, 2.0, size=(3,)).astype(np.float32)
    for length in lab4.CONV_LENGTHS:
        x = lab4._signed_examples(rng, 5, length, w)
        out = np.stack([lab4._convolve(row, w) for row in x])
        assert (out < 0).any()
        assert np.abs(out.sum(axis=0)).min() >= lab4.CONV_TOTAL_MARGIN


def test_q1_rejects_a_psum_of_absolute_values():
    def normalized_convolution(x, w):
        out = conv(x, w)
        return out / lax.psum(jnp.abs(out), "p")

    msg = verdict_message("q1_vmap_collective", normalized_convolution=normalized_convolution)
    assert msg.startswith("`normalized_convolution under jax.vmap")
    assert "has the wrong values" in msg


def test_q2_accepts_a_one_element_partial_sum():
    global_sum = smap(P("i"), P())(lambda x: lax.psum(jnp.sum(x, keepdims=True), "i")[0])
    assert verdict_message("q2_global_sum", global_sum=global_sum) is None


def test_q2_still_rejects_a_psum_of_whole_blocks():
    global_sum = smap(P("i"), P())(lambda x: jnp.sum(lax.psum(x, "i")))
    msg = verdict_message("q2_global_sum", global_sum=global_sum)
    assert msg.startswith("`global_sum` communicates 1 time(s) inside its shard_map (`psum")
    assert "one number per device" in msg


def test_q2_rejects_another_mesh():
    global_sum = smap(P("p"), P(), mesh=mesh1d("p"))(lambda x: lax.psum(jnp.sum(x), "p"))
    msg = verdict_message("q2_global_sum", global_sum=global_sum)
    assert msg == ("`global_sum` runs jax.shard_map on a mesh whose axis is 'p'; expected what "
                   "the task says: jax.shard_map on `mesh`, whose axis is 'i'.")


def test_q3_rejects_another_mesh():
    matmul_allgather = smap((P("x", None),) * 2, P("x", None), mesh=mesh1d("x"))(
        lambda lhs, rhs: lhs @ lax.all_gather(rhs, "x", tiled=True))
    msg = verdict_message("q3_matmul_allgather", matmul_allgather=matmul_allgather)
    assert msg.startswith("`matmul_allgather` runs jax.shard_map on a mesh whose axis is 'x'")
    assert verdict_message("q3_matmul_allgather", matmul_allgather=smap((ROWS, ROWS), ROWS)(
        lambda lhs, rhs: lhs @ lax.all_gather(rhs, "i", tiled=True))) is None


def test_q7_rejects_part_b_mesh():
    def loss_dp(params, batch):
        return jax.shard_map(lambda p, b: lax.pmean(lab4._loss(p, b), "i"), mesh=MESH,
                             in_specs=(P(), P("i")), out_specs=P())(params, batch)

    msg = verdict_message("q7_loss_dp", loss_dp=loss_dp)
    assert msg.startswith("`loss_dp` runs jax.shard_map on a mesh whose axis is 'i'; expected "
                          "what the task says: jax.shard_map on `mesh_batch`")
    assert verdict_message("q7_loss_dp", loss_dp=dp_loss(lax.pmean)) is None


def test_q8_rejects_an_untiled_gather_reshaped():
    def local(params, batch):
        x, targets = batch
        for W, b in params:
            W = lax.all_gather(W, "batch").reshape(-1, W.shape[1])
            b = lax.all_gather(b, "batch").reshape(-1)
            out = x @ W + b
            x = jax.nn.relu(out)
        return lax.pmean(jnp.mean(jnp.sum((out - targets) ** 2, axis=-1)), "batch")

    def loss_fsdp(params, batch):
        return jax.shard_map(local, mesh=BATCH, in_specs=P("batch"), out_specs=P())(params, batch)

    msg = verdict_message("q8_loss_fsdp", loss_fsdp=loss_fsdp)
    assert msg.startswith("`loss_fsdp` gathers with jax.lax.all_gather(..., tiled=False)")
    assert verdict_message("q8_loss_fsdp", loss_fsdp=fsdp_loss(up_front=False)) is None


def test_q9_rejects_mesh_batch():
    @partial(jax.shard_map, mesh=BATCH, in_specs=(P(None, "batch"), P("batch", None),
                                                  P("batch")), out_specs=P(None, "batch"))
    def gemm(x, W, b):
        return lax.psum_scatter(x @ W, "batch", scatter_dimension=1, tiled=True) + b

    def loss_tp(params, batch):
        x, targets = batch
        for W, b in params:
            out = gemm(x, W, b)
            x = jax.nn.relu(out)
        return jnp.mean(jnp.sum((out - targets) ** 2, axis=-1))

    msg = verdict_message("q9_loss_tp", loss_tp=loss_tp)
    assert msg.startswith("`loss_tp` runs jax.shard_map on a mesh whose axis is 'batch'; "
                          "expected what the task says: jax.shard_map on `mesh_feats`")


def loss_fn(params, xs, ys):
    return jnp.mean((params.weight * xs + params.bias - ys) ** 2)


def test_q10_rejects_the_devices_losses_averaged_outside():
    @partial(jax.shard_map, mesh=BATCH, in_specs=(P(), P("batch"), P("batch")),
             out_specs=(P(), P("batch")))
    def step(params, xs, ys):
        loss, grads = jax.value_and_grad(loss_fn)(params, xs, ys)
        grads = jax.tree.map(lambda g: g / lax.axis_size("batch"), grads)
        return jax.tree.map(lambda p, g: p - lab4.LEARNING_RATE * g, params, grads), loss[None]

    @jax.jit
    def update(params, xs, ys):
        new_params, losses = step(params, xs, ys)
        return new_params, jnp.mean(losses)

    msg = verdict_message("q10_dp_training", update=update, params_trained=trained())
    assert msg.startswith("`update` returns a loss that no jax.shard_map returns replicated: it "
                          "is computed outside jax.shard_map (by `div`)")


def test_q10_accepts_the_gradient_taken_outside_a_shard_mapped_loss():
    def dp_loss(params, xs, ys):
        return jax.shard_map(lambda p, x, y: lax.pmean(loss_fn(p, x, y), "batch"), mesh=BATCH,
                             in_specs=(P(), P("batch"), P("batch")), out_specs=P())(params, xs, ys)

    @jax.jit
    def update(params, xs, ys):
        loss, grads = jax.value_and_grad(dp_loss)(params, xs, ys)
        return jax.tree.map(lambda p, g: p - lab4.LEARNING_RATE * g, params, grads), loss

    assert verdict_message("q10_dp_training", update=update, params_trained=trained()) is None
    assert verdict_message("q10_dp_training", update=make_update(False),
                           params_trained=trained()) is None


def test_q10_rejects_another_mesh():
    @jax.jit
    @partial(jax.shard_map, mesh=MESH, in_specs=(P(), P("i"), P("i")), out_specs=(P(), P()))
    def update(params, xs, ys):
        loss, grads = jax.value_and_grad(lambda p: lax.pmean(loss_fn(p, xs, ys), "i"))(params)
        return jax.tree.map(lambda p, g: p - lab4.LEARNING_RATE * g, params, grads), loss

    msg = verdict_message("q10_dp_training", update=update, params_trained=trained())
    assert msg.startswith("`update` runs jax.shard_map on a mesh whose axis is 'i'; expected "
                          "what the task says: jax.shard_map on `mesh_dp`")
