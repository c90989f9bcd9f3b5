import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from tunix_nb import devices


def run_python(code: str, **env_changes) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter (JAX not yet started) with a modified environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", devices.DEVICES_ENV, devices.JAX_COUNT_ENV)}
    env.update(env_changes)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.cpu_only(reason="the suite's 8 simulated CPU devices")
def test_tests_see_eight_simulated_devices():
    assert jax.device_count() == 8
    assert jax.default_backend() == "cpu"


@pytest.mark.cpu_only(reason="simulates CPU devices")
def test_simulate_same_count_after_start_is_a_no_op():
    devices.simulate_cpu_devices(8)
    assert jax.device_count() == 8


@pytest.mark.cpu_only(reason="simulates CPU devices")
def test_simulate_other_count_after_start_says_restart():
    with pytest.raises(RuntimeError, match=r"already started with 8 cpu device\(s\).*Restart the kernel"):
        devices.simulate_cpu_devices(4)


@pytest.mark.parametrize("bad", [0, -2, 2.5, "8", True])
def test_simulate_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match="positive int"):
        devices.simulate_cpu_devices(bad)


def test_simulate_before_start_in_fresh_process():
    out = run_python(
        "from tunix_nb import devices; devices.simulate_cpu_devices(3); import jax; "
        "print(jax.device_count(), jax.default_backend())"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "cpu"]


def test_simulate_after_import_but_before_start():
    out = run_python(
        "import jax; from tunix_nb import devices; devices.simulate_cpu_devices(5); print(jax.device_count())"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "5"


def test_flag_is_replaced_not_duplicated():
    flags = devices._with_device_count_flag("--foo=1 --xla_force_host_platform_device_count=8", 4)
    assert flags == "--foo=1 --xla_force_host_platform_device_count=4"
    assert devices._with_device_count_flag("--foo=1 --xla_force_host_platform_device_count=8", 1) == "--foo=1"


def test_env_override_picks_single_device():
    out = run_python(
        "from tunix_nb import devices; n = devices.setup(8); import jax; print(n, jax.device_count())",
        TUNIX_NB_DEVICES="1",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].split() == ["1", "1"]


def test_env_override_must_be_an_integer():
    out = run_python("from tunix_nb import devices; devices.setup(8)", TUNIX_NB_DEVICES="eight")
    assert out.returncode != 0
    assert "TUNIX_NB_DEVICES='eight' is not a positive integer; set it to e.g. 1 or 8" in out.stderr


FLAG = devices.DEVICE_COUNT_FLAG
NO_DEVICE_FILES = "/nonexistent/dev"  # for devices.DEV_ROOT: a runtime without device files
SETUP_AND_COUNT = "from tunix_nb import devices; n = devices.setup(8); import jax; print(n, jax.device_count())"


@pytest.mark.parametrize("env, count, said", [
    ({}, 8, "Simulating 8 CPU devices (the notebook's default; set TUNIX_NB_DEVICES to change it)"),
    ({"XLA_FLAGS": f"{FLAG}=4"}, 4, "Simulating 4 CPU devices (from XLA_FLAGS)"),
    ({"XLA_FLAGS": f"--xla_cpu_enable_fast_math=false {FLAG}=1"}, 1, "Simulating 1 CPU device (from XLA_FLAGS)"),
    ({"JAX_NUM_CPU_DEVICES": "3"}, 3, "Simulating 3 CPU devices (from JAX_NUM_CPU_DEVICES)"),
    ({"XLA_FLAGS": f"{FLAG}=4", "TUNIX_NB_DEVICES": "2"}, 2, "Simulating 2 CPU devices (from TUNIX_NB_DEVICES)"),
    ({"JAX_NUM_CPU_DEVICES": "3", "TUNIX_NB_DEVICES": "1"}, 1, "Simulating 1 CPU device (from TUNIX_NB_DEVICES)"),
], ids=["default", "user-xla-flags", "user-xla-flags-one", "jax-num-cpu-devices", "override-beats-flags",
        "override-beats-jax-count"])
def test_setup_keeps_a_count_the_user_gave_and_says_which(env, count, said):
    """Priority: TUNIX_NB_DEVICES > a count already given to JAX > the notebook's default.
    A user who starts Jupyter with XLA_FLAGS=--xla_force_host_platform_device_count=4, as
    JAX's docs suggest, gets 4 devices, not the setup cell's 8."""
    out = run_python(SETUP_AND_COUNT, **env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == [said, f"{count} {count}"]


def test_binder_start_still_gives_eight_devices():
    start = Path(__file__).resolve().parent.parent / "binder" / "start"
    out = subprocess.run([str(start), sys.executable, "-c", SETUP_AND_COUNT], capture_output=True, text=True,
                         timeout=120, env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["Simulating 8 CPU devices (from XLA_FLAGS)", "8 8"]


def test_the_last_count_in_xla_flags_wins_as_in_xla(monkeypatch):
    monkeypatch.delenv(devices.DEVICES_ENV, raising=False)
    monkeypatch.delenv(devices.JAX_COUNT_ENV, raising=False)
    monkeypatch.setenv("XLA_FLAGS", f"{FLAG}=8 --xla_foo=1 {FLAG}=5")
    assert devices.requested_cpu_devices(2) == (5, "from XLA_FLAGS")
    monkeypatch.setenv("XLA_FLAGS", f"{FLAG}=many")
    with pytest.raises(ValueError, match=rf"XLA_FLAGS {FLAG}='many' is not a positive integer"):
        devices.requested_cpu_devices(2)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"JAX_PLATFORMS": "tpu"}, "tpu"),
        ({"JAX_PLATFORMS": "cuda"}, "gpu"),
        ({"JAX_PLATFORMS": "cpu"}, None),
        ({"COLAB_TPU_ADDR": "10.0.0.2:8470"}, "tpu"),
        ({"TPU_ACCELERATOR_TYPE": "v5litepod-1"}, "tpu"),
        ({"ISTPUVM": "1"}, "tpu"),  # Kaggle's TPU image
    ],
)
def test_accelerator_hint(monkeypatch, env, expected):
    for key in devices.HINT_ENV:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert devices.accelerator_hint() == expected


