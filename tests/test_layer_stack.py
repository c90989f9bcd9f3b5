"""--scan-layers trains the blocks' parameters stacked on a layer axis (tunix_nb.layer_stack):
the same steps as one tree per block, a compile that does not grow with the depth, checkpoints
that convert between the two layouts, and exports in the model's own layout."""

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tunix_nb import checkpoint, compare, data, layer_stack, lora, model, peft_adapter, sft, train
from tunix_nb.cli.methods import Method, stack_layers
from tunix_nb.tokenizer import ByteTokenizer

QWEN3 = str(Path(__file__).parent / "fixtures" / "hf" / "qwen3")


def student(n_layers: int = 2, preset: str = "student"):
    return model.split(model.make_model(preset, n_layers=n_layers, scan_layers=True))


def optimizer(clip_norm: float = 1.0):
    return train.make_optimizer(train.OptimizerConfig(learning_rate=1e-2, warmup_steps=1, total_steps=10,
                                                      clip_norm=clip_norm))


def test_stack_and_unstack_are_inverse_through_states_and_optimizer_states():
    graphdef, params = student(3)
    stacked = layer_stack.stack(params)
    assert set(stacked) == {"embed", "final_norm", layer_stack.STACKED}
    assert stacked[layer_stack.STACKED]["attn"]["q"]["kernel"].shape == (3, 64, 64)
    assert compare.bitwise_equal(layer_stack.into_state(stacked, params), params)
    host = layer_stack.unstack(jax.tree.map(np.asarray, stacked), on_host=True)
    assert compare.bitwise_equal(host, nnx.to_pure_dict(params))
    opt_state = optimizer().init(params)  # holds nnx States
    assert layer_stack.is_stacked(layer_stack.stack(opt_state)) and not layer_stack.is_stacked(opt_state)
    stacked_opt = layer_stack.convert(opt_state, optimizer().init(stacked))
    assert jax.tree.structure(stacked_opt) == jax.tree.structure(optimizer().init(stacked))


def test_stacking_can_free_the_blocks_it_was_handed():
    _, params = student(2)
    blocks = jax.tree.leaves(nnx.to_pure_dict(params)["blocks"])
    layer_stack.stack(params, delete_blocks=True)
    assert all(leaf.is_deleted() for leaf in blocks)


def test_blocks_that_cannot_be_stacked_are_named():
    block = {"kernel": jnp.zeros((4, 4))}
    with pytest.raises(ValueError, match="The blocks differ in their parameters"):
        layer_stack.stack({"blocks": {0: block, 1: {"kernel": jnp.zeros((4, 8))}}})
    with pytest.raises(ValueError, match=r"numbered \[0, 2\], not 0..1"):
        layer_stack.stack({"blocks": {0: block, 2: block}})


def reversed_blocks(stacked):
    """The stack with its blocks in reverse order: the stacked step run on it trains the blocks
    in reverse order (a known-wrong stack), with the program the stacked way already compiled."""
    return {**stacked, layer_stack.STACKED: jax.tree.map(lambda x: x[::-1], stacked[layer_stack.STACKED])}


def steps_each_way(clip_norm: float):
    """(start, {way: (params, metrics)}): three steps of full fine-tuning from the same start and
    batches, one tree per block ("plain"), stacked, and stacked with the blocks run in reverse
    ("wrong": handed to the step reversed, and turned back after)."""
    rows = data.sft_arrays(data.load_sft()[:48], ByteTokenizer(), data.DEFAULT_SEQ_LEN)
    ends = {}
    for way in ("plain", "stacked", "wrong"):
        graphdef, params = student(preset="tiny")
        start = jax.tree.map(jnp.copy, params)
        method = Method(graphdef, params, {}, sft.objective(graphdef))
        method = method if way == "plain" else stack_layers(method)
        opt = optimizer(clip_norm)
        step = train.make_step(method.objective, opt)
        p = reversed_blocks(method.params) if way == "wrong" else method.params
        o = opt.init(p)
        for k in range(3):
            p, o, metrics = step(p, o, {key: jnp.asarray(v[16 * k:16 * (k + 1)]) for key, v in rows.items()})
        ends[way] = (p if way == "plain" else method.unstack(reversed_blocks(p) if way == "wrong" else p), metrics)
    return start, ends


