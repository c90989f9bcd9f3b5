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
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from tunix_nb import model, parallel
from tunix_nb.model import abstract_model  # its former home: hf.abstract_model still works

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_FILE = "model-{index:05d}-of-{count:05d}.safetensors"  # transformers' shard names
# What save_pretrained copies from the source checkpoint, where present: the tokenizer
# (fast and slow files), its chat template (transformers 5 writes chat_template.jinja)
# and the generation defaults (eos ids, sampling settings).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")
DTYPES = ("float32", "bfloat16")  # what parameters are kept in (load) and written as (save)
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
        hint = (f" {directory} holds Orbax checkpoints (a --ckpt-dir or --export-params folder): run the training "
                "command that wrote it again with --export-hf OUT, which resumes at its last step and writes a "
                "Hugging Face folder there, and pass OUT." if _is_orbax(Path(directory)) else "")
        raise CheckpointError(f"{path} does not exist: a Hugging Face checkpoint directory holds "
                              f"config.json beside its *.safetensors files.{hint}")
    return json.loads(path.read_text())


def _is_orbax(directory: Path) -> bool:
    """Whether `directory` is an Orbax checkpoint folder (numbered steps) or one of its steps."""
    marker = "_CHECKPOINT_METADATA"
    if (directory / marker).is_file():
        return True
    return directory.is_dir() and any(p.name.isdigit() and (p / marker).is_file() for p in directory.iterdir())


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


def rope_config_fields(config: model.ModelConfig) -> dict:
    """RoPE in both forms readers expect: transformers 5's `rope_parameters`, and the
    top-level `rope_theta` / `rope_scaling` that transformers 4.x (and servers built on
    it) read. Both say the same; transformers 5 standardises either into the first."""
    rope = {"rope_type": "default", "rope_theta": config.rope_base}
    scaling = None
    if config.rope_scaling is not None:
        scaling = {"rope_type": "llama3", **model.dataclasses.asdict(config.rope_scaling)}
        rope = {**rope, **scaling}
    return {"rope_parameters": rope, "rope_theta": config.rope_base, "rope_scaling": scaling}


def hf_config_for(config: model.ModelConfig, *, dtype: str, extra: dict | None = None) -> dict:
    """config.json for a kit model, in the form transformers 5 writes, with the RoPE and
    dtype keys of 4.x too (`extra` adds keys, e.g. the source checkpoint's bos/eos token
    ids and max_position_embeddings; `export_config` keeps a source's fields)."""
    family = family_for(config)
    out = {
        "architectures": [FAMILY_ARCHITECTURE[family]], "model_type": family,
        "vocab_size": config.vocab_size, "hidden_size": config.d_model,
        "intermediate_size": config.d_ff, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_size, "hidden_act": "silu", "rms_norm_eps": config.norm_eps,
        **rope_config_fields(config), "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": 0.0, "max_position_embeddings": 2048,
        "dtype": dtype, "torch_dtype": dtype,  # 5.x reads dtype, 4.x torch_dtype
    }
    if family != "qwen2":
        out["attention_bias"] = False
    if family != "llama":
        out["use_sliding_window"] = False
    return {**out, **(extra or {})}


# Keys of a source config.json that describe the file, not the model: not carried over.
NOT_KEPT = ("transformers_version", "_name_or_path", "quantization_config")
# Keys hf_config_for fills with a default the kit's model does not know: the source's win.
SOURCE_WINS = ("max_position_embeddings", "attention_dropout")


def export_config(config: model.ModelConfig, *, dtype: str, source_config: dict | None = None,
                  extra: dict | None = None) -> dict:
    """config.json for an export: the source checkpoint's fields (max_position_embeddings,
    bos/eos/pad token ids, initializer_range, ...) kept, the model's own written over them.

    Raises if the source describes another model than `config` (e.g. the config.json of a
    different size), since its fields would then be wrong for these weights.
    """
    own = hf_config_for(config, dtype=dtype)
    if source_config is None:
        return {**own, **(extra or {})}
    theirs = hf_config_for(model_config(source_config), dtype=dtype)
    differ = sorted(k for k in own if own[k] != theirs.get(k) and k not in SOURCE_WINS)
    if differ:
        raise CheckpointError(f"The source config.json describes another model: {differ[0]} is "
                              f"{theirs.get(differ[0])!r} there and {own[differ[0]]!r} here (differing keys: "
                              f"{differ}). Pass the checkpoint these weights were loaded from as source.")
    kept = {k: v for k, v in source_config.items() if k not in NOT_KEPT}
    own = {k: v for k, v in own.items() if not (k in SOURCE_WINS and k in kept)}
    return {**kept, **own, **(extra or {})}