@pytest.mark.cpu_only(reason="describes the suite's 8 simulated CPU devices")
def test_describe_is_one_line():
    line = devices.describe()
    assert "\n" not in line
    assert "backend=cpu" in line and "devices=8" in line and f"jax={jax.__version__}" in line


def test_backend_defaults():
    assert devices.defaults_for("cpu").compute_dtype == "float32"
    assert devices.defaults_for("tpu").compute_dtype == "bfloat16"
    assert devices.defaults_for("gpu").compute_dtype == "bfloat16"
    assert devices.defaults_for().backend == jax.default_backend()  # the backend JAX runs on
    assert all(devices.defaults_for(b).param_dtype == "float32" for b in ("cpu", "gpu", "tpu"))
    with pytest.raises(ValueError, match="Unknown backend 'npu'"):
        devices.defaults_for("npu")


@pytest.mark.parametrize("hint_env, expected", [({"JAX_PLATFORMS": "tpu"}, 0), ({"COLAB_TPU_ADDR": "x"}, 0),
                                                ({"COLAB_GPU": "1"}, 0), ({}, 8)])
def test_setup_uses_an_accelerator_and_simulates_only_on_cpu(monkeypatch, hint_env, expected):
    """The setup cell's logic with the backend faked: TPU and GPU runtimes are left alone."""
    for key in (*devices.HINT_ENV, devices.DEVICES_ENV, "XLA_FLAGS", devices.JAX_COUNT_ENV):
        monkeypatch.delenv(key, raising=False)
    for key, value in hint_env.items():
        monkeypatch.setenv(key, value)
    calls = []
    monkeypatch.setattr(devices, "simulate_cpu_devices", lambda n: calls.append(n))
    monkeypatch.setattr(devices, "DEV_ROOT", NO_DEVICE_FILES)
    assert devices.setup(8) == expected
    assert calls == ([8] if expected else [])
    assert devices.setup(8, simulate_on_accelerator=True) == 8 and calls[-1] == 8


def fake_dev(root: Path, *names: str) -> str:
    """A folder standing in for /dev, holding empty files of these names."""
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).touch()
    return str(root)


@pytest.mark.parametrize("files, expected", [
    (["accel0"], "tpu"),
    (["accel3"], "tpu"),                  # any /dev/accel*, not just the first
    (["vfio/2", "vfio/vfio"], "tpu"),     # the v5e chip of issue 45 was /dev/vfio/2
    (["vfio/0"], "tpu"),
    (["vfio/vfio"], None),                # VFIO's control file alone: no TPU
    (["nvidia0"], "gpu"),
    ([], None),
])
def test_accelerator_device_files_are_recognised(monkeypatch, tmp_path, files, expected):
    for key in devices.HINT_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(devices, "DEV_ROOT", fake_dev(tmp_path, *files))
    assert devices.accelerator_hint() == expected


def test_tpu_device_files_lists_accel_and_numbered_vfio(tmp_path):
    root = fake_dev(tmp_path, "accel3", "vfio/2", "vfio/12", "vfio/vfio", "vfio/2x", "nvidia0")
    found = [Path(p).relative_to(tmp_path).as_posix() for p in devices.tpu_device_files(root)]
    assert found == ["accel3", "vfio/12", "vfio/2"]


@pytest.mark.needs_devices(8)
def test_has_devices_says_what_to_do(capsys, monkeypatch):
    assert devices.has_devices(8) is True
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    assert devices.has_devices(2, "The pmap equivalence check") is False
    out = capsys.readouterr().out
    assert "The pmap equivalence check needs at least 2 devices" in out
    assert "simulate_on_accelerator=True" in out


