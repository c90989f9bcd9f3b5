"""Parallel strategies beyond pmap: shard_map, dp (jit + NamedSharding) and fsdp.

Each must end where the single-device jit step ends after 10 steps (largest parameter
difference <= 1e-5), for SFT and DPO, with devices holding unequal token counts.
pmap's equivalence is tested in test_train.py and test_dpo_train.py.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tunix_nb import compare, data, model, parallel, train
from tunix_nb import dpo as dpo_method
from tunix_nb import sft as sft_method
from tunix_nb.tokenizer import ByteTokenizer

MESH_MODES = ("shard_map", "dp", "fsdp")
N = 8  # conftest.py simulates 8 CPU devices


def optimizer():
    return train.make_optimizer(train.OptimizerConfig(learning_rate=1e-2, warmup_steps=2, total_steps=20))


def on_device0(tree):
    device0 = jax.local_devices()[0]
    return all(x.sharding.device_set == {device0} for x in jax.tree.leaves(tree))


# ----------------------------------------------------------------------------- SFT


@pytest.fixture(scope="module")
def sft():
    """Rows sorted by completion length, the tiny model, and one step per strategy
    (shared, so each strategy compiles once for the whole module)."""
    examples = sorted(data.load_sft()[:256], key=lambda e: len(e["completion"]))
    rows = data.sft_arrays(examples, ByteTokenizer(), data.DEFAULT_SEQ_LEN)
    graphdef, params = model.split(model.make_model("tiny", seed=0))
    objective, opt = sft_method.objective(graphdef, compute_dtype=None), optimizer()
    steps = {mode: train.make_step(objective, opt, parallel_mode=mode, donate=mode != "jit")  # as the CLI
             for mode in ("jit", *MESH_MODES)}
    return {"rows": rows, "params": params, "opt": opt, "objective": objective, "steps": steps}


def global_batch(rows, step):
    """32 rows; device i's 4 rows come from the i-th eighth of the length-sorted examples."""
    return data.uneven_batch(rows, step, N)


def run_sft(sft, mode, step_fn=None, steps=10):
    params, opt = sft["params"], sft["opt"]
    return train.run(step_fn or sft["steps"][mode], params, opt.init(params),
                     lambda s: global_batch(sft["rows"], s), steps=steps, parallel_mode=mode, progress=False)


@pytest.fixture(scope="module")
def sft_jit(sft):
    return run_sft(sft, "jit")


def test_modes_are_listed():
    assert train.PARALLEL_MODES == ("jit", "pmap", "shard_map", "dp", "fsdp")


def test_devices_hold_different_token_counts(sft):
    counts = global_batch(sft["rows"], 0)["loss_mask"].reshape(N, 4, -1).sum(axis=(1, 2))
    assert counts.min() < counts.max()


@pytest.mark.parametrize("mode", MESH_MODES)
def test_sft_strategy_matches_single_device_after_10_steps(sft, sft_jit, mode):
    jit_params, _, jit_hist = sft_jit
    params, opt_state, hist = run_sft(sft, mode)
    assert compare.max_abs_diff(jit_params, params) <= 1e-5
    np.testing.assert_allclose([h["loss"] for h in hist], [h["loss"] for h in jit_hist], rtol=1e-5)
    np.testing.assert_allclose([h["grad_norm"] for h in hist], [h["grad_norm"] for h in jit_hist], rtol=1e-4)
    assert on_device0((params, opt_state))  # gathered back, whatever the strategy
    assert not any(x.is_deleted() for x in jax.tree.leaves(sft["params"]))  # donated copies only


@pytest.mark.needs_devices(8)
def test_dp_on_a_sub_mesh_with_donation_keeps_the_callers_arrays(sft, sft_jit):
    step = train.make_step(sft["objective"], sft["opt"], parallel_mode="dp", donate=True,
                           mesh=parallel.make_mesh(2))
    assert step.mesh.shape == {"data": 2}
    _, _, hist = run_sft(sft, "dp", step_fn=step, steps=3)
    np.testing.assert_allclose([h["loss"] for h in hist], [h["loss"] for h in sft_jit[2][:3]], rtol=1e-5)
    assert not any(x.is_deleted() for x in jax.tree.leaves(sft["params"]))


