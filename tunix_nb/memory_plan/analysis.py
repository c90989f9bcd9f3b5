"""XLA's memory analysis of the kit's training step, compiled ahead of time and never run.

The step is the one the training command builds (`train.make_step` over a method's
objective, LoRA/QLoRA from `tunix_nb.lora`), for a model read from a Hugging Face
config.json (`tunix_nb.hf.model_config`), with abstract parameters: shapes and dtypes
only (`jax.eval_shape`), so a 1B model's plan needs no memory for its weights. A figure
is per device: arguments + outputs + temporaries - aliased (the donated state's buffers
that the outputs reuse).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tunix_nb import fused_attention, hf, layer_stack, lora, sft, train
from tunix_nb.memory_plan import targets
from tunix_nb.memory_plan.config import PlanConfig

FIELDS = ("argument", "output", "temp", "alias", "generated_code")
MODEL_CONFIGS = Path(__file__).resolve().parent.parent.parent / "data" / "model_configs"


def read_model_config(model) -> dict:
    """config.json as a dict: from a dict, a directory, or a name under data/model_configs/."""
    if isinstance(model, dict):
        return model
    directory = Path(model)
    if not directory.is_dir() and (MODEL_CONFIGS / str(model)).is_dir():
        directory = MODEL_CONFIGS / str(model)
    return hf.read_config(directory)


def kit_config(hf_config: dict, cfg: PlanConfig):
    """The kit's ModelConfig at the plan's depth, with per-block remat and the layers'
    compute dtype as the plan says."""
    model_cfg = hf.model_config(hf_config, dtype="float32" if cfg.float32_activations else cfg.compute_dtype)
    return dataclasses.replace(model_cfg, remat=cfg.remat, n_layers=cfg.n_layers or model_cfg.n_layers,
                               scan_layers=cfg.scan_layers, attention=cfg.attention, remat_policy=cfg.remat_policy)


def _cast_abstract(tree, dtype: str):
    return jax.eval_shape(lambda t: jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, t), tree)


def _abstract_lora(graphdef, params, cfg: PlanConfig):
    """(LoRA graphdef, adapters, base), all abstract: qwix traced over shapes only."""
    built = {}

    def adapt(p):
        built["graphdef"], adapters, base = lora.apply(graphdef, p, rank=cfg.lora_rank, alpha=float(cfg.lora_rank),
                                                       quantize="nf4" if cfg.strategy == "qlora" else "none")
        return adapters, base

    adapters, base = jax.eval_shape(adapt, params)
    return built["graphdef"], adapters, base


def chunk_option(method_objective_builder, vocab_chunk: int | None, seq_chunk: int | None = None) -> dict:
    """{"vocab_chunk": n, "seq_chunk": m} (those given and that the objective builder
    takes), else {}: chunked log-probs are an option of the objectives that offer them."""
    if vocab_chunk is None:
        return {}
    parameters = inspect.signature(method_objective_builder).parameters
    if "vocab_chunk" not in parameters:
        return {}
    if seq_chunk is not None and "seq_chunk" in parameters:
        return {"vocab_chunk": vocab_chunk, "seq_chunk": seq_chunk}
    return {"vocab_chunk": vocab_chunk}


def abstract_step(hf_config: dict, cfg: PlanConfig, *, parallel_mode: str = "jit", mesh=None):
    """(step, (params, opt_state, batch, frozen) as ShapeDtypeStructs, details): the SFT
    step the training command builds for this model and strategy, nothing allocated."""
    graphdef, params = hf.abstract_model(kit_config(hf_config, cfg))
    options = chunk_option(sft.objective, cfg.vocab_chunk, cfg.seq_chunk)
    if cfg.strategy == "full":
        objective, trained, frozen = sft.objective(graphdef, compute_dtype=cfg.compute_dtype, **options), params, None
    else:
        lora_graphdef, trained, base = _abstract_lora(graphdef, _cast_abstract(params, cfg.base_dtype), cfg)
        objective = lora.objective(sft.objective(lora_graphdef, compute_dtype=cfg.compute_dtype, **options))
        frozen = lora.frozen(base)
    if cfg.scan_layers:  # as the command's --scan-layers: `cli.methods.stack_layers`
        stacked = layer_stack.layout(trained, frozen)
        trained, frozen = jax.eval_shape(lambda t, f: layer_stack.stack_state(t, f, stacked), trained, frozen)
        objective = stacked.objective(objective)
    optimizer = train.make_optimizer()
    opt_state = jax.eval_shape(optimizer.init, trained)
    batch = {k: jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), jnp.int32)
             for k in ("inputs", "targets", "loss_mask", "attention_mask")}
    step = train.make_step(objective, optimizer, parallel_mode=parallel_mode, donate=cfg.donate,
                           mesh=mesh if parallel_mode in ("dp", "fsdp", "shard_map") else None)
    details = {"vocab_chunk_used": options.get("vocab_chunk"), "seq_chunk_used": options.get("seq_chunk"),
               "input_bytes": {name: tree_bytes(tree) for name, tree in
                               (("params", trained), ("opt_state", opt_state), ("batch", batch), ("frozen", frozen))}}
    return step, (trained, opt_state, batch, frozen), details


def tree_bytes(tree) -> int:
    """Bytes of a tree's arrays (abstract or not), all devices together."""
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def lower(step, args, mesh, parallel_mode: str):
    """`step` lowered for `mesh`'s devices from abstract arguments."""
    if parallel_mode == "jit":
        on_device = NamedSharding(mesh, P())
        placed = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_device), args)
        return step.lower(*placed)
    params, opt_state, _, frozen = args
    return step.jitted(params, opt_state, frozen).lower(*args)


