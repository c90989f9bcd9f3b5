"""train.run reads a step's metrics only once the next step is queued (issue 45, item 4): on an
accelerator a `float()` per step idles the device while the host loads the next batch. The
records, their order, the eval metrics and the NaN check must be those of a step-by-step loop."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tunix_nb import train
from tunix_nb.train import loop

STEPS = 7


def objective(params, batch, frozen):
    """Least squares on 8 rows: (loss sum, weight, a scalar metric)."""
    err_B = batch["x"] @ params["w"] - batch["y"]
    return jnp.sum(err_B**2), jnp.float32(err_B.shape[0]), {"max_err": jnp.max(jnp.abs(err_B))}


def batch_at(step, nan_at=None):
    rng = np.random.default_rng(step)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    if step == nan_at:
        x[0, 0] = np.nan
    return {"x": x, "y": x @ np.arange(4, dtype=np.float32)}


@pytest.fixture(scope="module")
def setup():
    opt = optax.sgd(0.05)
    params = {"w": jnp.zeros(4)}
    return {mode: train.make_step(objective, opt, parallel_mode=mode) for mode in ("jit", "pmap")}, params, opt


class Counted:
    """A step that counts its calls, so a callback can tell how far the loop has queued."""

    def __init__(self, step):
        self.step, self.calls = step, 0

    def __call__(self, *args):
        self.calls += 1
        return self.step(*args)


def hand_loop(step, params, opt_state, mode, eval_every=0):
    """The loop as it was: each step's metrics turned into floats before the next step."""
    place = loop.Placement(step, mode)
    params, opt_state, _ = place.state(params, opt_state)
    history = []
    for k in range(STEPS):
        params, opt_state, metrics = step(params, opt_state, place.batch(batch_at(k)), None)
        if mode == "pmap":
            metrics = jax.tree.map(lambda x: x[0], metrics)
        record = {"step": k + 1, **{name: float(v) for name, v in metrics.items()}}
        if eval_every and (k + 1) % eval_every == 0:
            record["eval/w0"] = float(place.on_one_device(params)["w"][0])
        history.append(record)
    return history


@pytest.mark.parametrize("mode", ["jit", "pmap"])
def test_history_and_on_step_are_a_step_by_step_loops(setup, mode):
    steps, params, opt = setup
    seen = []
    _, _, history = train.run(steps[mode], params, opt.init(params), batch_at, steps=STEPS, parallel_mode=mode,
                              progress=False, on_step=lambda k, record: seen.append((k, record)),
                              eval_fn=lambda p: {"eval/w0": float(p["w"][0])}, eval_every=3)
    assert history == hand_loop(steps[mode], params, opt.init(params), mode, eval_every=3)
    assert [k for k, _ in seen] == list(range(1, STEPS + 1))
    assert [record for _, record in seen] == history


def test_a_steps_record_is_logged_once_the_next_step_is_queued(setup):
    """No wait on the device with nothing queued behind: on_step(k) comes after step k + 1
    was dispatched, except at an eval step (its params are evaluated now) and the last step."""
    steps, params, opt = setup
    step = Counted(steps["jit"])
    queued_at_log = {}
    train.run(step, params, opt.init(params), batch_at, steps=STEPS, progress=False, eval_every=4,
              eval_fn=lambda p: {}, on_step=lambda k, record: queued_at_log.setdefault(k, step.calls))
    assert queued_at_log == {k: k if k in (4, STEPS) else k + 1 for k in range(1, STEPS + 1)}


def test_a_non_finite_loss_stops_the_run_naming_its_step_before_its_eval(setup):
    steps, params, opt = setup
    seen, evaluated = [], []
    with pytest.raises(FloatingPointError, match="at step 3;"):
        train.run(steps["jit"], params, opt.init(params), lambda k: batch_at(k, nan_at=2), steps=STEPS,
                  progress=False, on_step=lambda k, record: seen.append(k), eval_every=3,
                  eval_fn=lambda p: evaluated.append(p) or {})
    assert seen == [1, 2] and evaluated == []
    with pytest.raises(FloatingPointError, match="at step 5;"):  # no eval: found while step 6 is queued
        train.run(steps["jit"], params, opt.init(params), lambda k: batch_at(k, nan_at=4), steps=STEPS,
                  progress=False)


def test_steps_finished_before_a_failing_batch_are_logged(setup):
    steps, params, opt = setup
    seen = []

    def failing_at_3(k):
        if k == 3:
            raise KeyError("no batch 3")
        return batch_at(k)

    with pytest.raises(KeyError):
        train.run(steps["jit"], params, opt.init(params), failing_at_3, steps=STEPS, progress=False,
                  on_step=lambda k, record: seen.append(k))
    assert seen == [1, 2, 3]


@pytest.fixture
def compiles():
    """A list that collects JAX's "Compiling ..." log lines (the persistent cache does not hide them)."""
    found = []
    handler = logging.Handler()
    handler.emit = lambda record: found.append(record.getMessage()) if record.getMessage().startswith(
        "Compiling") else None
    logger = logging.getLogger("jax._src.interpreters.pxla")
    logger.addHandler(handler)
    with jax.log_compiles(True):
        yield found
    logger.removeHandler(handler)


def test_placing_and_returning_the_state_compiles_no_op_per_leaf(compiles):
    """jnp.copy (jit) and eager indexing (pmap) compiled and dispatched one program per leaf
    shape: on a TPU each a slow round of its own."""
    tree = {f"w{i}": jnp.ones((3, 5 + i)) for i in range(6)}  # shapes no other test uses
    opt_state = {"mu": jax.tree.map(jnp.zeros_like, tree)}
    compiles.clear()
    placed, placed_opt, _ = loop.Placement(None, "jit").state(tree, opt_state)
    assert compiles == []
    assert all(a is not b and np.array_equal(a, b) for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(tree)))
    pmap = loop.Placement(None, "pmap")
    replicated, _, _ = pmap.state(tree, opt_state)
    compiles.clear()
    back = pmap.on_one_device(replicated)
    assert len(compiles) <= 1  # one program for the whole tree
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree)))


def test_more_steps_compile_nothing_more(setup, compiles):
    steps, params, opt = setup
    train.run(steps["jit"], params, opt.init(params), batch_at, steps=2, progress=False)  # warm
    counts = []
    for n in (2, 6):
        compiles.clear()
        train.run(steps["jit"], params, opt.init(params), batch_at, steps=n, progress=False)
        counts.append(len(compiles))
    assert counts == [0, 0]