def stack_bound(params) -> float:
    """How far apart (`relative_distance`) the stacked and the plain runs may end where the clip
    acts: its global norm sums the squares of every trained entry in another order, a relative
    error of at most float32's bound on that many terms, which scales each clipped step alike
    (AdamW's own last-bit differences are far below it); per distance travelled, the steps'
    errors add up to no more than that."""
    return compare.float32_bound(sum(x.size for x in jax.tree.leaves(params)))


def test_a_step_on_the_stack_is_the_step_per_block():
    """The clip aside (a norm it never reaches), the stack's step is the plain step, bit for bit:
    the same arithmetic; blocks run in reverse order (the known-wrong stack) end over 100 times
    further than `stack_bound`, the bound the clip's reordering is held to where it acts (LoRA,
    through the command: test_the_command_resumes_across_layouts_and_exports_the_models_layout)."""
    start, ends = steps_each_way(clip_norm=1e9)
    assert compare.bitwise_equal(ends["stacked"][0], ends["plain"][0])
    assert compare.relative_distance(ends["wrong"][0], ends["plain"][0], start) > 100 * stack_bound(start)


def compile_seconds(n_layers: int, clip_norm: float) -> float:
    """XLA's compile of the command's stacked step (`stack_layers`), full fine-tuning."""
    graphdef, params = student(n_layers)
    method = stack_layers(Method(graphdef, params, {}, sft.objective(graphdef)))
    tokens = jax.random.randint(jax.random.key(0), (4, 64), 0, 200)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, 1), "attention_mask": jnp.ones_like(tokens),
             "loss_mask": jnp.ones((4, 64), jnp.float32)}
    opt = optimizer(clip_norm)
    lowered = train.make_step(method.objective, opt).lower(method.params, opt.init(method.params), batch)
    start = time.perf_counter()
    lowered.compile()
    return time.perf_counter() - start


def depth_ratio(clip_norm: float) -> float:
    """28-layer / 2-layer compile seconds: one compile each, a second (the best of two) only where
    the first ratio is over 1.5, as a busy machine's timing can be."""
    seconds = {n: compile_seconds(n, clip_norm) for n in (2, 28)}
    if seconds[28] > 1.5 * seconds[2]:
        seconds = {n: min(s, compile_seconds(n, clip_norm)) for n, s in seconds.items()}
    return seconds[28] / seconds[2]


def test_the_compile_does_not_grow_with_depth():
    """The command's stacked step at 28 layers compiles in at most 1.5x its 2-layer time (the
    best of two where the first is over). Each run's steps are new to JAX's persistent cache,
    which would otherwise answer from earlier runs: the clip norm, a constant in the compiled
    program (and so in the cache's key), differs in its last digits each run, and nothing
    compiled here is written to the cache. One tree per block took 3.74x
    (results/compile_costs/depth_cpu.json). LoRA's blocks, each named by qwix with its index,
    ran as a loop until the scan learned to name them as block 0's: that the adapted blocks
    lower to one loop is test_model's test_scanned_blocks_compute_the_unrolled_models_logits_..."""
    import random

    minimum = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        ratio = depth_ratio(clip_norm=1.0 + random.random() * 1e-6)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", minimum)
    assert ratio <= 1.5, ratio


