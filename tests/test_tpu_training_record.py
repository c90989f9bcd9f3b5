"""results/tpu_v5e_training/README.md's table of the chip's --scan-layers runs is their records'."""

import json
import re
from pathlib import Path

HERE = Path(__file__).parent.parent / "results" / "tpu_v5e_training"
ROWS = {"full_scan": ("scan_5b886db.json", "full_scan"),
        "lora_r16_scan (blocks as a loop)": ("scan_5b886db.json", "lora_r16_scan"),
        "lora_r16_scan": ("scan_4068b73.json", "lora_r16_scan")}


def row(name: str, file: str, run: str) -> str:
    record = json.loads((HERE / file).read_text())
    r = record["runs"][run]
    return (f"| {name} | {record['commit'][:7]} | {r['step_compiles']} | {r['step_compile_seconds']['xla_compile']:.1f} "
            f"| {r['median_step_seconds']:.3f} | {r['tokens_per_second']:,.0f} | {r['mfu']:.3f} "
            f"| {r['xla_memory']['peak_bytes'] / 1e9:.2f} |")


def test_the_scan_table_is_the_records():
    readme = (HERE / "README.md").read_text()
    table = re.search(r"<!-- begin scan runs -->\n(.*?)<!-- end scan runs -->", readme, re.S)[1]
    lines = table.strip().splitlines()[2:]
    assert lines == [row(name, *where) for name, where in ROWS.items()]


def test_the_records_ran_on_the_chip_and_name_no_machine_path():
    for file in {file for file, _ in ROWS.values()}:
        text = (HERE / file).read_text()
        assert "/tmp/" not in text and "/home/" not in text
        for run in json.loads(text)["runs"].values():
            assert run["device"]["kind"] == "TPU v5 lite" and run["exit_code"] == 0
            assert "--scan-layers" in run["command"]


def test_the_notes_quote_the_records():
    readme = " ".join((HERE / "README.md").read_text().split())
    full = json.loads((HERE / "scan_5b886db.json").read_text())["runs"]["full_scan"]
    lora = json.loads((HERE / "scan_4068b73.json").read_text())["runs"]["lora_r16_scan"]
    assert (f"({100 * full['xla_over_model_flops']:.1f}% and {100 * lora['xla_over_model_flops']:.1f}% of the "
            "model's FLOPs in full_scan and the scanned lora_r16_scan)") in readme
    assert f"{lora['step_compile_seconds']['xla_compile'] - 30:.1f} s over" in readme