# ---------------------------------------------------------------- reading tensors


HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "tokenizer.model"]


def resolve(path_or_repo_id, *, revision: str | None = None, token: str | None = None) -> Path:
    """A local checkpoint directory, or a Hub repository id downloaded when online.

    `revision` pins a Hub commit (or a branch or tag); `token` defaults to what
    huggingface_hub finds itself (the HF_TOKEN variable, or `hf auth login`).
    """
    path = Path(path_or_repo_id)
    if path.is_dir():
        if revision is not None:
            raise CheckpointError(f"revision={revision!r} pins a Hub commit, but {path} is a local "
                                  "directory; drop the revision, or pass a Hub id such as 'Qwen/Qwen3-0.6B'.")
        return path
    if path.exists() or str(path_or_repo_id).count("/") != 1:
        raise CheckpointError(f"{path_or_repo_id} is neither a checkpoint directory nor a Hub id "
                              "such as 'Qwen/Qwen3-0.6B'.")
    from huggingface_hub import snapshot_download  # only needed online

    try:
        return Path(snapshot_download(str(path_or_repo_id), revision=revision, token=token,
                                      allow_patterns=HUB_PATTERNS))
    except Exception as err:  # offline, unknown repository or revision, gated model without a token
        raise CheckpointError(_download_error(str(path_or_repo_id), revision, err)) from err


def _download_error(repo_id: str, revision: str | None, err: Exception) -> str:
    """What went wrong fetching a checkpoint from the Hub, and what to do about it."""
    from huggingface_hub import errors

    what = f"Could not download {repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    cause = f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    if isinstance(err, errors.GatedRepoError):
        fix = ("It is a gated model: accept its licence on its Hub page, then set HF_TOKEN to a token "
               "of that account (or run `hf auth login`).")
    elif isinstance(err, errors.RevisionNotFoundError):
        fix = "The revision does not exist there: pass a commit hash, branch or tag of that repository."
    elif isinstance(err, errors.RepositoryNotFoundError):
        fix = ("No such repository, or a private/gated one this account cannot read: check the id, and "
               "set HF_TOKEN (or run `hf auth login`) if it needs a login.")
    elif isinstance(err, errors.HfHubHTTPError):
        fix = ("The Hub refused the download: if the model needs a login, set HF_TOKEN (or run "
               "`hf auth login`); otherwise pass a local checkpoint directory.")
    elif isinstance(err, OSError):  # LocalEntryNotFoundError: offline and not in the cache
        fix = ("The Hub could not be reached and it is not in the local cache: run online once (with "
               "HF_TOKEN set for a gated model), or pass a local checkpoint directory instead.")
    else:
        fix = "Check the id, your connection and HF_TOKEN, or pass a local checkpoint directory."
    return f"{what} {cause}. {fix}"


def source_fingerprint(directory) -> str:
    """'sha256:<hex>' of a checkpoint's config.json and weight files (names and bytes).

    It depends on the content alone, not on where the folder is, so a run config can
    record it and a resume can refuse a different model. Files are streamed in 1 MiB
    blocks; each is framed by its name and size, so no two file sets hash alike.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory: source_fingerprint hashes a checkpoint "
                              "folder (hf.resolve gives one for a Hub id).")
    read_config(directory)  # raises, naming a missing config.json
    files = [directory / CONFIG_FILE] + sorted(set(tensor_files(directory).values()))
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return f"sha256:{digest.hexdigest()}"


@contextlib.contextmanager
def open_safetensors(path: Path):
    """`safe_open(path, "np")`, with an error that names the file when it is not a whole
    safetensors file (a download or copy cut short): safetensors' own names none."""
    try:
        handle = safe_open(path, "np")
    except SafetensorError as err:
        raise CheckpointError(f"{path}: not a whole safetensors file ({err}); it is truncated or damaged: "
                              "download (or copy) it again.") from None
    with handle as f:
        yield f


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
    with open_safetensors(single) as f:
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
            self._handles[file] = self.enter_context(open_safetensors(file))
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


