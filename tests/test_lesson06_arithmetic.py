"""Lesson 06's arithmetic and its worker script.

The bytes DP and FSDP send per step (`tunix_nb.comm_cost`), against closed-form values and
against the arrays the collectives of a compiled DP and FSDP step return; when a step's
compute hides its communication; and the lesson's two-process worker (the `%%writefile`
cell of notebooks/06_beyond_pmap.ipynb, started twice) against one process.
"""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb import comm_cost, devices, launch, model, parallel, sft, train

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "06_beyond_pmap.ipynb"
WORKER_CELL = "%%writefile runs/nb06/worker.py"

# ------------------------------------------------------------------ per-strategy bytes, closed form


@pytest.mark.parametrize("n, dp, fsdp_kept, fsdp_twice", [
    (1, 0, 0, 0),          # one device sends nothing
    (2, 4000, 4000, 6000),  # (n-1)/n = 1/2 of 4000 bytes per phase
    (4, 6000, 6000, 9000),
    (8, 7000, 7000, 10500),
])
def test_strategy_bytes_per_step_closed_form(n, dp, fsdp_kept, fsdp_twice):
    param_bytes = 4000  # 1000 float32 parameters
    assert comm_cost.dp_step_bytes(param_bytes, n) == {"all-reduce": dp}
    kept = comm_cost.fsdp_step_bytes(param_bytes, n, regather_in_backward=False)
    assert kept == {"all-gather": fsdp_kept / 2, "reduce-scatter": fsdp_kept / 2}
    twice = comm_cost.fsdp_step_bytes(param_bytes, n)
    assert twice == {"all-gather": fsdp_twice * 2 / 3, "reduce-scatter": fsdp_twice / 3}


def test_fsdp_with_kept_weights_sends_what_dp_sends_and_twice_gathered_half_as_much_again():
    for n in (2, 3, 8, 256):
        dp = sum(comm_cost.dp_step_bytes(1e6, n).values())
        assert sum(comm_cost.fsdp_step_bytes(1e6, n, regather_in_backward=False).values()) == pytest.approx(dp)
        assert sum(comm_cost.fsdp_step_bytes(1e6, n).values()) == pytest.approx(1.5 * dp)


def test_strategy_bytes_refuse_a_ring_of_no_devices():
    with pytest.raises(ValueError, match="at least 1"):
        comm_cost.dp_step_bytes(4000, 0)
    with pytest.raises(ValueError, match="at least 0"):
        comm_cost.fsdp_step_bytes(-1, 4)


# ------------------------------------------------------------------ time: compute against the links


def test_step_flops_and_the_tokens_that_hide_communication():
    assert comm_cost.train_step_flops(1e9, 1000) == 6e12
    assert comm_cost.tokens_to_hide_communication(6, 1.0, 1.0) == 1.0
    v5e = comm_cost.TPU_V5E
    assert (v5e["bf16_flops_per_s"], v5e["hbm_bytes_per_s"]) == (1.97e14, 8.1e11)
    assert v5e["ici_link_bidi_bytes_per_s"] == 2 * v5e["ici_link_one_way_bytes_per_s"] == 1e11
    # DP on a v5e-8 slice, float32 gradients: 7 bytes per parameter; the lesson prints 2,298 tokens
    dp = sum(comm_cost.dp_step_bytes(4, 8).values())
    tokens = comm_cost.tokens_to_hide_communication(dp, v5e["bf16_flops_per_s"], v5e["ici_link_bidi_bytes_per_s"])
    assert dp == 7.0 and round(tokens) == 2298
    # at that many tokens per chip, compute and all-reduce take the same time, whatever P is
    P = 6e8
    compute_s = comm_cost.train_step_flops(P, tokens) / v5e["bf16_flops_per_s"]
    assert compute_s == pytest.approx(dp * P / v5e["ici_link_bidi_bytes_per_s"])
    with pytest.raises(ValueError, match="positive"):
        comm_cost.tokens_to_hide_communication(7, 1.97e14, 0)