def test_a_checkpoint_saved_under_fsdp_resumes_under_shard_map(sft, sft_jit, tmp_path):
    """run() hands back the state whole on one device, so checkpoints do not depend on the strategy."""
    from tunix_nb import checkpoint

    params, opt_state, _ = run_sft(sft, "fsdp", steps=5)
    manager = checkpoint.make_manager(tmp_path / "run", async_save=False)
    checkpoint.save(manager, 5, params=params, opt_state=opt_state, meta={})
    like = sft["params"], sft["opt"].init(sft["params"])
    params, opt_state, meta = checkpoint.restore(manager, params_like=like[0], opt_state_like=like[1])
    manager.close()
    params, _, _ = train.run(sft["steps"]["shard_map"], params, opt_state, lambda s: global_batch(sft["rows"], s),
                             steps=5, start_step=meta["step"], parallel_mode="shard_map", progress=False)
    assert compare.max_abs_diff(sft_jit[0], params) <= 1e-5  # the same as 10 uninterrupted steps on one device


# ----------------------------------------------------------------------------- DPO


@pytest.fixture(scope="module")
def dpo():
    graphdef, params = model.split(model.make_model("tiny", seed=0))
    pairs = data.preference_arrays(data.load_preferences()[:64], ByteTokenizer(), data.DEFAULT_SEQ_LEN)
    pairs = dpo_method.reference_log_probs(graphdef, params, pairs, batch_size=64)
    objective, opt = dpo_method.objective(graphdef, compute_dtype=None), optimizer()

    def run(mode):
        step = train.make_step(objective, opt, parallel_mode=mode)
        return train.run(step, params, opt.init(params), lambda s: data.batch_at(pairs, s, 16, seed=0),
                         steps=10, parallel_mode=mode, progress=False)

    return run, run("jit")


@pytest.mark.parametrize("mode", MESH_MODES)
def test_dpo_strategy_matches_single_device_after_10_steps(dpo, mode):
    run, (jit_params, _, jit_hist) = dpo
    params, _, hist = run(mode)
    assert compare.max_abs_diff(jit_params, params) <= 1e-5
    for key in ("loss", "rewards/margin"):
        np.testing.assert_allclose([h[key] for h in hist], [h[key] for h in jit_hist], rtol=1e-4, atol=1e-6)
    assert jit_hist[-1]["rewards/margin"] > 0


# ----------------------------------------------------------------------------- FSDP


@pytest.mark.parametrize("shape, spec", [
    ((259, 32), P(None, "data")),  # the vocabulary axis does not divide by 8
    ((64, 32), P("data")),         # the largest dividing axis
    ((16, 16), P("data")),         # ties: the first
    ((32,), P("data")),
    ((7,), P()),                   # nothing divides: replicated
    ((4, 4), P()),                 # smaller than the mesh: replicated
    ((), P()),                     # scalars (Adam's step count)
])
def test_fsdp_rule_splits_the_largest_dimension_that_divides(shape, spec):
    assert parallel.fsdp_spec(shape, N) == spec


@pytest.mark.needs_devices(8)
def test_fsdp_really_shards_params_and_optimizer_state_and_keeps_them_sharded(sft):
    params, opt = sft["params"], sft["opt"]
    step = sft["steps"]["fsdp"]
    p, o = parallel.place_state((params, opt.init(params)), step.mesh, "fsdp")
    embedding = p["embed"]["embedding"]
    assert embedding.shape == (259, 32)  # the global shape is unchanged
    assert embedding.sharding.spec == P(None, "data")
    assert {s.data.shape for s in embedding.addressable_shards} == {(259, 4)}
    assert len({s.device for s in embedding.addressable_shards}) == N
    p2, o2, metrics = step(p, o, parallel.place_batch(global_batch(sft["rows"], 0), step.mesh))
    same = jax.tree.map(lambda a, b: a.sharding == b.sharding, (p, o), (p2, o2))
    assert all(jax.tree.leaves(same))  # params and Adam moments stay split after the step
    mu = jax.tree.leaves(o2, is_leaf=lambda x: hasattr(x, "mu"))
    assert any(hasattr(s, "mu") and s.mu["embed"]["embedding"].sharding.spec == P(None, "data") for s in mu)
    assert metrics["loss"].sharding.is_fully_replicated


