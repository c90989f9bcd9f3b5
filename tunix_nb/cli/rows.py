"""The build stage's data: the rows a method trains and evaluates on, as arrays; the shipped
task's splits, or --train-file / --eval-file in TRL's formats (`tunix_nb.user_data`).
"""

from __future__ import annotations

from tunix_nb import sampler
from tunix_nb.cli.flags import RunError
from tunix_nb.cli.run_config import RunConfig
from tunix_nb.distributed import print_once


def training_examples(config: RunConfig, split: str = "train") -> list[dict]:
    """The shipped task's examples of `split` ("train" or "eval") for the method."""
    from tunix_nb import data

    if config.command == "dpo":
        return data.load_preferences(data.DATA_DIR / f"preferences_{split}.jsonl")
    return data.load_sft(data.DATA_DIR / f"sft_{split}.jsonl")


def user_file(config: RunConfig, split: str = "train") -> str | None:
    """--train-file or --eval-file (None: the shipped task's split)."""
    return config.data.train_file if split == "train" else config.data.eval_file


def encoded_user_data(config: RunConfig, tokenizer, split: str = "train"):
    """--train-file / --eval-file through tunix_nb.user_data (TRL's formats, the chat template,
    --max-length's truncation policy): a user_data.Encoded, its cut rows reported."""
    from tunix_nb import data, user_data

    source = user_file(config, split)
    encode = user_data.ENCODERS["dpo" if config.command == "dpo" else "grpo" if config.command == "grpo" else "sft"]
    template_kwargs = _template_kwargs(config, tokenizer)
    try:
        encoded = encode(source, tokenizer, max_length=config.data.max_length, template_kwargs=template_kwargs)
    except (data.DataError, FileNotFoundError, ValueError) as err:
        raise RunError(f"--{'train' if split == 'train' else 'eval'}-file: {err}")
    _check_positions(config, encoded.arrays, f"--{'train' if split == 'train' else 'eval'}-file {source}")
    if encoded.n_cut:
        print_once(f"{source}: {encoded.n_cut} rows lost the beginning of their prompt to fit --max-length "
                   f"{config.data.max_length}")
    return encoded


def _template_kwargs(config: RunConfig, tokenizer) -> dict | None:
    """--chat-template-kwargs as a dict (None: not given); refused for a tokenizer without a template."""
    import json

    if config.data.chat_template_kwargs is None:
        return None
    if getattr(tokenizer, "chat_template", None) is None:
        raise RunError(f"--chat-template-kwargs {config.data.chat_template_kwargs}: the model's tokenizer has no chat "
                       "template to pass them to; drop the flag")
    return json.loads(config.data.chat_template_kwargs)


def _check_positions(config: RunConfig, arrays: dict, what: str) -> None:
    """RunError when a row needs positions past the model's max_position_embeddings (a Hugging
    Face model's config.json), which it was never trained on: --max-length cuts rows to fit."""
    if config.model_dir is None:
        return
    from tunix_nb import hf

    limit = hf.read_config(config.model_dir).get("max_position_embeddings")
    masks = [mask for key, mask in arrays.items() if key.endswith(("attention_mask", "prompt_mask"))]  # grpo: prompts
    longest = max(int(mask.sum(axis=1).max()) for mask in masks)
    if config.command == "grpo":  # the completions follow the prompt: --max-new-tokens is the other fix
        from tunix_nb.generate import positions_problem

        problem = positions_problem(f"{what}: its longest prompt", longest, config.method.max_new_tokens, limit,
                                    fix="cut the prompts' beginnings")
        if problem is not None:
            raise RunError(problem)
    elif limit is not None and longest > limit:
        raise RunError(f"{what}: its longest row needs {longest} positions, past the model's max_position_embeddings "
                       f"{limit} (config.json); pass --max-length {limit} or less to cut the rows to fit")


def training_arrays(config: RunConfig, tokenizer, split: str = "train", examples=None) -> dict:
    """The rows the method trains (or evaluates) on, as arrays: prompt/completion rows (sft,
    distill), preference pairs (dpo) or prompts (grpo); from --train-file / --eval-file when given."""
    from tunix_nb import data

    if user_file(config, split) is not None:
        return encoded_user_data(config, tokenizer, split).arrays
    examples = training_examples(config, split) if examples is None else examples
    if config.command == "dpo":
        return data.preference_arrays(examples, tokenizer, data.DEFAULT_SEQ_LEN)
    if config.command == "grpo":
        return sampler.prompt_rows(examples, tokenizer)
    return data.sft_arrays(examples, tokenizer, data.DEFAULT_SEQ_LEN)
