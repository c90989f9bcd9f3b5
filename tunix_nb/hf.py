"""Hugging Face checkpoints <-> the kit's model: `config.json` and safetensors, both ways.

A Hugging Face causal LM directory holds `config.json` (the architecture and its
sizes) and `model.safetensors`, or several `model-0000i-of-0000n.safetensors` files
with `model.safetensors.index.json` saying which tensor lives where. Each tensor is
named after the PyTorch module that owns it (`model.layers.3.self_attn.q_proj.weight`)
and a linear layer's weight is stored [out, in], where Flax's kernel is [in, out]. So
loading is a name map, a transpose for kernels, and a check that nothing is missing,
left over or of the wrong shape; saving is the same map run backwards.

Covers the Llama family as `tunix_nb.model` does: Llama (1, 2, 3.x incl. RoPE scaling,
SmolLM2), Qwen2/Qwen2.5 (q/k/v biases) and Qwen3 (q/k norms, explicit head_dim).
Gemma 3 is not covered: its (1 + w) RMSNorm, four norms per block, scaled embeddings,
GELU MLP and alternating sliding-window layers would each need a model option.

    graphdef, params, config = hf.load_pretrained("Qwen/Qwen3-0.6B", dtype="float32")
    hf.save_pretrained("out", graphdef, params, config)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from tunix_nb import model, parallel

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
FAMILY_ARCHITECTURE = {family: arch for arch, family in ARCHITECTURES.items()}
# What transformers assumes when config.json leaves a field out (Qwen2/Qwen3 default to
# 32 key/value heads, not to one per query head; Qwen3's head_dim defaults to 128).
DEFAULTS = {
    "llama": {"num_key_value_heads": None, "head_dim": None},
    "qwen2": {"num_key_value_heads": 32, "head_dim": None},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128},
}
# Tensors some checkpoints carry that hold nothing to learn.
IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")

# The kit's parameter names (as in nnx.State paths) -> the checkpoint's module names.
GLOBAL_NAMES = {"embed": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
    "attn/q": "self_attn.q_proj", "attn/k": "self_attn.k_proj", "attn/v": "self_attn.v_proj",
    "attn/out": "self_attn.o_proj", "attn/q_norm": "self_attn.q_norm", "attn/k_norm": "self_attn.k_norm",
    "mlp/gate": "mlp.gate_proj", "mlp/up": "mlp.up_proj", "mlp/down": "mlp.down_proj",
}
TENSOR_NAMES = {"kernel": "weight", "embedding": "weight", "scale": "weight", "bias": "bias"}


class CheckpointError(ValueError):
    """A checkpoint the kit cannot load or write, with what is wrong and what to do."""


# ---------------------------------------------------------------- names


def hf_name(kit_name: str) -> str:
    """'blocks/3/attn/q/kernel' -> 'model.layers.3.self_attn.q_proj.weight'."""
    *module, tensor = kit_name.split("/")
    if module[0] == "blocks":
        owner = f"model.layers.{module[1]}.{LAYER_NAMES['/'.join(module[2:])]}"
    else:
        owner = GLOBAL_NAMES[module[0]]
    return f"{owner}.{TENSOR_NAMES[tensor]}"


def is_transposed(kit_name: str) -> bool:
    """Linear kernels are [in, out] in Flax and [out, in] in PyTorch."""
    return kit_name.endswith("/kernel")


def kit_name(path) -> str:
    """The kit's name of a parameter's path, 'blocks/0/attn/q/kernel' (`model.param_name`)."""
    return model.param_name(path)


def kit_names(abstract_params) -> list[str]:
    return [kit_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(abstract_params)]


# ---------------------------------------------------------------- config.json


def read_config(directory) -> dict:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist: a Hugging Face checkpoint directory holds "
                              "config.json beside its *.safetensors files.")
    return json.loads(path.read_text())


def family_of(hf_config: dict) -> str:
    """'llama', 'qwen2' or 'qwen3', from config.json's architectures (or model_type)."""
    architectures = hf_config.get("architectures") or []
    for arch in architectures:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if not architectures and hf_config.get("model_type") in DEFAULTS:
        return hf_config["model_type"]
    named = architectures or [hf_config.get("model_type")]
    raise CheckpointError(f"Unsupported architecture {named}: tunix_nb.hf loads {sorted(ARCHITECTURES)}. "
                          "Gemma 3 and other families need model options the kit does not have.")


