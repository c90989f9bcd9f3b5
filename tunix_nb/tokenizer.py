"""Tokenizers: the `Tokenizer` protocol the kit codes against, a byte tokenizer, and a
Hugging Face `tokenizer.json` behind the same protocol.

A byte tokenizer needs no training and no download, handles any UTF-8 text, and keeps
the vocabulary tiny (259), so the lessons' models stay small enough for a CPU. A real
checkpoint comes with its own tokenizer: `HFTokenizer.from_dir` reads it.
"""

from __future__ import annotations

import copy
import functools
import json
import operator
from pathlib import Path
from typing import Iterable, Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the generation loop need from a tokenizer.

    `encode` returns only the text's ids, with no bos/eos: callers add those, so a
    prompt and its completion can be encoded separately and joined.
    """

    pad_id: int
    bos_id: int
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: pad=0, bos=1, eos=2, byte b -> id b+3 (vocab_size=259).

    >>> tok = ByteTokenizer()
    >>> tok.encode("hi")
    [107, 108]
    >>> tok.decode([1, 107, 108, 2, 0])
    'hi'
    """

    pad_id = 0
    bos_id = 1
    eos_id = 2
    n_special = 3  # ids below this are special; byte b is id b + n_special
    vocab_size = 256 + n_special

    def encode(self, text: str) -> list[int]:
        """The ids of `text`'s UTF-8 bytes (no bos/eos)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() needs a str, got {type(text).__name__}; decode bytes to str first.")
        return [b + self.n_special for b in text.encode("utf-8")]

    def _checked(self, ids: Iterable[int]) -> list[int]:
        """ids as plain ints, each checked to be in [0, vocab_size)."""
        out = []
        for i in ids:
            i = operator.index(i)  # accepts Python and NumPy ints, rejects floats
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"token id {i} is out of range: valid ids are 0..{self.vocab_size - 1} "
                    f"(vocab_size={self.vocab_size}). Check that the model's vocab_size "
                    "matches the tokenizer's."
                )
            out.append(i)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, skipping pad/bos/eos wherever they are.

        It does not stop at eos (cut there first if you need to). Invalid UTF-8,
        which a model can generate, becomes U+FFFD instead of raising.
        """
        data = bytes(i - self.n_special for i in self._checked(ids) if i >= self.n_special)
        return data.decode("utf-8", errors="replace")

    def render(self, ids: Iterable[int]) -> str:
        """Like decode, but shows special tokens as <pad>/<bos>/<eos>, to inspect a row."""
        names = {self.pad_id: "<pad>", self.bos_id: "<bos>", self.eos_id: "<eos>"}
        parts, run = [], []
        for i in self._checked(ids) + [self.pad_id]:  # sentinel flushes the last run
            if i in names:
                if run:
                    parts.append(bytes(run).decode("utf-8", errors="replace"))
                    run = []
                parts.append(names[i])
            else:
                run.append(i - self.n_special)
        return "".join(parts[:-1])

    def __repr__(self) -> str:
        return (
            f"ByteTokenizer(vocab_size={self.vocab_size}, pad_id={self.pad_id}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, byte b -> id b+{self.n_special})"
        )


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (the `tokenizers` library) behind the kit's protocol.

    Special tokens come from `tokenizer_config.json`. The kit's rows start with bos; a
    tokenizer without one (Qwen) uses its pad token, the `<|endoftext|>` document
    separator those models were pretrained with, and one without a pad token (Llama 3)
    pads with eos, which the attention mask hides.
    """

    def __init__(self, tokenizer, *, bos_token=None, eos_token=None, pad_token=None, chat_template=None):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token}
        if eos_token is None:
            raise ValueError("The tokenizer names no eos_token; add one to tokenizer_config.json: "
                             "generation needs to know where an answer ends.")
        self.eos_id = self._id(eos_token)
        self.pad_id = self._id(pad_token) if pad_token is not None else self.eos_id
        self.bos_id = self._id(bos_token) if bos_token is not None else self.pad_id
        self.chat_template = chat_template
        self.template_kwargs = {}  # passed to every rendering: see with_template_kwargs

    @classmethod
    def from_dir(cls, directory) -> "HFTokenizer":
        """Read `tokenizer.json` and `tokenizer_config.json` from a checkpoint directory.

        The chat template comes from `chat_template.jinja` when the folder has one (where
        transformers 5 saves it, and what transformers reads first), else from the config's
        `chat_template` key.
        """
        from tokenizers import Tokenizer as _Tokenizer  # imported here: the byte tokenizer needs none of it

        directory = Path(directory)
        if not (directory / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{directory} has no tokenizer.json (the `tokenizers` format). "
                                    "A slow-only tokenizer (tokenizer.model) must be converted with "
                                    "transformers first.")
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        content = lambda t: t.get("content") if isinstance(t, dict) else t  # noqa: E731
        template_path = directory / "chat_template.jinja"
        chat_template = (template_path.read_text(encoding="utf-8") if template_path.is_file()
                         else config.get("chat_template"))
        if isinstance(chat_template, list):  # named templates, [{"name", "template"}]: the default one
            chat_template = {t.get("name"): t.get("template") for t in chat_template}.get("default")
        return cls(_Tokenizer.from_file(str(directory / "tokenizer.json")),
                   **{k: content(config.get(k)) for k in ("bos_token", "eos_token", "pad_token")},
                   chat_template=chat_template)

    def _id(self, token: str) -> int:
        i = self.tokenizer.token_to_id(token)
        if i is None:
            raise ValueError(f"Special token {token!r} is not in the tokenizer's vocabulary.")
        return i

    def encode(self, text: str) -> list[int]:
        """The ids of `text` (no bos/eos, as the protocol asks)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() needs a str, got {type(text).__name__}; decode bytes to str first.")
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, skipping special tokens wherever they are."""
        ids = [operator.index(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range: valid ids are 0..{self.vocab_size - 1} "
                             f"(vocab_size={self.vocab_size}). A model's vocabulary may be padded past "
                             "the tokenizer's; mask those logits or cut the ids.")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = False, **template_kwargs) -> str:
        """The model's chat template rendered as transformers renders it (Jinja2, sandboxed).

        `template_kwargs` (over `self.template_kwargs`) reach the template as variables, as
        transformers' `apply_chat_template(..., **kwargs)` passes them (e.g. Qwen3's `enable_thinking`).
        A `{% generation %}` block (transformers' marker for assistant masks) renders its body.
        """
        if self.chat_template is None:
            raise ValueError("This tokenizer has no chat_template; build the prompt text yourself.")
        return _compiled_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **self.template_kwargs, **template_kwargs})

    def with_template_kwargs(self, template_kwargs: dict | None) -> "HFTokenizer":
        """A copy that passes `template_kwargs` to every rendering (what --chat-template-kwargs sets),
        so the rows, the prompts and generation all render the template alike."""
        if not template_kwargs:
            return self
        if self.chat_template is None:
            raise ValueError(f"chat template kwargs {json.dumps(template_kwargs)} given, but this tokenizer has "
                             "no chat template to pass them to; drop them, or use a checkpoint whose tokenizer "
                             "has one.")
        rendering = copy.copy(self)  # shares the tokenizer; only the kwargs differ
        rendering.template_kwargs = {**self.template_kwargs, **template_kwargs}
        return rendering

    def __repr__(self) -> str:
        return (f"HFTokenizer(vocab_size={self.vocab_size}, pad_id={self.pad_id}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id})")


def template_kwargs_from_json(text: str) -> dict:
    """--chat-template-kwargs' value: a JSON object of template variables, e.g.
    '{"enable_thinking": false}' (Qwen3). ValueError naming the fix otherwise."""
    example = 'e.g. \'{"enable_thinking": false}\''
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{text!r} is not valid JSON ({err.msg} at column {err.colno}); give a JSON object, "
                         f"{example} (JSON writes false, true and null in lower case, strings in double quotes)")
    if not isinstance(value, dict):
        raise ValueError(f"{text!r} is a JSON {type(value).__name__}, not an object; give a JSON object, {example}")
    return value


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str):
    """`source` compiled once (a data set renders it several times a row), in the sandboxed
    environment transformers uses: trim_blocks, lstrip_blocks, loop controls, raise_exception."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    import jinja2.ext

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _generation_tag()])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def _generation_tag():
    """A Jinja2 extension for `{% generation %}...{% endgeneration %}`: the body, rendered as is.

    Templates written for transformers' `return_assistant_tokens_mask` wrap assistant turns in
    it; the kit finds those turns by rendering prefixes instead (tunix_nb.user_data), so here
    the block only has to parse. Built on first use: the byte tokenizer needs no jinja2.
    """
    import jinja2.ext
    import jinja2.nodes

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationTag
