"""The memory plan (tunix_nb.memory_plan) and the memory remedies it measures: donation
shows up as aliased bytes, a bfloat16 base halves the frozen base's argument bytes,
bfloat16 attention keeps no float32 [B, H, L, L] array (the float32 path is unchanged),
per-block remat on a loaded checkpoint, and the stored plans (results/bench.json's "memory")."""

import contextlib
import io
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from tunix_nb import hf, lora, losses, memory_plan, model, precision, sft
from tunix_nb.memory_plan import analysis as plan_lib
from tunix_nb.memory_plan import report

ROOT = Path(__file__).resolve().parent.parent
STORED = ROOT / "results" / "bench.json"
QWEN3_FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "qwen3"
TINY_HF = hf.hf_config_for(model.get_config("tiny", n_layers=1), dtype="float32")
TINY_PLAN = memory_plan.PlanConfig(strategy="lora", batch_size=2, seq_len=8, lora_rank=2)


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    """The bench's memory group on a one-layer tiny config, CPU only: the LoRA step as the
    kit built it before (no donation, float32 base) and after the remedies, two compiles
    that the tests below share."""
    out = tmp_path_factory.mktemp("memory")
    (out / "tiny").mkdir()
    (out / "tiny" / "config.json").write_text(json.dumps(TINY_HF))
    base = memory_plan.PlanConfig(batch_size=TINY_PLAN.batch_size, seq_len=TINY_PLAN.seq_len,
                                  lora_rank=TINY_PLAN.lora_rank)
    results = report.run(out, rows=((str(out / "tiny"), "lora"),), target_names=("cpu",), layers=(1,), base=base,
                         progress=lambda line: None)
    return out, results


@pytest.fixture(scope="module")
def cpu_before_after(tiny_report):
    return {row["variant"]: row["compiled"]["1"] for row in tiny_report[1]["rows"]}


def test_the_report_writes_its_rows_into_the_bench_record_and_prints_a_table(tiny_report):
    out, results = tiny_report
    assert json.loads((out / "bench.json").read_text()) == {"memory": results}
    assert json.loads((out / "memory.json").read_text()) == results  # lesson 09's copy
    assert [(r["variant"], r["extrapolated"], r["n_layers"]) for r in results["rows"]] == [
        ("before", False, 1), ("after", False, 1), (report.CHUNKED, False, 1)]
    text = report.table(results)
    assert text.count(" cpu ") == 3 and "before" in text and "after" in text and report.CHUNKED in text


def test_the_cpu_analysis_reports_every_field_and_the_inputs(cpu_before_after):
    for result in cpu_before_after.values():
        assert {f"{k}_bytes" for k in plan_lib.FIELDS} <= set(result)
        assert result["total_bytes"] == (result["argument_bytes"] + result["output_bytes"] + result["temp_bytes"]
                                         - result["alias_bytes"])
        # the arguments are the step's inputs, byte for byte on one device
        assert result["argument_bytes"] >= sum(result["input_bytes"].values())
        assert result["n_layers"] == 1 and result["devices"] == 1


def test_donation_shows_up_as_aliased_bytes(cpu_before_after):
    before, after = cpu_before_after["before"], cpu_before_after["after"]
    assert before["alias_bytes"] == 0
    donated = after["input_bytes"]["params"] + after["input_bytes"]["opt_state"]
    # every donated buffer comes back as an output (the optimizer's step count may be kept apart)
    assert donated - 64 <= after["alias_bytes"] <= donated


def test_a_bfloat16_base_halves_the_frozen_bases_argument_bytes(cpu_before_after):
    before, after = cpu_before_after["before"], cpu_before_after["after"]
    assert after["input_bytes"]["frozen"] * 2 == before["input_bytes"]["frozen"]
    saved = before["input_bytes"]["frozen"] // 2
    assert before["argument_bytes"] - after["argument_bytes"] == saved
    assert after["input_bytes"]["params"] == before["input_bytes"]["params"]  # adapters stay float32


def test_lora_adapters_train_in_float32_over_a_bfloat16_base():
    graphdef, params = model.split(model.make_model("tiny"))
    _, adapters, base = lora.apply(graphdef, precision.cast_floats(params, jnp.bfloat16), rank=2)
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype(jnp.bfloat16)}


def _attention_residual_dtypes(dtype) -> set:
    """The dtypes of the [B, H, L, L] arrays the tiny model's forward pass keeps for its
    backward pass, its layers computing in `dtype` (float32 params either way; XLA fuses the softmax's float32 arithmetic;
    what is kept between the passes is what a step's memory holds)."""
    graphdef, params = model.split(model.make_model("tiny", dtype=None if dtype == jnp.float32 else "bfloat16"))
    tokens = jnp.ones((2, 8), jnp.int32)

    def loss(p):
        return jnp.sum(model.apply(graphdef, p, tokens))

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(loss, params)
    return set(re.findall(r"(\w+)\[2,2,8,8\]", printed.getvalue())) - {"bool"}  # the mask: 1 byte each