def fake_tpu_runtime(monkeypatch):
    for key in (*devices.HINT_ENV, devices.DEVICES_ENV, devices.JAX_COUNT_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("COLAB_TPU_ADDR", "10.0.0.2:8470")
    monkeypatch.setattr(devices, "DEV_ROOT", NO_DEVICE_FILES)
    calls = []
    monkeypatch.setattr(devices, "simulate_cpu_devices", lambda n: calls.append(n))
    return calls


def test_a_count_in_xla_flags_does_not_hide_an_accelerator(monkeypatch):
    """The flag only sizes the CPU backend; the kit's override and the keyword still simulate."""
    calls = fake_tpu_runtime(monkeypatch)
    monkeypatch.setenv("XLA_FLAGS", f"{FLAG}=4")
    assert devices.setup(8) == 0 and calls == []
    assert devices.setup(8, simulate_on_accelerator=True) == 4 and calls == [4]
    monkeypatch.setenv(devices.DEVICES_ENV, "2")
    assert devices.setup(8) == 2 and calls == [4, 2]


def test_check_backend_warns_when_an_accelerator_is_left_unused(monkeypatch, recwarn):
    devices.check_backend()  # JAX runs on the runtime's accelerator, or the runtime has none: nothing to say
    assert not recwarn.list
    fake_tpu_runtime(monkeypatch)  # a TPU hint, but this JAX runs on CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # also where the tests hold a chip
    with pytest.warns(UserWarning, match=r"has a TPU, but JAX is running on CPU\. On Colab: restart the runtime"):
        devices.check_backend()


def test_auto_compute_dtype_is_float32_on_gpus_without_native_bfloat16():
    """Colab's T4 (compute capability 7.5) emulates bfloat16: float32 there; Ampere and later
    (A100 8.0, L4 8.9, H100/H200 9.0) compute in bfloat16."""
    assert devices.defaults_for("gpu", compute_capability="7.5").compute_dtype == "float32"
    assert devices.defaults_for("cuda", compute_capability="7.0").compute_dtype == "float32"
    for capability in ("8.0", "8.9", "9.0"):
        assert devices.defaults_for("gpu", compute_capability=capability).compute_dtype == "bfloat16"
    assert "compute capability 7.5 has no native bfloat16" in devices.defaults_for(
        "gpu", compute_capability="7.5").reason


def test_the_command_says_which_dtype_auto_chose(tmp_path, capsys):
    from tunix_nb import cli

    assert cli.main(["sft", "--steps", "1", "--batch-size", "4", "--metrics-file", str(tmp_path / "m.jsonl")]) == 0
    # on a chip the suite runs under the agreement policy (conftest.py), which "auto" follows
    chosen = {"cpu": "float32 (CPUs have no fast bfloat16 matmul)",
              "tpu": "float32 (precision.set_auto_compute_dtype chose it for this process)"}[jax.default_backend()]
    assert f"--compute-dtype auto: {chosen}" in capsys.readouterr().out


def test_the_commands_auto_follows_the_processs_precision_policy(capsys):
    """`precision.set_auto_compute_dtype` (a lesson of checks sets float32) holds for the command
    run in the same process, as for `precision.resolve_compute_dtype`; reset, the backend decides."""
    from tunix_nb import cli, precision

    previous = precision.set_auto_compute_dtype("bfloat16")
    try:
        assert cli.config_from_argv(["sft"]).training.compute_dtype == "bfloat16"
        assert "--compute-dtype auto: bfloat16 (precision.set_auto_compute_dtype" in capsys.readouterr().out
        precision.set_auto_compute_dtype(None)
        assert cli.config_from_argv(["sft"]).training.compute_dtype == devices.defaults_for().compute_dtype
    finally:
        precision.set_auto_compute_dtype(previous)


@pytest.mark.parametrize("hint_env, quick_compile, user_value, expected", [
    ({"COLAB_TPU_ADDR": "x"}, True, None, "-1"),        # a TPU: least effort on execution time
    ({"COLAB_TPU_ADDR": "x"}, True, "0.5", "0.5"),     # the user's own setting wins
    ({"COLAB_TPU_ADDR": "x"}, False, None, None),      # to time programs at XLA's default
    ({"COLAB_GPU": "1"}, True, None, None),            # measured on a TPU only
    ({}, True, None, None),                            # a CPU compiles no faster so
])
def test_setup_asks_a_tpu_for_quick_compiles(monkeypatch, capsys, hint_env, quick_compile, user_value, expected):
    for key in (*devices.HINT_ENV, devices.DEVICES_ENV, devices.JAX_COUNT_ENV, devices.COMPILE_EFFORT_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("XLA_FLAGS", f"{FLAG}=8")
    for key, value in {**hint_env, **({devices.COMPILE_EFFORT_ENV: user_value} if user_value else {})}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(devices, "DEV_ROOT", NO_DEVICE_FILES)
    monkeypatch.setattr(devices, "simulate_cpu_devices", lambda n: None)
    before = jax.config.jax_exec_time_optimization_effort
    try:
        devices.setup(8, quick_compile=quick_compile)
        assert os.environ.get(devices.COMPILE_EFFORT_ENV) == expected
        assert jax.config.jax_exec_time_optimization_effort == (float(expected) if expected else before)
        said = capsys.readouterr().out
        assert (f"{devices.COMPILE_EFFORT_ENV}={expected})" in said) == (expected is not None), said
    finally:
        jax.config.update("jax_exec_time_optimization_effort", before)
