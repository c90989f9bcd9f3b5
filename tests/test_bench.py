"""python -m tunix_nb.bench --quick runs every figure and writes a valid bench.json."""

import json
import math
import os
import subprocess
import sys

import pytest

from tunix_nb import bench, data


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run([sys.executable, "-m", "tunix_nb.bench", "--quick", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=400, cwd=out)
    assert run.returncode == 0, run.stderr[-3000:]
    return out, json.loads((out / "bench.json").read_text()), run.stdout


def test_every_figure_is_there_with_its_target(quick_results):
    _, results, stdout = quick_results
    assert set(results["figures"]) == set(bench.FIGURES)
    for name, fig in results["figures"].items():
        _, target, kind = bench.FIGURES[name]
        # a share is clipped at 0 when noise makes the step without the all-reduce slower
        assert isinstance(fig["value"], float) and (fig["value"] > 0 or name == "allreduce_share"), name
        assert fig["value"] >= 0, name
        assert fig["target"] == target and fig["target_kind"] == kind
        if target is not None:
            assert fig["meets_target"] == (fig["value"] <= target if kind == "max" else fig["value"] >= target)
        assert f"{name}: " in stdout


def test_machine_and_settings_are_described(quick_results):
    _, results, _ = quick_results
    machine = results["machine"]
    assert machine["backend"] == "cpu" and machine["device_count"] == 8 and machine["cpu_count"] >= 1
    assert set(machine["versions"]) == {"jax", "flax", "optax", "orbax-checkpoint"}
    assert results["settings"]["quick"] is True and results["settings"]["repeats"] >= 3


def test_details_hold_the_measured_parts(quick_results):
    _, results, _ = quick_results
    figs = results["figures"]
    assert {"1", "8", "64"} <= set(figs["vmap_speedup_over_loop"]["curve"])
    assert figs["allreduce_share"]["devices"] == 8
    assert figs["train_step_mfu"]["matmul_peak_flops_per_second"] > figs["train_step_mfu"]["achieved_flops_per_second"]
    assert figs["ckpt_save_over_disk_bandwidth"]["state_bytes"] >= 16 * 2**20
    assert set(figs["dp_overhead"]["per_strategy"]) == {"pmap", "shard_map", "dp"}
    assert set(figs["compile_share"]["per_step"]) == {"03 sft step"}  # --quick compiles one step
    table = figs["lora_optimizer_state_share"]["table"]
    assert set(table) == {name for name, *_ in bench.QUICK_LORA_SETTINGS} == {"full", "lora r16", "qlora nf4 r16"}
    assert table["full"]["trainable_share"] == 1.0 and 0.3 < table["lora r16"]["trainable_share"] < 0.35
    # Adam's two moments per trainable parameter, float32: the state shrinks with the share
    for row in table.values():
        assert 8 * row["trainable_params"] <= row["optimizer_state_bytes"] <= 8 * row["trainable_params"] + 64
    assert table["qlora nf4 r16"]["frozen_bytes"] < table["lora r16"]["frozen_bytes"] / 2
    assert set(figs["lora_step_time_ratio"]["thin_matmul_profile"]) == {"dense", "r1", "r4", "r16"}
    remat = figs["remat_memory_ratio"]
    assert remat["temp_bytes"]["remat"] < remat["temp_bytes"]["plain"] and remat["update_max_abs_difference"] <= 1e-6
    assert figs["train_step_mfu"]["fix"] == {}  # the fix against the model before it: full runs only


def test_timed_figures_carry_their_spread_and_quick_ones_say_they_are_not_comparable(quick_results):
    _, results, stdout = quick_results
    assert results["settings"]["comparable_to_targets"] is False
    for name, fig in results["figures"].items():
        assert fig["comparable_to_target"] is False, name
        if "spread" in fig:
            s = fig["spread"]
            assert s["min"] <= s["q25"] <= s["median"] <= s["q75"] <= s["max"], name
    timed = ("vmap_speedup_over_loop", "train_step_mfu", "backward_over_forward", "dp_overhead", "allreduce_share",
             "ckpt_save_over_disk_bandwidth", "dpo_cached_ref_speedup", "kv_cache_decode_speedup",
             "grpo_rollout_share", "lora_step_time_ratio", "remat_step_time_ratio")
    assert all("spread" in results["figures"][name] for name in timed)
    assert stdout.count("[--quick: not comparable to the target]") == sum(
        fig["target"] is not None for fig in results["figures"].values())


def test_the_save_is_measured_like_the_disk_probe(quick_results):
    """Both timed until their bytes are on disk: a save cannot beat the disk it writes to."""
    _, results, _ = quick_results
    fig = results["figures"]["ckpt_save_over_disk_bandwidth"]
    assert fig["value"] <= 1.0 and "fsync" in fig["note"] and fig["spread"]["rounds"] == 3


def test_plots_are_written(quick_results):
    out, _, _ = quick_results
    for name in ("vmap_speedup.png", "dp_overhead.png", "targets.png"):
        assert (out / name).stat().st_size > 10_000


def test_model_flops_formula_agrees_with_xla_cost_analysis():
    """The analytic count against XLA's own count of the compiled programs (an independent figure).

    XLA also counts the elementwise work (norms, RoPE, softmax, SiLU) that the formula
    leaves out, about 1% of the forward pass at this size; its forward + backward is
    2.95x the forward (the embedding lookup has no input gradient). Both agree with the
    formula's 3x (matmul-only) forward to within 2%.
    """
    import jax
    import jax.numpy as jnp

    from tunix_nb import model

    cfg = model.get_config("tiny", d_model=128, n_layers=2, n_heads=4, d_ff=512)  # matmuls dominate
    graphdef, params = model.split(model.make_model(cfg, seed=0))
    tokens = jnp.zeros((2, 32), jnp.int32)

    def xla_flops(fn):
        cost = jax.jit(fn).lower(params, tokens).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    forward = xla_flops(lambda p, t: model.apply(graphdef, p, t))
    forward_backward = xla_flops(jax.grad(lambda p, t: model.apply(graphdef, p, t).sum()))
    formula = bench.model_flops_per_step(cfg, batch=2, seq_len=32)
    assert 0.98 * 3 * forward <= formula <= 3 * forward  # matmuls only: a little under XLA's count
    assert abs(formula / forward_backward - 1) <= 0.02


def test_bad_only_name_is_refused():
    run = subprocess.run([sys.executable, "-m", "tunix_nb.bench", "--only", "speed"], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and "invalid choice: 'speed'" in run.stderr


def quick_group_alone(group, figure, tmp_path):
    """(the process, its figure): `--quick --only group` on one device, in a folder of its own."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run([sys.executable, "-m", "tunix_nb.bench", "--quick", "--only", group,
                          "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.loads((tmp_path / "bench.json").read_text())["figures"][figure]


def test_a_group_runs_alone(tmp_path):
    """--only runs one group and writes its figures alone (vmap: one of the quickest groups)."""
    run, fig = quick_group_alone("vmap", "vmap_speedup_over_loop", tmp_path)
    figures = json.loads((tmp_path / "bench.json").read_text())["figures"]
    assert set(figures) == {name for name, (group, *_) in bench.FIGURES.items() if group == "vmap"}
    assert math.isfinite(fig["value"]) and fig["value"] > 0 and "vmap_speedup_over_loop: " in run.stdout


def test_the_kv_cache_group_measures_the_cached_decoder_against_recomputing(quick_results):
    """The cached decoder against recomputing, each checked greedy (from the quick run's figures)."""
    _, results, stdout = quick_results
    fig = results["figures"]["kv_cache_decode_speedup"]
    assert math.isfinite(fig["value"]) and fig["value"] > 0
    assert fig["greedy_checked"] and set(fig["curve"]) == {str(data.MAX_NEW_TOKENS), "32"}
    for point in fig["curve"].values():
        assert point["cached_tokens_per_second"] > 0 and point["recompute_tokens_per_second"] > 0
    assert "kv_cache_decode_speedup: " in stdout


def test_grpo_group_splits_a_step_into_rollout_and_update(quick_results):
    """GRPO steps from the shipped SFT student: the rollout's share of each (from the quick run)."""
    fig = quick_results[1]["figures"]["grpo_rollout_share"]
    assert 0 < fig["value"] < 1
    assert fig["rollout_seconds"] > 0 and fig["update_seconds"] > 0
    # the median of the steps' shares, stored with their spread
    assert fig["spread"]["q25"] <= fig["value"] <= fig["spread"]["q75"] and fig["spread"]["rounds"] >= 3
    assert fig["group_size"] == 8 and fig["num_iterations"] == 2


def test_each_group_is_a_module_found_by_its_name():
    for name in bench.GROUPS + bench.OPTIONAL_GROUPS:
        module = bench.group(name)
        assert module.__name__ == f"tunix_nb.bench.{name}"
        assert callable(module.measure if name in bench.GROUPS else module.run_alone), name
    # every figure is its group's, with the group's target
    for name, (group, target, kind) in bench.FIGURES.items():
        assert bench.group(group).FIGURES[name] == (target, kind)
    assert sum(len(bench.group(g).FIGURES) for g in bench.GROUPS) == len(bench.FIGURES)
    with pytest.raises(ValueError, match="no benchmark group 'speed'; choose one of vmap, mfu"):
        bench.group("speed")
    with pytest.raises(ValueError, match="--only packing"):
        bench.run(["packing"], quick=True, out_dir=None)


def _alone(group, out, *flags, timeout=300):
    """`--only group` in a folder whose bench.json already holds figures, which must stay."""
    kept = {"figures": {"vmap_speedup_over_loop": {"value": 1.0}}, "settings": {"quick": False}}
    out.mkdir(exist_ok=True)
    (out / "bench.json").write_text(json.dumps(kept))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run([sys.executable, "-m", "tunix_nb.bench", "--only", group, "--out", str(out), *flags],
                         capture_output=True, text=True, env=env, timeout=timeout, cwd=out)
    assert run.returncode == 0, run.stderr[-3000:]
    stored = json.loads((out / "bench.json").read_text())
    assert {k: stored[k] for k in kept} == kept
    return run, stored


def test_packing_group_writes_its_record_beside_the_figures(tmp_path):
    """--quick --only packing: padded, packed and padding-free rows of one batch, timed in turns
    on one device, into bench.json's "packing" record (the tiny preset: not comparable)."""
    run, stored = _alone("packing", tmp_path, "--quick")
    record = stored["packing"]
    assert record["command"] == f"python -m tunix_nb.bench --only packing --out {tmp_path} --quick"
    assert record["quick"] and record["machine"]["device_count"] == 1 and record["preset"] == "tiny"
    assert set(record["tokens_per_second"]) == {"padding", "packing", "padding_free"}
    losses = list(record["loss"].values())  # one batch, three layouts, one loss
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])
    rows, length = record["shapes"]["packing"]
    assert record["shapes"]["padding"] == [8, length] and rows < 8
    fig = record["packing_over_padding"]
    assert fig["value"] == record["speedup_over_padding"]["packing"]["median"] and fig["target"] == 1.5
    assert fig["comparable_to_target"] is False and fig["spread"]["rounds"] == 3
    assert "packing_over_padding: " in run.stdout and "[--quick: not comparable to the target]" in run.stdout


def test_memory_group_keeps_the_stored_plans_when_every_target_is_skipped(tmp_path):
    """--only memory --targets v5e,v5e-8 plans on TPUs only: without libtpu there is nothing
    to compile, and bench.json is left as it was (its "memory" record too)."""
    from tunix_nb import memory_plan

    if memory_plan.libtpu_missing() is None:
        pytest.skip("libtpu is installed: --quick would compile three real models' steps for minutes")
    run, stored = _alone("memory", tmp_path, "--quick", "--targets", "v5e,v5e-8", timeout=120)
    assert "memory" not in stored and "is unchanged" in run.stdout
    assert "v5e: skipped" in run.stdout and "v5e-8: skipped" in run.stdout


def test_tunix_group_is_the_tunix_comparison(tmp_path):
    """--only tunix runs tunix_nb.tunix_compare: without google-tunix it says why and writes nothing."""
    from tunix_nb import tunix_compare

    if tunix_compare.tunix_missing() is None:
        pytest.skip("google-tunix is installed: the comparison would run for many minutes")
    run, _ = _alone("tunix", tmp_path, timeout=120)
    assert "tunix_compare skipped: google-tunix's trainers are not importable" in run.stdout
    assert not (tmp_path / "tunix_compare.json").exists()


def test_the_remat_check_holds_where_auto_computes_in_bfloat16():
    """On a v5e chip "auto" computes in bfloat16, and the plain and rematerialised updates came
    1.1e-3 apart (rounding where the recomputation fuses differently), so `bench --quick` stopped.
    The check now compiles the pair at float32 for the comparison: the same on every backend."""
    import jax
    import numpy as np

    from tunix_nb import precision
    from tunix_nb.bench import remat

    previous = precision.set_auto_compute_dtype("bfloat16")
    try:
        assert not remat.computes_in_float32()
        small = {"d_model": 64, "n_layers": 2, "d_ff": 128}
        programs = remat.remat_programs(2, 64, **small)
        updates = {name: compiled(*args) for name, (compiled, args) in programs.items()}
        bfloat16_apart = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                             for a, b in zip(*(jax.tree.leaves(u) for u in updates.values())))
        assert bfloat16_apart > 1e-6  # what the chip's run tripped on, reproduced here
        assert remat.update_difference(None, 2, 64, **small) <= 1e-6
    finally:
        precision.set_auto_compute_dtype(previous)
    assert remat.computes_in_float32() == (jax.default_backend() == "cpu")
