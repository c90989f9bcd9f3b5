import jax
import numpy as np
import pytest

from tunix_nb import parallel


@pytest.mark.needs_devices(8)
def test_replicate_puts_one_copy_on_each_device_and_unreplicate_takes_it_back():
    tree = {"w": np.arange(6.0).reshape(2, 3), "b": np.float32(1.5)}
    rep = parallel.replicate(tree)
    assert rep["w"].shape == (8, 2, 3) and rep["b"].shape == (8,)
    assert {s.device for s in rep["w"].addressable_shards} == set(jax.local_devices())
    for shard in rep["w"].addressable_shards:
        np.testing.assert_array_equal(shard.data[0], tree["w"])
    back = parallel.unreplicate(rep)
    np.testing.assert_array_equal(back["w"], tree["w"])
    assert float(back["b"]) == 1.5


@pytest.mark.needs_devices(8)
def test_shard_batch_splits_rows_in_order():
    batch = {"x": np.arange(16 * 3).reshape(16, 3)}
    sharded = parallel.shard_batch(batch)
    assert sharded["x"].shape == (8, 2, 3)
    for i, shard in enumerate(sorted(sharded["x"].addressable_shards, key=lambda s: s.index[0].start)):
        np.testing.assert_array_equal(shard.data[0], batch["x"][2 * i: 2 * i + 2])


@pytest.mark.needs_devices(8)
def test_shard_batch_on_fewer_devices():
    assert parallel.shard_batch({"x": np.zeros((6, 2))}, n_devices=2)["x"].shape == (2, 3, 2)


@pytest.mark.needs_devices(8)
def test_batch_not_divisible_by_devices_names_both_numbers_and_the_fix():
    with pytest.raises(ValueError, match=r"batch of 12 rows does not divide by the 8 devices.*multiple of 8 \(e.g. 16\)"):
        parallel.shard_batch({"x": np.zeros((12, 4))})


@pytest.mark.needs_devices(8)
def test_more_devices_than_exist_is_a_clear_error():
    with pytest.raises(ValueError, match="Asked for 9 devices but JAX has 8"):
        parallel.replicate({"x": np.zeros(2)}, n_devices=9)


def test_pmap_of_psum_on_replicated_and_sharded_inputs():
    total = jax.pmap(lambda w, x: jax.lax.psum((w * x).sum(), "devices"), axis_name="devices")(
        parallel.replicate(np.float32(2.0)), parallel.shard_batch(np.ones((16, 2), np.float32)))
    np.testing.assert_allclose(np.asarray(total), 2.0 * 32)
