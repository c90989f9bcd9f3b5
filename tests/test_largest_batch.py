"""The largest batch that fits (tunix_nb.memory_plan.largest_batch): the search over the batch grid,
by bisection (the plan) and from a start outwards (the chip, fit_or_oom.py), and the plan's
verdict of one batch: the TPU compiler's refusal, or XLA's bytes and the program's code against
what the chip lets a program use."""

from __future__ import annotations

import pytest

from tunix_nb.memory_plan import largest_batch
from tunix_nb.memory_plan.largest_batch import BATCH_GRID, largest_on_grid


def up_to(limit):
    """fits(batch): true up to `limit`, counting its calls."""
    calls = []

    def fits(batch):
        calls.append(batch)
        return batch <= limit, {"batch": batch}

    return fits, calls


@pytest.mark.parametrize("limit, expected", [(44, 40), (8, 8), (7, None), (256, 256), (1000, 256), (63, 56)])
def test_bisection_finds_the_largest_grid_point_that_fits(limit, expected):
    fits, calls = up_to(limit)
    largest, tried = largest_on_grid(fits, BATCH_GRID)
    assert largest == expected
    assert len(calls) == len(set(calls)) <= 6  # 32 grid points: log2 + 1, each batch compiled once
    assert all(tried[b][0] == (b <= limit) for b in calls)


@pytest.mark.parametrize("start, limit, expected, walked", [
    (64, 44, 40, [64, 56, 48, 40]),      # the plan said too much: down until it fits
    (24, 44, 40, [24, 32, 40, 48]),      # too little: up until it runs out
    (40, 44, 40, [40, 48]),              # the same answer: two runs
    (8, 7, None, [8]),                   # not even the smallest
    (248, 500, 256, [248, 256]),         # the grid's end
])
def test_from_a_start_the_search_walks_one_grid_step_at_a_time(start, limit, expected, walked):
    fits, calls = up_to(limit)
    largest, _ = largest_on_grid(fits, BATCH_GRID, start=start)
    assert (largest, calls) == (expected, walked)


def test_the_plan_counts_the_peak_and_the_programs_code_and_takes_the_compilers_refusal(monkeypatch):
    """A batch fits by the plan when XLA's peak plus the program's code stays within the usable
    bytes, whatever the total (arguments + outputs + temporaries, not all live at once); the TPU
    compiler's RESOURCE_EXHAUSTED is a "does not fit", any other error is raised."""
    from tunix_nb.memory_plan import analysis, config

    usable = largest_batch.USABLE_BYTES["v5e"]

    def analyse(model, cfg, target):
        if cfg.batch_size == 24:
            raise ValueError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 17G of 15.75G hbm.")
        if cfg.batch_size == 32:
            raise ValueError("some other failure")
        peak = {8: usable - 100, 16: usable - 99}[cfg.batch_size]
        return {"argument_bytes": 1, "output_bytes": 1, "temp_bytes": 1, "alias_bytes": 0, "total_bytes": 2 * usable,
                "peak_bytes": peak, "generated_code_bytes": 100, "compile_seconds": 0.1}

    monkeypatch.setattr(analysis, "analyse", analyse)
    fits = largest_batch.plan_fits("Qwen3-0.6B", config.PlanConfig(), "v5e")
    assert fits(8)[0] and fits(8)[1]["held_bytes"] == usable
    assert not fits(16)[0]  # one byte over, with the code
    ok, details = fits(24)
    assert not ok and details["refused"].startswith("RESOURCE_EXHAUSTED")
    with pytest.raises(ValueError, match="some other failure"):
        fits(32)


def test_without_libtpu_the_command_line_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    from tunix_nb.memory_plan import targets

    monkeypatch.setattr(targets, "libtpu_missing", lambda: "libtpu is not installed: pip install ...")
    assert largest_batch.main(["--strategy", "lora", "--out", str(tmp_path / "plan.json")]) == 2
    assert "libtpu is not installed" in capsys.readouterr().err and not (tmp_path / "plan.json").exists()