def test_bfloat16_attention_keeps_no_float32_scores_and_float32_keeps_them():
    assert "f32" in _attention_residual_dtypes(jnp.float32)
    assert _attention_residual_dtypes(jnp.bfloat16) == {"bf16"}


def _attend_before(q, k, v, allowed):
    """model.attend as it was before the bfloat16 path (the lessons' float32 path)."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(q.shape[-1])
    scores = jnp.where(allowed[:, None], scores, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1).astype(v.dtype), v)


def _qkv(dtype):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 6, 4, 8), dtype)
    k, v = (jax.random.normal(key, (2, 6, 2, 8), dtype) for key in keys[1:])
    return q, k, v, jnp.tril(jnp.ones((6, 6), bool))[None].repeat(2, 0)


def test_float32_attention_is_bitwise_the_old_one():
    args = _qkv(jnp.float32)
    np.testing.assert_array_equal(jax.jit(model.attend)(*args), jax.jit(_attend_before)(*args))


def test_bfloat16_attention_and_its_gradient_match_float32_softmax():
    """The low-precision softmax's own backward pass against autodiff of the float32 one."""
    scores = jax.random.normal(jax.random.key(3), (2, 4, 6, 6)) * 4
    cotangent = jax.random.normal(jax.random.key(4), scores.shape)
    mine, pullback = jax.vjp(model.low_precision_softmax, scores.astype(jnp.bfloat16))
    ref, ref_pullback = jax.vjp(lambda s: jax.nn.softmax(s, axis=-1), scores)
    assert mine.dtype == jnp.bfloat16
    np.testing.assert_allclose(mine.astype(jnp.float32), ref, atol=2e-2)
    (grad,), (ref_grad,) = pullback(cotangent.astype(jnp.bfloat16)), ref_pullback(cotangent)
    np.testing.assert_allclose(grad.astype(jnp.float32), ref_grad, atol=3e-2 * float(jnp.max(jnp.abs(ref_grad))))


def test_per_block_remat_works_on_a_loaded_checkpoint():
    graphdef, params, config = hf.load_pretrained(QWEN3_FIXTURE, remat=True)
    plain_graphdef, _, _ = hf.load_pretrained(QWEN3_FIXTURE)
    assert config.remat and nnx_cfg(graphdef, params).remat and not nnx_cfg(plain_graphdef, params).remat
    tokens = jnp.asarray(np.arange(3, 19).reshape(2, 8) % config.vocab_size, jnp.int32)

    def loss(graphdef):
        return lambda p: jnp.sum(losses.token_log_probs(model.apply(graphdef, p, tokens[:, :-1]), tokens[:, 1:]))

    # jax.checkpoint appears in the backward pass as its primitive, "remat"
    assert "remat" in str(jax.make_jaxpr(jax.grad(loss(graphdef)))(params))
    assert "remat" not in str(jax.make_jaxpr(jax.grad(loss(plain_graphdef)))(params))
    (value, grads), (ref_value, ref_grads) = (jax.value_and_grad(loss(g))(params) for g in (graphdef, plain_graphdef))
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, ref_grads)


def nnx_cfg(graphdef, params):
    return model.nnx.merge(graphdef, params).cfg


@pytest.mark.skipif(memory_plan.libtpu_missing() is not None, reason=f"{memory_plan.libtpu_missing()}")
def test_a_v5e_chip_plan_compiles_here_donates_and_keeps_no_float32_attention():
    after = memory_plan.analyse(TINY_HF, memory_plan.after(TINY_PLAN), "v5e")
    before = memory_plan.analyse(TINY_HF, memory_plan.before(TINY_PLAN), "v5e")
    assert after["alias_bytes"] > 0 and before["alias_bytes"] == 0
    # float32 activations (before) hold float32 attention scores in HBM; bfloat16 ones do not
    assert before["hlo_buffers"]["f32_BxHxLxL"] > 0 and after["hlo_buffers"]["f32_BxHxLxL"] == 0


def test_a_chunked_plan_passes_both_chunks_and_keeps_no_float32_logits():
    assert plan_lib.chunk_option(sft.objective, 64, 4) == {"vocab_chunk": 64, "seq_chunk": 4}
    assert plan_lib.chunk_option(sft.objective, 64) == {"vocab_chunk": 64}
    assert plan_lib.chunk_option(lambda graphdef: None, 64, 4) == {}
    cfg = memory_plan.after(TINY_PLAN, vocab_chunk=64, seq_chunk=4)
    chunked = memory_plan.analyse(TINY_HF, cfg, "cpu")
    unchunked = memory_plan.analyse(TINY_HF, memory_plan.after(TINY_PLAN), "cpu")
    assert (chunked["vocab_chunk_used"], chunked["seq_chunk_used"]) == (64, 4)
    assert unchunked["hlo_buffers"]["f32_BxLxV"] > 0 and chunked["hlo_buffers"]["f32_BxLxV"] == 0


