"""The backward-pass fix, its profile, rematerialisation and the benchmark's spreads."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb import bench, compare, lora, model, sft, train


def mlp_heavy_model():
    """A model whose MLP dominates, as the benchmark's (d_ff = 3 x d_model)."""
    cfg = model.get_config("tiny", d_model=64, n_layers=2, n_heads=2, d_ff=192)
    return model.split(model.make_model(cfg, seed=0))


def sft_batch(batch=4, seq_len=32, vocab=259):
    tokens = np.random.default_rng(0).integers(3, vocab, (batch, seq_len + 1)).astype(np.int32)
    mask = np.ones((batch, seq_len), np.int32)
    mask[0, :5] = 0  # a left-padded row
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask.astype(np.float32),
            "attention_mask": mask}


def loss_and_grads(graphdef, params, batch):
    objective = sft.objective(graphdef)
    return jax.jit(jax.value_and_grad(lambda p: objective(p, batch)[0]))(params)


@pytest.mark.cpu_only(reason="XLA's CPU dot gives a [B, L, D] and a [B*L, D] product the same bits; a TPU tiles "
                             "the two shapes differently (test_remat_gives_the_same_update checks agreement there)")
@pytest.mark.parametrize("preset", ["tiny", "student", "teacher"])
def test_linears_on_token_rows_give_the_same_bits(preset):
    """model.per_token reshapes, nothing else: logits, loss and gradients are bitwise those
    of the model before the fix (every Linear applied to [B, L, D])."""
    graphdef, params = model.split(model.make_model(preset, seed=1))
    batch = sft_batch()
    loss, grads = loss_and_grads(graphdef, params, batch)
    apply = jax.jit(model.apply, static_argnums=0)
    logits = apply(graphdef, params, batch["inputs"], batch["attention_mask"])
    with bench.linears_on_token_grid():
        loss_before, grads_before = loss_and_grads(graphdef, params, batch)
        logits_before = jax.jit(model.apply, static_argnums=0)(graphdef, params, batch["inputs"],
                                                                batch["attention_mask"])
    assert np.array_equal(logits, logits_before) and float(loss) == float(loss_before)
    assert compare.max_abs_diff(grads, grads_before) == 0.0


def silu_gradient_layout_copies(graphdef, params, batch) -> int:
    """Ops in the compiled backward pass that come from SiLU's gradient and write a
    transposed copy: the culprit the benchmark's op profile found."""
    objective = sft.objective(graphdef)
    hlo = jax.jit(jax.grad(lambda p: objective(p, batch)[0])).lower(params).compile().as_text()
    lines = [line for line in hlo.splitlines() if "transpose(jvp(jit(silu)))" in line and " = " in line]
    return sum(1 for line in lines if re.search(r"= \S+ (copy|transpose)\(", line) or
               re.match(r"\s*%?\S*copy\S* = ", line))


@pytest.mark.cpu_only(reason="the transposed copy is XLA's CPU code for SiLU's gradient on [B, L, D]; the TPU's "
                             "compiled step had none before the fix either (share s3 of the chip's run)")
def test_the_fix_removes_the_transposed_copy_of_silus_gradient():
    graphdef, params = mlp_heavy_model()
    batch = sft_batch()
    with bench.linears_on_token_grid():
        before = silu_gradient_layout_copies(graphdef, params, batch)
    assert before >= 1  # one per layer's MLP on XLA's CPU backend
    assert silu_gradient_layout_copies(graphdef, params, batch) == 0


def test_op_profile_names_the_ops_and_where_they_come_from():
    graphdef, params = mlp_heavy_model()
    batch = sft_batch()
    opt = train.make_optimizer(train.OptimizerConfig(total_steps=100))
    args = (params, opt.init(params), batch)
    compiled = train.make_step(sft.objective(graphdef), opt).lower(*args).compile()
    profile = bench.op_profile(compiled, args, calls=2)
    assert profile["traced_seconds"] > 0 and 0 <= profile["layout_copy_share"] < 1
    assert sum(k["share"] for k in profile["by_kind"]) <= 1 + 1e-9
    # each op with its shape, and (where XLA kept it) the JAX operation it came from
    assert profile["top_ops"] and all(op["shape"] for op in profile["top_ops"])
    assert any(op["source"].startswith("jit(step)/") for op in profile["top_ops"])
    # the matmuls: by kind on a CPU (XLA's "dot", XNNPACK's "ynn" fusions); a TPU names its fusions
    # otherwise (e.g. "convolution"), so also by the JAX operation a top op comes from
    assert (any(re.search("dot|ynn|convolution", k["kind"]) for k in profile["by_kind"])
            or any(op["source"].endswith("dot_general") for op in profile["top_ops"]))


