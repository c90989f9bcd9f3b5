"""python -m tunix_nb.measure_command: the training command run in-process on a random Qwen3-shaped
folder, its step compiled once, its step times, MFU and XLA's FLOPs in one record (issue 47)."""

import json

import jax
import pytest

from tunix_nb import measure_command, mfu, random_checkpoint

STEPS = 5


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """One run, on a chip faked for the peak (the device itself is the tests' CPU)."""
    work = tmp_path_factory.mktemp("measure")
    random_checkpoint.write(work / "model", random_checkpoint.preset_config("tiny"))
    rows = work / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"row {i}: " + "abc def " * 20}) + "\n" for i in range(8)))
    out = work / "record.json"
    saved = mfu.device_peak
    mfu.device_peak = lambda device=None: mfu.peak_for("TPU v5 lite")
    try:
        code = measure_command.main(["--out", str(out), "--trace-steps", "2", "--trace-top", "1000", "--", "sft",
                                     "--model", str(work / "model"), "--train-file", str(rows), "--max-length", "65",
                                     "--batch-size", "2", "--steps", str(STEPS), "--remat"])
    finally:
        mfu.device_peak = saved
    assert code == 0
    return json.loads(out.read_text())


def test_the_step_compiles_once_and_its_phases_are_timed(record):
    assert record["step_compiles"] == 1
    assert set(record["step_compile_seconds"]) == {"tracing", "lowering", "xla_compile"}
    assert all(seconds > 0 for seconds in record["step_compile_seconds"].values())
    assert record["xla_analysis"]["compiled_again"] is False  # XLA's FLOPs are the run's own program's


def test_step_times_leave_out_the_warm_up(record):
    assert record["steps_logged"] == STEPS and (record["batch"], record["seq_len"]) == (2, 64)
    assert len(record["step_seconds"]) == STEPS - measure_command.WARMUP_STEPS
    assert record["tokens_per_second"] == pytest.approx(2 * 64 / record["median_step_seconds"])


def test_mfu_is_model_flops_over_the_peak_and_xla_counts_the_recomputation(record):
    config = random_checkpoint.hf.model_config(random_checkpoint.preset_config("tiny"))
    flops = mfu.step_flops(config, batch=2, seq_len=64)
    assert record["model_flops_per_step"] == flops and record["model"]["lora"] is False
    assert record["mfu"] == pytest.approx(flops / record["median_step_seconds"] / 197e12)
    assert record["peak"]["chip"] == "TPU v5e"
    # --remat: XLA's count holds each block's forward twice; MFU does not
    assert 1.15 < record["xla_over_model_flops"] < 1.45
    assert record["xla_flops_utilisation"] > record["mfu"]


def test_the_traced_steps_say_where_the_time_goes(record):
    """--trace-steps 2: the steps after the warm-up profiled, op by op (tunix_nb.step_profile), on
    this machine: the matmuls and attention are found (--trace-top 1000 names every
    source: on a busy machine attention's ops can fall below the tenth)."""
    profile = record["profile"]
    if jax.default_backend() == "cpu":  # a CPU's trace has no device line of whole programs
        assert profile["programs"] is None and profile["traced_steps"] == 2
    else:  # the steps' worth of the step's program the device ran in the window (its edges cut runs)
        runs = profile["programs"]["run_seconds"]
        assert profile["traced_steps"] == pytest.approx(sum(runs) / max(runs)) and 0 < profile["traced_steps"] <= len(runs)
    assert profile["ops"]["traced_seconds"] > 0
    assert sum(k["share"] for k in profile["ops"]["by_kind"]) == pytest.approx(1)
    assert "matmul" in {k["name"] for k in profile["ops"]["by_kind"]}
    assert "model.py:attend" in {s["name"] for s in profile["ops"]["by_source"]}
    assert profile["trace_lines"][0]["seconds"] > 0


def test_bad_input_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit):
        measure_command.main(["--out", str(tmp_path / "x.json")])
    assert "give the training command after --" in capsys.readouterr().err
    assert measure_command.main(["--out", str(tmp_path / "x.json"), "--", "sft", "--parallel", "fsdp"]) == 2
    assert "measure_command times one device" in capsys.readouterr().err
    assert measure_command.main(["--out", str(tmp_path / "x.json"), "--", "sft", "--model", "no/such"]) == 2
    assert "reads a preset" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_a_scanned_run_reports_no_xla_utilisation(tmp_path):
    """XLA's cost analysis counts a loop's body once: with --scan-layers its FLOPs (kept as
    xla_flops_counted) fall far below the step's, so the record gives no XLA utilisation and
    says why (the chip's scanned runs counted 0.045 of the model's FLOPs)."""
    random_checkpoint.write(tmp_path / "model", random_checkpoint.preset_config("tiny"))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"row {i}: " + "abc def " * 20}) + "\n" for i in range(8)))
    out = tmp_path / "record.json"
    assert measure_command.main(["--out", str(out), "--", "sft", "--model", str(tmp_path / "model"), "--train-file",
                                 str(rows), "--max-length", "65", "--batch-size", "2", "--steps", "3",
                                 "--scan-layers"]) == 0
    record = json.loads(out.read_text())
    assert record["xla_flops_utilisation"] is None and record["xla_flops_per_step"] is None
    assert 0 < record["xla_flops_counted"] < record["model_flops_per_step"]
    assert "counts the scanned blocks once" in record["note"]
