"""Rewards: verifiable reward functions for the kit's task, and their weighted sum.

A reward function is a plain callable, as in TRL's GRPOTrainer and Tunix's
RLLearner:

    reward_fn(prompts, completions, **example) -> list[float]     one reward per completion

`prompts` and `completions` are lists of the same length: strings, or with conversational
data (prompts that are lists of {"role", "content"} messages) TRL's form, each completion
a list holding one assistant message (`for_reward_functions`); `example` holds
the data set's columns, one entry per completion (with G completions per prompt,
repeat each prompt's row G times). The kit's columns are `completion` (the reference
answer) and `task` (one of `data.TASKS`). Completions are compared as they are, with
no stripping, as `data.exact_match` does.

`combine(reward_fns, weights)` returns a `RewardSet` that calls each function and
returns the weighted total per completion and each function's rewards, so metrics can
report every function (`reward_metrics`, with TRL's and Tunix's metric names).

Note for TRL users: TRL drops a `completion` column before calling reward functions
(it names the generated text), so there the reference answer needs another column
name. Tunix passes every column through.
"""

from __future__ import annotations

import importlib
import math
import numbers
import os
import string
import sys
import sysconfig
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np

from tunix_nb.data import TASKS

RewardFn = Callable[..., Sequence[float]]


class RewardError(ValueError):
    """A reward function that returned something other than one finite number per completion."""

# The characters each sub-task's answer is made of.
ALPHABETS = {
    "add": string.digits,
    "sort": string.digits,
    "reverse": string.ascii_lowercase,
    "swap": string.ascii_lowercase,
}


def _column(example: Mapping, name: str, n: int, fn_name: str) -> list:
    """example[name] as a list of n entries, or a ValueError naming the fix."""
    if name not in example:
        raise ValueError(
            f"{fn_name} needs the data set's {name!r} column (one entry per completion); "
            f"got columns {sorted(example)}: pass it as {name}=[...]"
        )
    values = list(example[name])
    if len(values) != n:
        raise ValueError(
            f"{fn_name} got {n} completions but {len(values)} {name!r} entries: pass one per "
            "completion (with G completions per prompt, repeat each example G times)"
        )
    return values


def _check_pairs(prompts, completions, fn_name):
    if len(prompts) != len(completions):
        raise ValueError(
            f"{fn_name} got {len(prompts)} prompts but {len(completions)} completions: pass "
            "one prompt per completion (repeat each prompt G times for G completions)"
        )


def for_reward_functions(prompts: Sequence, texts: Sequence[str]) -> list:
    """The completions as TRL hands them to reward functions: the texts for standard prompts;
    for conversational prompts (lists of messages), [{"role": "assistant", "content": text}] each,
    so a reward written for TRL's conversational data runs unchanged."""
    if len(prompts) and not isinstance(prompts[0], str):
        return [[{"role": "assistant", "content": text}] for text in texts]
    return list(texts)


def exact_match(prompts, completions, **example) -> list[float]:
    """1.0 where the completion equals the reference answer (`completion` column), else 0.0.

    Its mean over a batch is `data.exact_match`, the task's own metric.
    """
    _check_pairs(prompts, completions, "exact_match")
    refs = _column(example, "completion", len(completions), "exact_match")
    return [float(c == r) for c, r in zip(completions, refs)]


def char_match(prompts, completions, **example) -> list[float]:
    """Partial credit: characters that agree with the reference at the same position,
    divided by the longer of the two lengths.

    "42" against "42" -> 1; "41" -> 1/2; "420" -> 2/3 (an extra character costs); "24"
    -> 0 (position matters, so a half-reversed word earns only its fixed points);
    "" -> 0. Two empty strings -> 1. Equals 1 exactly when `exact_match` does.
    """
    _check_pairs(prompts, completions, "char_match")
    refs = _column(example, "completion", len(completions), "char_match")
    scores = []
    for c, r in zip(completions, refs):
        longest = max(len(c), len(r))
        same = sum(a == b for a, b in zip(c, r))  # zip stops at the shorter one
        scores.append(same / longest if longest else 1.0)
    return scores


