"""`python -m tunix_nb.bench --only memory`: the memory plans of real models' steps, before
and after the memory remedies, in one run; a table on stdout and DIR/bench.json's "memory"
record, copied to DIR/memory.json, which lesson 09 reads (`fit.stored_row`)
(`tunix_nb.bench.memory` runs it)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import jax

from tunix_nb.memory_plan import targets
from tunix_nb.memory_plan.config import PlanConfig, after, before
from tunix_nb.memory_plan.analysis import plan

GIB = 2**30
MODELS = ("Qwen3-0.6B", "Llama-3.2-1B")
ROWS = tuple((m, s) for m in MODELS for s in ("full", "lora", "qlora"))
# (model, strategy) -> the target for the v5e chip, GiB (after the remedies)
TARGET_GIB = {("Qwen3-0.6B", "lora"): 6.0, ("Qwen3-0.6B", "full"): 14.0, ("Llama-3.2-1B", "qlora"): 6.0}
QUICK_ROWS = tuple(TARGET_GIB)
CHUNKED = "after, chunked"  # the "after" step with chunked log-probs as well
VARIANTS = ("before", "after", CHUNKED)
# the chunked variant's chunks: the training command's --vocab-chunk auto, and positions 256 per row at a time
DEFAULT_VOCAB_CHUNK, DEFAULT_SEQ_CHUNK = 8192, 256
RECORD = "memory"  # the plans' key in DIR/bench.json
COPY = "memory.json"  # the same plans in a file of their own: lesson 09 reads it (fit.RESULTS)


def variant_config(cfg: PlanConfig, variant: str, vocab_chunk: int, seq_chunk: int | None) -> PlanConfig:
    """`cfg` as the variant's step: "before" the remedies, "after" them (full logits), or
    "after, chunked" (the chunked log-probs too)."""
    if variant not in VARIANTS:
        raise ValueError(f"Unknown variant {variant!r}; choose from {VARIANTS}.")
    if variant == "before":
        return before(cfg)
    return after(cfg, vocab_chunk, seq_chunk) if variant == CHUNKED else after(cfg)


def jobs(rows, target_names, variants=VARIANTS) -> list[tuple]:
    """(model, strategy, variant, target) to compile: `variants` on every target, except the
    v5e-8, where only the remedied steps are planned (fsdp is one of the remedies)."""
    return [(m, s, v, t) for t in target_names for (m, s) in rows for v in variants
            if not (t == "v5e-8" and v == "before")]


def settings(base: PlanConfig, layers, vocab_chunk, seq_chunk=None, command=None) -> dict:
    return {"batch_size": base.batch_size, "seq_len": base.seq_len, "compute_dtype": base.compute_dtype,
            "lora_rank": base.lora_rank, "layers_compiled": "full depth" if layers is None else list(layers),
            "vocab_chunk": vocab_chunk, "seq_chunk": seq_chunk, "command": command,
            "total": "argument + output + temp - alias, per device",
            "extrapolation": "none: every row compiled at the model's full depth" if layers is None else
                             "linear in depth through the two deepest depths compiled, to the model's full depth",
            "before": "no donation, float32 frozen base, full logits; remat off for full fine-tuning, on for "
                      "LoRA/QLoRA (the issue's 'today' rows)",
            "after": "donated params and optimizer state, bfloat16 frozen base, per-block remat; full logits",
            CHUNKED: f"the 'after' step with chunked log-probs (sft.objective(..., vocab_chunk={vocab_chunk}, "
                     f"seq_chunk={seq_chunk})): no [B, L, V] logits",
            "v5e_topology": targets.TOPOLOGY, "jax": jax.__version__, "machine": platform.machine()}


def run(out_dir: Path, *, rows=ROWS, target_names=targets.TARGETS, layers=(1, 2),
        vocab_chunk: int = DEFAULT_VOCAB_CHUNK, seq_chunk: int | None = DEFAULT_SEQ_CHUNK, variants=VARIANTS,
        base: PlanConfig = PlanConfig(), command: str | None = None, progress=print) -> dict:
    """Plan every job, writing the results into DIR/bench.json's "memory" record (the file's
    other records stay as they are) and into DIR/memory.json after each (a long run keeps what
    it has). `layers=None`: every row at full depth; `vocab_chunk`/`seq_chunk`: the chunked
    variant's chunks; `command`: the command line to record."""
    from tunix_nb.bench.common import store

    missing = targets.libtpu_missing()
    skipped = [t for t in target_names if t != "cpu" and missing]
    results = {"settings": settings(base, layers, vocab_chunk, seq_chunk, command),
               "skipped_targets": {t: missing for t in skipped},
               "rows": []}
    for model, strategy, variant, target in jobs(rows, [t for t in target_names if t not in skipped], variants):
        started = time.perf_counter()
        cfg = variant_config(PlanConfig(**{**_base_fields(base), "strategy": strategy}), variant, vocab_chunk,
                             seq_chunk)
        row = {"model": model, "strategy": strategy, "variant": variant, **plan(model, cfg, target, layers=layers)}
        row["total_gib"] = row["full_depth"]["total_bytes"] / GIB
        target_gib = TARGET_GIB.get((model, strategy)) if target == "v5e" and variant != "before" else None
        row["target_gib"], row["meets_target"] = target_gib, None if target_gib is None else row["total_gib"] <= target_gib
        results["rows"].append(row)
        store(out_dir, RECORD, results)
        (Path(out_dir) / COPY).write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        progress(f"{model} {strategy} {variant} {target}: {row['total_gib']:.2f} GiB "
                 f"({time.perf_counter() - started:.0f} s)")
    return results