def test_checkpoints_convert_between_the_layouts(tmp_path):
    """A state saved one tree per block (every checkpoint before the stack) restores into a
    stacked run, and a stacked one into a run per block, bit for bit; `load_params` reads a
    stacked checkpoint in the model's own layout."""
    graphdef, params = student(2)
    opt = optimizer()
    plain = (params, opt.init(params))
    stacked = layer_stack.stack(plain)
    for name, saved, like in (("plain", plain, stacked), ("stacked", stacked, plain)):
        manager = checkpoint.make_manager(tmp_path / name, async_save=False)
        checkpoint.save(manager, 1, params=saved[0], opt_state=saved[1], meta={})
        restored = checkpoint.restore(manager, params_like=like[0], opt_state_like=like[1], plain_like=plain)
        assert compare.bitwise_equal(restored[:2], like) and jax.tree.structure(restored[1]) == jax.tree.structure(like[1])
    assert compare.bitwise_equal(checkpoint.load_params(tmp_path / "stacked"), nnx.to_pure_dict(params))
    with pytest.raises(checkpoint.LayoutError, match="one tree per block and this run stacks them; pass plain_like"):
        checkpoint.restore(checkpoint.make_manager(tmp_path / "plain"), params_like=stacked[0],
                           opt_state_like=stacked[1], step=1)


def test_the_command_resumes_across_layouts_and_exports_the_models_layout(tmp_path):
    """LoRA on the Qwen3 fixture, in-process, in float32 on every backend (the command's "auto"
    is the backend's own dtype: bfloat16 on a TPU, where the two layouts' programs round apart by
    far more than the clip's reordering). Stopped after 2 steps with --scan-layers and resumed
    without it (a stacked checkpoint read one tree per block), the run ends within the stack's
    bound of the uninterrupted stacked run (its last two steps ran one tree per block, with the
    clip acting: their gradient norms are over the default clip of 1). A run saved one tree per
    block resumes stacked: test_a_run_saved_before_the_stack_resumes_in_either_layout. The
    stacked run's exports are in the model's layout, one tensor per block: the adapters in PEFT's,
    the checkpoint's own, and the merged model (--export-params) the adapters merged into the
    Hugging Face folder's base, bit for bit, as `lora.merge` gives it."""
    from tunix_nb import cli, hf

    def run(name, *flags):
        assert cli.main(["sft", "--model", QWEN3, "--batch-size", "8", "--steps", "4", "--save-every", "2",
                         "--lora-rank", "4", "--parallel", "jit", "--compute-dtype", "float32",
                         "--ckpt-dir", str(tmp_path / name), *flags]) == 0

    run("whole", "--scan-layers", "--export-adapter", str(tmp_path / "adapter"),
        "--export-params", str(tmp_path / "merged"))
    run("cut", "--scan-layers", "--stop-after", "2")
    run("cut", "--metrics-file", str(tmp_path / "cut.jsonl"))
    plain_steps = [json.loads(line) for line in (tmp_path / "cut.jsonl").read_text().splitlines()]
    assert [row["step"] for row in plain_steps] == [3, 4] and min(row["grad_norm"] for row in plain_steps) > 1.0
    assert not checkpoint.load_meta(tmp_path / "cut").get("stacked_blocks")
    whole, cut = checkpoint.load_params(tmp_path / "whole"), checkpoint.load_params(tmp_path / "cut")
    graphdef, params, _ = hf.load_pretrained(QWEN3, dtype="float32")
    _, adapters, _, _ = peft_adapter.load_adapter(tmp_path / "adapter", graphdef, params)
    assert "blocks" in whole and compare.bitwise_equal(nnx.to_pure_dict(adapters), whole)
    # the command's adapters at step 0 (the default alpha, the rank, scales them, not their values)
    lora_graphdef, adapters, base = lora.apply(graphdef, params, rank=4, alpha=4.0, seed=0)
    start = nnx.to_pure_dict(adapters)
    assert compare.relative_distance(cut, whole, start) <= stack_bound(start)

    nnx.replace_by_pure_dict(adapters, whole)
    merged = nnx.to_pure_dict(lora.merge(lora_graphdef, adapters, base, alpha=4.0)[1])
    assert compare.bitwise_equal(checkpoint.load_params(tmp_path / "merged"), merged)