def memory_of(compiled) -> dict:
    """XLA's memory analysis of a compiled program, per device, in bytes; `total` is
    arguments + outputs + temporaries - aliased, the figure the targets use."""
    analysis = compiled.memory_analysis()
    out = {f"{k}_bytes": int(getattr(analysis, f"{k}_size_in_bytes")) for k in FIELDS}
    out["total_bytes"] = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    peak = getattr(analysis, "peak_memory_in_bytes", 0)
    if peak:  # the TPU compiler reports its own peak; the CPU's does not
        out["peak_bytes"] = int(peak)
    return out


def temporary_bytes(compiled) -> int:
    """The bytes a compiled program holds beyond its arguments and outputs at its peak.

    A CPU reports them as `temp_size_in_bytes`. The TPU compiler reports 0 there and folds them
    into its own `peak_memory_in_bytes` (lesson 12's loss gradients on a v5e: temp 0, peak 11.1 MB
    over 2.6 MB of arguments and outputs), so there they are the peak less the arguments and outputs
    that are not aliased."""
    analysis = compiled.memory_analysis()
    temp = int(analysis.temp_size_in_bytes)
    peak = int(getattr(analysis, "peak_memory_in_bytes", 0) or 0)
    if temp or not peak:
        return temp
    held = analysis.argument_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
    return max(0, peak - int(held))


def materialised_shapes(hlo_text: str) -> list[str]:
    """The result shapes of the compiled program's instructions outside fusions: what the
    program holds in memory (a fused computation's instructions live in registers and
    on-chip scratch, so a float32 softmax inside a fusion costs no HBM)."""
    shapes, in_fusion = [], False
    for line in hlo_text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):  # a computation begins
            name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            in_fusion = "fused" in name or "fusion" in name
        elif not in_fusion and line.startswith(" ") and " = " in line:
            result = line.split(" = ", 1)[1]
            shapes.append(result[:result.index(")") + 1] if result.startswith("(") else result.split("{")[0])
    return shapes


def large_f32_buffers(hlo_text: str, *, rows: int, seq_len: int, vocab: int, heads: int) -> dict:
    """How many instructions outside fusions make float32 [B, L, V] (logits) and
    [B, H, L, L] (attention) arrays, B being the rows each device holds."""
    shapes = materialised_shapes(hlo_text)
    return {"f32_BxLxV": sum(f"f32[{rows},{seq_len},{vocab}]" in s for s in shapes),
            "f32_BxHxLxL": sum(f"f32[{rows},{heads},{seq_len},{seq_len}]" in s for s in shapes)}