def well_formed(prompts, completions, **example) -> list[float]:
    """1.0 where the answer has the right shape: the reference's length, and only the
    sub-task's characters (digits for add and sort, lowercase letters for reverse and
    swap), else 0.0.

    A format reward, not a correctness one: "99" for "add 37+5=" scores 1. Needs the
    `completion` and `task` columns.
    """
    _check_pairs(prompts, completions, "well_formed")
    refs = _column(example, "completion", len(completions), "well_formed")
    tasks = _column(example, "task", len(completions), "well_formed")
    scores = []
    for c, r, task in zip(completions, refs, tasks):
        if task not in ALPHABETS:
            raise ValueError(f"well_formed got task {task!r}; the kit's tasks are {TASKS}")
        scores.append(float(len(c) == len(r) and all(ch in ALPHABETS[task] for ch in c)))
    return scores


class Rewards(NamedTuple):
    """What a `RewardSet` returns: the weighted total and each function's rewards, all [n]."""

    total: np.ndarray
    per_function: dict[str, np.ndarray]


class RewardSet:
    """Reward functions with weights: total = sum_k weight_k * reward_fn_k(...).

    `reward_fns` is a sequence (each named by its `__name__`) or a mapping name -> fn;
    `weights` defaults to 1 each. Tunix sums the functions' rewards, TRL weights them
    (`reward_weights`). Both let a function return None (NaN) where it does not apply
    and use nansum; here a function returns one finite number per completion, so no
    NaN can reach the advantages.
    """

    def __init__(self, reward_fns: Sequence[RewardFn] | Mapping[str, RewardFn],
                 weights: Sequence[float] | None = None):
        if isinstance(reward_fns, Mapping):
            names, fns = list(reward_fns), list(reward_fns.values())
        else:
            fns = [reward_fns] if callable(reward_fns) else list(reward_fns)
            names = [getattr(fn, "__name__", type(fn).__name__) for fn in fns]
        if not fns:
            raise ValueError("a RewardSet needs at least one reward function")
        if len(set(names)) != len(names):
            raise ValueError(f"reward function names must be unique, got {names}: pass a mapping "
                             "name -> function to name them")
        weights = [1.0] * len(fns) if weights is None else list(weights)
        if len(weights) != len(fns):
            raise ValueError(f"got {len(fns)} reward functions but {len(weights)} weights: pass "
                             "one weight per function")
        if not all(isinstance(w, numbers.Real) and math.isfinite(w) for w in weights):
            raise ValueError(f"weights must be finite numbers, got {weights}")
        self.names, self.fns, self.weights = tuple(names), tuple(fns), tuple(float(w) for w in weights)

    def __call__(self, prompts, completions, **example) -> Rewards:
        _check_pairs(prompts, completions, "RewardSet")
        per_function = {}
        for name, fn in zip(self.names, self.fns):
            per_function[name] = self._checked(name, fn(prompts, completions, **example), len(completions))
        total = sum(w * per_function[name] for name, w in zip(self.names, self.weights))
        return Rewards(np.asarray(total, np.float32), per_function)

    @staticmethod
    def _checked(name, values, n) -> np.ndarray:
        try:
            out = np.asarray(values, np.float32)
        except (TypeError, ValueError) as e:
            raise RewardError(f"reward function {name!r} must return numbers, got {values!r}") from e
        if out.shape != (n,):
            raise RewardError(f"reward function {name!r} returned shape {out.shape} for {n} "
                              "completions: return one reward per completion")
        if not np.all(np.isfinite(out)):
            raise RewardError(f"reward function {name!r} returned a non-finite reward: {values!r}; return a "
                              "finite number for every completion (0.0 where it does not apply)")
        return out

    def __repr__(self):
        terms = ", ".join(f"{w:g} * {n}" for n, w in zip(self.names, self.weights))
        return f"RewardSet({terms})"


def combine(reward_fns, weights=None) -> RewardSet:
    """`RewardSet(reward_fns, weights)`: call it like a reward function, get `Rewards`."""
    return RewardSet(reward_fns, weights)