def _rope_fields(hf_config: dict) -> tuple[float, model.Llama3RopeScaling | None]:
    """(rope_theta, scaling). transformers 5 writes both into `rope_parameters`; older
    checkpoints carry a top-level `rope_theta` and a `rope_scaling` dict."""
    params = hf_config.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf_config.get("rope_theta", 10_000.0))
    scaling = hf_config.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise CheckpointError(f"RoPE scaling {kind!r} is not supported (only 'llama3'); "
                              "remove it from config.json only if you keep sequences within the "
                              "original context length.")
    fields = [f.name for f in model.dataclasses.fields(model.Llama3RopeScaling)]
    return float(theta), model.Llama3RopeScaling(**{f: scaling[f] for f in fields})


def _check_supported(hf_config: dict, family: str) -> None:
    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"hidden_act={act!r}: the kit's MLP is SwiGLU (silu) only.")
    for flag in ("attention_bias", "mlp_bias"):
        if family != "qwen2" and hf_config.get(flag):
            raise CheckpointError(f"{flag}=true: the kit's {family} layers have no such biases.")
    windowed = [t for t in hf_config.get("layer_types") or [] if t != "full_attention"]
    if windowed:
        raise CheckpointError(f"layer_types has {windowed[0]!r} layers: the kit's attention is full "
                              "causal attention in every layer.")
    if hf_config.get("use_sliding_window"):
        raise CheckpointError("use_sliding_window=true: the kit's attention is full causal attention; "
                              "set it to false (as Qwen2.5 and Qwen3 ship) to load the model.")


def model_config(hf_config: dict, *, dtype: str | None = None) -> model.ModelConfig:
    """The kit's ModelConfig for a Hugging Face config.json dict."""
    family = family_of(hf_config)
    _check_supported(hf_config, family)
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if k not in hf_config]
    if missing:
        raise CheckpointError(f"config.json lacks {missing}; the model's sizes cannot be known without them.")
    given = {**DEFAULTS[family], **{k: v for k, v in hf_config.items() if v is not None}}
    n_heads = hf_config["num_attention_heads"]
    theta, scaling = _rope_fields(hf_config)
    # kv heads and head_dim are always explicit, so a saved and reloaded config is equal.
    return model.ModelConfig(
        vocab_size=hf_config["vocab_size"], d_model=hf_config["hidden_size"],
        n_layers=hf_config["num_hidden_layers"], n_heads=n_heads,
        d_ff=hf_config["intermediate_size"], rope_base=theta, dtype=dtype,
        n_kv_heads=given["num_key_value_heads"] or n_heads,
        head_dim=given["head_dim"] or hf_config["hidden_size"] // n_heads,
        qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)), rope_scaling=scaling)


