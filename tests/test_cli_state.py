"""The training command's state on the devices: its step compiles once for the whole run, and
the training state lives once (params, optimizer state, frozen base and reference, each once),
through the save boundary. The command runs in this process; the arrays alive before it
started, and compiles before it, are not its own and are left out."""

import logging
from pathlib import Path

import jax
import pytest

from tunix_nb import cli, train
from tunix_nb.train import loop

QWEN3 = str(Path(__file__).parent / "fixtures" / "hf" / "qwen3")


def device_bytes(arrays) -> int:
    """Each device buffer once: an array and a view of its shard (Orbax's) share one buffer, and
    a replicated array counts once a device."""
    buffers = {(shard.device.id, shard.data.unsafe_buffer_pointer()): shard.data.nbytes
               for x in arrays if isinstance(x, jax.Array) and not x.is_deleted()
               for shard in x.addressable_shards}
    return sum(buffers.values())


class CompileLog(logging.Handler):
    """The names of the programs JAX compiles while attached (JAX's compile log)."""

    def __init__(self):
        super().__init__()
        self.compiled = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Compiling "):
            self.compiled.append(message.split()[1])


def measured_run(monkeypatch, argv) -> dict:
    """cli.main(argv) with its compiles, the state's bytes as `train.run` receives it, and the
    bytes of the live device arrays the run made, at every logged step."""
    before = jax.live_arrays()  # held until the end, so no id of theirs is reused by the run's
    before_ids = {id(x) for x in before}
    state_bytes, live_bytes = [], []
    run, log = train.run, loop.StepLog.log

    def run_measuring_the_state(step_fn, params, opt_state, batch_fn, *, frozen=None, **kw):
        state_bytes.append(device_bytes(jax.tree.leaves((params, opt_state, frozen))))
        return run(step_fn, params, opt_state, batch_fn, frozen=frozen, **kw)

    def log_measuring_the_live_arrays(self, record):
        live_bytes.append(device_bytes([x for x in jax.live_arrays() if id(x) not in before_ids]))
        log(self, record)

    monkeypatch.setattr(train, "run", run_measuring_the_state)
    monkeypatch.setattr(loop.StepLog, "log", log_measuring_the_live_arrays)
    compiles = CompileLog()
    logging.getLogger("jax").addHandler(compiles)
    try:
        with jax.log_compiles(True):
            code = cli.main(argv)
    finally:
        logging.getLogger("jax").removeHandler(compiles)
    del before
    return {"code": code, "compiled": compiles.compiled, "state": state_bytes, "live": live_bytes}


# One device, one tree per block; and sharded over the tests' eight simulated devices with the
# blocks stacked (--scan-layers), so that each placement and each layout is run once
@pytest.mark.parametrize("parallel", [["--parallel", "jit"], ["--parallel", "fsdp", "--devices", "8", "--scan-layers"]],
                         ids=["jit", "fsdp-stacked"])
def test_the_step_compiles_once_and_the_state_lives_once(tmp_path, monkeypatch, parallel):
    """A save every step (written before the next, --sync-save): the boundary where the loop used
    to copy the state again. Saved in the background, Orbax's host copy of the state is, on the
    CPU backend, a view of the device buffers (numpy shares a CPU array's memory), so it would
    count here as device bytes; on an accelerator it is host memory."""
    if "--devices" in parallel and (jax.default_backend(), jax.device_count()) != ("cpu", 8):
        pytest.skip("the sharded run is the CPU suite's, on its eight simulated devices")
    result = measured_run(monkeypatch, ["sft", "--model", QWEN3, "--batch-size", "8", "--steps", "4", *parallel,
                                        "--save-every", "1", "--sync-save", "--ckpt-dir", str(tmp_path / "ckpt")])
    assert result["code"] == 0
    assert result["compiled"].count("jit(step)") == 1, result["compiled"]
    state = result["state"][0]
    assert len(set(result["state"])) == 1 and len(result["live"]) == 4
    assert max(result["live"]) <= 1.1 * state, (result["live"], state)