def analyse(model, cfg: PlanConfig, target: str = "cpu") -> dict:
    """Compile one step for `target` ("cpu", "v5e": one chip, "v5e-8": per chip, fsdp)
    and return its memory analysis per device, the inputs' bytes and the compile time."""
    hf_config = read_model_config(model)
    mesh = targets.mesh_for(target)
    parallel_mode = "fsdp" if mesh.size > 1 else "jit"
    step, args, details = abstract_step(hf_config, cfg, parallel_mode=parallel_mode, mesh=mesh)
    started = time.perf_counter()
    with fused_attention.lowering_for("cpu" if target == "cpu" else "tpu"):
        compiled = lower(step, args, mesh, parallel_mode).compile()
    model_cfg = kit_config(hf_config, cfg)
    return {**memory_of(compiled), "compile_seconds": time.perf_counter() - started, "devices": mesh.size,
            "parallel_mode": parallel_mode, "n_layers": model_cfg.n_layers, **details,
            "hlo_buffers": large_f32_buffers(compiled.as_text(), rows=cfg.batch_size // mesh.size,
                                             seq_len=cfg.seq_len, vocab=model_cfg.vocab_size,
                                             heads=model_cfg.n_heads)}


# the depths a row that the TPU compiler refuses at full depth is extrapolated from
REFUSED_LAYERS = (2, 4)


def extrapolate(by_layers: dict, n_layers: int) -> dict:
    """Each byte field at `n_layers`, linear in the depth through the two deepest depths
    compiled (each block adds the same buffers; the deepest are the least disturbed by what
    XLA schedules around the first block): {field: bytes}, plus per_layer."""
    (l1, a), (l2, b) = sorted(by_layers.items())[-2:]
    keys = [k for k in a if k.endswith("_bytes") and isinstance(a[k], (int, float))]
    per_layer = {k: (b[k] - a[k]) / (l2 - l1) for k in keys}
    return {**{k: a[k] + (n_layers - l1) * per_layer[k] for k in keys}, "per_layer": per_layer}


REFUSAL = re.compile(r"memory required for HLO temporaries \((\d+(?:\.\d+)?)([KMGT])\)")


def with_refused_temporaries(full: dict, refusal: str) -> dict:
    """`full` (extrapolated) with the temporaries the TPU compiler said the full-depth program
    needs when it refused it (its "G" is GiB, to two decimals): the line through shallow
    compiles misses how the deep program's live ranges grow. Arguments, outputs and
    aliasing stay extrapolated (they are linear in depth: the parameters' bytes); the
    compiler's peak is unknown for a program it did not build, so it is left out."""
    found = REFUSAL.search(refusal)
    if found is None:
        return full
    temp_bytes = float(found.group(1)) * 2 ** (10 * "KMGT".index(found.group(2)) + 10)
    total = full["argument_bytes"] + full["output_bytes"] + temp_bytes - full["alias_bytes"]
    kept = {k: v for k, v in full.items() if k != "peak_bytes"}
    return {**kept, "temp_bytes": temp_bytes, "total_bytes": total, "temp_bytes_from": "the compiler's refusal"}


def plan(model, cfg: PlanConfig, target: str = "cpu", *, layers=(1, 2)) -> dict:
    """The step's memory at the model's full depth: compiled at `layers` and extrapolated
    linearly when the full depth is not among them (the result says which); `layers=None`
    compiles the full depth itself (minutes for a real model on a CPU). A TPU compiler
    refuses a program whose temporaries exceed the chip's memory: such a row is then
    extrapolated from REFUSED_LAYERS, with the refusal kept as "refused_at_full_depth"."""
    hf_config = read_model_config(model)
    depth = cfg.n_layers or hf.model_config(hf_config).n_layers
    refused, by_layers = None, None
    if layers is None:
        try:
            by_layers = {depth: analyse(hf_config, dataclasses.replace(cfg, n_layers=depth), target)}
        except jax.errors.JaxRuntimeError as err:
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            refused, layers = str(err).splitlines()[0], REFUSED_LAYERS
    if by_layers is None:
        by_layers = {n: analyse(hf_config, dataclasses.replace(cfg, n_layers=n), target)
                     for n in sorted(set(min(n, depth) for n in layers))}
    if depth in by_layers:
        full = {k: v for k, v in by_layers[depth].items() if k.endswith("_bytes") and isinstance(v, int)}
        extrapolated = False
    else:
        if len(by_layers) < 2:
            raise ValueError(f"layers={layers}: extrapolating to {depth} layers needs two depths.")
        full, extrapolated = extrapolate(by_layers, depth), True
    if refused is not None:
        full = with_refused_temporaries(full, refused)
    row = {"config": dataclasses.asdict(cfg), "target": target, "n_layers": depth, "extrapolated": extrapolated,
           "full_depth": full, "compiled": {str(n): v for n, v in by_layers.items()}}
    return row if refused is None else {**row, "refused_at_full_depth": refused}
