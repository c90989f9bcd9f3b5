"""A Hugging Face model folder with random weights, written from a real model's config.json.

To measure a real model's training step where its weights cannot be carried (1.2 GB for
Qwen3-0.6B) and the Hub cannot be reached (a TPU machine without network), write the
folder on the machine that trains: the published config.json's shapes, seeded random
weights in `model.safetensors` (what `tunix_nb.hf.load_pretrained` and transformers load),
and a small byte-level tokenizer whose ids fit any vocabulary. Speed and memory depend on
the shapes alone; what the model says is noise.

    python -m tunix_nb.random_checkpoint --preset qwen3-0.6b --out runs/qwen3_random
    python -m tunix_nb.train sft --model runs/qwen3_random --train-file rows.jsonl ...

Presets read `data/model_configs/` (the publishers' config.json files; values also in
torchtune's `qwen3_0_6b_base` and `llama3_2_1b` builders): `qwen3-0.6b`, `llama-3.2-1b`,
and `tiny`, Qwen3-0.6B's architecture at test size (2 layers, hidden 64, vocabulary 512).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from tunix_nb import hf

MODEL_CONFIGS = Path(__file__).resolve().parent.parent / "data" / "model_configs"
REAL_MODELS = {"qwen3-0.6b": "Qwen3-0.6B", "llama-3.2-1b": "Llama-3.2-1B"}
# Qwen3-0.6B's architecture (GQA, head_dim apart from hidden / heads, q/k norms, tied) at test size
TINY_SIZES = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048}
PRESETS = (*REAL_MODELS, "tiny")
# Weights: N(0, 0.02^2) for matrices (the configs' initializer_range), norm scales 1, biases 0
INIT_STD = 0.02

# The tokenizer: UTF-8 bytes as 256 tokens (GPT-2's byte-level symbols, so id b is byte b),
# then Qwen's special tokens; rows start with <|endoftext|> (no bos), replies end with <|im_end|>.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
CHAT_TEMPLATE = (  # ChatML, as the kit's Qwen-like fixtures (tests/fixtures/hf)
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOKENIZER_VOCAB = 256 + len(SPECIAL_TOKENS)


def preset_config(preset: str) -> dict:
    """config.json of a preset: a real model's as published, or `tiny`."""
    if preset not in PRESETS:
        raise ValueError(f"Unknown preset {preset!r}; choose one of {PRESETS}, or pass a config.json.")
    if preset == "tiny":
        return {**hf.read_config(MODEL_CONFIGS / REAL_MODELS["qwen3-0.6b"]), **TINY_SIZES,
                "max_window_layers": TINY_SIZES["num_hidden_layers"]}
    return hf.read_config(MODEL_CONFIGS / REAL_MODELS[preset])


def random_params(config, *, seed: int = 0, dtype: str = "bfloat16"):
    """(graphdef, params): the kit's parameter tree for `config` as seeded NumPy arrays in
    `dtype`, drawn leaf by leaf (float32 draws cast at once, so a 1B model never sits in
    memory in float32)."""
    import jax

    graphdef, abstract = hf.abstract_model(config)
    rng = np.random.default_rng(seed)
    target = jax.numpy.dtype(dtype)

    def draw(path, like):
        name = hf.kit_name(path)
        if name.endswith("/scale"):
            return np.ones(like.shape, target)
        if name.endswith("/bias"):
            return np.zeros(like.shape, target)
        return _cast(rng.standard_normal(like.shape, np.float32) * INIT_STD, target)

    return graphdef, jax.tree_util.tree_map_with_path(draw, abstract)


def _cast(x_float32: np.ndarray, target) -> np.ndarray:
    """`x_float32` in `target`; to bfloat16 by dropping the low 16 bits (round toward zero),
    several times faster than NumPy's rounding cast, which took half of a 0.6B model's write."""
    if np.dtype(target).name != "bfloat16":
        return x_float32.astype(target)
    return (x_float32.view(np.uint32) >> 16).astype(np.uint16).view(target)


def tokenizer_files() -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json of the byte-level tokenizer (no merges)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    symbols = pre_tokenizers.ByteLevel.alphabet()
    by_byte = sorted(symbols, key=lambda s: _byte_of(s))
    tokenizer = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(by_byte)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": EOS_TOKEN,
              "pad_token": PAD_TOKEN, "unk_token": None, "clean_up_tokenization_spaces": False,
              "chat_template": CHAT_TEMPLATE}
    return {"tokenizer.json": tokenizer.to_str(), "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


def _byte_of(symbol: str) -> int:
    """The byte GPT-2's byte-level alphabet maps to `symbol` (printable bytes map to
    themselves, the others to U+0100 onwards in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    code = ord(symbol)
    return code if code in printable else others[code - 256]


def write(out_dir, hf_config: dict, *, seed: int = 0, dtype: str = "bfloat16") -> tuple[Path, int]:
    """Write the folder: config.json (`hf_config`'s fields, the special token ids made the
    tokenizer's), model.safetensors with seeded random weights, and the byte-level tokenizer.
    Returns (the folder, the number of parameters)."""
    hf.check_dtype(dtype, hf.EXPORT_DTYPES)
    config = hf.model_config(hf_config)
    if config.vocab_size < TOKENIZER_VOCAB:
        raise ValueError(f"vocab_size={config.vocab_size} is smaller than the tokenizer's {TOKENIZER_VOCAB} ids; "
                         f"the model needs at least {TOKENIZER_VOCAB} embeddings.")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder; pass a new --out (nothing was written).")
    graphdef, params = random_params(config, seed=seed, dtype=dtype)
    import jax

    ids = {"bos_token_id": None, "pad_token_id": 256, "eos_token_id": 256 + SPECIAL_TOKENS.index(EOS_TOKEN)}
    # the published fields kept (max_position_embeddings, ...), the shapes checked against them
    fields = hf.export_config(config, dtype=dtype, source_config=hf_config, extra=ids)
    hf.save_pretrained(out, graphdef, params, config, extra_config=fields, dtype=dtype)
    for name, text in tokenizer_files().items():
        (out / name).write_text(text, encoding="utf-8")
    return out, sum(x.size for x in jax.tree.leaves(params))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tunix_nb.random_checkpoint", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=PRESETS, help="a real model's published config.json, or tiny")
    source.add_argument("--config", help="a config.json file (Llama, Qwen2 or Qwen3) to take the shapes from")
    parser.add_argument("--out", required=True, help="the folder to write (new, or empty)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights (default: 0)")
    parser.add_argument("--dtype", choices=hf.EXPORT_DTYPES, default="bfloat16",
                        help="the weights' dtype on disk (default: bfloat16, as the publishers ship them)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        hf_config = preset_config(args.preset) if args.preset else json.loads(Path(args.config).read_text())
        out, params = write(args.out, hf_config, seed=args.seed, dtype=args.dtype)
    except (ValueError, OSError) as err:  # hf.CheckpointError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}: {params:,} random parameters ({args.dtype}), {TOKENIZER_VOCAB}-token byte tokenizer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
