"""Every figure the README and the pages under docs/ quote is the one its source stored: a
notebook's output or a record in results/.

`FIGURES` is the registry: one entry per number a page prints, saying on which page
(`PAGES`) and where on it the number stands, and where it was measured. When the notebooks
are re-executed or the benchmark is rerun, timing figures change and a test here fails with
the figure, the page's value, the stored value at the page's precision, and where it is
stored. `python tests/test_readme_figures.py` copies every stored value into its page. A
number added to one of the pages' tables (`TABLES`) must be registered here
(`test_every_number_in_the_tables_is_registered`).

How an entry reads:
- `page`: the file it is quoted in, relative to the repository root (README.md unless the
  entry is placed on a docs page with `on(PAGE, [...])`).
- `text`: the page's text around the number, literally (line breaks and indentation
  count as one space), with `{}` where the figure stands, `{n}` for any other number and
  `{...}` for any text within a table cell. It must occur exactly once on the page.
- `source`: a notebook in notebooks/, or a record in results/ ("bench.json",
  "compile_cache.json", ...). `where`, for a notebook, is a
  regular expression over one code cell's stored output (text and text/plain), with
  `{}` for each number it reads and `{n}` for a number it skips, matching exactly one
  cell; or `WALL`, the cells' wall time from the execution timestamps the notebook
  keeps. For a record, `where` is a key path ("figures.x.value", or a tuple of keys where
  a key holds a dot), or several.
- `combine` makes several numbers one ("max", "ratio" a/b, "difference" a-b), and
  `scale` converts the stored unit to the page's (1e3: seconds to ms, 100: to %).
The page's value must equal the stored one rounded to as many decimals as the page
prints (for 2.4e-7: the mantissa's).

The README's headline results are rows of docs/results.md's table quoted whole: every
figure of a docs/results.md row that the README repeats word for word is checked in the
README too (`quoted_rows`), so the two stay the same.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from datetime import datetime
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README, RESULTS, BENCHMARKS = "README.md", "docs/results.md", "docs/benchmarks.md"
LAYOUT, MULTIPROCESS = "docs/layout.md", "docs/multiprocess.md"
PAGES = (README, RESULTS, BENCHMARKS, LAYOUT, MULTIPROCESS)  # the pages that quote figures
BENCH = "bench.json"
CACHE = "compile_cache.json"
TEST_COMMAND = "test_command.json"  # the README's test command as .ci/run ran it
WALL = "cells' wall time"
NUMBER = r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?"


@dataclass(frozen=True)
class Figure:
    name: str
    text: str
    source: str
    where: str | tuple[str, ...]
    combine: str = "one"
    scale: float = 1.0
    page: str = README


def nb(name, text, notebook, where, **kw):
    return Figure(name, text, notebook, where, **kw)


def bench(name, text, *keys, **kw):
    return Figure(name, text, BENCH, keys, **kw)


def cache_record(name, text, *keys, **kw):
    """A figure from results/compile_cache.json: the suite and the notebooks with and without the cache."""
    return Figure(name, text, CACHE, keys, **kw)


def memory(name, text, *keys, **kw):
    """A figure from results/bench.json's "memory": the memory plan's settings (its table is
    tests/test_docs_benchmarks.py's). `keys`: tuples of keys within that record."""
    return Figure(name, text, BENCH, tuple(("memory", *k) for k in keys), **kw)


def on(page: str, figures: list[Figure]) -> list[Figure]:
    """`figures`, quoted on `page` (a path under the repository root) instead of the README."""
    assert page in PAGES, f"{page} is not in PAGES: add it there"
    return [replace(f, page=page) for f in figures]


def page_text(page: str) -> str:
    return (ROOT / page).read_text()


def text_pattern(template: str) -> re.Pattern:
    """A page template as a regex: {} captures the figure; whitespace runs match any whitespace."""
    placeholders = {"{}": f"({NUMBER})", "{n}": NUMBER, "{...}": r"[^|\n]*"}
    parts = re.split(r"(\{\}|\{n\}|\{\.\.\.\})", template)
    literal = lambda part: re.escape(re.sub(r"\s+", " ", part)).replace(r"\ ", r"\s+")  # noqa: E731
    return re.compile("".join(placeholders.get(part) or literal(part) for part in parts))


def quoted_rows(figures: list[Figure], page: str) -> list[Figure]:
    """The figures among `figures` whose whole table row `page` repeats word for word, placed on `page`
    too (named "... (page)"). A figure not found once on its own page is left to the test that says so."""
    lines_there, out = set(page_text(page).split("\n")), []
    for fig in figures:
        source = page_text(fig.page)
        matches = list(text_pattern(fig.text).finditer(source))
        if len(matches) == 1:
            start = source.rfind("\n", 0, matches[0].start()) + 1
            end = source.find("\n", matches[0].end())
            row = source[start:end if end >= 0 else len(source)]
            if row.startswith("|") and row in lines_there:
                out.append(replace(fig, name=f"{fig.name} ({page})", page=page))
    return out


N00, N01, N02, N03 = "00_devices_and_setup", "01_vmap_kl_distillation", "02_distilling_a_student", "03_pmap_sft"
N04, N05, N06, N07 = "04_pmap_dpo", "05_orbax_checkpointing", "06_beyond_pmap", "07_benchmarks"
N08, N09, N10, N11 = "08_grpo", "09_hf_checkpoints", "10_lora_qlora", "11_on_policy_distillation"
N12 = "12_your_model_and_data"
L02, L08, L11 = "lesson02_distillation_budgets.json", "lesson08_grpo_budgets.json", "lesson11_gkd.json"
L11C = "lesson11_gkd_count.json"  # lesson 11's second design, running counts
L11S = "lesson11_gkd_small_student.json"  # its third design, running counts with a one-layer student
L11T = "lesson11_gkd_small_student_1000_steps.json"  # the third design at 1000 steps, chosen on validation for the share
L11F = "lesson11_gkd_count14.json"  # the fourth design, running counts of exactly 14 bits
L11B = "lesson11_gkd_count14_budgets.json"  # the fourth design, each arm at its own best validation checkpoint


GATE = ("greedy", "pass_at_1", "pass_at_8")


def gain_paths(*path):
    return [(*path, "mean"), (*path, "ci95", 0), (*path, "ci95", 1)]


# (lesson, record, the docs/results.md row with {} where each figure stands, the key paths under "summary", scale)
EXPERIMENT_ROWS = [
    ("02", L02, "| 02 | test exact match at 300 labels (10 seeds, 1000 test prompts): hard labels only / plus the "
                "teacher's greedy answers to 4000 unlabelled prompts / distilled on them | {}% / {}% / {}% |",
     [("labels=300", "exact_match", arm, "mean") for arm in ("labels", "teacher_labels", "distilled")], 100),
    ("02", L02, "| 02 | distilled over hard labels only, 300 labels, points (10 seeds, each drawing its labelled "
                "prompts; each arm at its best validation checkpoint of 2400 steps and its validation-chosen learning "
                "rate; 95% t-interval over seeds) | {±}{} ({±}{} to {±}{}) |",
     gain_paths("labels=300", "distilled_over_labels"), 100),
    ("02", L02, "| 02 | same, at 100 / 1000 labels | {±}{} / {±}{} |",
     [("labels=100", "distilled_over_labels", "mean"), ("labels=1000", "distilled_over_labels", "mean")], 100),
    ("02", L02, "| 02 | soft targets over the teacher's greedy answers as labels, 300 labels (the budget a "
                "limit for both) | {±}{} ({±}{} to {±}{}) |",
     gain_paths("labels=300", "soft_over_teacher_labels"), 100),
    ("02", L02, "| 02 | test answers equal to the teacher's (fidelity), 300 labels: hard labels only / teacher's "
                "answers / distilled | {}% / {}% / {}% |",
     [("labels=300", "fidelity", arm, "mean") for arm in ("labels", "teacher_labels", "distilled")], 100),
    ("08", L08, "| 08 | long family, test (5 seeds, 1000 prompts), greedy exact match: SFT student / RFT / GRPO "
                "| {}% / {}% / {}% |", [("greedy", arm, "mean") for arm in ("sft", "rft", "grpo")], 100),
    ("08", L08, "| 08 | same, sampled pass@1 at each policy's best validation temperature | {}% / {}% / {}% |",
     [("sampled_pass_at_1", arm, "mean") for arm in ("sft", "rft", "grpo")], 100),
    ("08", L08, "| 08 | GRPO over the SFT student, sampled pass@1, points (learning rates, checkpoints and temperatures "
                "chosen on validation; 600 steps, every run still improving: the budget is the limit; 95% t-interval "
                "over seeds) | {±}{} ({±}{} to {±}{}) |",
     gain_paths("grpo_over_sft_sampled"), 100),
    ("08", L08, "| 08 | same, greedy | {±}{} ({±}{} to {±}{}) |", gain_paths("grpo_over_sft_greedy"), 100),
    ("08", L08, "| 08 | GRPO over RFT, sampled pass@1 | {±}{} ({±}{} to {±}{}) |", gain_paths("grpo_over_rft_sampled"), 100),
    ("08", L08, "| 08 | pass@64 at temperature 1: SFT student / RFT / GRPO | {}% / {}% / {}% |",
     [("pass_at_k", arm, "64") for arm in ("sft", "rft", "grpo")], 100),
    ("11", L11, "| 11 | long family (5 seeds, 1000 test prompts), edit similarity on the longest third of answers: "
                "offline / on-policy | {} / {} |",
     [("edit_similarity_longest_third", arm, "mean") for arm in ("offline", "on_policy")], 1),
    ("11", L11, "| 11 | on-policy over offline, same (95% interval) | {±}{} ({±}{} to {±}{}) |",
     gain_paths("on_policy_over_offline_longest_third"), 1),
    ("11", L11, "| 11 | same, exact match on all answers (the control), points | {±}{} ({±}{} to {±}{}) |",
     gain_paths("exact_match_control"), 100),
    ("11", L11, "| 11 | free-running token error on the longest third: offline / on-policy | {}% / {}% |",
     [("free_running_error_longest_third", arm, "mean") for arm in ("offline", "on_policy")], 100),
    ("11", L11, "| 11 | share of those errors its own prefix caused: offline / on-policy | {}% / {}% |",
     [("own_prefix_share_longest_third", arm, "mean") for arm in ("offline", "on_policy")], 100),
    ("11", L11, "| 11 | same, reversals only (where slips compound): offline / on-policy | {}% / {}% |",
     [("by_task", "long_reverse", "own_prefix_share_longest_third", arm, "mean") for arm in ("offline", "on_policy")],
     100),
    ("11", L11, "| 11 | reversals' token error after the right prefix: offline / on-policy | {}% / {}% |",
     [("by_task", "long_reverse", "teacher_forced_error_longest_third", arm) for arm in ("offline", "on_policy")],
     100),
    ("11", L11C, "| 11 | running counts (5 seeds, 1000 test prompts), edit similarity on the longest third (the 14-digit "
                 "answers): offline / on-policy | {} / {} |",
     [("edit_similarity_longest_third", arm, "mean") for arm in ("offline", "on_policy")], 1),
    ("11", L11C, "| 11 | running counts, on-policy over offline, same (95% interval) | {±}{} ({±}{} to {±}{}) |",
     gain_paths("on_policy_over_offline_longest_third"), 1),
    ("11", L11C, "| 11 | running counts, share of errors its own prefix caused: offline / on-policy | {}% / {}% |",
     [("own_prefix_share_longest_third", arm, "mean") for arm in ("offline", "on_policy")], 100),
    ("11", L11C, "| 11 | running counts, right after a miscount: the slip carried on, offline / on-policy | {}% / {}% |",
     [("after_a_slip", arm, "carried", "mean") for arm in ("offline", "on_policy")], 100),
    ("11", L11S, "| 11 | running counts, a one-layer student (5 seeds, 1000 test prompts), edit similarity on the "
                 "14-digit answers: offline / on-policy | {} / {} |",
     [("edit_similarity_longest_third", arm, "mean") for arm in ("offline", "on_policy")], 1),
    ("11", L11S, "| 11 | a one-layer student, on-policy over offline, same (95% interval) | {±}{} ({±}{} to {±}{}) |",
     gain_paths("on_policy_over_offline_longest_third"), 1),
    ("11", L11S, "| 11 | a one-layer student, free-running token error: offline / on-policy | {}% / {}% |",
     [("free_running_error_longest_third", arm, "mean") for arm in ("offline", "on_policy")], 100),
    ("11", L11S, "| 11 | a one-layer student, share of errors its own prefix caused: offline / on-policy | {}% / {}% |",
     [("own_prefix_share_longest_third", arm, "mean") for arm in ("offline", "on_policy")], 100),
    ("11", L11S, "| 11 | a one-layer student, right after its own first slip (free-running): the right digit, "
                 "offline / on-policy | {}% / {}% |",
     [("after_own_slip", arm, "right", "mean") for arm in ("offline", "on_policy")], 100),
    ("11", L11S, "| 11 | a one-layer student, right after its own first slip: the slip carried on, offline / "
                 "on-policy | {}% / {}% |",
     [("after_own_slip", arm, "carried", "mean") for arm in ("offline", "on_policy")], 100),
    ("11", L11S, "| 11 | a one-layer student, the same share within its own answers (the tail after an early eos left "
                 "out): offline / on-policy | {}% / {}% |",
     [("own_prefix_share_within_answer_longest_third", arm, "mean") for arm in ("offline", "on_policy")], 100),
    ("11", L11T, "| 11 | a one-layer student at 1000 steps (of the validation pilots at the default settings, the one "
                 "with the lowest share), on-policy over offline, edit similarity on the 14-digit answers (95% "
                 "interval) | {±}{} ({±}{} to {±}{}) |",
     gain_paths("on_policy_over_offline_longest_third"), 1),
    ("11", L11T, "| 11 | a one-layer student at 1000 steps, share of errors its own prefix caused: offline / on-policy "
                 "| {}% / {}% |",
     [("own_prefix_share_longest_third", arm, "mean") for arm in ("offline", "on_policy")], 100),
    ("11", L11T, "| 11 | a one-layer student at 1000 steps, the same share within its own answers: offline / on-policy "
                 "| {}% / {}% |",
     [("own_prefix_share_within_answer_longest_third", arm, "mean") for arm in ("offline", "on_policy")], 100),
    ("11", L11T, "| 11 | a one-layer student at 1000 steps, the tails after an early eos, part of what its own prefix "
                 "caused: offline / on-policy | {}% / {}% |",
     [("tail_part_of_own_prefix_errors_longest_third", arm, "mean") for arm in ("offline", "on_policy")], 100),
    ("11", L11F, "| 11 | counts of exactly 14 bits, a one-layer student stopped early (5 seeds, 1000 test prompts, 120 "
                 "steps: the validation pilot with the largest gain), on-policy over offline, edit similarity (95% "
                 "interval) | {±}{} ({±}{} to {±}{}) |",
     gain_paths("on_policy_over_offline_longest_third"), 1),
    ("11", L11F, "| 11 | counts of 14 bits, share of errors its own prefix caused: offline / on-policy | {}% / {}% |",
     [("own_prefix_share_longest_third", arm, "mean") for arm in ("offline", "on_policy")], 100),
    ("11", L11F, "| 11 | counts of 14 bits, free-running token error: offline / on-policy | {}% / {}% |",
     [("free_running_error_longest_third", arm, "mean") for arm in ("offline", "on_policy")], 100),
    ("11", L11F, "| 11 | counts of 14 bits, right after its own first slip: the right digit, offline / on-policy "
                 "| {}% / {}% |",
     [("after_own_slip", arm, "right", "mean") for arm in ("offline", "on_policy")], 100),
    ("11", L11F, "| 11 | counts of 14 bits, same, exact match (the control), points | {±}{} ({±}{} to {±}{}) |",
     gain_paths("exact_match_control"), 100),
    ("11", L11B, "| 11 | counts of 14 bits, each arm at its own best validation checkpoint of one 400-step run (10 seeds, "
                 "1000 test prompts), edit similarity: offline / on-policy | {} / {} |",
     [("edit_similarity_longest_third", arm, "mean") for arm in ("offline", "on_policy")], 1),
    ("11", L11B, "| 11 | counts of 14 bits at each arm's best checkpoint, on-policy over offline, edit similarity (95% "
                 "t-interval over seeds) | {±}{} ({±}{} to {±}{}) |",
     gain_paths("on_policy_over_offline_longest_third"), 1),
    ("11", L11B, "| 11 | counts of 14 bits at each arm's best checkpoint, same, exact match, points | {±}{} ({±}{} to {±}{}) |",
     gain_paths("exact_match_control"), 100),
]


TUNIX = "tunix_compare.json"
TUNIX_ROWS = {"SFT": "sft", "DPO": "dpo", "distillation": "distill"}


def tunix_table_figures():
    """The Tunix comparison's table: medians and quartiles on 1 and 8 devices, targets, first-step losses."""
    row = "{} ({}–{}) | {} ({}–{}) | ≤ {} | {} / {}".split("{}")  # the cells' text around the numbers
    out = []
    for label, method in TUNIX_ROWS.items():
        paths = [(n, *k) for n in ("1", "8") for k in (("value",), ("spread", "q25"), ("spread", "q75"))]
        paths += [("1", "target"), ("1", "losses", "kit", 0), ("1", "losses", "tunix", 0)]
        for i, path in enumerate(paths):
            text = "".join(part + ("{}" if j == i else "{n}") for j, part in enumerate(row[:-1])) + row[-1]
            out.append(Figure(f"tunix {method} {'.'.join(map(str, path))}", f"| {label} | {text} |", TUNIX,
                              (("figures", method, *path),)))
    return out


def experiment_figures():
    """The multi-seed experiments' rows (lessons 02, 08, 11): their records' summaries in results/.

    `{±}` in a row stands for the sign of the figure after it, read from the record: a
    gain is printed "+30.1 (+27.0 to +33.2)", and the page's signs must be the stored ones
    too (the figure's digits are compared as for every other figure, `combine="abs"`)."""
    out = []
    for lesson, source, row, paths, scale in EXPERIMENT_ROWS:
        summary = json.loads((ROOT / "results" / source).read_text())["summary"]
        signs = []
        for path in paths:
            value = summary
            for key in path:
                value = value[key]
            signs.append("-" if value < 0 else "+")
        for i, path in enumerate(paths):
            design = {L11C: " running counts", L11S: " small student", L11T: " small student 1000 steps",
                      L11F: " counts of 14 bits", L11B: " counts of 14 bits at best budgets"}.get(
                source, "")  # keys shared across designs
            out.append(Figure(f"{lesson}{design} {'.'.join(map(str, path))}", signed_row(row, i, signs), source,
                              (("summary", *path),), combine="abs", scale=scale))
    return out


def signed_row(row: str, i: int, signs: list[str]) -> str:
    """`row` as a registry template: slot i is the figure ({}), the others any number ({n}), and each
    {±} before a slot is that slot's stored sign."""
    parts, out = row.split("{}"), []
    for j, part in enumerate(parts[:-1]):
        out.append(part.replace("{±}", signs[j]) + ("{}" if j == i else "{n}"))
    return "".join(out) + parts[-1]


F = "figures."
LORA = F + "lora_optimizer_state_share."  # the LoRA study's table and settings live with this figure
P = F + "lora_step_time_ratio.thin_matmul_profile."
LORA_ROWS = {"full fine-tuning": "full", "LoRA r1": "lora r1", "LoRA r4": "lora r4", "LoRA r16": "lora r16",
             "QLoRA nf4 r16": "qlora nf4 r16"}


def lora_table_figures():
    """Every cell of docs/benchmarks.md's LoRA table: shares, bytes, and time and FLOPs relative to full."""
    out = []
    for label, key in LORA_ROWS.items():
        row, full = f"{LORA}table.{key}.", f"{LORA}table.full."
        cells = [("share", "{}%", (row + "trainable_share",), "one", 100.0),
                 ("Adam state", "{}", (row + "optimizer_state_bytes",), "one", 1.0),
                 ("checkpoint", "{}", (row + "checkpoint_bytes",), "one", 1.0),
                 ("step time", "{}", (row + "step_seconds", full + "step_seconds"), "ratio", 1.0),
                 ("FLOPs", "{}", (row + "step_flops", full + "step_flops"), "ratio", 1.0),
                 ("exact match", "{}%", (row + "exact_match",), "one", 100.0)]
        for i, (column, template, keys, combine, scale) in enumerate(cells):
            before = " | ".join(["{n}%" if c[1].endswith("%") else "{n}" for c in cells[:i]])
            text = f"| {label} | " + (before + " | " if before else "") + template + " |"
            out.append(bench(f"LoRA table: {label}, {column}", text, *keys, combine=combine, scale=scale))
    return out

# The benchmark table: row label (as printed before the first number) -> figure, and
# whether it has a spread (IQR column) and a target.
BENCH_ROWS = {
    "`vmap_speedup_over_loop` {...}": ("vmap_speedup_over_loop", "{}x"),
    "`vmap_over_batched_ratio`": ("vmap_over_batched_ratio", "{}"),
    "`train_step_mfu` {...}": ("train_step_mfu", "{}"),
    "`backward_over_forward` {...}": ("backward_over_forward", "{}"),
    "`dp_overhead` {...}": ("dp_overhead", "{}"),
    "`allreduce_share` {...}": ("allreduce_share", "{}"),
    "`ckpt_save_over_disk_bandwidth` {...}": ("ckpt_save_over_disk_bandwidth", "{}"),
    "`async_block_share`": ("async_block_share", "{}"),
    "`ckpt_restore_seconds` {...}": ("ckpt_restore_seconds", "{} s"),
    "`dpo_cached_ref_speedup`": ("dpo_cached_ref_speedup", "{}"),
    "`compile_share` {...}": ("compile_share", "{}"),
    "`kv_cache_decode_speedup` {...}": ("kv_cache_decode_speedup", "{}x"),
    "`grpo_rollout_share` {...}": ("grpo_rollout_share", "{}"),
    "`lora_optimizer_state_share` {...}": ("lora_optimizer_state_share", "{}"),
    "`lora_step_time_ratio` {...}": ("lora_step_time_ratio", "{}"),
    "`lora_exact_match_over_full` {...}": ("lora_exact_match_over_full", "{}"),
    "`remat_memory_ratio` {...}": ("remat_memory_ratio", "{}"),
    "`remat_step_time_ratio` {...}": ("remat_step_time_ratio", "{}"),
}
SPREAD_SHOWN = {"vmap_speedup_over_loop", "vmap_over_batched_ratio", "train_step_mfu", "backward_over_forward",
                "dp_overhead", "allreduce_share", "ckpt_save_over_disk_bandwidth", "async_block_share",
                "dpo_cached_ref_speedup", "kv_cache_decode_speedup", "grpo_rollout_share", "lora_step_time_ratio",
                "remat_step_time_ratio"}
TARGETED = {"vmap_over_batched_ratio", "train_step_mfu", "backward_over_forward", "dp_overhead", "allreduce_share",
            "ckpt_save_over_disk_bandwidth", "async_block_share", "dpo_cached_ref_speedup"}


def bench_table_figures():
    """Every number of the benchmark table: the median, its interquartile range, the target."""
    out = []
    for label, (name, value) in BENCH_ROWS.items():
        measured = value.replace("{}", "{n}")
        out.append(bench(name, f"| {label} | {value} |", F + f"{name}.value"))
        if name in SPREAD_SHOWN:
            out.append(bench(f"{name} q25", f"| {label} | {measured} | {{}}–", F + f"{name}.spread.q25"))
            out.append(bench(f"{name} q75", f"| {label} | {measured} | {{n}}–{{}} |", F + f"{name}.spread.q75"))
        if name in TARGETED:
            iqr = "{n}–{n}" if name in SPREAD_SHOWN else "—"
            out.append(bench(f"{name} target", f"| {label} | {measured} | {iqr} | {{...}}{{}} |", F + f"{name}.target"))
    return out


# Each page's figures, in the order the page quotes them (roughly). `on(PAGE, [...])` places them.
README_FIGURES = [
    # ------------------------------------------------------------ Learning path: the cells' time
    *[nb(f"{n[:2]} cells' time", f"(notebooks/{n}.ipynb) | {{...}} | {{}} s |", n, WALL)
      for n in (N00, N01, N02, N03, N04, N05, N06, N07, N08, N09, N10, N11, N12)],
    # ------------------------------------------------------------ Quick start: the test command's time
    Figure("the test command's time", "The test command took {} s on a 2-core machine", TEST_COMMAND,
           (("runs", 0, "pytest_seconds"),)),
    Figure("the test command's tests", "for {} passing tests", TEST_COMMAND, (("runs", 0, "tests", "passed"),)),
    Figure("the test command's time, the run before", "{} s in the run before", TEST_COMMAND,
           (("runs", 1, "pytest_seconds"),)),
]

RESULTS_FIGURES = on(RESULTS, [
    # ------------------------------------------------------------ Results the lessons measure
    nb("09 logits against transformers", "float32's bound 2.9e-04) | {} |", N09,
       r"largest difference {}, within {n} \(logits' std"),
    nb("09 SFT steps on the fixture", "random weights, {} SFT steps", N09, r"{} steps of 32 rows"),
    nb("09 exact match before", "held-out exact match | {}% →", N09, r"held-out exact match\s+{}% ->"),
    nb("03 naive accumulation error", "sums divided once (the stored run's rounding; bound 9.3e-05) | {};", N03,
       r"relative gradient error of the mean of micro-batch means: {}\n"),
    nb("03 accumulation bound", "sums divided once (the stored run's rounding; bound {}) |", N03,
       r"sums divided once ≤ {} \(float32's bound\)"),
    nb("03 exact accumulation error", "sums divided once (the stored run's rounding; bound 9.3e-05) | {n}; {} |", N03,
       r"sums divided once: {}, within {n};"),
    nb("03 grad_accum bound", "the stored run's rounding, bound {}) |", N03,
       r"AdamW: grad_accum=4 vs the whole batch, {n} device\(s\), {n} steps: apart ≤ {} "),
    nb("03 pmap vs jit bound", "the check is float32's bound, {}) |", N03, r"travelled apart \(bound {}\)"),
    nb("09 logits bound", "float32's bound {}) |", N09, r"transformers' logits ≤ {} \(float32's bound"),
    nb("03 grad_accum vs whole, AdamW", "the stored run's rounding, bound 9.3e-05) | {};", N03, r"AdamW: {} of the distance travelled apart\nSGD"),
    nb("03 grad_accum vs whole, SGD", "the stored run's rounding, bound 9.3e-05) | {n}; {} |", N03, r"SGD  : {} of the distance travelled apart\nAdamW, the mean"),
    nb("10 adapters' share", "adapters' share of its parameters | {}% |", N10, r"adapters {n} \({}%\)"),
    nb("10 student before", "fresh prompts from the student ({}%)", N10, r"exact match: student {}%; after"),
    nb("11 token error, right prefix", "after the right prefix / after its own (1000 test prompts) | {}% /", N11,
       r"offline-distilled student\s+token error: right prefix {}%"),
    nb("11 token error, own prefix", "after the right prefix / after its own (1000 test prompts) | {n}% / {}% |", N11,
       r"offline-distilled student\s+token error: right prefix {n}%, own prefix {}%"),
    nb("11 GKD 8 devices vs 1", "8 devices vs 1, largest parameter difference after 2 steps | {} |", N11,
       r"vs 1, steps \[.*\]: largest parameter difference {}"),
    *experiment_figures(),
    *[Figure(f"08 pilot gate {key}", "| 08 | the long student's pilot gate on the validation split: greedy / pass@1 / "
             "pass@8 at temperature 1 | " + " / ".join("{}%" if k == key else "{n}%" for k in GATE) + " |", L08,
             (("setup", "gate", key),), scale=100) for key in GATE],
    nb("10 full after 100 steps", "QLoRA nf4 r16 | {}% /", N10, r"full {}%, LoRA r16"),
    nb("10 LoRA after 100 steps", "QLoRA nf4 r16 | {n}% / {}% /", N10, r"LoRA r16 {}%\n"),
    nb("10 QLoRA after 100 steps", "QLoRA nf4 r16 | {n}% / {n}% / {}% |", N10, r"after {n} steps {}%\n"),
    nb("10 SFT steps", "after {} SFT steps on fresh prompts", N10, r"after {} steps: full"),
    nb("10 DPO loss at step 1", "(log 2: the policy is the reference) | {} |", N10, r"step 1: loss {} \(log 2"),
    nb("09 exact match after", "held-out exact match | {n}% → {}% |", N09, r"held-out exact match\s+{n}% -> {}%"),
    nb("01 loop / vmap, B = 64", "Python loop of jit'd calls / `vmap`, B = 64 | {}x |",
       N01, r"B= 64\s+loop.*loop/vmap\s+{}x"),
    nb("01 vmap / hand-batched, B = 64", "| `vmap` / hand-batched, B = 64 | {} |",
       N01, r"B= 64\s+loop\s+{n} ms\s+vmap\s+{} ms\s+hand-batched\s+{} ms", combine="ratio"),
    nb("02 teacher's parameters (results table)", "| 02 | teacher ({}k params)",
       N00, r"teacher\s+layers=\d+ d_model=\d+ params={}", scale=1e-3),
    nb("02 teacher eval exact match", "eval exact match / eval loss | {}% / {n} |",
       N02, r"teacher on the 200 eval prompts: exact match {}%"),
    nb("02 teacher eval loss", "eval exact match / eval loss | {n}% / {} |",
       N02, r"teacher on the 200 eval prompts: exact match {n}%, eval loss {}"),
    nb("03 pmap vs jit after 10 steps", "the check is float32's bound, 9.3e-05) | {} |", N03,
       r"8 devices vs 1 after 10 steps: {} of the distance travelled apart"),
    nb("03 per-device-mean trap", "| 03 | the per-device-mean trap, same comparison | {} |",
       N03, r"per-device means: {} of the distance travelled apart"),
    nb("03 exact match after 400 SFT steps", "| 03 | student after 400 SFT steps, eval exact match | {}% |",
       N03, r"step 400: loss {n}, eval exact match {}%"),
    nb("04 DPO pmap vs jit after 10 steps", "| 04 | DPO, pmap vs jit, largest parameter difference after 10 "
       "steps | {} |", N04, r"8 devices vs 1: largest parameter difference after 10 steps = {}"),
    nb("04 recomputed / cached reference", "(ceiling about 4/3) | {}x |",
       N04, r"recomputing the reference / cached: {}x"),
    nb("04 held-out reward accuracy", "| 04 | held-out reward accuracy after 200 DPO steps | {}% |",
       N04, r"held-out pairs: loss {n}, reward accuracy {}%"),
    nb("04 exact match, SFT", "SFT term (RPO) | {}% → {n}% → {n}% |",
       N04, r"exact match SFT {}% -> DPO {n}% -> DPO\+SFT"),
    nb("04 exact match, DPO", "SFT term (RPO) | {n}% → {}% → {n}% |",
       N04, r"exact match SFT {n}% -> DPO {}% -> DPO\+SFT"),
    nb("04 exact match, DPO + SFT term", "SFT term (RPO) | {n}% → {n}% → {}% |",
       N04, r"exact match SFT {n}% -> DPO {n}% -> DPO\+SFT {}%"),
    nb("05 teacher's parameters (results table)", "and AdamW state: {}k params, {n} MB)",
       N00, r"teacher\s+layers=\d+ d_model=\d+ params={}", scale=1e-3),
    nb("05 teacher's state in MB", "and AdamW state: {n}k params, {} MB)", N05, r"state: {} MB"),
    nb("05 sync / async blocking per save", "10.6 MB) | {}x |", N05, r"sync / async = {}x"),
    nb("05 8 -> 4 -> 1 devices vs 1 device", "after 240 steps | {} |",
       N05, r"8->4->1 devices {n}, 1 device throughout {n}; largest parameter difference {}"),
    nb("06 strategies vs jit, SFT", "(SFT; DPO) | ≤ {}; ≤ {n} |",
       N06, r"SFT: shard_map {}\s+dp {}\s+fsdp {}", combine="max"),
    nb("06 strategies vs jit, DPO", "(SFT; DPO) | ≤ {n}; ≤ {} |",
       N06, r"DPO: shard_map {}\s+dp {}\s+fsdp {}", combine="max"),
    nb("06 FSDP / DP bytes per device", "8 devices, teacher | {} |", N06, r"teacher\s+{n}\s+{n}\s+{n}\s+{}"),
    nb("06 2x4 vs 1x8 (results table)", "after 10 FSDP steps | {} |",
       N06, r"2 processes x 4 devices vs 1 process x 8 devices: {}"),
])

BENCHMARK_FIGURES = on(BENCHMARKS, [
    # ------------------------------------------------------------ the benchmark table
    *bench_table_figures(),
    bench("loop / vmap at B = 1", "(B = 64; {}x at B = 1",
          F + "vmap_speedup_over_loop.curve.1.loop_over_vmap"),
    bench("loop / vmap at B = 256", "{}x at B = 256) |", F + "vmap_speedup_over_loop.curve.256.loop_over_vmap"),
    bench("vmap_speedup_over_loop batch size", "`vmap_speedup_over_loop` (B = {};",
          F + "vmap_speedup_over_loop.batch_size"),
    bench("train_step_mfu d_model", "`train_step_mfu` (d={},", F + "train_step_mfu.model.d_model"),
    bench("train_step_mfu layers", "`train_step_mfu` (d={n}, {} layers", F + "train_step_mfu.model.n_layers"),
    bench("train_step_mfu batch", "layers, {}×{n} tokens", F + "train_step_mfu.model.batch"),
    bench("train_step_mfu sequence", "layers, {n}×{} tokens", F + "train_step_mfu.model.seq_len"),
    bench("dp_overhead devices", "(worst of pmap, shard_map, dp on {} devices,", F + "dp_overhead.at_devices"),
    bench("dp_overhead global batch", "dp on 8 devices, global batch {})", F + "dp_overhead.global_batch"),
    bench("allreduce_share global batch", "(pmap, 8 devices, global batch {})", F + "allreduce_share.global_batch"),
    bench("ckpt_save_over_disk_bandwidth size", "`ckpt_save_over_disk_bandwidth` ({} MiB",
          F + "ckpt_save_over_disk_bandwidth.state_bytes", scale=2**-20),
    bench("ckpt_restore_seconds size", "`ckpt_restore_seconds` ({} MiB)", F + "ckpt_restore_seconds.state_bytes",
          scale=2**-20),
    bench("kv_cache_decode_speedup at 128 tokens", "answers; {}x at 128)", F + "kv_cache_decode_speedup.curve.128.speedup"),
    bench("kv_cache_decode_speedup prompts", "(student, {} prompts, 8 new", F + "kv_cache_decode_speedup.batch_size"),
    bench("kv_cache_decode_speedup new tokens", "prompts, {} new tokens: the task", F + "kv_cache_decode_speedup.new_tokens"),
    bench("grpo_rollout_share prompts", "on one device: {} prompts ×", F + "grpo_rollout_share.prompts"),
    bench("grpo_rollout_share group size", "prompts × {} completions", F + "grpo_rollout_share.group_size"),
    bench("grpo_rollout_share updates", "completions, then {} updates)", F + "grpo_rollout_share.num_iterations"),
    bench("remat tokens per row", "SFT step at {}×{n} tokens", F + "remat_memory_ratio.batch"),
    bench("remat sequence", "SFT step at {n}×{} tokens", F + "remat_memory_ratio.seq_len"),
    # ------------------------------------------------------------ the benchmark's prose
    bench("vmap loss's sequence length", "tiny ({} × {n} logits)", F + "vmap_speedup_over_loop.seq_len"),
    bench("vmap loss's vocabulary", "tiny ({n} × {} logits)", F + "vmap_speedup_over_loop.vocab"),
    nb("01 loop / vmap in prose", "Lesson 01's stored run measured {}x at B = 64",
       N01, r"B= 64\s+loop.*loop/vmap\s+{}x"),
    nb("01 vmap / hand-batched in prose", "{} in lesson 01's run at B = 64)",
       N01, r"B= 64\s+loop\s+{n} ms\s+vmap\s+{} ms\s+hand-batched\s+{} ms", combine="ratio"),
    bench("backward / forward before the fix", "The backward pass once took {}x the",
          F + "train_step_mfu.fix.backward_over_forward_before.median"),
    bench("layout copies before the fix", "one per layer: {}% of the traced step",
          F + "train_step_mfu.fix.op_profile_before.layout_copy_share", scale=100),
    bench("the fix's step speedup", "the step {}x faster, MFU", F + "train_step_mfu.fix.step_speedup.median"),
    bench("MFU before the fix", "faster, MFU {} →", F + "train_step_mfu.fix.mfu_before.median"),
    bench("MFU after the fix", "faster, MFU {n} → {}, backward", F + "train_step_mfu.value"),
    bench("backward / forward before the fix, again", "backward / forward {} → {n}, layout",
          F + "train_step_mfu.fix.backward_over_forward_before.median"),
    bench("backward / forward after the fix", "backward / forward {n} → {}, layout", F + "backward_over_forward.value"),
    bench("layout copies before the fix, again", "layout copies {}% → {n}% of the traced step",
          F + "train_step_mfu.fix.op_profile_before.layout_copy_share", scale=100),
    bench("layout copies after the fix", "layout copies {n}% → {}% of the traced step",
          F + "train_step_mfu.profile.op_profile.layout_copy_share", scale=100),
    bench("train_step_mfu in prose", "**MFU misses narrowly ({} < {n})", F + "train_step_mfu.value"),
    bench("train_step_mfu target in prose", "**MFU misses narrowly ({n} < {})", F + "train_step_mfu.target"),
    bench("backward_over_forward in prose", "`backward_over_forward` ({} >", F + "backward_over_forward.value"),
    bench("backward_over_forward target in prose", "`backward_over_forward` ({n} > {});",
          F + "backward_over_forward.target"),
    bench("matmul peak size", "The peak (a {}² float32 matmul)", F + "train_step_mfu.peak_matmul_size"),
    bench("matmul peak", "reached {} GFLOP/s", F + "train_step_mfu.matmul_peak_flops_per_second", scale=1e-9),
    bench("model's largest matmul", "the model's largest matmul alone {} of it",
          F + "train_step_mfu.profile.model_matmul_over_peak.median"),
    bench("forward at a share of the peak", "the forward pass {} of it for",
          F + "train_step_mfu.profile.matmul_flops_share_of_forward_time_at_peak"),
    bench("AdamW update's share of the step", "the AdamW update ({}% of the step)",
          F + "train_step_mfu.profile.optimizer_update_seconds", F + "train_step_mfu.step_seconds",
          combine="ratio", scale=100),
    bench("gradient all-reduced", "one {} MB gradient", F + "allreduce_share.gradient_bytes", scale=1e-6),
    bench("all-reduce share at 64", "{}% at a global batch of 64",
          F + "allreduce_share.share_by_global_batch.64.share", scale=100),
    nb("03 all-reduce share", "({}% in lesson 03's stored run;", N03, r"all-reduce share of the pmap step:\s+{}%"),
    bench("all-reduce share at 1024", "more so at this share), {}% at 1024",
          F + "allreduce_share.share_by_global_batch.1024.share", scale=100),
    bench("pmap step at 1024", "(a {} ms step), where", F + "allreduce_share.share_by_global_batch.1024.step_seconds",
          scale=1e3),
    bench("ckpt ratio in prose", "misses ({} < {n}), measured alike", F + "ckpt_save_over_disk_bandwidth.value"),
    bench("ckpt target in prose", "misses ({n} < {}), measured alike", F + "ckpt_save_over_disk_bandwidth.target"),
    bench("save into RAM", "(`/dev/shm`) takes {} ms", F + "ckpt_save_over_disk_bandwidth.save_to_memory_seconds",
          scale=1e3),
    bench("writing the bytes to disk", "writing its bytes to this disk ({} ms)",
          F + "ckpt_save_over_disk_bandwidth.state_bytes", F + "ckpt_save_over_disk_bandwidth.disk_write_bytes_per_second",
          combine="ratio", scale=1e3),
    bench("the whole save", "the whole save takes {} ms",
          F + "ckpt_save_over_disk_bandwidth.state_bytes", F + "ckpt_save_over_disk_bandwidth.save_bytes_per_second",
          combine="ratio", scale=1e3),
    bench("checkpoint bytes on disk", "({} MiB on disk of", F + "ckpt_save_over_disk_bandwidth.bytes_on_disk",
          scale=2**-20),
    bench("checkpoint state bytes", "on disk of {} MiB)", F + "ckpt_save_over_disk_bandwidth.state_bytes", scale=2**-20),
    bench("dpo_cached_ref_speedup in prose", "`dpo_cached_ref_speedup` misses ({};",
          F + "dpo_cached_ref_speedup.value"),
    bench("dpo_cached_ref_speedup q25 in prose", "misses ({n}; IQR {}–", F + "dpo_cached_ref_speedup.spread.q25"),
    bench("dpo_cached_ref_speedup q75 in prose", "misses ({n}; IQR {n}–{};", F + "dpo_cached_ref_speedup.spread.q75"),
    nb("04 recomputed / cached reference in prose", "{} in lesson 04's run).**",
       N04, r"recomputing the reference / cached: {}x"),
    bench("DPO FLOPs, recompute / cached", "XLA counts {}x the FLOPs", F + "dpo_cached_ref_speedup.flops_ratio"),
    bench("DPO backward / forward, time", "costs {}x the forward",
          F + "dpo_cached_ref_speedup.backward_over_forward_seconds"),
    bench("DPO backward / forward, FLOPs", "costs {n}x the forward ({}x in FLOPs)",
          F + "dpo_cached_ref_speedup.backward_over_forward_flops"),
    bench("what the reference forward adds", "adds only {} ms",
          F + "dpo_cached_ref_speedup.recompute_seconds", F + "dpo_cached_ref_speedup.cached_seconds",
          combine="difference", scale=1e3),
    bench("the reference forward alone", "less than the {} ms it takes alone",
          F + "dpo_cached_ref_speedup.profile.reference_forward_seconds", scale=1e3),
    bench("the cached DPO step", "to a {} ms step (`profile`", F + "dpo_cached_ref_speedup.cached_seconds",
          scale=1e3),
    bench("predicted_from_profile", "`predicted_from_profile`, {}, is",
          F + "dpo_cached_ref_speedup.predicted_from_profile"),
    cache_record("suite with the cache off", "{} s with the cache switched", "runs.cache_off.suite_seconds"),
    cache_record("suite with a warm cache", "off, and {} s with the cache an earlier run", "runs.warm.suite_seconds"),
    cache_record("warm cache over off", "an earlier run filled ({});", "warm_over_off"),
    cache_record("notebooks with the cache off", "the notebooks' cells took {} s and", "runs.cache_off.notebooks_total_seconds"),
    cache_record("notebooks with a warm cache", "cells took {n} s and {} s. With", "runs.warm.notebooks_total_seconds"),
    cache_record("suite with an empty cache", "the command took {} s ({n}) in one run", "runs.cold.suite_seconds"),
    cache_record("empty cache over off", "the command took {n} s ({}) in one run", "cold_over_off"),
    cache_record("suite with an empty cache again", "in one run and {} s ({n}) in another", "runs.cold_again.suite_seconds"),
    cache_record("empty cache over off again", "in one run and {n} s ({}) in another", "cold_again_over_off"),
    cache_record("cache entries", "then held {} programs", "cache_after_cold_run.entries"),
    cache_record("cache size", "programs in {} MB", "cache_after_cold_run.megabytes"),
    cache_record("a third empty-cache run", "in another, and {} s in a third", "runs.cold_third.suite_seconds"),
    bench("lesson 03 step warm over cold", "compiles lesson 03's step in {} of the cold time",
          F + "compile_share.persistent_cache.warm_over_cold.03 sft step"),
    bench("remat time in prose", "block) costs {}x the step time", F + "remat_step_time_ratio.value"),
    bench("remat memory in prose", "and keeps {} of XLA's", F + "remat_memory_ratio.value"),
    bench("remat memory, memory-minimising schedule", "the same program keeps {} of",
          F + "remat_memory_ratio.temp_bytes_with_memory_scheduler.remat",
          F + "remat_memory_ratio.temp_bytes_with_memory_scheduler.plain", combine="ratio"),
    bench("remat update difference", "the same to float32 rounding ({}).", F + "remat_memory_ratio.update_max_abs_difference"),
    # ------------------------------------------------------------ LoRA and QLoRA against full fine-tuning
    *lora_table_figures(),
    bench("lora study: steps", "student (55.0% held-out exact match), {} steps of", LORA + "steps"),
    bench("lora study: start", "student ({}% held-out exact match), 300", LORA + "exact_match_before", scale=100),
    bench("lora study: batch", "steps of {} fresh prompts", LORA + "batch_size"),
    bench("lora study: quantised loss", "the quantised student's loss is {} against", LORA + "table.qlora nf4 r16.loss_first"),
    bench("lora study: float loss", "loss is {n} against {})", LORA + "table.full.loss_first"),
    bench("LoRA r16 time in prose", "says ({} of the time for", LORA + "table.lora r16.step_seconds",
          LORA + "table.full.step_seconds", combine="ratio"),
    bench("LoRA r16 FLOPs in prose", "of the time for {} of the FLOPs at rank 16)", LORA + "table.lora r16.step_flops",
          LORA + "table.full.step_flops", combine="ratio"),
    bench("QLoRA points lost", "and {} points at the end", LORA + "table.full.exact_match",
          LORA + "table.qlora nf4 r16.exact_match", combine="difference", scale=100),
    bench("thin matmul r4 time", "projection at {} of the dense x W", P + "r4.time_over_dense"),
    bench("thin matmul r4 flops", "dense x W for {} of its FLOPs at rank 4", P + "r4.flops_over_dense"),
    bench("thin matmul r16 time", "and {} for {n} at rank 16;", P + "r16.time_over_dense"),
    bench("thin matmul r16 flops", "and {n} for {} at rank 16;", P + "r16.flops_over_dense"),
    bench("rounds per figure", "per-round ratios over {} rounds", "settings.repeats"),
    # ------------------------------------------------------------ against Tunix 0.1.7's trainers
    *tunix_table_figures(),
    Figure("tunix sft kit GFLOP", "XLA counts {} and {n} GFLOP per", TUNIX,
           (("figures", "sft", "1", "gradient_profile", "xla_cost", "kit", "flops"),), scale=1e-9),
    Figure("tunix sft Tunix GFLOP", "XLA counts {n} and {} GFLOP per", TUNIX,
           (("figures", "sft", "1", "gradient_profile", "xla_cost", "tunix", "flops"),), scale=1e-9),
    Figure("tunix sft losses agree", "The losses agree at every step, to {} relative on 1 device", TUNIX,
           (("figures", "sft", "1", "losses", "max_relative_difference"),)),
    Figure("tunix dpo reference share", "(`tunix_prepare`, {} of its step on 1 device)", TUNIX,
           (("figures", "dpo", "1", "seconds", "tunix_prepare"), ("figures", "dpo", "1", "seconds", "tunix")),
           combine="ratio"),
    Figure("tunix dpo host batch", "then takes {} and its distillation step", TUNIX,
           (("figures", "dpo", "8", "kit_over_tunix_host_batch", "median"),)),
    Figure("tunix distill host batch", "its distillation step {} of Tunix's on 8 devices", TUNIX,
           (("figures", "distill", "8", "kit_over_tunix_host_batch", "median"),)),
    # ------------------------------------------------------------ packing against padding
    bench("packing examples", "on a batch of {} examples whose", "packing.examples_per_batch"),
    bench("packing row length", "padded to {} tokens a row", ("packing", "shapes", "padding", 1)),
    bench("packed row length", "first-fit-decreasing into rows of {},", ("packing", "shapes", "packing", 1)),
    bench("padding of the padded batch", "Padding is {}% of the padded batch",
          "packing.padding_fraction.padding", scale=100),
    bench("padding of padded batches on average", "padded batch ({}% on average over",
          "packing.padding_fraction_mean.padding", scale=100),
    bench("batches averaged", "on average over {} batches)", "packing.padding_fraction_mean_batches"),
    bench("padding of the packed batch", "and {}% of the packed one", "packing.padding_fraction.packing", scale=100),
    bench("padding of packed batches on average", "packed one ({}% on average)",
          "packing.padding_fraction_mean.packing", scale=100),
    bench("packing_over_padding", "packed rows' tokens per second over padded rows', is {}",
          "packing.packing_over_padding.value"),
    bench("packing_over_padding q25", "(IQR {}–{n} over", "packing.packing_over_padding.spread.q25"),
    bench("packing_over_padding q75", "(IQR {n}–{} over", "packing.packing_over_padding.spread.q75"),
    bench("packing_over_padding rounds", "over {} rounds;", "packing.packing_over_padding.spread.rounds"),
    bench("packing_over_padding target", "target ≥ {}), with the same loss", "packing.packing_over_padding.target"),
    bench("padding-free over padding", "The padding-free row runs at {} of", ("packing", "speedup_over_padding",
                                                                                "padding_free", "median")),
    # ------------------------------------------------------------ the memory plan's settings
    memory("memory plan batch", "at batch × length {} × {n} with", ("settings", "batch_size")),
    memory("memory plan length", "at batch × length {n} × {} with", ("settings", "seq_len")),
    memory("memory plan vocab chunk", "`--vocab-chunk {} --seq-chunk {n}`", ("settings", "vocab_chunk")),
    memory("memory plan seq chunk", "`--vocab-chunk {n} --seq-chunk {}`", ("settings", "seq_chunk")),
])

LAYOUT_FIGURES = on(LAYOUT, [
    # ------------------------------------------------------------ the task and the model
    nb("tiny preset's parameters", "presets `tiny` ({}k", N00, r"tiny\s+layers=\d+ d_model=\s*\d+ params={}",
       scale=1e-3),
    nb("student preset's parameters", "`student` ({}k)", N00, r"student\s+layers=\d+ d_model=\s*\d+ params={}",
       scale=1e-3),
    nb("teacher preset's parameters", "`teacher` ({}k)", N00, r"teacher\s+layers=\d+ d_model=\s*\d+ params={}",
       scale=1e-3),
])

MULTIPROCESS_FIGURES = on(MULTIPROCESS, [
    nb("06 2x4 vs 1x8 (multi-process prose)", "(largest parameter difference {} after 10 steps;",
       N06, r"2 processes x 4 devices vs 1 process x 8 devices: {}"),
])

FIGURES = [*README_FIGURES, *RESULTS_FIGURES, *BENCHMARK_FIGURES, *LAYOUT_FIGURES, *MULTIPROCESS_FIGURES,
           *quoted_rows(RESULTS_FIGURES, README)]

# The pages' tables whose figures must all be registered: page -> header row -> checked columns.
# (The benchmark table's last column quotes the articles, and its first names settings. The memory
# table of docs/benchmarks.md is a code block that tests/test_docs_benchmarks.py regenerates.)
TABLES = {
    README: {"| notebook | what it teaches | cells' time* |": ("cells' time*",),
             "| lesson | figure | value |": ("value",)},
    RESULTS: {"| lesson | figure | value |": ("value",)},
    BENCHMARKS: {
        "| figure | measured | IQR | target | the articles' claim |": ("measured", "IQR", "target"),
        "| setting | trainable share | Adam state (bytes) | checkpoint (bytes) | step time | FLOPs | held-out exact match |":
            ("trainable share", "Adam state (bytes)", "checkpoint (bytes)", "step time", "FLOPs", "held-out exact match"),
        "| step | 1 device | 8 devices | target | first-step loss, kit / Tunix |":
            ("1 device", "8 devices", "target", "first-step loss, kit / Tunix"),
    },
}


# ------------------------------------------------------------------------------ reading


def page_figure(fig: Figure, text: str | None = None) -> tuple[str, tuple[int, int]]:
    """(the number as the page prints it, its span in the page's text)."""
    text = page_text(fig.page) if text is None else text
    matches = list(text_pattern(fig.text).finditer(text))
    assert len(matches) == 1, (f"{fig.name}: the text {fig.text!r} occurs {len(matches)} times in {fig.page}, "
                               f"not once; edit this entry's `text` to match {fig.page}")
    return matches[0].group(1), matches[0].span(1)


@cache
def notebook(name: str) -> dict:
    return json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())