def test_remat_gives_the_same_update_and_is_switched_on_a_built_model():
    graphdef, params = mlp_heavy_model()
    remat_graphdef = model.with_remat(graphdef, params)
    assert nnx_cfg(remat_graphdef, params).remat and not nnx_cfg(graphdef, params).remat
    batch = sft_batch()
    opt = train.make_optimizer(train.OptimizerConfig(total_steps=100))
    out = {}
    for name, g in (("plain", graphdef), ("remat", remat_graphdef)):
        step = train.make_step(sft.objective(g), opt)
        p, s = params, opt.init(params)
        for _ in range(3):
            p, s, metrics = step(p, s, batch)
        out[name] = (p, metrics)
    assert compare.max_abs_diff(out["plain"][0], out["remat"][0]) <= 1e-6
    # decoding with a cache never rematerialises, and gives the same logits for real tokens
    cache = model.init_cache(remat_graphdef, params, 4, 40)
    logits, _ = model.extend(remat_graphdef, params, batch["inputs"], batch["attention_mask"], cache, 0)
    real = batch["attention_mask"].astype(bool)
    full = model.apply(graphdef, params, batch["inputs"], batch["attention_mask"])
    assert np.allclose(np.asarray(logits)[real], np.asarray(full)[real], atol=1e-5)


def nnx_cfg(graphdef, params):
    from flax import nnx

    return nnx.merge(graphdef, params).cfg


def test_remat_keeps_less_alive_under_a_memory_aware_schedule():
    """XLA's temporary bytes of the compiled step: smaller with remat (by default on CPU a
    little; the benchmark also measures XLA's memory-minimising CPU schedule)."""
    memory = bench.temp_bytes(bench.remat_programs(4, 128))
    assert memory["remat"] < memory["plain"]


def test_remat_composes_with_lora():
    graphdef, params = mlp_heavy_model()
    batch = sft_batch()
    grads = {}
    for name, g in (("plain", graphdef), ("remat", model.with_remat(graphdef, params))):
        lora_graphdef, adapters, base = lora.apply(g, params, rank=4, seed=0)
        objective = lora.objective(sft.objective(lora_graphdef))
        grads[name] = jax.jit(jax.grad(lambda a: objective(a, batch, lora.frozen(base))[0]))(adapters)
    largest = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(grads["plain"]))
    assert largest > 0 and compare.max_abs_diff(grads["plain"], grads["remat"]) <= 1e-5 * largest


def test_the_training_command_takes_remat_and_resumes_either_way(tmp_path):
    from tunix_nb import checkpoint
    from tunix_nb import cli as cli_module

    # float32: "auto" is bfloat16 on an accelerator, where remat's recomputation may round otherwise
    base = ["sft", "--model", "tiny", "--batch-size", "16", "--steps", "6", "--save-every", "3",
            "--compute-dtype", "float32"]
    assert cli_module.main([*base, "--ckpt-dir", str(tmp_path / "plain")]) == 0
    assert cli_module.main([*base, "--remat", "--stop-after", "3", "--ckpt-dir", str(tmp_path / "remat")]) == 0
    # not run-defining: the same run continues without it
    assert cli_module.main([*base, "--ckpt-dir", str(tmp_path / "remat")]) == 0
    assert compare.max_abs_diff(checkpoint.load_params(tmp_path / "plain"),
                                checkpoint.load_params(tmp_path / "remat")) <= 1e-6


