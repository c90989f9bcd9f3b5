"""python -m tunix_nb.tunix_compare: skipped with a reason without google-tunix; with it,
the kit's steps against Tunix's trainers, losses that agree and figures in a valid json."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tunix_nb import tunix_compare

REPO = Path(tunix_compare.__file__).resolve().parent.parent


def run_module(args, cwd, *, hide_tunix=False, timeout=60):
    """The module's main() in a fresh process; `hide_tunix` makes `import tunix` fail there."""
    hide = "import sys; sys.modules['tunix'] = None; " if hide_tunix else ""
    code = f"{hide}from tunix_nb import tunix_compare; raise SystemExit(tunix_compare.main({args!r}))"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # the tunix_nb under test, whichever checkout an editable install points at
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)


def test_without_tunix_it_says_why_and_writes_nothing(tmp_path):
    run = run_module(["--out", "out"], tmp_path, hide_tunix=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("tunix_compare skipped: google-tunix's trainers are not importable")
    assert "google-tunix==0.1.7" in run.stdout and "--no-deps" in run.stdout and "--help" in run.stdout
    assert not (tmp_path / "out").exists()


def test_first_step_values_must_agree_to_the_stated_tolerance():
    assert tunix_compare.agreement([("loss", 6.1739316, 6.1739306)])["agree"]
    off = tunix_compare.agreement([("loss", 0.6931472, 0.6931472), ("log-prob", -30.77, -30.78)])
    assert not off["agree"] and off["rtol"] == tunix_compare.LOSS_RTOL


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    pytest.importorskip("tunix.sft.peft_trainer", reason="google-tunix 0.1.7 is not installed (optional: "
                        "`python -m tunix_nb.tunix_compare --help` says how)")
    out = tmp_path_factory.mktemp("tunix_compare")
    run = run_module(["--quick", "--out", str(out)], out, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "tunix_compare.json").read_text()), run.stdout, out


def test_quick_run_writes_every_figure(quick):
    res, stdout, out = quick
    assert res["command"] == f"python -m tunix_nb.tunix_compare --quick --out {out}"
    assert res["quick"] is True and res["comparable_to_targets"] is False
    assert res["versions"]["google-tunix"] == "0.1.7" and {"jax", "flax", "optax"} <= set(res["versions"])
    assert {n: m["device_count"] for n, m in res["machines"].items()} == {"1": 1, "8": 8}
    assert set(res["failed_attempts"]) == {"1", "8"}
    assert (out / "tunix_compare.png").stat().st_size > 0
    for method in tunix_compare.METHODS:
        assert set(res["figures"][method]) == {"1", "8"}
        for n, fig in res["figures"][method].items():
            s = fig["spread"]
            assert math.isfinite(fig["value"]) and fig["value"] > 0, (method, n)
            assert s["min"] <= s["q25"] <= fig["value"] <= s["q75"] <= s["max"] and s["rounds"] >= 3
            assert fig["target"] == tunix_compare.TARGETS[method]
            assert fig["meets_target"] == (fig["value"] <= fig["target"])
            assert all(t > 0 for t in fig["seconds"].values())
            assert len(fig["losses"]["kit"]) == len(fig["losses"]["tunix"]) == 3
            assert f"{method}, {n} device(s): kit/Tunix step time" in stdout
    assert "kit_over_tunix_host_batch" in res["figures"]["dpo"]["8"]


def test_both_sides_do_the_same_work_per_gradient(quick):
    res, _, _ = quick
    for method in tunix_compare.SAME_DEFINITION:
        profile = res["figures"][method]["1"]["gradient_profile"]
        kit, tunix = profile["xla_cost"]["kit"]["flops"], profile["xla_cost"]["tunix"]["flops"]
        assert abs(kit - tunix) <= 0.01 * tunix, (method, kit, tunix)
        assert profile["kit_over_tunix"]["median"] > 0


def test_first_step_losses_agree(quick):
    res, _, _ = quick
    assert res["losses_agree"]
    for per_n in res["figures"].values():
        for fig in per_n.values():
            for check in fig["first_step"]["checks"]:
                a, b = check["values"]
                assert abs(a - b) <= tunix_compare.LOSS_RTOL * abs(b), check
    for n in ("1", "8"):
        sft, dpo = res["figures"]["sft"][n]["losses"], res["figures"]["dpo"][n]["losses"]
        assert abs(sft["kit"][0] - sft["tunix"][0]) <= tunix_compare.LOSS_RTOL * sft["tunix"][0]
        # policy == reference at step 0: every margin is 0, both losses ln 2
        assert dpo["kit"][0] == pytest.approx(math.log(2), rel=1e-6) == dpo["tunix"][0]


def test_distillation_definitions_differ_and_each_side_matches_its_own(quick):
    res, _, _ = quick
    fig = res["figures"]["distill"]["1"]
    kit, tunix = fig["losses"]["kit"][0], fig["losses"]["tunix"][0]
    # the kit averages over completion tokens, where the fresh student and the teacher differ
    # most; Tunix over every position: not the same number
    assert abs(kit - tunix) > 0.1 * tunix
    assert fig["kit_definition_on_tunix_logits"] == pytest.approx(kit, rel=tunix_compare.LOSS_RTOL)
    assert fig["tunix_definition_on_kit_logits"] == pytest.approx(tunix, rel=tunix_compare.LOSS_RTOL)