def cell_output(cell) -> str:
    return "".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                   for o in cell.get("outputs", []))


def wall_seconds(name: str) -> tuple[float, str]:
    code = [c for c in notebook(name)["cells"] if c["cell_type"] == "code"]
    times = [c.get("metadata", {}).get("execution", {}) for c in (code[0], code[-1])]
    assert "iopub.execute_input" in times[0] and "shell.execute_reply" in times[1], (
        f"notebooks/{name}.ipynb keeps no execution timestamps: execute it with nbconvert (CONTRIBUTING.md)")
    start, end = (datetime.fromisoformat(t[k].replace("Z", "+00:00"))
                  for t, k in zip(times, ("iopub.execute_input", "shell.execute_reply")))
    return (end - start).total_seconds(), f"notebooks/{name}.ipynb, execution timestamps of its {len(code)} code cells"


def stored(fig: Figure) -> tuple[float, str]:
    """(the stored value, in the page's unit; where it is stored)."""
    if fig.where == WALL:
        seconds, where = wall_seconds(fig.source)
        return seconds * fig.scale, where
    if fig.source.endswith(".json"):  # bench.json or another record in results/
        results = json.loads((ROOT / "results" / fig.source).read_text())
        values = []
        for path in fig.where:
            value = results
            for key in path if isinstance(path, tuple) else path.split("."):  # a tuple: keys with dots
                value = value[key]  # (or list indices)
            values.append(float(value))
        where = f"results/{fig.source}: " + " and ".join(p if isinstance(p, str) else ".".join(map(str, p))
                                                         for p in fig.where)
    else:
        pattern = re.compile(fig.where.replace("{}", f"({NUMBER})").replace("{n}", NUMBER))
        cells = notebook(fig.source)["cells"]
        hits = [(i, m) for i, c in enumerate(cells) if c["cell_type"] == "code"
                for m in [pattern.search(cell_output(c))] if m]
        assert len(hits) == 1, (f"{fig.name}: {len(hits)} cells of notebooks/{fig.source}.ipynb print "
                                f"{fig.where!r}, not one; edit this entry's `where` to match the output")
        i, match = hits[0]
        values = [float(g.replace(",", "")) for g in match.groups()]
        where = f"notebooks/{fig.source}.ipynb, cell {i} (code cell [{cells[i]['execution_count']}])"
    combine = {"one": lambda v: v[0] if len(v) == 1 else None, "max": max, "abs": lambda v: abs(v[0]),
               "ratio": lambda v: v[0] / v[1], "difference": lambda v: v[0] - v[1]}[fig.combine]
    value = combine(values)
    assert value is not None, f"{fig.name}: {len(values)} numbers read; say how to combine them"
    return value * fig.scale, where


