"""LoRA adapters as a PEFT adapter folder, both ways: what `PeftModel.from_pretrained` loads.

A PEFT LoRA folder holds `adapter_config.json` (peft_type LORA, r, lora_alpha,
target_modules, the base model's id) and `adapter_model.safetensors`, one pair of
tensors per adapted linear layer, named after the base's module with PEFT's prefix:

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight   [out, r]

PyTorch's Linear stores [out, in], so the kit's A [in, r] and B [r, out] are written
transposed. PEFT computes W x + (lora_alpha / r) B A x (without `use_rslora`) and qwix
W x + (alpha / rank) x A B, so with lora_alpha = the kit's alpha the two are the same
model. The base is not in the folder: PEFT loads it from `base_model_name_or_path`.

    peft_adapter.save_adapter("adapter", adapters, config, alpha=16.0,
                              base_model_name_or_path="Qwen/Qwen3-0.6B")
    lora_graphdef, adapters, base, alpha = peft_adapter.load_adapter("adapter", graphdef, params)
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jax
import numpy as np

from tunix_nb import hf, lora, model, parallel

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel wraps the base: base_model (LoraModel) . model (the base)
KIT_FACTORS = {"kernel_lora_a": "lora_A", "kernel_lora_b": "lora_B"}
PEFT_FACTORS = {v: k for k, v in KIT_FACTORS.items()}
KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<factor>lora_A|lora_B)\.weight$")


class AdapterError(ValueError):
    """An adapter folder the kit cannot write or read, with what is wrong and what to do."""


# ---------------------------------------------------------------- names


def adapted_layers(adapters) -> dict[str, dict[str, np.ndarray]]:
    """{'blocks/0/attn/q': {'kernel_lora_a': A [in, r], 'kernel_lora_b': B [r, out]}, ...} on the host."""
    layers: dict[str, dict[str, np.ndarray]] = {}
    for path, x in jax.tree_util.tree_leaves_with_path(adapters):
        *layer, factor = model.param_name(path).split("/")
        if factor not in KIT_FACTORS:
            raise AdapterError(f"{model.param_name(path)} is not a LoRA factor (kernel_lora_a / kernel_lora_b): "
                               "pass the adapters returned by lora.apply, not the full state.")
        layers.setdefault("/".join(layer), {})[factor] = parallel.to_host(x)
    return layers


def hf_module(kit_layer: str) -> str:
    """'blocks/0/attn/q' -> 'model.layers.0.self_attn.q_proj' (the base's module name)."""
    parts = kit_layer.split("/")
    if parts[0] != "blocks" or "/".join(parts[2:]) not in hf.LAYER_NAMES:
        raise AdapterError(f"{kit_layer} has an adapter save_adapter cannot name: PEFT adapters here cover "
                           "the blocks' attention and MLP projections (lora.DEFAULT_TARGETS).")
    return hf.hf_name(f"{kit_layer}/kernel").removesuffix(".weight")


def kit_layer(module_name: str) -> str:
    """'model.layers.0.self_attn.q_proj' -> 'blocks/0/attn/q' (the inverse of hf_module)."""
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module_name)
    names = {v: k for k, v in hf.LAYER_NAMES.items()}
    if not match or match.group(2) not in names:
        raise AdapterError(f"{module_name!r} is not a projection of the kit's model (expected e.g. "
                           "'model.layers.0.self_attn.q_proj').")
    return f"blocks/{match.group(1)}/{names[match.group(2)]}"


def target_modules(modules: list[str], n_layers: int) -> list[str]:
    """PEFT's target_modules: the short names ('q_proj') when each is adapted in all
    n_layers layers, else the full module names (PEFT matches a name or its suffix)."""
    by_short: dict[str, set[int]] = {}
    for module in modules:
        by_short.setdefault(module.rsplit(".", 1)[-1], set()).add(int(module.split(".")[2]))
    if all(found == set(range(n_layers)) for found in by_short.values()):
        return sorted(by_short)
    return sorted(modules, key=lambda m: (int(m.split(".")[2]), m))


# ---------------------------------------------------------------- writing


