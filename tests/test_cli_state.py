"""The training command's state on the devices: its step compiles once for the whole run, and
the training state lives once (params, optimizer state, frozen base and reference, each once),
through the save boundary. Each run is a fresh process, so that `jax.live_arrays()` and the
compile log hold this run's alone."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

QWEN3 = str(Path(__file__).parent / "fixtures" / "hf" / "qwen3")

# Runs the command in-process and prints, as JSON, the step's compiles (JAX's compile log) and,
# at every logged step, the bytes of all live device arrays against the state's, counted on the
# devices (each buffer once: a replicated leaf counts once a device).
PROBE = r'''
import json, logging, sys
import jax
from tunix_nb import cli, train
from tunix_nb.train import loop

compiled = []
class CompileLog(logging.Handler):
    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Compiling "):
            compiled.append(message.split()[1])
jax.config.update("jax_log_compiles", True)
logging.getLogger("jax").addHandler(CompileLog())

def device_bytes(tree):
    # each device buffer once: an array and a view of its shard (Orbax's) share one buffer
    buffers = {(shard.device.id, shard.data.unsafe_buffer_pointer()): shard.data.nbytes
               for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and not x.is_deleted()
               for shard in x.addressable_shards}
    return sum(buffers.values())

state_bytes, live_bytes = [], []
run = train.run
def measured_run(step_fn, params, opt_state, batch_fn, *, frozen=None, **kw):
    state_bytes.append(device_bytes((params, opt_state, frozen)))
    return run(step_fn, params, opt_state, batch_fn, frozen=frozen, **kw)
train.run = measured_run
log = loop.StepLog.log
def measured_log(self, record):
    live_bytes.append(device_bytes(jax.live_arrays()))
    log(self, record)
loop.StepLog.log = measured_log

code = cli.main(sys.argv[1:])
print(json.dumps({"code": code, "compiled": compiled, "state": state_bytes, "live": live_bytes}))
'''


def probe(tmp_path, *argv):
    out = subprocess.run([sys.executable, "-c", PROBE, "sft", "--model", QWEN3, "--batch-size", "8", "--steps", "4",
                          *argv, "--ckpt-dir", str(tmp_path / "ckpt")],
                         capture_output=True, text=True, timeout=300, env={**__import__("os").environ,
                                                                             "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# One device, one tree per block; and sharded over two with the blocks stacked (--scan-layers),
# so that each placement and each layout is run once
@pytest.mark.parametrize("parallel", [["--parallel", "jit"], ["--parallel", "fsdp", "--devices", "2", "--scan-layers"]],
                         ids=["jit", "fsdp-stacked"])
def test_the_step_compiles_once_and_the_state_lives_once(tmp_path, parallel):
    """A save every step (written before the next, --sync-save): the boundary where the loop used
    to copy the state again. Saved in the background, Orbax's host copy of the state is, on the
    CPU backend, a view of the device buffers (numpy shares a CPU array's memory), so it would
    count here as device bytes; on an accelerator it is host memory."""
    result = probe(tmp_path, *parallel, "--save-every", "1", "--sync-save")
    assert result["code"] == 0
    assert result["compiled"].count("jit(step)") == 1, result["compiled"]
    state = result["state"][0]
    assert len(set(result["state"])) == 1 and len(result["live"]) == 4
    assert max(result["live"]) <= 1.1 * state, (result["live"], state)