# ------------------------------------------------------------------ reading a compiled program


HLO = """
  %p = f32[4,32]{1,0} parameter(0)
  %all-reduce.14 = (f32[32,32]{1,0}, f32[], /*index=2*/bf16[259,32]{1,0}) all-reduce(%a, %b, %c), channel_id=1
  %all-gather.2 = f32[32,64]{0,1} all-gather(%p), channel_id=3, dimensions={1}
  %ags = (f32[4,32]{1,0}, f32[32,32]{1,0}) all-gather-start(%p), channel_id=4
  %rs = f32[8,32]{1,0} reduce-scatter(%q), channel_id=5, dimensions={0}
  %add = f32[32,32]{1,0} add(%x, %y)
"""


def test_hlo_collective_arrays_reads_results_tuples_and_async_starts():
    assert comm_cost.hlo_collective_arrays(HLO) == {
        "all-reduce": [("f32", (32, 32)), ("f32", ()), ("bf16", (259, 32))],
        "all-gather": [("f32", (32, 64)), ("f32", (32, 32))],  # of the -start, its result only
        "reduce-scatter": [("f32", (8, 32))],
    }
    assert comm_cost.hlo_collective_arrays("%x = f32[2]{0} add(%a, %b)") == {}


def test_array_bytes():
    assert comm_cost.array_bytes("f32", (32, 64)) == 8192
    assert comm_cost.array_bytes("bf16", (3, 4)) == 24
    assert comm_cost.array_bytes("f32", ()) == 4
    with pytest.raises(ValueError, match="Unknown HLO element type"):
        comm_cost.array_bytes("f33", (2,))


def _compiled_sft_step(mode):
    """The kit's SFT step on the `tiny` model, compiled for `mode` on all devices; its params, and the
    placed state and batch it was compiled for."""
    graphdef, params = model.split(model.make_model("tiny", seed=0))
    optimizer = train.make_optimizer(train.OptimizerConfig(learning_rate=1e-2, warmup_steps=2, total_steps=20))
    step = train.make_step(sft.objective(graphdef, compute_dtype=jnp.float32), optimizer, parallel_mode=mode)
    state = parallel.place_state((params, optimizer.init(params)), step.mesh, mode)
    rows = 2 * jax.device_count()
    tokens = np.random.default_rng(0).integers(1, 259, size=(rows, 16)).astype(np.int32)
    batch = parallel.place_batch({"inputs": tokens, "targets": np.roll(tokens, -1, axis=1),
                                  "attention_mask": np.ones_like(tokens), "loss_mask": np.ones_like(tokens)}, step.mesh)
    return step.jitted(*state).lower(*state, batch, None).compile(), params, state, batch


def _array_bytes(found, kind):
    return sum(comm_cost.array_bytes(*a) for a in found.get(kind, []) if a[1])  # scalars left out


@pytest.mark.needs_devices(8)
@pytest.mark.parametrize("mode", ["dp", "fsdp"])
def test_the_compiled_steps_move_the_predicted_arrays(mode):
    """DP all-reduces the gradients; FSDP all-gathers every parameter once (kept for the
    backward pass) and reduces the gradients (on CPU as an all-reduce, then a slice). Both
    also reduce the tied embedding's gradient a second time: one part from the lookup, one
    from the output head, each all-reduced before they are added."""
    n = jax.device_count()
    assert n == 8  # conftest simulates 8 devices
    compiled, params, _, _ = _compiled_sft_step(mode)
    found = comm_cost.hlo_collective_arrays(compiled.as_text())
    param_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
    embedding_bytes = 4 * params["embed"]["embedding"].size
    assert _array_bytes(found, "all-reduce") == param_bytes + embedding_bytes
    if mode == "dp":
        assert set(found) == {"all-reduce"}
        predicted = comm_cost.dp_step_bytes(param_bytes, n)["all-reduce"]
        assert comm_cost.all_reduce_bytes(_array_bytes(found, "all-reduce") - embedding_bytes, n) == predicted
    else:
        assert set(found) == {"all-reduce", "all-gather"}
        assert _array_bytes(found, "all-gather") == param_bytes
        kept = comm_cost.fsdp_step_bytes(param_bytes, n, regather_in_backward=False)
        assert comm_cost.all_gather_bytes(_array_bytes(found, "all-gather"), n) == kept["all-gather"]