def test_an_extrapolation_that_shrinks_with_depth_gives_no_estimate():
    row = {"extrapolated": True, "full_depth": {"per_layer": {"argument_bytes": 1, "output_bytes": 1,
                                                              "temp_bytes": -5}}}
    assert not report.extrapolation_holds(row)
    assert report.extrapolation_holds({**row, "extrapolated": False})


def test_extrapolation_is_linear_in_depth():
    by_layers = {1: {"temp_bytes": 10, "argument_bytes": 100, "input_bytes": {"params": 1}},
                 2: {"temp_bytes": 13, "argument_bytes": 150, "input_bytes": {"params": 1}}}
    full = memory_plan.extrapolate(by_layers, 28)
    assert full["temp_bytes"] == 10 + 27 * 3 and full["argument_bytes"] == 100 + 27 * 50
    assert full["per_layer"] == {"temp_bytes": 3, "argument_bytes": 50}
    # a third, deeper compile: the line runs through the two deepest (1 layer's odd schedule left out)
    deeper = {**by_layers, 1: {"temp_bytes": 99, "argument_bytes": 100, "input_bytes": {"params": 1}},
              4: {"temp_bytes": 19, "argument_bytes": 250, "input_bytes": {"params": 1}}}
    full = memory_plan.extrapolate(deeper, 28)
    assert full["temp_bytes"] == 19 + 24 * 3 and full["argument_bytes"] == 250 + 24 * 50


def test_layers_none_compiles_the_full_depth_itself():
    two_layers = hf.hf_config_for(model.get_config("tiny", n_layers=2), dtype="float32")
    row = memory_plan.plan(two_layers, memory_plan.after(TINY_PLAN), "cpu", layers=None)
    assert (row["n_layers"], row["extrapolated"], list(row["compiled"])) == (2, False, ["2"])
    assert row["full_depth"]["total_bytes"] == row["compiled"]["2"]["total_bytes"]


def test_a_full_depth_the_chip_refuses_is_extrapolated_and_the_refusal_kept(monkeypatch):
    """The TPU compiler refuses a program whose temporaries exceed the chip's HBM: that row
    falls back to compiles at REFUSED_LAYERS and says why."""
    eight_layers = hf.hf_config_for(model.get_config("tiny", n_layers=8), dtype="float32")
    compile_for = plan_lib.analyse
    refusal = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
               "(42.92G) exceeds available HBM (15.75G).")

    def analyse(hf_config, cfg, target):
        if cfg.n_layers == 8:
            raise jax.errors.JaxRuntimeError(refusal)
        return compile_for(hf_config, cfg, target)

    monkeypatch.setattr(plan_lib, "analyse", analyse)
    row = memory_plan.plan(eight_layers, memory_plan.after(TINY_PLAN), "cpu", layers=None)
    assert row["refused_at_full_depth"] == refusal
    assert (row["extrapolated"], sorted(row["compiled"])) == (True, [str(n) for n in plan_lib.REFUSED_LAYERS])
    line = memory_plan.extrapolate({n: row["compiled"][str(n)] for n in (2, 4)}, 8)
    # the temporaries are the compiler's own figure for the refused program; the rest is the line's
    assert row["full_depth"]["temp_bytes"] == 42.92 * 2**30 and "peak_bytes" not in row["full_depth"]
    assert row["full_depth"]["total_bytes"] == (line["argument_bytes"] + line["output_bytes"] + 42.92 * 2**30
                                                - line["alias_bytes"])
    assert all(row["full_depth"][k] == line[k] for k in ("argument_bytes", "output_bytes", "alias_bytes"))


def test_the_memory_group_refuses_an_unknown_target(tmp_path, capsys):
    import argparse

    from tunix_nb.bench import memory as memory_group

    options = argparse.Namespace(targets="cpu,tpu-v9", full_depth=False, vocab_chunk=8192, seq_chunk=256,
                                 command_line="python -m tunix_nb.bench --only memory --targets cpu,tpu-v9")
    assert memory_group.run_alone(tmp_path, quick=True, options=options) == 2
    assert "--targets cpu,tpu-v9: choose from cpu, v5e, v5e-8" in capsys.readouterr().err
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.parametrize("field, value", [("strategy", "dora"), ("base_dtype", "float16"), ("batch_size", 0),
                                          ("n_layers", 0), ("vocab_chunk", True), ("seq_chunk", 4)])
