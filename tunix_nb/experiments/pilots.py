"""Choosing an experiment's settings per arm from validation pilots, as a hyperparameter is chosen.

A pilot is an experiment record made with `eval_split=validation`: its scores are on the
validation prompts, so choosing among pilots never looks at the test prompts. Given pilots
that differ in one config field (e.g. three learning rates), `choose` takes for each arm the
value with the best mean validation score over the pilots' seeds; each run within a pilot has
already picked its own best checkpoint along its trajectory (`eval_every`).
"""

from __future__ import annotations

import numpy as np

from tunix_nb.experiments import runner, stats


EVAL_SPLITS = ("test", "validation")


def check_eval_split(eval_split: str) -> None:
    """An experiment's `eval_split`: "test" for the reported run, "validation" for its pilots."""
    if eval_split not in EVAL_SPLITS:
        raise ValueError(f"eval_split is 'test' (the reported run) or 'validation' (pilots); got {eval_split!r}.")


def _value(config: dict, fields: list[str]):
    return config[fields[0]] if len(fields) == 1 else "/".join(str(config[f]) for f in fields)


def choose(records: list[dict], field: str) -> dict:
    """{setting: {arm: {"chosen": value, "by_value": {value: seed_interval of the mean validation
    scores}, "chosen_steps": {value: [each seed's chosen step]}}}} over pilots that differ in `field`
    ("learning_rate"; or fields varied together, "learning_rate,rft_learning_rate", whose values
    then read "3e-4/1e-3").

    The first of tied values wins. Refuses a record scored on the test prompts, and pilots that
    differ in other fields than `field` (they would not compare like with like)."""
    if not records:
        raise ValueError("no pilot records given")
    fields = field.split(",")
    others = [{k: v for k, v in r["config"].items() if k not in fields} for r in records]
    for record, rest in zip(records, others):
        if record["config"].get("eval_split") != "validation":
            raise ValueError(f"a pilot with {field}={_value(record['config'], fields)!r} was scored on "
                             f"{record['config'].get('eval_split')!r}: settings are chosen on validation pilots only "
                             "(--set eval_split=validation)")
        if rest != others[0]:
            differ = sorted(k for k in rest if rest[k] != others[0].get(k))
            raise ValueError(f"the pilots differ in {', '.join(differ)} besides {field}: run them with one config "
                             "but for that field")
    out = {}
    for setting in records[0]["runs"]:
        out[setting] = {}
        for arm in records[0]["runs"][setting]:
            by_value = {_value(r["config"], fields): stats.seed_interval(np.mean(runner.scores(r, setting, arm), axis=1))
                        for r in records}
            steps = {_value(r["config"], fields): [run.get("chosen_step") for run in r["runs"][setting][arm]]
                     for r in records}
            chosen = max(by_value, key=lambda value: by_value[value]["mean"])
            out[setting][arm] = {"chosen": chosen, "by_value": by_value, "chosen_steps": steps}
    return out


def describe(choice: dict, field: str) -> str:
    """The choice as lines: per setting and arm, each value's mean validation score and the chosen one."""
    lines = []
    for setting, arms in choice.items():
        for arm, c in arms.items():
            values = ", ".join(f"{value}: {s['mean']:.4f}" + (" *" if value == c["chosen"] else "")
                               for value, s in c["by_value"].items())
            lines.append(f"{setting} {arm}: {field} {values}; chosen steps {c['chosen_steps'][c['chosen']]}")
    return "\n".join(lines)


def steps_to_reach(record: dict, arm: str, threshold: float, *, setting: str = "long",
                   key: str = "val_edit_similarity") -> list[int | None]:
    """Each seed's first checkpoint whose validation score (`key` in the run's "curve") is at
    least `threshold`; None where the run never reaches it. "Faster to a given score" is this,
    compared arm by arm, where "better" would be the score at each arm's best checkpoint."""
    runs = record["runs"][setting][arm]
    if any("curve" not in run for run in runs):
        raise ValueError(f"the {arm} runs keep no validation curve: make the record with --set eval_every=N")
    return [next((point["step"] for point in run["curve"] if point[key] >= threshold), None) for run in runs]