def _base_fields(base: PlanConfig) -> dict:
    return {k: getattr(base, k) for k in ("batch_size", "seq_len", "compute_dtype", "lora_rank")}


def extrapolation_holds(row: dict) -> bool:
    """False when an extrapolated row's arguments, outputs or temporaries shrink with depth
    (XLA scheduled the deeper program differently): a line through two depths then says
    nothing; compile deeper, or at full depth."""
    if not row["extrapolated"]:
        return True
    per_layer = row["full_depth"]["per_layer"]
    return all(per_layer[k] >= 0 for k in ("argument_bytes", "output_bytes", "temp_bytes"))


def table(results: dict) -> str:
    """The rows as a text table, GiB per device at full depth (extrapolated rows marked
    with *; none where the extrapolation does not hold). total: arguments + outputs + temporaries - aliased; peak: the TPU compiler's own
    peak (the CPU backend's field holds only the arguments there, so it is left out)."""
    head = f"{'model':<14}{'strategy':<9}{'target':<7}{'variant':<16}{'args':>8}{'outputs':>9}{'temps':>8}" \
           f"{'aliased':>9}{'total':>8}{'peak':>8}  target"
    lines = [head, "-" * len(head)]
    for r in results["rows"]:
        f = r["full_depth"]
        goal = "" if r["target_gib"] is None else f"<= {r['target_gib']:g} {'met' if r['meets_target'] else 'MISSED'}"
        variant = r["variant"] + ("*" if r["extrapolated"] else "")
        if not extrapolation_holds(r):
            lines.append(f"{r['model']:<14}{r['strategy']:<9}{r['target']:<7}{variant:<16}  no estimate: its "
                         "temporaries shrink with depth; compile deeper")
            continue
        lines.append(f"{r['model']:<14}{r['strategy']:<9}{r['target']:<7}{variant:<16}"
                     + "".join(f"{f[k] / GIB:>{w}.2f}" for k, w in (("argument_bytes", 8), ("output_bytes", 9),
                                                                      ("temp_bytes", 8), ("alias_bytes", 9),
                                                                      ("total_bytes", 8)))
                     + (f"{f['peak_bytes'] / GIB:>8.2f}" if "peak_bytes" in f and r["target"] != "cpu" else f"{'-':>8}")
                     + f"  {goal}")
    for target, reason in results["skipped_targets"].items():
        lines.append(f"{target}: skipped, {reason}")
    return "\n".join(lines)