# ------------------------------------------------------------------ XLA's argument bytes


@pytest.mark.needs_devices(8)
@pytest.mark.parametrize("mode", ["dp", "fsdp"])
def test_xla_counts_the_arguments_as_the_devices_store_them(mode):
    """The lesson's check: a compiled step's argument bytes per device are the state and this device's
    rows, as stored (`devices.bytes_on_device`). Counting every row on every device, or under FSDP the
    whole state, misses by exactly the bytes the other devices hold."""
    compiled, _, state, batch = _compiled_sft_step(mode)
    n = jax.device_count()
    arguments = compiled.memory_analysis().argument_size_in_bytes
    stored = devices.bytes_on_device((state, batch))
    assert len(stored) == n and set(stored.values()) == {arguments}
    batch_bytes = sum(x.nbytes for x in jax.tree.leaves(batch))
    every_row = max(devices.bytes_on_device(state).values()) + batch_bytes
    assert every_row - arguments == batch_bytes * (n - 1) // n > 0
    if mode == "fsdp":
        whole_state = sum(x.nbytes for x in jax.tree.leaves(state)) + batch_bytes // n
        assert whole_state - arguments > 6 * arguments  # 7/8 of the split arrays live elsewhere


def test_bytes_on_device_counts_what_a_device_allocated_not_nbytes():
    """On a TPU a [2, 24] int32 shard is stored in tiles and takes more than its 192 bytes: what
    the device reports for each shard is what counts (faked here: the tests have no TPU)."""
    class Device:
        def __init__(self, i):
            self.id = i

    class Data:
        nbytes = 192

        def on_device_size_in_bytes(self):
            return 1024  # [2, 24] int32 in (2, 128) tiles, as XLA lays it out for a TPU v5e

    class Shard:
        def __init__(self, i):
            self.device, self.data = Device(i), Data()

    class TiledArray:
        addressable_shards = [Shard(1), Shard(0)]

    held = devices.bytes_on_device({"inputs": TiledArray(), "targets": TiledArray()})
    assert [(d.id, b) for d, b in held.items()] == [(0, 2048), (1, 2048)]


# ------------------------------------------------------------------ the worker, started twice


def _worker_source() -> str:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    (source,) = [s for s in sources if s.startswith(WORKER_CELL)]
    return source.split("\n", 1)[1]


def test_the_lessons_worker_started_twice_matches_one_process(tmp_path):
    """The lesson's %%writefile worker as two processes of 4 CPU devices: each loads half
    of a 16-row batch, and both print the whole batch's mean, as one process computes it."""
    if not launch.can_listen_on_loopback("This test"):
        pytest.skip("no TCP socket on loopback for the coordinator (as the lesson skips its part)")
    script = tmp_path / "worker.py"
    script.write_text(_worker_source())
    coordinator = f"127.0.0.1:{launch.free_port()}"
    procs = [subprocess.Popen([sys.executable, str(script), coordinator, str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outputs = [p.communicate(timeout=120) for p in procs]  # a hang guard, not a speed requirement
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    one_process = np.arange(48.0).reshape(16, 3).mean(axis=0).tolist()
    for i, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, err[-2000:]
        (line,) = [l for l in out.splitlines() if l.startswith(f"process {i}:")]
        assert line.startswith(f"process {i}: 4 of 8 devices, batch (16, 3), mean "), line
        assert [float(x) for x in line.split("mean [")[1].rstrip("]").split(",")] == one_process