def test_a_run_saved_before_the_stack_resumes_in_either_layout(tmp_path):
    """A checkpoint the command wrote before the layer stack (tests/fixtures/pre_stack_run, from
    c8d2fab) resumes today: one tree per block, to the bits of today's uninterrupted run (the same
    first two steps); stacked (--scan-layers, through the converter), within the stack's bound of
    that run."""
    import shutil

    from tunix_nb import cli
    from tunix_nb.cli import models as cli_models

    stored = Path(__file__).parent / "fixtures" / "pre_stack_run"
    assert not checkpoint.load_meta(stored).get("stacked_blocks")
    base = ["sft", "--model", "tiny", "--batch-size", "8", "--steps", "4", "--save-every", "2",
            "--compute-dtype", "float32"]
    built = nnx.merge(*cli_models.build_model(cli.config_from_argv([*base, "--scan-layers", "--remat"]))[:2]).cfg
    assert (built.scan_layers, built.remat) == (True, True)  # the model runs its blocks as one scan
    for name, flags in (("plain", []), ("stacked", ["--scan-layers"])):
        shutil.copytree(stored, tmp_path / name)
        assert cli.main([*base, "--ckpt-dir", str(tmp_path / name), *flags]) == 0
    assert cli.main([*base, "--ckpt-dir", str(tmp_path / "whole")]) == 0
    whole, plain, stacked = (checkpoint.load_params(tmp_path / name) for name in ("whole", "plain", "stacked"))
    start = nnx.to_pure_dict(model.split(model.make_model("tiny", seed=0))[1])
    assert compare.bitwise_equal(plain, whole)
    assert compare.relative_distance(stacked, whole, start) <= stack_bound(start)


def test_the_shipped_checkpoints_start_a_stacked_run(tmp_path):
    """data/'s checkpoints (one tree per block, written before the stack) start a --scan-layers
    run: dpo's policy is data/sft_student's parameters bit for bit, and a stacked step runs from
    them and saves a stacked checkpoint that reads back in the model's layout."""
    from tunix_nb import cli
    from tunix_nb.cli import models as cli_models

    argv = ["dpo", "--steps", "1", "--batch-size", "4", "--scan-layers", "--compute-dtype", "float32"]
    _, params, _ = cli_models.build_model(cli.config_from_argv(argv))
    shipped = checkpoint.load_params(data.DATA_DIR / "sft_student")
    assert compare.bitwise_equal(nnx.to_pure_dict(params), shipped)
    assert cli.main([*argv, "--ckpt-dir", str(tmp_path / "run")]) == 0
    assert checkpoint.load_meta(tmp_path / "run").get("stacked_blocks")
    trained = checkpoint.load_params(tmp_path / "run")
    def shapes(tree):  # by name: the shipped files' block keys read back as strings, a fresh save's as ints
        return {model.param_name(path): x.shape for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    assert shapes(trained) == shapes(shipped) and compare.max_abs_diff(trained, shipped) > 0


def test_a_lora_base_is_handed_over_stacked():
    """--scan-layers with LoRA stacks the frozen base too, freeing its per-block arrays: one tree
    per block, the model's scan would stack a copy of the whole base inside every step (1.69 GB of
    the chip's temporaries at Qwen3-0.6B's shapes: results/tpu_v5e_training/base_stack_plan.json).
    The command's merged export from such a run:
    test_the_command_resumes_across_layouts_and_exports_the_models_layout."""
    graphdef, params = student(preset="tiny")
    graphdef, adapters, base = lora.apply(graphdef, params, rank=4, alpha=8.0)
    a_base_block = jax.tree.leaves(nnx.to_pure_dict(base)["blocks"][0])[0]
    method = stack_layers(Method(graphdef, adapters, {}, lora.objective(sft.objective(graphdef)),
                                 frozen=lora.frozen(base)))
    assert layer_stack.is_stacked(method.frozen["base"]) and layer_stack.is_stacked(method.params)
    assert a_base_block.is_deleted()
