"""tunix_nb.step_profile: a compiled step's traced ops by kind and by the kit's function they come
from, with containers' time left out, and the device's idle time between steps (issue 47, item 4).
A real step traced on this machine: the training command's, in tests/test_measure_command.py."""

import jax
import jax.numpy as jnp
import pytest

from tunix_nb import step_profile


PLUMBING = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")


def looped_matmul():
    """A loop whose body is a matmul and a tanh: a container with a matmul inside."""
    f = jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda i, y: jnp.tanh(y @ y) + 1.0, x))
    return f.lower(jnp.ones((64, 64))).compile().as_text()


def tpu_like_trace(hlo_text):
    """Events laid out as a TPU's trace is: a device process with its "XLA Modules" line (whole
    programs) and "XLA Ops" line (the HLO's instructions by name), in microseconds."""
    index = step_profile.hlo_index(hlo_text)
    # the backends fuse the body otherwise (a CPU: a dot fusion and an elementwise one; a TPU may
    # fuse all into one convolution fusion), so any matmul and any other computing instruction
    loop = next(n for n in index.lines if index.opcode[n] == "while")
    matmul = next(n for n in index.lines if index.kind(n) == "matmul")
    other = next(n for n in index.lines if index.kind(n) == "other" and index.opcode[n] not in PLUMBING)
    meta = [{"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/device:TPU:0"}},
            {"ph": "M", "pid": 3, "tid": 1, "name": "thread_name", "args": {"name": "XLA Modules"}},
            {"ph": "M", "pid": 3, "tid": 2, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    modules = [{"ph": "X", "pid": 3, "tid": 1, "name": "jit_step(81)", "ts": ts, "dur": 100} for ts in (0, 150, 300)]
    small = [{"ph": "X", "pid": 3, "tid": 1, "name": "jit_metrics(9)", "ts": 120, "dur": 10}]
    ops = []
    for ts in (0, 150, 300):  # each step: the loop (90) around its body's ops (60 + 20)
        ops += [{"ph": "X", "pid": 3, "tid": 2, "name": loop, "ts": ts, "dur": 90},
                {"ph": "X", "pid": 3, "tid": 2, "name": matmul, "ts": ts, "dur": 60},
                {"ph": "X", "pid": 3, "tid": 2, "name": "%" + other, "ts": ts + 60, "dur": 20}]
    return meta + modules + small + ops


def test_ops_per_step_by_kind_leave_the_loop_containers_out():
    hlo = looped_matmul()
    profile = step_profile.summarise(tpu_like_trace(hlo), hlo, calls=3)
    assert profile["traced_seconds"] == pytest.approx(80e-6)  # the while's own 90 µs not counted again
    kinds = {k["name"]: k["share"] for k in profile["by_kind"]}
    assert kinds == pytest.approx({"matmul": 0.75, "other": 0.25})
    assert profile["top_ops"][0]["kind"] == "matmul" and profile["top_ops"][0]["seconds"] == pytest.approx(60e-6)
    # the source is the function the op was written in (this file's lambda)
    assert profile["top_ops"][0]["source"].startswith("test_step_profile.py:")


def test_the_device_idle_time_between_steps():
    hlo = looped_matmul()
    gaps = step_profile.program_gaps(tpu_like_trace(hlo), "jit_step")
    assert gaps["runs"] == 3 and gaps["idle_between_runs_seconds"] == pytest.approx([50e-6, 50e-6])
    assert gaps["busy_share"] == pytest.approx(300 / 400) and gaps["other_programs"] == ["jit_metrics(9)"]
    # a CPU's trace has no device line of whole programs
    assert step_profile.program_gaps([e for e in tpu_like_trace(hlo) if e.get("pid") != 3]) is None


def test_the_ops_divide_by_the_steps_worth_the_window_holds(tmp_path):
    """measure_command's profile: where the trace window cuts the first step's program to half,
    the ops' seconds divide by the 2.5 steps' worth it holds, not by the 3 runs it saw."""
    import gzip
    import json

    from tunix_nb import measure_command

    hlo = looped_matmul()
    events = tpu_like_trace(hlo)
    first = next(e for e in events if e.get("name") == "jit_step(81)" and e["ts"] == 0)
    first["dur"] = 50
    (tmp_path / "host.trace.json.gz").write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    profile = measure_command.step_profile_of(tmp_path, hlo, traced_steps=3)
    assert profile["traced_steps"] == pytest.approx(2.5) and profile["programs"]["runs"] == 3
    assert profile["ops"]["traced_seconds"] == pytest.approx(3 * 80e-6 / 2.5)
    ops = profile["ops"]["ops"]
    # --trace-top: how many of the slowest ops and sources the profile names
    assert len(profile["ops"]["top_ops"]) == min(10, ops) and ops > 1
    one = measure_command.step_profile_of(tmp_path, hlo, traced_steps=3, top=1)["ops"]
    assert len(one["top_ops"]) == len(one["by_source"]) == 1 and one["top_ops"] == profile["ops"]["top_ops"][:1]