def test_bad_plan_options_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"PlanConfig.{field}"):
        memory_plan.PlanConfig(**{field: value})


def test_the_shipped_model_configs_read_as_the_published_shapes():
    qwen3 = hf.model_config(memory_plan.read_model_config("Qwen3-0.6B"))
    llama = hf.model_config(memory_plan.read_model_config("Llama-3.2-1B"))
    assert (qwen3.vocab_size, qwen3.d_model, qwen3.n_layers, qwen3.n_heads, qwen3.kv_heads, qwen3.head_size,
            qwen3.qk_norm, qwen3.tie_embeddings) == (151_936, 1024, 28, 16, 8, 128, True, True)
    assert (llama.vocab_size, llama.d_model, llama.d_ff, llama.n_layers, llama.n_heads, llama.kv_heads,
            llama.head_size, llama.rope_scaling.factor) == (128_256, 2048, 8192, 16, 32, 8, 64, 32.0)


def stored_plans() -> dict:
    return json.loads(STORED.read_text())["memory"]


def test_lesson_09s_copy_of_the_stored_plans_is_the_bench_record():
    """results/memory.json, which lesson 09 reads (memory_plan.fit.stored_row), holds what
    results/bench.json's "memory" record holds."""
    assert memory_plan.fit.RESULTS == ROOT / "results" / report.COPY
    assert json.loads(memory_plan.fit.RESULTS.read_text()) == stored_plans()


def test_the_stored_memory_results_have_their_fields():
    results = stored_plans()
    assert results["settings"]["batch_size"] == 8 and results["settings"]["seq_len"] == 1024
    assert results["settings"]["compute_dtype"] == "bfloat16"
    assert results["rows"], "results/bench.json holds no memory plan; run python -m tunix_nb.bench --only memory"
    for row in results["rows"]:
        full = row["full_depth"]
        assert full["total_bytes"] == pytest.approx(full["argument_bytes"] + full["output_bytes"]
                                                    + full["temp_bytes"] - full["alias_bytes"])
        assert row["total_gib"] == pytest.approx(full["total_bytes"] / 2**30)
        assert row["extrapolated"] == (str(row["n_layers"]) not in row["compiled"])
        assert (row["variant"] != "before") == (full["alias_bytes"] > 0), (row["model"], row["strategy"])
        assert report.extrapolation_holds(row) or row["target_gib"] is None  # no target judged on a bad line
        if row["target_gib"] is not None:
            assert row["meets_target"] == (row["total_gib"] <= row["target_gib"])
    pairs = {(r["model"], r["strategy"], r["target"], r["variant"]) for r in results["rows"]}
    for model_name, strategy, target, _ in pairs:
        if target != "v5e-8":  # before and after side by side
            assert {(model_name, strategy, target, v) for v in report.VARIANTS} <= pairs


def test_the_stored_rows_are_the_before_and_after_steps():
    results = stored_plans()
    for row in results["rows"]:
        cfg = memory_plan.PlanConfig(**row["config"])
        make = memory_plan.before if row["variant"] == "before" else memory_plan.after
        expected = make(memory_plan.PlanConfig(strategy=row["strategy"]))
        assert (cfg.donate, cfg.base_dtype, cfg.remat) == (expected.donate, expected.base_dtype, expected.remat)
        assert (cfg.vocab_chunk is not None) == (row["variant"] == report.CHUNKED)


def test_the_stored_chunked_rows_hold_no_float32_logits():
    """The "after, chunked" rows (chunked log-probs) on one v5e chip: no float32 [B, L, V]
    array in the compiled program at any depth compiled, for every row with a target."""
    results = stored_plans()
    chunked = [r for r in results["rows"] if r["variant"] == report.CHUNKED]
    assert {(r["model"], r["strategy"]) for r in chunked if r["target"] == "v5e"} == set(report.QUICK_ROWS)
    assert results["settings"]["command"].startswith("python -m tunix_nb.bench --only memory")
    for row in chunked:
        for compiled in row["compiled"].values():
            assert compiled["vocab_chunk_used"] == row["config"]["vocab_chunk"]
            assert compiled["hlo_buffers"]["f32_BxLxV"] == 0, (row["model"], row["strategy"])


def test_before_rows_compute_in_float32_and_after_rows_in_the_compute_dtype():
    """The before rows rebuild the pre-issue step, whose activations were float32 after the
    embedding whatever the params' dtype; the default config now follows the params."""
    hf_config = hf.read_config(QWEN3_FIXTURE)
    base = memory_plan.PlanConfig(strategy="lora", batch_size=2, seq_len=8)
    assert plan_lib.kit_config(hf_config, memory_plan.before(base)).dtype == "float32"
    assert plan_lib.kit_config(hf_config, memory_plan.after(base)).dtype == "bfloat16"