def adapter_config(*, rank: int, alpha: float, modules: list[str], n_layers: int, base_model_name_or_path: str,
                   revision: str | None = None) -> dict:
    """adapter_config.json's fields, as PEFT's LoraConfig writes them (the rest take PEFT's defaults)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "revision": revision, "r": rank, "lora_alpha": alpha, "target_modules": target_modules(modules, n_layers),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
    }


def adapter_tensors(layers: dict[str, dict[str, np.ndarray]], dtype: str | None = None) -> dict[str, np.ndarray]:
    """PEFT's key names and [out, in] layouts for the kit's factors."""
    tensors = {}
    for layer, factors in layers.items():
        for factor, array in factors.items():
            array = array if dtype is None else array.astype(jax.numpy.dtype(dtype))
            tensors[f"{PREFIX}{hf_module(layer)}.{KIT_FACTORS[factor]}.weight"] = np.ascontiguousarray(array.T)
    return tensors


def save_adapter(out_dir, adapters, config: model.ModelConfig, *, alpha: float, base_model_name_or_path: str,
                 revision: str | None = None, dtype: str | None = None) -> Path:
    """Write a PEFT LoRA adapter folder for the adapters of `lora.apply` (trained or not).

    config: the base model's ModelConfig (hf.load_pretrained returns it); it must be one
    transformers has an architecture for (hf.family_for).
    alpha: the alpha the adapters were trained with (scale alpha / rank, as in lora.merge).
    base_model_name_or_path: the Hub id (with `revision`) or folder of the base checkpoint,
    which PEFT's `AutoPeftModelForCausalLM` loads under the adapters. dtype: the tensors'
    dtype on disk (None keeps the adapters', float32). Returns the directory.

    For QLoRA the adapters were trained on the quantised base; PEFT applies them to the
    base as stored, so the result differs from the trained model by the quantisation
    error (export merged weights with hf.save_merged for the exact model).
    """
    if not alpha > 0:
        raise AdapterError(f"alpha must be positive, got {alpha!r} (the adapters' scale is alpha / rank).")
    hf.check_dtype(dtype, hf.EXPORT_DTYPES)
    layers = adapted_layers(adapters)
    if not layers:
        raise AdapterError("The adapters are empty: pass the adapters returned by lora.apply.")
    hf.family_for(config)  # raises for a model no Hugging Face architecture holds
    ranks = {factors["kernel_lora_a"].shape[-1] for factors in layers.values()}
    if len(ranks) != 1:
        raise AdapterError(f"The adapters have ranks {sorted(ranks)}; save_adapter writes one rank for all.")
    fields = adapter_config(rank=ranks.pop(), alpha=float(alpha), modules=[hf_module(n) for n in layers],
                            n_layers=config.n_layers, base_model_name_or_path=str(base_model_name_or_path),
                            revision=revision)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_safetensors(adapter_tensors(layers, dtype), out / WEIGHTS_FILE)
    (out / CONFIG_FILE).write_text(json.dumps(fields, indent=2) + "\n")
    return out


# ---------------------------------------------------------------- reading


def read_adapter_config(directory) -> dict:
    """adapter_config.json, checked for what the kit's LoRA can represent."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{path} does not exist: a PEFT adapter folder holds {CONFIG_FILE} beside "
                           f"{WEIGHTS_FILE}.")
    config = json.loads(path.read_text())
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type is {config.get('peft_type')!r}; the kit reads LoRA adapters only.")
    unsupported = {"use_dora": False, "bias": "none", "modules_to_save": None, "rank_pattern": {},
                   "alpha_pattern": {}, "fan_in_fan_out": False}
    for field, plain in unsupported.items():
        if config.get(field, plain) not in (plain, None, [], {}, False):
            raise AdapterError(f"{path}: {field}={config[field]!r} has no counterpart in the kit's LoRA "
                               f"(W + (alpha / r) A B on each projection); it needs {field}={plain!r}.")
    return config


def kit_alpha(config: dict) -> float:
    """The kit's alpha giving PEFT's scale: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    rank, peft_alpha = config["r"], float(config["lora_alpha"])
    scale = peft_alpha / math.sqrt(rank) if config.get("use_rslora") else peft_alpha / rank
    return scale * rank


def read_factors(directory) -> dict[str, dict[str, np.ndarray]]:
    """{'blocks/0/attn/q': {'kernel_lora_a': [in, r], 'kernel_lora_b': [r, out]}} from the safetensors file."""
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise AdapterError(f"{path} does not exist (PyTorch adapter_model.bin files: load and re-save "
                           "them with PEFT to get safetensors).")
    layers: dict[str, dict[str, np.ndarray]] = {}
    with hf.open_safetensors(path) as f:
        for key in f.keys():
            match = KEY.match(key)
            if not match:
                raise AdapterError(f"{path.name} holds {key!r}, which is not a LoRA factor named like "
                                   f"'{PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight'.")
            factor = PEFT_FACTORS[match.group("factor")]
            layers.setdefault(kit_layer(match.group("module")), {})[factor] = f.get_tensor(key).T
    return layers


def load_adapter(adapter_dir, graphdef, params, *, quantize: str = "none", tile_size: int = lora.DEFAULT_TILE_SIZE):
    """(lora_graphdef, adapters, base, alpha): a PEFT LoRA adapter on the kit's base model
    (`graphdef, params` from hf.load_pretrained of the adapter's base_model_name_or_path).

    The layers adapted are those the file holds; alpha is the kit's (scale * rank). quantize
    "nf4"/"int8" puts the adapters on a quantised base, as lora.apply does.
    """
    config = read_adapter_config(adapter_dir)
    factors = read_factors(adapter_dir)
    targets = "|".join(re.escape(layer) for layer in sorted(factors))
    alpha = kit_alpha(config)
    lora_graphdef, adapters, base = lora.apply(graphdef, params, rank=int(config["r"]), alpha=alpha, targets=targets,
                                               quantize=quantize, tile_size=tile_size)
    return lora_graphdef, fill(adapters, factors, adapter_dir), base, alpha


def fill(adapters, factors: dict[str, dict[str, np.ndarray]], where):
    """The adapters with each factor replaced by the file's, shapes and coverage checked."""
    wanted = adapted_layers(adapters)
    missing = sorted(set(wanted) - set(factors))
    if missing:
        raise AdapterError(f"{where}: no tensors for {missing[:3]} ({len(missing)} layer(s)).")

    def replace(path, x):
        *layer, factor = model.param_name(path).split("/")
        stored = factors["/".join(layer)].get(factor)
        name = f"{hf_module('/'.join(layer))}.{KIT_FACTORS[factor]}.weight"
        if stored is None:
            raise AdapterError(f"{where}: {name} is missing; each adapted module needs lora_A and lora_B.")
        if stored.shape != x.shape:
            raise AdapterError(f"{where}: {name} has shape {stored.shape[::-1]}, but the base model and r imply "
                               f"{tuple(x.shape[::-1])}. Is this adapter for this base model?")
        return jax.numpy.asarray(stored, dtype=x.dtype)

    return jax.tree_util.tree_map_with_path(replace, adapters)