def check_dtype(dtype, allowed=DTYPES, *, what: str = "dtype") -> None:
    if dtype is not None and str(dtype) not in allowed:
        raise CheckpointError(f"{what}={dtype!r}; choose one of {allowed} (or None to keep the file's).")


def load_pretrained(path_or_repo_id, *, dtype: str | None = None,
                    sharding: jax.sharding.Sharding | Callable | None = None,
                    revision: str | None = None, token: str | None = None, remat: bool = False):
    """(graphdef, params, config) of a Hugging Face Llama / Qwen2 / Qwen3 checkpoint.

    path_or_repo_id: a local checkpoint folder, or a Hub id (`revision` pins a commit;
    `token` defaults to HF_TOKEN). dtype: the parameters' dtype, "float32" (to train) or
    "bfloat16"; None keeps the file's. sharding: where the parameters go: None (the
    default device), one Sharding for all, or a function from the abstract parameter tree
    to a tree of shardings, e.g. `lambda like: parallel.fsdp_shardings(like, mesh)`. Each
    device reads only its own slice of each tensor from the files, so a model that does
    not fit one device never sits whole on one, and no random initialisation is ever computed.
    remat: per-block rematerialisation in the training pass (`ModelConfig.remat`; the same
    numbers, less memory); `model.with_remat` switches it later.
    """
    check_dtype(dtype)
    directory = resolve(path_or_repo_id, revision=revision, token=token)
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

EXPORT_DTYPES = DTYPES + ("float16",)


def _params_dtype(params) -> str:
    dtypes = {str(np.dtype(x.dtype)) for x in jax.tree.leaves(params)}
    if len(dtypes) != 1:
        raise CheckpointError(f"The parameters mix dtypes {sorted(dtypes)}; pass dtype= to write them "
                              "in one, or cast them first (e.g. tunix_nb.precision.cast_floats).")
    return dtypes.pop()


def hf_tensors(params, dtype: str | None = None) -> dict[str, np.ndarray]:
    """The checkpoint's tensors (host arrays, [out, in] weights) of a kit parameter tree,
    cast to `dtype` when given."""
    tensors = {}
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        name = kit_name(path)
        array = parallel.to_host(x)
        array = array if dtype is None else array.astype(jax.numpy.dtype(dtype))
        tensors[hf_name(name)] = np.ascontiguousarray(array.T if is_transposed(name) else array)
    return tensors


SIZE_UNITS = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}