def test_spread_and_per_round_ratios():
    s = bench.spread([3.0, 1.0, 2.0, 4.0])
    assert s == {"median": 2.5, "q25": 1.75, "q75": 3.25, "min": 1.0, "max": 4.0, "rounds": 4}
    times = {"a": [2.0, 4.0, 9.0], "b": [1.0, 2.0, 3.0]}
    assert bench.spread_of_ratio(times, "a", "b")["median"] == 2.0  # per round: 2, 2, 3


def test_a_quick_figure_is_not_compared_with_its_target():
    fig = {"value": 0.3, "target": 0.45, "target_kind": "min", "meets_target": False,
           "spread": bench.spread([0.3, 0.31, 0.29])}
    assert bench.describe(fig).endswith("target >= 0.45 MISSED")
    assert "IQR 0.295-0.305, 3 rounds" in bench.describe(fig)
    assert bench.describe({**fig, "comparable_to_target": False}).endswith("[--quick: not comparable to the target]")


def test_met_needs_every_round_on_the_targets_side():
    """The all-reduce share's stored rounds run from -2.5% to 5.2% around a median of 3.2%: the
    median meets the 5% target, the rounds do not all."""
    fig = {"value": 0.032, "target": 0.05, "target_kind": "max", "meets_target": True,
           "spread": bench.spread([-0.025, 0.007, 0.032, 0.040, 0.052])}
    assert bench.describe(fig).endswith("target <= 0.05 met by the median only (its rounds cross the target)")
    assert bench.describe({**fig, "spread": bench.spread([0.01, 0.03, 0.04])}).endswith("target <= 0.05 met")
    assert bench.describe({**fig, "value": 0.06, "meets_target": False}).endswith("MISSED")


def test_the_compile_cache_lives_outside_the_repository_and_can_be_switched_off(monkeypatch, tmp_path):
    from pathlib import Path

    from tunix_nb import devices

    repo = Path(__file__).resolve().parent.parent
    monkeypatch.delenv(devices.COMPILE_CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert devices.compile_cache_dir() == tmp_path / "tunix_nb" / "jax"
    monkeypatch.setenv(devices.COMPILE_CACHE_ENV, "off")
    assert devices.compile_cache_dir() is None and devices.use_compile_cache() is None
    monkeypatch.setenv(devices.COMPILE_CACHE_ENV, str(tmp_path / "mine"))
    assert devices.compile_cache_dir() == tmp_path / "mine"
    # the suite itself (conftest.py) runs with the cache on, outside the repository,
    # unless whoever runs it switched it off
    if jax.config.jax_compilation_cache_dir is None:
        pytest.skip("the suite runs with the compilation cache switched off (TUNIX_NB_COMPILE_CACHE=off)")
    cache = Path(jax.config.jax_compilation_cache_dir)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    assert repo not in cache.resolve().parents


def test_a_cached_program_is_read_back_by_a_new_process(tmp_path):
    """Two fresh processes compile the same step with the cache in tmp_path: the second
    reads it back (a cache hit, JAX's own log says so) and computes the same loss."""
    import os
    import subprocess
    import sys

    code = ("import jax, numpy as np, logging; logging.basicConfig(level=logging.DEBUG);\n"
            "from tunix_nb import model, sft\n"
            "g, p = model.split(model.make_model('tiny', seed=0))\n"
            "t = np.arange(40, dtype=np.int32).reshape(2, 20) % 259\n"
            "b = {'inputs': t, 'targets': t, 'loss_mask': np.ones(t.shape, np.float32), 'attention_mask': np.ones(t.shape, np.int32)}\n"
            "print('LOSS', float(jax.jit(lambda p: sft.objective(g)(p, b)[0])(p)))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION", "JAX_PERSISTENT"))}
    env.update(TUNIX_NB_COMPILE_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
    code = "from tunix_nb import devices; devices.use_compile_cache()\n" + code
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    losses = [next(line for line in r.stdout.splitlines() if line.startswith("LOSS")) for r in runs]
    assert losses[0] == losses[1]
    assert any((tmp_path / "cache").iterdir())
    assert "Persistent compilation cache hit" in runs[1].stderr
    assert "Persistent compilation cache hit" not in runs[0].stderr
