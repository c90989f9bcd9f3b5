"""tunix_nb.memory_plan.fit: the memory analysis of a step about to train (lesson 09's), and
the stored plans of real models beside it."""

import json

import jax
import numpy as np
import pytest

from tunix_nb import devices, memory_plan, model, sft, train
from tunix_nb.memory_plan import analysis, fit

ROWS, SEQ = 8, 6


@pytest.fixture(scope="module")
def tiny():
    graphdef, params = model.split(model.make_model("tiny"))
    opt = train.make_optimizer()
    batch = {k: np.ones((ROWS, SEQ), np.int32) for k in ("inputs", "targets", "loss_mask", "attention_mask")}
    return graphdef, params, opt, batch


def _laid_out(tree) -> int:
    """The bytes `tree` takes on one device as that device stores it: its nbytes on a CPU, with
    a TPU's tile padding there (devices.bytes_on_device), which is what XLA's analysis counts."""
    return sum(devices.bytes_on_device(jax.device_put(tree, jax.devices()[0])).values())


def _step(tiny, parallel_mode, donate):
    graphdef, _, opt, _ = tiny
    return train.make_step(sft.objective(graphdef), opt, parallel_mode=parallel_mode, donate=donate)


def test_a_donating_jit_step_takes_the_state_and_the_batch_and_aliases_the_state(tiny):
    _, params, opt, batch = tiny
    opt_state = opt.init(params)
    donated = _laid_out((params, opt_state))
    kept = fit.analyse_step(_step(tiny, "jit", False), params, opt_state, batch)
    given = fit.analyse_step(_step(tiny, "jit", True), params, opt_state, batch)
    assert given["argument_bytes"] == kept["argument_bytes"] == donated + _laid_out(batch)
    assert kept["alias_bytes"] == 0
    assert donated - 64 <= given["alias_bytes"] <= donated  # the optimizer's step count may be kept apart
    assert given["total_bytes"] == (given["argument_bytes"] + given["output_bytes"] + given["temp_bytes"]
                                    - given["alias_bytes"])
    assert (given["backend"], given["devices"]) == (jax.default_backend(), 1)


def test_shapes_alone_give_the_same_analysis(tiny):
    _, params, opt, batch = tiny
    step = _step(tiny, "jit", True)
    concrete = fit.analyse_step(step, params, opt.init(params), batch)
    abstract = fit.analyse_step(step, *jax.eval_shape(lambda: (params, opt.init(params), batch)))
    assert abstract == concrete