def family_for(config: model.ModelConfig) -> str:
    """The Hugging Face architecture that holds a kit model: q/k norms -> Qwen3, q/k/v
    biases -> Qwen2, neither -> Llama."""
    if config.qkv_bias and config.qk_norm:
        raise CheckpointError("A model with both q/k/v biases and q/k norms has no Hugging Face "
                              "architecture (Qwen2 has the biases, Qwen3 the norms).")
    if config.qkv_bias and config.head_dim not in (None, config.d_model // config.n_heads):
        raise CheckpointError(f"Qwen2 needs head_dim = d_model / n_heads, got head_dim={config.head_dim}.")
    return "qwen3" if config.qk_norm else "qwen2" if config.qkv_bias else "llama"


def hf_config_for(config: model.ModelConfig, *, dtype: str, extra: dict | None = None) -> dict:
    """config.json for a kit model, in the form transformers 5 writes (`extra` adds keys,
    e.g. the source checkpoint's bos/eos token ids and max_position_embeddings)."""
    family = family_for(config)
    rope = {"rope_type": "default", "rope_theta": config.rope_base}
    if config.rope_scaling is not None:
        rope = {**rope, "rope_type": "llama3", **model.dataclasses.asdict(config.rope_scaling)}
    out = {
        "architectures": [FAMILY_ARCHITECTURE[family]], "model_type": family,
        "vocab_size": config.vocab_size, "hidden_size": config.d_model,
        "intermediate_size": config.d_ff, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_size, "hidden_act": "silu", "rms_norm_eps": config.norm_eps,
        "rope_parameters": rope, "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": 0.0, "max_position_embeddings": 2048, "dtype": dtype,
    }
    if family != "qwen2":
        out["attention_bias"] = False
    if family != "llama":
        out["use_sliding_window"] = False
    return {**out, **(extra or {})}


# ---------------------------------------------------------------- reading tensors


def resolve(path_or_repo_id) -> Path:
    """A local checkpoint directory, or a Hub repository id downloaded when online."""
    path = Path(path_or_repo_id)
    if path.is_dir():
        return path
    if path.exists() or str(path_or_repo_id).count("/") != 1:
        raise CheckpointError(f"{path_or_repo_id} is neither a checkpoint directory nor a Hub id "
                              "such as 'Qwen/Qwen3-0.6B'.")
    from huggingface_hub import snapshot_download  # only needed online

    try:
        return Path(snapshot_download(str(path_or_repo_id),
                                      allow_patterns=["*.json", "*.safetensors", "*.txt"]))
    except Exception as err:  # offline, unknown repository, gated model without a token
        raise CheckpointError(f"Could not download {path_or_repo_id!r} from the Hugging Face Hub "
                              f"({type(err).__name__}: {err}). Offline, pass a local directory "
                              "instead; for a gated model, log in with `huggingface-cli login`.") from err


def tensor_files(directory: Path) -> dict[str, Path]:
    """Each tensor's name -> the safetensors file that holds it."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}. "
                              "(PyTorch *.bin checkpoints: convert them with transformers first.)")
    with safe_open(single, "np") as f:
        return {name: single for name in f.keys()}


class TensorReader(contextlib.ExitStack):
    """Open safetensors files by name; reads slices without loading whole files."""

    def __init__(self, directory: Path):
        super().__init__()
        self.files = tensor_files(directory)
        self._handles = {}

    def slice(self, name: str):
        file = self.files[name]
        if file not in self._handles:
            if not file.is_file():
                raise CheckpointError(f"{INDEX_FILE} puts {name!r} in {file.name}, which does not exist.")
            self._handles[file] = self.enter_context(safe_open(file, "np"))
        return self._handles[file].get_slice(name)


def _expected_names(names: list[str]) -> dict[str, str]:
    return {hf_name(n): n for n in names}


def check_names(found, expected: dict[str, str], config: model.ModelConfig, where) -> None:
    """Raise naming the first missing and unexpected tensors."""
    found = set(found)
    missing = sorted(set(expected) - found)
    allowed = {"lm_head.weight"} if config.tie_embeddings else set()  # some tied checkpoints keep a copy
    unexpected = sorted(n for n in found - set(expected) - allowed if not IGNORED.match(n))
    if missing:
        raise CheckpointError(f"{where} lacks {len(missing)} tensor(s) the model needs, e.g. "
                              f"{missing[:3]}. Does config.json describe this checkpoint?")
    if unexpected:
        raise CheckpointError(f"{where} holds {len(unexpected)} tensor(s) the model has no place for, e.g. "
                              f"{unexpected[:3]}. Does config.json describe this checkpoint?")


def _check_shape(name: str, hf_shape, want_shape) -> None:
    if tuple(hf_shape) != tuple(want_shape):
        raise CheckpointError(f"{name} has shape {tuple(hf_shape)} in the checkpoint, but config.json "
                              f"implies {tuple(want_shape)}. Is config.json the one saved with these weights?")


def _load_leaf(reader: TensorReader, name: str, like, sharding, dtype):
    """One parameter, read shard by shard straight onto its devices."""
    key = hf_name(name)
    tensor = reader.slice(key)
    flip = is_transposed(name)
    _check_shape(key, tensor.get_shape(), like.shape[::-1] if flip else like.shape)

    def read(index):
        index = tuple(index) + (slice(None),) * (len(like.shape) - len(index))
        part = np.ascontiguousarray(tensor[index[::-1]].T if flip else tensor[index])
        # dtype None keeps what the file stores (float32, bfloat16, ...).
        return part if dtype is None else part.astype(jax.numpy.dtype(dtype))

    return jax.make_array_from_callback(like.shape, sharding, read)


def _shardings(abstract_params, sharding):
    """A sharding per leaf: the default device, one for all, or `sharding(abstract_params)`."""
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda _: sharding, abstract_params)
    return sharding(abstract_params)


def abstract_model(config: model.ModelConfig):
    """(graphdef, params of ShapeDtypeStructs): the model's structure, nothing allocated."""
    return nnx.split(nnx.eval_shape(lambda: model.Transformer(config, rngs=nnx.Rngs(0))))


def load_pretrained(path_or_repo_id, *, dtype: str | None = None,
                    sharding: jax.sharding.Sharding | Callable | None = None, remat: bool = False):
    """(graphdef, params, config) of a Hugging Face Llama / Qwen2 / Qwen3 checkpoint.

    dtype: the parameters' dtype ("float32" to train; None keeps the file's). sharding:
    where the parameters go: None (the default device), one Sharding for all, or a
    function from the abstract parameter tree to a tree of shardings, e.g.
    `lambda like: parallel.fsdp_shardings(like, mesh)`. Each device reads only its own
    slice of each tensor from the files, so a model that does not fit one device never
    sits whole on one, and no random initialisation is ever computed. remat: per-block
    rematerialisation in the training pass (`ModelConfig.remat`; the same numbers, less
    memory); `model.with_remat` switches it later.
    """
    directory = resolve(path_or_repo_id)
    config = dataclasses.replace(model_config(read_config(directory)), remat=remat)
    graphdef, abstract = abstract_model(config)
    names = kit_names(abstract)
    with TensorReader(directory) as reader:
        check_names(reader.files, _expected_names(names), config, directory.name)
        shardings = _shardings(abstract, sharding)
        params = jax.tree_util.tree_map_with_path(
            lambda path, like, where: _load_leaf(reader, kit_name(path), like, where, dtype),
            abstract, shardings)
    return graphdef, params, config


# ---------------------------------------------------------------- writing


def _params_dtype(params) -> str:
    dtypes = {str(np.dtype(x.dtype)) for x in jax.tree.leaves(params)}
    if len(dtypes) != 1:
        raise CheckpointError(f"The parameters mix dtypes {sorted(dtypes)}; cast them to one first "
                              "(e.g. tunix_nb.precision.cast_floats).")
    return dtypes.pop()


def hf_tensors(params) -> dict[str, np.ndarray]:
    """The checkpoint's tensors (host arrays, [out, in] weights) of a kit parameter tree."""
    tensors = {}
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        name = kit_name(path)
        array = parallel.to_host(x)
        tensors[hf_name(name)] = np.ascontiguousarray(array.T if is_transposed(name) else array)
    return tensors


def save_pretrained(out_dir, graphdef, params, config: model.ModelConfig, *, extra_config: dict | None = None):
    """Write config.json and model.safetensors that transformers' AutoModelForCausalLM loads.

    `graphdef` is checked against `config` so that a config from another model is caught
    before anything is written. Returns the directory.
    """
    expected_graphdef, abstract = abstract_model(config)
    if expected_graphdef != graphdef:
        raise CheckpointError("graphdef does not match config: pass the config returned with these "
                              "parameters (by hf.load_pretrained, or the one the model was built from).")
    check_names([hf_name(n) for n in kit_names(params)], _expected_names(kit_names(abstract)), config, "params")
    hf_config = hf_config_for(config, dtype=_params_dtype(params), extra=extra_config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_tensors(params), out / SINGLE_FILE, metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    return out
