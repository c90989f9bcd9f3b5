"""Lesson 05's mechanisms built by hand: raw Orbax restores into sharded abstract arrays.

The lesson saves FSDP-sharded state with Orbax's own `StandardSave` and restores it with
`StandardRestore` into `jax.ShapeDtypeStruct`s that carry shardings: onto the mesh it
was saved on (checked against `checkpoint.restore(mesh=, parallel_mode="fsdp")`), and
onto a mesh of half as many devices (8 -> 4 with the suite's 8 simulated devices).
"""

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import Mesh

from tunix_nb import checkpoint, model, parallel, train

STEP = 7


def _bit_identical(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(la, lb))


def _fsdp_mesh(n_devices: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n_devices]), ("fsdp",))


def _sharded_like(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _restore_by_hand(manager, state, shardings):
    """The lesson's restore: StandardRestore of each item into abstract arrays with shardings."""
    params_like, opt_state_like = _sharded_like(state, shardings)
    restored = manager.restore(STEP, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(params_like), opt_state=ocp.args.StandardRestore(opt_state_like)))
    return restored["params"], restored["opt_state"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(manager, state, params_like, opt, save_shardings): state sharded FSDP-style over 8 devices, saved raw."""
    assert jax.device_count() == 8, "the suite runs on 8 simulated devices (conftest.py)"
    _, params_like = model.split(model.make_model("tiny", seed=0))
    opt = train.make_optimizer(train.OptimizerConfig(warmup_steps=2, total_steps=10))
    # one update with the params as stand-in gradients: moments and counts that are not zero
    _, opt_state = opt.update(params_like, opt.init(params_like), params_like)
    state = (nnx.to_pure_dict(params_like), opt_state)
    save_shardings = parallel.fsdp_shardings(state, _fsdp_mesh(8), axis="fsdp")
    state_fsdp = jax.device_put(state, save_shardings)
    manager = ocp.CheckpointManager(tmp_path_factory.mktemp("fsdp").absolute(), options=ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False, create=True))
    manager.save(STEP, args=ocp.args.Composite(params=ocp.args.StandardSave(state_fsdp[0]),
                                               opt_state=ocp.args.StandardSave(state_fsdp[1]),
                                               meta=ocp.args.JsonSave({"step": STEP})))
    return manager, state, params_like, opt, save_shardings


def _kit_restore(manager, params_like, opt, n_devices):
    params, opt_state, meta = checkpoint.restore(manager, params_like=params_like, opt_state_like=opt.init(params_like),
                                                 mesh=parallel.make_mesh(n_devices), parallel_mode="fsdp")
    assert meta["step"] == STEP
    return nnx.to_pure_dict(params), opt_state


def _same_layout(a, b) -> bool:
    return all(x.sharding.is_equivalent_to(y.sharding, x.ndim) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.needs_devices(8)
def test_the_saved_state_is_really_split_over_8_devices(saved):
    _, state, _, _, save_shardings = saved
    emb = jax.device_put(state[0]["embed"]["embedding"], save_shardings[0]["embed"]["embedding"])
    assert len(emb.sharding.device_set) == 8
    assert {s.data.shape for s in emb.addressable_shards} == {(259, 4)}
    assert float(np.abs(np.asarray(state[1][1][0].mu["embed"]["embedding"])).max()) > 0  # moments are not zeros


@pytest.mark.needs_devices(8)
def test_raw_standard_restore_into_sharded_structs_equals_the_kits_restore(saved):
    manager, state, params_like, opt, save_shardings = saved
    mine = _restore_by_hand(manager, state, save_shardings)
    assert _bit_identical(mine, state)
    assert all(x.sharding == s for x, s in zip(jax.tree.leaves(mine), jax.tree.leaves(save_shardings)))
    kit = _kit_restore(manager, params_like, opt, 8)
    assert _bit_identical(mine, kit)
    assert _same_layout(mine, kit)


@pytest.mark.needs_devices(8)
def test_fsdp_checkpoint_of_8_devices_restores_onto_4_bitwise(saved):
    manager, state, params_like, opt, save_shardings = saved
    mesh4 = _fsdp_mesh(4)
    target = parallel.fsdp_shardings(state, mesh4, axis="fsdp")
    resharded = _restore_by_hand(manager, state, target)
    assert _bit_identical(resharded, state)
    four = set(jax.devices()[:4])
    for x, s in zip(jax.tree.leaves(resharded), jax.tree.leaves(target)):
        assert x.sharding == s and x.sharding.device_set == four
    emb = resharded[0]["embed"]["embedding"]
    assert {sh.data.shape for sh in emb.addressable_shards} == {(259, 8)}  # twice the slice each device saved
    # the chunks on disk are the 8-device layout's shards: each of the 4 devices read two
    saved_emb = manager.item_metadata(STEP)["params"]["embed"]["embedding"]
    assert tuple(saved_emb.storage.chunk_shape) == (259, 4)
    kit = _kit_restore(manager, params_like, opt, 4)
    assert _bit_identical(resharded, kit) and _same_layout(resharded, kit)
    assert not _same_layout(resharded, _restore_by_hand(manager, state, save_shardings))  # the layout did change
