"""The lora group: LoRA and QLoRA against full fine-tuning of the same model on the same batches."""

from __future__ import annotations

import tempfile
from pathlib import Path

from tunix_nb.bench.common import cost, figure, interleaved_medians, interleaved_times, medians, spread_of_ratio, \
    timed_figure

FIGURES = {"lora_optimizer_state_share": (None, None), "lora_step_time_ratio": (None, None),
           "lora_exact_match_over_full": (None, None)}


LORA_SETTINGS = (("full", None, "none", 1e-3), ("lora r1", 1, "none", 1e-2), ("lora r4", 4, "none", 1e-2),
                 ("lora r16", 16, "none", 1e-2), ("qlora nf4 r16", 16, "nf4", 1e-2))
# --quick: the settings the figures read (each setting compiles a step and a decoder)
QUICK_LORA_SETTINGS = tuple(s for s in LORA_SETTINGS if s[0] in ("full", "lora r16", "qlora nf4 r16"))


def measure(*, quick: bool, repeats: int) -> dict:
    if quick:
        return bench_lora(repeats, steps=10, n_eval=50, settings=QUICK_LORA_SETTINGS)
    return bench_lora(repeats, steps=300, n_eval=200)


def lora_setups(graphdef, params, settings=LORA_SETTINGS):
    """{name: (graphdef, trained, frozen, objective, learning_rate, base)} for each setting."""
    from tunix_nb import lora, sft

    out = {}
    for name, rank, quantize, learning_rate in settings:
        if rank is None:
            out[name] = (graphdef, params, None, sft.objective(graphdef), learning_rate, None)
            continue
        lora_graphdef, adapters, base = lora.apply(graphdef, params, rank=rank, alpha=float(rank), quantize=quantize)
        out[name] = (lora_graphdef, adapters, lora.frozen(base), lora.objective(sft.objective(lora_graphdef)),
                     learning_rate, base)
    return out


def _saved_bytes(params, opt_state) -> int:
    """Bytes on disk of a checkpoint of (params, opt_state), as the training command writes it."""
    from tunix_nb import checkpoint

    with tempfile.TemporaryDirectory(dir=".") as root:
        manager = checkpoint.make_manager(Path(root) / "ck", keep=1, async_save=False)
        checkpoint.save(manager, 1, params=params, opt_state=opt_state, meta={}, force=True)
        manager.wait_until_finished()
        manager.close()
        return sum(f.stat().st_size for f in Path(root).rglob("*") if f.is_file())


def _thin_matmul_profile(rows, graphdef, params, repeats, ranks=(1, 4, 16)) -> dict:
    """The adapter path (x A) B of one d x d projection against the dense x W it adds to:
    time and FLOPs of each relative to the dense matmul, timed in turns."""
    import jax
    from flax import nnx

    d = nnx.merge(graphdef, params).cfg.d_model
    x = jax.random.normal(jax.random.key(0), (rows, d))
    w = jax.random.normal(jax.random.key(1), (d, d))
    fns = {"dense": jax.jit(lambda x: x @ w)}
    for r in ranks:
        a, b = jax.random.normal(jax.random.key(2), (d, r)), jax.random.normal(jax.random.key(3), (r, d))
        fns[f"r{r}"] = jax.jit(lambda x, a=a, b=b: (x @ a) @ b)
    seconds = interleaved_medians({k: (lambda f=f: f(x)) for k, f in fns.items()}, repeats=max(repeats, 10))
    return {k: {"time_over_dense": seconds[k] / seconds["dense"],
                "flops_over_dense": 1.0 if k == "dense" else 2 * int(k[1:]) / d, "seconds": seconds[k]}
            for k in fns}