@pytest.mark.needs_devices(8)
def test_fsdp_holds_about_one_nth_per_device_of_what_dp_holds(sft):
    params, opt = sft["params"], sft["opt"]
    state = (params, opt.init(params))
    mesh = parallel.make_mesh()
    dp = parallel.bytes_per_device(parallel.place_state(state, mesh, "dp"))
    fsdp = parallel.bytes_per_device(parallel.place_state(state, mesh, "fsdp"))
    total = sum(x.nbytes for x in jax.tree.leaves(state))
    assert len(dp) == len(fsdp) == N and set(dp.values()) == {total}  # dp: a full copy each
    expected = sum(x.nbytes // N if parallel.fsdp_spec(x.shape, N) != P() else x.nbytes
                   for x in jax.tree.leaves(state))
    assert set(fsdp.values()) == {expected}
    assert expected < total / 6  # nearly everything in the tiny model divides by 8


# --------------------------------------------------------------------- errors, misc


@pytest.mark.needs_devices(8)
def test_batch_not_divisible_by_the_mesh_gets_the_shard_batch_error(sft):
    with pytest.raises(ValueError, match=r"batch of 12 rows does not divide by the 8 devices.*multiple of 8 \(e.g. 16\)"):
        parallel.place_batch({"x": np.zeros((12, 4))}, parallel.make_mesh())
    step = sft["steps"]["dp"]
    with pytest.raises(ValueError, match="batch of 12 rows does not divide by the 8 devices"):
        train.run(step, sft["params"], sft["opt"].init(sft["params"]),
                  lambda s: {k: v[:12] for k, v in sft["rows"].items()}, steps=1, parallel_mode="dp",
                  progress=False)


@pytest.mark.needs_devices(8)
def test_mismatched_settings_are_refused(sft):
    with pytest.raises(ValueError, match="built for parallel_mode='fsdp' but run\\(\\) was given 'dp'"):
        train.run(sft["steps"]["fsdp"], sft["params"], None, lambda s: {}, steps=1, parallel_mode="dp")
    with pytest.raises(ValueError, match="all_reduce=False needs per-device code"):
        train.make_step(sft["objective"], sft["opt"], parallel_mode="fsdp", all_reduce=False)
    with pytest.raises(ValueError, match="Asked for 9 devices but JAX has 8"):
        parallel.make_mesh(9)


def test_gather_brings_a_sharded_tree_back_whole_to_device_0():
    x = np.arange(64.0).reshape(8, 8)
    mesh = parallel.make_mesh()
    back = parallel.gather({"x": parallel.place_state({"x": x}, mesh, "fsdp")["x"]})
    assert on_device0(back)
    np.testing.assert_array_equal(back["x"], x)


# ------------------------------------------------------------------ RPO across devices


@pytest.fixture(scope="module")
def rpo():
    """DPO + the chosen answers' NLL (sft_weight > 0), a token mean over the global batch."""
    graphdef, params = model.split(model.make_model("tiny", seed=0))
    pairs = data.preference_arrays(data.load_preferences()[:64], ByteTokenizer(), data.DEFAULT_SEQ_LEN)
    pairs = dpo_method.reference_log_probs(graphdef, params, pairs, batch_size=64)
    objective, opt = dpo_method.objective(graphdef, sft_weight=1.0, compute_dtype=None), optimizer()

    def run(mode, steps=3):
        step = train.make_step(objective, opt, parallel_mode=mode)
        return train.run(step, params, opt.init(params), lambda s: data.batch_at(pairs, s, 16, seed=0),
                         steps=steps, parallel_mode=mode, progress=False)

    return pairs, run, run("jit")


def test_rpo_batches_put_different_chosen_token_counts_on_the_devices(rpo):
    pairs = rpo[0]
    for s in range(3):
        counts = data.batch_at(pairs, s, 16, seed=0)["chosen_loss_mask"].reshape(N, 2, -1).sum(axis=(1, 2))
        assert counts.min() < counts.max()


@pytest.mark.parametrize("mode", ["pmap", "shard_map", "dp"])
def test_rpo_term_is_the_global_token_mean_under_every_strategy(rpo, mode):
    _, run, (jit_params, _, jit_hist) = rpo
    params, _, hist = run(mode)
    assert compare.max_abs_diff(jit_params, params) <= 1e-5
    # the loss and its two terms, each divided by its global count, are exact
    for key in ("loss", "loss/dpo", "loss/sft"):
        np.testing.assert_allclose([h[key] for h in hist], [h[key] for h in jit_hist], rtol=1e-5)