def at_precision(value: float, printed: str) -> str:
    """`value` with as many decimals as `printed` shows (of the mantissa, in e-notation)."""
    printed = printed.replace(",", "")
    mantissa, e, _ = printed.partition("e")
    decimals = len(mantissa.partition(".")[2])
    return f"{value:.{decimals}{'e' if e else 'f'}}"


# ------------------------------------------------------------------------------ tests


def test_figure_names_are_unique():
    names = [f.name for f in FIGURES]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_every_page_is_there_and_quotes_figures():
    for page in PAGES:
        assert (ROOT / page).is_file(), f"{page} is in PAGES but does not exist: remove it from PAGES"
        assert any(f.page == page for f in FIGURES), f"{page} is in PAGES but no entry of FIGURES is on it"


def test_the_readme_headline_rows_are_rows_of_the_results_page():
    """The README's headline table holds rows of docs/results.md's, word for word, so `quoted_rows`
    checks (and `python tests/test_readme_figures.py` updates) each of its figures on both pages."""
    readme = page_text(README)
    below = readme[readme.index("| lesson | figure | value |"):].split("\n")[2:]  # under the header and |---|
    rows = below[:next(i for i, line in enumerate(below + [""]) if not line.startswith("|"))]
    strays = [row for row in rows if row not in page_text(RESULTS).split("\n")]
    assert rows and not strays, (f"README.md's headline rows that docs/results.md does not hold word for word: "
                                 f"{strays}; copy the row from docs/results.md")
    assert any(f.page == README and f.source in (L02, L08, L11, L11C, L11S, L11T, L11F) for f in FIGURES)