def bench_lora(repeats, steps=300, n_eval=200, batch_size=64, settings=LORA_SETTINGS):
    """LoRA and QLoRA against full fine-tuning of the same model on the same batches.

    From the shipped SFT student (55% held-out exact match), `steps` SFT steps on fresh
    prompts of the task (none a training or held-out prompt) for each setting: what
    trains, its optimizer state, the checkpoint on disk, the step's time (all settings
    timed in turns) and XLA's FLOP count, and the held-out exact match after. Alpha =
    rank (scale 1, as Tunix's examples); LoRA's learning rate is 10x full fine-tuning's.
    """
    import jax

    from tunix_nb import checkpoint, data, evaluate, lora, train
    from tunix_nb.tokenizer import ByteTokenizer

    graphdef, params, _ = checkpoint.load_model(data.DATA_DIR / "sft_student")
    held_out = data.load_sft(data.DATA_DIR / "sft_eval.jsonl")[:n_eval]
    seen = [e["prompt"] for e in data.load_sft() + data.load_sft(data.DATA_DIR / "sft_eval.jsonl")]
    rows = data.sft_arrays(data.generate_sft(steps * batch_size, seed=8, exclude=seen), ByteTokenizer(),
                           data.DEFAULT_SEQ_LEN)
    batch = data.batch_at(rows, 0, batch_size, seed=0)
    table, steps_fns = {}, {}
    for name, (g, trained, frozen, objective, lr, base) in lora_setups(graphdef, params, settings).items():
        opt = train.make_optimizer(train.OptimizerConfig(learning_rate=lr, warmup_steps=5, total_steps=steps))
        step = train.make_step(objective, opt)
        opt_state = opt.init(trained)
        steps_fns[name] = (lambda step=step, t=trained, o=opt_state, f=frozen: step(t, o, batch, f))
        out, out_state, history = train.run(step, trained, opt_state, lambda s: data.batch_at(rows, s, batch_size, seed=0),
                                            steps=steps, frozen=frozen, progress=False)
        model_state = out if base is None else lora.combine(out, base)
        table[name] = {
            "trainable_params": lora.count(trained), "optimizer_state_bytes": sum(x.nbytes for x in jax.tree.leaves(opt_state)),
            "frozen_bytes": 0 if base is None else sum(x.nbytes for x in jax.tree.leaves(base)),
            "checkpoint_bytes": _saved_bytes(out, out_state), "step_flops": cost(step, trained, opt_state, batch, frozen)["flops"],
            "loss_first": history[0]["loss"], "loss_last": history[-1]["loss"],
            "exact_match": evaluate.exact_match_accuracy(g, model_state, held_out, batch_size=n_eval)}
    step_times = interleaved_times(steps_fns, repeats=repeats)
    seconds = medians(step_times)
    total = table["full"]["trainable_params"]
    for name, row in table.items():
        row["trainable_share"] = row["trainable_params"] / total
        row["step_seconds"] = seconds[name]
    before = evaluate.exact_match_accuracy(graphdef, params, held_out, batch_size=n_eval)
    profile = _thin_matmul_profile(batch_size * data.DEFAULT_SEQ_LEN, graphdef, params, repeats)
    common = dict(table=table, exact_match_before=before, steps=steps, batch_size=batch_size, held_out=n_eval,
                  model="student (data/sft_student)", repeats=repeats)
    full, r16 = table["full"], table["lora r16"]
    return {**figure(FIGURES, "lora_optimizer_state_share",
                     r16["optimizer_state_bytes"] / full["optimizer_state_bytes"],
                     **common, note="LoRA rank 16 / full fine-tuning, AdamW state bytes"),
            **timed_figure(FIGURES, "lora_step_time_ratio", spread_of_ratio(step_times, "lora r16", "full"),
                           qlora_ratio=table["qlora nf4 r16"]["step_seconds"] / full["step_seconds"],
                           flops_ratio=r16["step_flops"] / full["step_flops"], thin_matmul_profile=profile,
                           note="LoRA rank 16 step / full fine-tuning step, one device, timed in turns"),
            **figure(FIGURES, "lora_exact_match_over_full", r16["exact_match"] / full["exact_match"],
                     note=f"held-out exact match after {steps} steps, LoRA rank 16 / full fine-tuning")}