def size_in_bytes(size) -> int:
    """5_000_000, "5GB" (10^9 bytes), "500MB", "48KB" or "2GiB" (2^30), as transformers reads them."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    text = str(size).strip().upper()
    for unit, factor in SIZE_UNITS.items():  # longest units first, so "GIB" is not read as "B"
        number = text[: -len(unit)].strip()
        if text.endswith(unit) and number.replace(".", "", 1).isdigit() and float(number) > 0:
            return int(float(number) * factor)
    raise CheckpointError(f"max_shard_size={size!r}: give a positive number of bytes or a size such as "
                          "'5GB', '500MB' or '2GiB'.")


def _module_order(name: str):
    """The embedding, the layers (10 after 9), the final norm, then lm_head: the order of a
    model's modules, in which transformers fills its shards."""
    return name.startswith("lm_head"), [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def shard(tensors: dict[str, np.ndarray], max_shard_size) -> list[dict[str, np.ndarray]]:
    """Tensors in module order, cut into shards of at most max_shard_size bytes (a tensor
    larger than that gets a shard of its own), as transformers' save_pretrained does."""
    limit = size_in_bytes(max_shard_size)
    shards, current, used = [], {}, 0
    for name in sorted(tensors, key=_module_order):
        size = tensors[name].nbytes
        if current and used + size > limit:
            shards.append(current)
            current, used = {}, 0
        current[name], used = tensors[name], used + size
    return shards + [current]


def save_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    """`tensors` in one .safetensors file, readable as the process's other files are: safetensors
    creates its files with mode 0600, which a server running as another user cannot read."""
    save_file(tensors, path, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_tensors(out: Path, tensors: dict[str, np.ndarray], max_shard_size=None) -> list[str]:
    """model.safetensors, or shards with model.safetensors.index.json; returns the file names.

    Weight files of an earlier save in `out` are removed first: a stale index or shard
    would otherwise be read instead of (or mixed with) the new weights.
    """
    for stale in [out / SINGLE_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    shards = [tensors] if max_shard_size is None else shard(tensors, max_shard_size)
    if len(shards) == 1:
        save_safetensors(tensors, out / SINGLE_FILE)
        return [SINGLE_FILE]
    weight_map, names = {}, []
    for index, part in enumerate(shards, start=1):
        names.append(SHARD_FILE.format(index=index, count=len(shards)))
        save_safetensors(part, out / names[-1])
        weight_map.update({name: names[-1] for name in part})
    index_json = {"metadata": {"total_parameters": sum(t.size for t in tensors.values()),
                               "total_size": sum(t.nbytes for t in tensors.values())},
                  "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index_json, indent=2) + "\n")
    return names + [INDEX_FILE]


def copy_tokenizer_files(source: Path, out: Path) -> list[str]:
    """Copy the tokenizer, chat template and generation config files `source` has."""
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copyfile(source / name, out / name)
    return copied


def save_pretrained(out_dir, graphdef, params, config: model.ModelConfig, *, extra_config: dict | None = None,
                    source=None, dtype: str | None = None, max_shard_size=None):
    """Write config.json and safetensors that transformers' AutoModelForCausalLM loads.

    source: the checkpoint folder (or Hub id) the model came from: its config.json's
    fields are kept (max_position_embeddings, special token ids, ...) and its tokenizer
    files copied (TOKENIZER_FILES), so the folder is complete for transformers and vLLM.
    dtype: the tensors' dtype on disk ("float32", "bfloat16", "float16"; None keeps the
    parameters', which must then be one). max_shard_size: e.g. "5GB"; larger weights
    are split into shards with model.safetensors.index.json, as transformers writes them.
    `graphdef` is checked against `config` so that a config from another model is caught
    before anything is written. Returns the directory.
    """
    check_dtype(dtype, EXPORT_DTYPES)
    expected_graphdef, abstract = abstract_model(config)
    if expected_graphdef != graphdef:
        raise CheckpointError("graphdef does not match config: pass the config returned with these "
                              "parameters (by hf.load_pretrained, or the one the model was built from).")
    check_names([hf_name(n) for n in kit_names(params)], _expected_names(kit_names(abstract)), config, "params")
    source_dir = None if source is None else resolve(source)
    hf_config = export_config(config, dtype=dtype or _params_dtype(params), extra=extra_config,
                              source_config=None if source_dir is None else read_config(source_dir))
    if max_shard_size is not None:
        size_in_bytes(max_shard_size)  # a bad size fails before anything is written
    out = Path(out_dir)
    if source_dir is not None and out.resolve() == source_dir.resolve():
        raise CheckpointError(f"{out} is the source checkpoint itself; export to another directory.")
    out.mkdir(parents=True, exist_ok=True)
    write_tensors(out, hf_tensors(params, dtype), max_shard_size)
    (out / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    if source_dir is not None:
        copy_tokenizer_files(source_dir, out)
    return out


def save_merged(out_dir, lora_graphdef, adapters, base, *, alpha: float, dtype: str | None = None, **save_kwargs):
    """Export a LoRA or QLoRA model as a plain checkpoint: the adapters merged into the
    weights (`lora.merge`, QLoRA's base dequantised first), then `save_pretrained`.

    dtype None writes the frozen base's dtype (the embedding's: the dtype the base was
    loaded in), since merged kernels come out in float32 from float32 adapters.
    """
    from tunix_nb import lora  # qwix is imported only for LoRA models

    plain_graphdef, merged = lora.merge(lora_graphdef, adapters, base, alpha=alpha)
    config = nnx.merge(plain_graphdef, merged).cfg
    if dtype is None:
        dtype = str(np.dtype(nnx.to_pure_dict(base)["embed"]["embedding"].dtype))
    return save_pretrained(out_dir, plain_graphdef, merged, config, dtype=dtype, **save_kwargs)