def test_under_pmap_each_device_holds_the_state_and_its_share_of_the_batch(tiny):
    _, params, opt, batch = tiny
    opt_state = opt.init(params)
    n = jax.local_device_count()
    result = fit.analyse_step(_step(tiny, "pmap", True), params, opt_state, batch, parallel_mode="pmap")
    # each device's slice of pmap's arguments keeps their leading device axis, of length 1: laid
    # out on a TPU as a [1, ...] array, which pads otherwise than the array without it
    state = _laid_out(jax.tree.map(lambda x: np.asarray(x)[None], (params, opt_state)))
    assert result["devices"] == n
    assert result["argument_bytes"] == state + _laid_out({k: v[None, : ROWS // n] for k, v in batch.items()})
    assert state - 64 <= result["alias_bytes"] <= state


@pytest.mark.needs_devices(8)
def test_a_mesh_step_is_analysed_on_its_mesh(tiny):
    _, params, opt, batch = tiny
    step = _step(tiny, "fsdp", True)
    opt_state = opt.init(params)
    result = fit.analyse_step(step, params, opt_state, batch, parallel_mode="fsdp")
    whole = analysis.tree_bytes(params) + analysis.tree_bytes(opt_state)
    assert result["devices"] == step.mesh.size == jax.device_count()
    # the state lies split over the mesh: each device holds less than all of it
    assert result["argument_bytes"] < whole


def test_a_batch_that_does_not_split_over_the_devices_says_so(tiny):
    _, params, opt, batch = tiny
    n = jax.local_device_count()
    if n == 1:
        pytest.skip("every batch splits over one device")
    odd = {k: np.ones((n + 1, SEQ), np.int32) for k in batch}
    with pytest.raises(ValueError, match=f"multiple of {n}"):
        fit.analyse_step(_step(tiny, "pmap", False), params, opt.init(params), odd, parallel_mode="pmap")
    with pytest.raises(ValueError, match="parallel mode"):
        fit.analyse_step(_step(tiny, "jit", False), params, opt.init(params), batch, parallel_mode="vmap")


def _write(tmp_path, rows):
    path = tmp_path / "memory.json"
    path.write_text(json.dumps({"settings": {}, "skipped_targets": {}, "rows": rows}))
    return path


def test_a_stored_row_is_found_by_model_strategy_variant_and_target(tmp_path):
    rows = [{"model": "M", "strategy": s, "variant": v, "target": t, "total_gib": i}
            for i, (s, v, t) in enumerate([("full", "before", "v5e"), ("full", "after", "v5e"),
                                           ("full", "after", "cpu"), ("lora", "after", "v5e")])]
    path = _write(tmp_path, rows)
    assert fit.stored_row("M", "full", "after", "v5e", path)["total_gib"] == 1
    assert fit.stored_row("M", "full", "after", "cpu", path)["total_gib"] == 2
    with pytest.raises(KeyError, match="no row for model='M', strategy='qlora'.*it holds"):
        fit.stored_row("M", "qlora", "after", path=path)
    with pytest.raises(FileNotFoundError, match="bench --only memory"):
        fit.stored_row("M", "full", "after", path=tmp_path / "absent.json")


def test_the_shipped_results_hold_the_rows_lesson_09_reads():
    for strategy in ("full", "lora"):
        for variant in ("before", "after", "after, chunked"):
            row = memory_plan.stored_row("Qwen3-0.6B", strategy, variant, "v5e")
            assert row["full_depth"]["total_bytes"] > 0 and row["n_layers"] == 28


def test_bytes_read_in_the_largest_unit_that_keeps_them_above_one():
    assert fit.format_bytes(3 * 2**20) == "3.00 MiB"
    assert fit.format_bytes(1.5 * 2**30) == "1.50 GiB"
    assert fit.format_bytes(2**10) == "1.00 KiB"
    assert fit.format_bytes(512) == "512 bytes"
    line = fit.describe({"argument_bytes": 2**20, "output_bytes": 2**20, "temp_bytes": 2**21, "alias_bytes": 2**20,
                         "total_bytes": 3 * 2**20})
    assert line == ("arguments 1.00 MiB, outputs 1.00 MiB, temporaries 2.00 MiB, aliased 1.00 MiB; "
                    "total 3.00 MiB")


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_a_devices_memory_is_what_its_runtime_reports():
    assert fit.device_memory_bytes(_Device({"bytes_limit": 16 * 2**30, "bytes_in_use": 0})) == 16 * 2**30
    assert fit.device_memory_bytes(_Device(None)) is None
    assert fit.device_memory_bytes(_Device({"bytes_in_use": 0})) is None
    assert jax.default_backend() != "cpu" or fit.device_memory_bytes() is None  # the CPU reports no limit


class _Compiled:
    """A compiled program's memory analysis as a backend reports it."""

    def __init__(self, **sizes):
        fields = {"argument_size_in_bytes": 100, "output_size_in_bytes": 40, "alias_size_in_bytes": 0, **sizes}
        self._analysis = type("Analysis", (), fields)()

    def memory_analysis(self):
        return self._analysis


def test_temporaries_are_the_cpus_field_or_what_the_tpus_peak_holds_beyond_arguments_and_outputs():
    assert analysis.temporary_bytes(_Compiled(temp_size_in_bytes=500, peak_memory_in_bytes=140)) == 500  # a CPU
    # a TPU: temp 0, the peak holds the arguments, the outputs (less what aliases them) and the temporaries
    assert analysis.temporary_bytes(_Compiled(temp_size_in_bytes=0, peak_memory_in_bytes=640)) == 500
    assert analysis.temporary_bytes(_Compiled(temp_size_in_bytes=0, peak_memory_in_bytes=640,
                                              alias_size_in_bytes=40)) == 540
    assert analysis.temporary_bytes(_Compiled(temp_size_in_bytes=0, peak_memory_in_bytes=0)) == 0