@pytest.mark.parametrize("fig", FIGURES, ids=[f.name for f in FIGURES])
def test_figure_is_the_stored_one(fig):
    printed, _ = page_figure(fig)
    value, where = stored(fig)
    rounded = at_precision(value, printed)
    assert float(rounded) == float(printed.replace(",", "")), (
        f"{fig.name}: {fig.page} says {printed}, the stored value is {rounded} ({value:.6g}), from {where}. "
        f"Put the stored value in {fig.page} (`python tests/test_readme_figures.py` does).")


def table_cells(text: str, header: str, columns) -> list[tuple[int, str]]:
    """(offset in the page, text) of every body cell in the named columns of the table under `header`."""
    names = [c.strip() for c in header.strip("|").split("|")]
    wanted = [names.index(c) for c in columns]
    cells, offset = [], text.index(header)
    for row, line in enumerate(text[offset:].split("\n")):
        if not line.startswith("|"):
            break
        if row >= 2:  # below the header and the |---| row
            bars = [m.start() for m in re.finditer(r"\|", line)]
            cells += [(offset + bars[k] + 1, line[bars[k] + 1:bars[k + 1]]) for k in wanted]
        offset += len(line) + 1
    return cells


@pytest.mark.parametrize("page", TABLES)
def test_every_number_in_the_tables_is_registered(page):
    text = page_text(page)
    registered = {page_figure(f, text)[1] for f in FIGURES if f.page == page}
    missing = []
    for header, columns in TABLES[page].items():
        for offset, cell in table_cells(text, header, columns):
            for m in re.finditer(NUMBER, cell):
                if (offset + m.start(), offset + m.end()) not in registered:
                    missing.append(f"{m.group()} in {cell.strip()!r}")
    assert not missing, (f"numbers in {page}'s tables that FIGURES does not register (add an entry saying "
                         f"where each was measured): {missing}")


def update_pages() -> list[str]:
    """Write every registered figure's stored value into its page; returns what changed."""
    changes = []
    for page in PAGES:
        text, edits = page_text(page), []
        for fig in (f for f in FIGURES if f.page == page):
            printed, (start, end) = page_figure(fig, text)
            rounded = at_precision(stored(fig)[0], printed)
            if float(rounded) != float(printed.replace(",", "")):
                edits.append((start, end, rounded))
                changes.append(f"{page}: {fig.name}: {printed} -> {rounded}")
        for start, end, rounded in sorted(set(edits), reverse=True):  # from the end: spans stay valid
            text = text[:start] + rounded + text[end:]
        if edits:
            (ROOT / page).write_text(text)
    return changes


if __name__ == "__main__":  # python tests/test_readme_figures.py: after re-executing notebooks
    print("\n".join(update_pages()) or "The figures of the README and docs/ are the stored ones.")
