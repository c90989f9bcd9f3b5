"""What a checkpoint says to a prompt: `python -m tunix_nb.generate --model DIR --prompt "..."`.

Loads a Hugging Face folder (one the kit exported with `hf.save_pretrained`, or any
Llama / Qwen2 / Qwen3 checkpoint), renders the prompt as one user message through the
checkpoint's chat template (raw text when it has none), samples with
`tunix_nb.sampler` and prints the completion, up to the first eos:

    python -m tunix_nb.generate --model runs/export --prompt "add 2 3" --max-new-tokens 32
    python -m tunix_nb.generate --model runs/export --prompt "add 2 3" --temperature 0.8 --seed 1

Temperature 0 (the default) is greedy decoding, so the same folder and prompt always
give the same answer; with a temperature, the seed alone decides the draws.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from tunix_nb import hf, sampler
from tunix_nb.tokenizer import ByteTokenizer, HFTokenizer, template_kwargs_from_json


def load_tokenizer(directory: Path, vocab_size: int):
    """The checkpoint's tokenizer (tokenizer.json, with its chat template: HFTokenizer reads
    chat_template.jinja first, as transformers does); the kit's byte tokenizer for a
    byte-level preset exported without tokenizer files."""
    if (directory / "tokenizer.json").is_file():
        return HFTokenizer.from_dir(directory)
    if vocab_size == ByteTokenizer.vocab_size:
        return ByteTokenizer()
    raise FileNotFoundError(f"{directory} has no tokenizer.json and its vocabulary ({vocab_size}) is not the "
                            "byte tokenizer's: copy the tokenizer files of the model it came from into it "
                            "(hf.save_pretrained(..., source=...) does this).")


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the model saw prompts in training: one user turn through the chat
    template, ending with the assistant's header; without a template, the raw text after
    the tokenizer's bos (if it has one). The template writes its own bos where it has one."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        messages = [{"role": "user", "content": prompt}]
        return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    has_bos = isinstance(tokenizer, ByteTokenizer) or tokenizer.special_tokens.get("bos_token") is not None
    return ([tokenizer.bos_id] if has_bos else []) + tokenizer.encode(prompt)


def complete(model_dir, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
             top_k: int | None = None, top_p: float | None = None, dtype: str = "float32",
             template_kwargs: dict | None = None, max_length: int | None = None) -> str:
    """The model's completion of `prompt` (its text up to the first eos). `template_kwargs`
    reach the chat template, as in training (--chat-template-kwargs, e.g. Qwen3's enable_thinking).
    A prompt that, with `max_new_tokens`, needs more positions than the model's
    max_position_embeddings is a ValueError, unless `max_length` cuts its beginning (as training does)."""
    directory = Path(model_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"--model {model_dir}: no such folder. Pass a folder written by "
                                "hf.save_pretrained (--export-hf) or a Hugging Face checkpoint folder.")
    hf_config = hf.read_config(directory)
    tokenizer = load_tokenizer(directory, hf.model_config(hf_config).vocab_size)
    if template_kwargs:
        if not isinstance(tokenizer, HFTokenizer):
            raise ValueError(f"--chat-template-kwargs: {directory} has the byte tokenizer, which has no chat "
                             "template to pass them to; drop the flag")
        tokenizer = tokenizer.with_template_kwargs(template_kwargs)
    ids = prompt_ids(tokenizer, prompt)
    if not ids:
        raise ValueError("The prompt is empty and the model has no chat template or bos to start from.")
    ids = fit_positions(ids, max_new_tokens, max_length, hf_config.get("max_position_embeddings"))
    graphdef, params, _ = hf.load_pretrained(directory, dtype=dtype)  # after the checks: a real model loads slowly
    prompt_1xP = jnp.asarray([ids], jnp.int32)
    tokens, mask, _ = sampler.generate(graphdef, params, prompt_1xP, jnp.ones_like(prompt_1xP),
                                       jax.random.key(seed), max_new_tokens=max_new_tokens,
                                       temperature=temperature, top_k=top_k, top_p=top_p,
                                       eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    tokens_T, mask_T = (x[0] for x in jax.device_get((tokens, mask)))  # one fetch, not one per token
    new = [int(t) for t, real in zip(tokens_T, mask_T) if real and int(t) != tokenizer.eos_id]
    return tokenizer.decode(new)


def fit_positions(ids: list[int], max_new_tokens: int, max_length: int | None, positions: int | None) -> list[int]:
    """The prompt's ids, cut to their last `max_length` when given (training's rule: a prompt loses its
    beginning); a ValueError when they and `max_new_tokens` need positions past the model's, which it
    never saw in training, so its output there would be silently wrong."""
    if max_length is not None:
        if max_length < 1:
            raise ValueError(f"--max-length {max_length}: give at least 1 token of prompt")
        ids = ids[-max_length:]
    problem = positions_problem("--max-length" if max_length is not None else "the prompt", len(ids), max_new_tokens,
                                positions, fix="keep the prompt's last tokens")
    if problem is not None:
        raise ValueError(problem)
    return ids


def positions_problem(prompt: str, prompt_tokens: int, max_new_tokens: int, positions: int | None, *,
                      fix: str) -> str | None:
    """What is wrong, naming both fixes, when `prompt` (`prompt_tokens` long) and `max_new_tokens`
    sampled after it need positions past the model's max_position_embeddings `positions`; None when
    they fit. `fix` says what a smaller --max-length does (generate, and GRPO's rollouts, cut prompts)."""
    need = prompt_tokens + max_new_tokens
    if positions is None or need <= positions:
        return None
    if max_new_tokens >= positions:
        return (f"--max-new-tokens {max_new_tokens} alone fills the model's max_position_embeddings "
                f"{positions} (config.json); give fewer")
    return (f"{prompt} ({prompt_tokens} tokens) and --max-new-tokens {max_new_tokens} need {need} positions, past "
            f"the model's max_position_embeddings {positions} (config.json); pass --max-length "
            f"{positions - max_new_tokens} or less to {fix}, or fewer --max-new-tokens")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tunix_nb.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint folder (e.g. an --export-hf one)")
    parser.add_argument("--prompt", required=True, help="the user's message (rendered with the chat template)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy decoding")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0, help="the sampling key's seed (used when temperature > 0)")
    parser.add_argument("--dtype", default="float32", choices=hf.DTYPES, help="the parameters' dtype")
    parser.add_argument("--max-length", type=int, default=None, metavar="N",
                        help="keep the prompt's last N tokens (its beginning is cut, as in training); without it, "
                             "a prompt that with --max-new-tokens needs more than the model's "
                             "max_position_embeddings is an error")
    parser.add_argument("--chat-template-kwargs", type=_template_kwargs, default=None, metavar="JSON",
                        help="variables for the chat template, as a JSON object, e.g. '{\"enable_thinking\": false}' "
                             "for Qwen3: give what the model was trained with")
    return parser


def _template_kwargs(text: str) -> dict:
    try:
        return template_kwargs_from_json(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        text = complete(args.model, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        seed=args.seed, top_k=args.top_k, top_p=args.top_p, dtype=args.dtype,
                        template_kwargs=args.chat_template_kwargs, max_length=args.max_length)
    except (FileNotFoundError, ValueError) as err:  # hf.CheckpointError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