def reward_metrics(rewards: Rewards, group_size: int) -> dict[str, float]:
    """Reward metrics of one rollout batch, under TRL's names.

    "reward", "reward_std": mean and sample std (ddof=1) of the total;
    "rewards/{name}/mean", "rewards/{name}/std": the same per function;
    "frac_reward_zero_std": fraction of groups (G = group_size consecutive completions)
    whose total rewards are all equal, so their advantages are all 0.
    """
    n = len(rewards.total)
    if not isinstance(group_size, numbers.Integral) or group_size < 1 or n == 0 or n % group_size:
        raise ValueError(f"{n} rewards do not split into groups of group_size={group_size!r}: "
                         "pass the number of completions per prompt")

    def std(x):  # one completion has no spread: 0, not NaN
        return float(np.std(x, ddof=1)) if len(x) > 1 else 0.0

    out = {"reward": float(np.mean(rewards.total)), "reward_std": std(rewards.total)}
    for name, r in rewards.per_function.items():
        out[f"rewards/{name}/mean"] = float(np.mean(r))
        out[f"rewards/{name}/std"] = std(r)
    groups = rewards.total.reshape(-1, group_size)
    out["frac_reward_zero_std"] = float(np.mean(groups.max(axis=1) == groups.min(axis=1)))
    return out


def load_reward_funcs(spec: str) -> dict[str, RewardFn]:
    """{function name: function} of 'module:function,...' (`--reward-funcs`), as TRL's
    `reward_funcs` takes them: each `fn(prompts, completions, **columns) -> list[float]`.

    A module is a dotted name on sys.path or a `module.py` in the working directory.
    Raises ValueError naming the entry and the fix: no colon, a module that does not
    import, a missing or non-callable function, two functions of one name.
    """
    funcs = {}
    for entry in (e.strip() for e in spec.split(",") if e.strip()):
        module_name, _, fn_name = entry.partition(":")
        if not module_name or not fn_name.isidentifier():
            raise ValueError(f"--reward-funcs {entry!r}: write MODULE:FUNCTION, e.g. my_rewards:length_penalty "
                             "for the function length_penalty in my_rewards.py")
        fn = getattr(_import_reward_module(entry, module_name), fn_name, None)
        if not callable(fn):
            raise ValueError(f"--reward-funcs {entry!r}: module {module_name!r} has no function {fn_name!r}; "
                             "define it there as fn(prompts, completions, **columns) -> list[float]")
        if fn_name in funcs:
            raise ValueError(f"--reward-funcs {entry!r}: two reward functions named {fn_name!r}; each logs "
                             "rewards/<name>, so give them distinct names")
        funcs[fn_name] = fn
    if not funcs:
        raise ValueError(f"--reward-funcs {spec!r} names no function; write MODULE:FUNCTION,...")
    return funcs


def _is_users_own(module) -> bool:
    """Whether `module` is a user's .py file: not installed and not the standard library,
    so importing it again is safe (a C extension or an installed package is never reimported)."""
    path = getattr(module, "__file__", None) or ""
    kit = os.path.dirname(os.path.abspath(__file__))
    installed = {sysconfig.get_path(key) for key in ("purelib", "platlib", "stdlib", "platstdlib")} | {kit}
    return path.endswith(".py") and not any(path.startswith(root) for root in installed if root)


def _import_reward_module(entry: str, module_name: str):
    """Import `module_name`, looking in the working directory too (as `python -m` does).

    A module imported before is imported again from the file found now: in a notebook
    the user edits my_rewards.py, or moves to another folder with its own, and runs
    the command again in the same kernel."""
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        importlib.invalidate_caches()  # a file written moments ago is not in the finders' listings yet
        if _is_users_own(sys.modules.get(module_name)):
            del sys.modules[module_name]
        return importlib.import_module(module_name)
    except Exception as err:  # not found, or the module itself fails: either way the user's fix
        raise ValueError(f"--reward-funcs {entry!r}: could not import module {module_name!r} "
                         f"({type(err).__name__}: {err}); put {module_name.replace('.', '/')}.py in the working "
                         "directory or on PYTHONPATH") from err
    finally:
        if added:
            sys.path.remove(os.getcwd())
