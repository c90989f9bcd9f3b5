"""Run an experiment's arms over seeds, pair them by seed, and store the record its claims rest on.

An experiment is a module with a config dataclass, `ARMS`, `run_arm(arm, seed, config,
shared) -> dict` and `prepare(config) -> shared` (what every run reuses: data, a teacher's
answers). `run_arm` returns at least `scores` (one score per test prompt, the same
prompts in every run) and whatever else the lesson plots (`curve`, `chosen_step`, ...).
`run_experiment` runs every arm on every seed (arms that share a seed share the
initialisation and the data order), then `summarise` turns the scores into paired gains
with intervals (`stats.paired_gain`). The record is JSON, with the command that made it.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from tunix_nb.experiments import stats


def run_experiment(experiment, config, seeds: Sequence[int], *, command: str,
                   progress: Callable[[str], None] | None = None, partial: str | Path | None = None) -> dict:
    """{"experiment", "command", "config", "seeds", "setup", "runs": {setting: {arm: [run per seed]}},
    "environment"}; "setup" is what `prepare` measured once and put under shared["record"].

    With `partial`, the record so far is written there after every run, and the runs an
    earlier, interrupted call stored there under the same config are reused, not rerun."""
    shared = experiment.prepare(config)
    record = {"experiment": experiment.NAME, "command": command, "config": dataclasses.asdict(config),
              "seeds": list(seeds), "setup": shared.get("record", {}), "runs": {}}
    done = earlier_runs(partial, record)
    for setting in experiment.settings(config):
        for arm in experiment.ARMS:
            arm_runs = record["runs"].setdefault(setting, {}).setdefault(arm, [])
            for seed in seeds:
                result = done.get((setting, arm, seed)) or timed_run(experiment, arm, seed, config, shared, setting)
                arm_runs.append(dict(result, seed=seed))
                if progress:
                    progress(f"{experiment.NAME} {setting} {arm} seed {seed}: {describe(result)}")
                if partial:
                    save(record, partial)
    return dict(record, environment=environment())


def timed_run(experiment, arm: str, seed: int, config, shared: dict, setting: str) -> dict:
    t0 = time.perf_counter()
    result = experiment.run_arm(arm, seed, config, shared, setting)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def earlier_runs(partial: str | Path | None, record: dict) -> dict:
    """{(setting, arm, seed): run} from an interrupted call's record, if it ran the same config."""
    if not partial or not Path(partial).exists():
        return {}
    old = json.loads(Path(partial).read_text())
    if (old.get("experiment"), old.get("config")) != (record["experiment"], json.loads(json.dumps(record["config"]))):
        return {}
    return {(setting, arm, run["seed"]): run for setting, arms in old["runs"].items()
            for arm, runs in arms.items() for run in runs if "seed" in run}


def describe(result: dict) -> str:
    """One line about a run: its mean score and how long it took."""
    scores = result["scores"]
    return f"mean score {sum(scores) / len(scores):.3f} in {result['seconds']:.0f} s"


def scores(record: dict, setting: str, arm: str) -> list[list[float]]:
    """[seeds][prompts]: one arm's per-prompt scores in one setting."""
    return [run["scores"] for run in record["runs"][setting][arm]]


def gain(record: dict, setting: str, arm: str, baseline: str) -> dict:
    """`stats.paired_gain` of `arm` over `baseline` in `setting`, paired by seed."""
    return stats.paired_gain(scores(record, setting, arm), scores(record, setting, baseline))


def environment() -> dict:
    import jax

    return {"python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": jax.device_count(), "machine": platform.machine()}


def save(record: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def command_line() -> str:
    """The command that is running, as a user would type it."""
    return " ".join(["python -m tunix_nb.experiments", *sys.argv[1:]])
