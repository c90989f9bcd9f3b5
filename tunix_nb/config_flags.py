"""Config dataclasses as command-line flags: one field, one flag, its help, type and check.

Each method's options are a dataclass in the method's module (`sft.SFTConfig`,
`dpo.DPOConfig`, `grpo.GRPOConfig`, `distill.DistillConfig`, `gkd.GKDConfig`,
`lora.LoRAConfig`), as TRL's `SFTConfig`/`DPOConfig`/`GRPOConfig` and Tunix's trainer
configs are; the options every method shares are `train.config.TrainingConfig`. A field
declared with `option(...)` becomes `--field-name` (underscores as dashes), with the
field's default, `help`, `choices` and `type` (a function that parses and checks one
value, raising `argparse.ArgumentTypeError` with the fix). `python -m tunix_nb.train`
builds its subcommands from these (`tunix_nb.cli`). Nothing here imports JAX.
"""

from __future__ import annotations

import argparse
import dataclasses


def option(default=None, *, help: str, type=None, choices=None, metavar=None, switch: bool = False,
           run_defining: bool = True):
    """A dataclass field that is also a flag. `switch`: a flag without a value (store_true);
    `run_defining`: part of what a checkpoint's run is (resuming with another value is refused)."""
    return dataclasses.field(default=default, metadata={
        "help": help, "type": type, "choices": choices, "metavar": metavar, "switch": switch,
        "run_defining": run_defining})


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def option_fields(config_cls) -> list[dataclasses.Field]:
    """The fields of `config_cls` that are flags."""
    return [f for f in dataclasses.fields(config_cls) if "help" in f.metadata]


def add_options(parser, config_cls, *, title: str | None = None, description: str | None = None) -> None:
    """Add one flag per `option` field of `config_cls` (in an argument group when titled)."""
    group = parser.add_argument_group(title, description) if title else parser
    for field in option_fields(config_cls):
        meta = field.metadata
        kwargs = {"dest": field.name, "default": field.default, "help": meta["help"].replace("%", "%%")}
        if meta["switch"]:
            kwargs["action"] = "store_true"
        else:
            kwargs.update({k: meta[k] for k in ("type", "choices", "metavar") if meta[k] is not None})
        group.add_argument(flag_name(field.name), **kwargs)


def from_args(config_cls, args: argparse.Namespace, **resolved):
    """An instance of `config_cls` from parsed flags; `resolved` overrides fields (filled-in defaults)."""
    values = {f.name: getattr(args, f.name) for f in option_fields(config_cls) if hasattr(args, f.name)}
    return config_cls(**{**values, **resolved})


def run_defining_names(config_cls) -> tuple[str, ...]:
    return tuple(f.name for f in option_fields(config_cls) if f.metadata["run_defining"])


# ---------------------------------------------------------------- value checks (argparse types)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")


def positive_float(text: str) -> float:
    value = number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be greater than 0")
    return value


def non_negative_float(text: str) -> float:
    value = number(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return value


def in_unit_interval(meaning: str):
    """An argparse type for a number in [0, 1]; out of range, the error says `meaning`."""

    def parse(text: str) -> float:
        value = number(text)
        if not 0 <= value <= 1:
            raise argparse.ArgumentTypeError(f"{value} {meaning}")
        return value

    return parse
