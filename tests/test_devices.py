import os
import subprocess
import sys

import jax
import pytest

from tunix_nb import devices


def run_python(code: str, **env_changes) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter (JAX not yet started) with a modified environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", devices.DEVICES_ENV)}
    env.update(env_changes)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_tests_see_eight_simulated_devices():
    assert jax.device_count() == 8
    assert jax.default_backend() == "cpu"


def test_simulate_same_count_after_start_is_a_no_op():
    devices.simulate_cpu_devices(8)
    assert jax.device_count() == 8


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
    assert out.stdout.split() == ["1", "1"]


def test_env_override_must_be_an_integer():
    out = run_python("from tunix_nb import devices; devices.setup(8)", TUNIX_NB_DEVICES="eight")
    assert out.returncode != 0
    assert "TUNIX_NB_DEVICES='eight' is not an integer" in out.stderr


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"JAX_PLATFORMS": "tpu"}, "tpu"),
        ({"JAX_PLATFORMS": "cuda"}, "gpu"),
        ({"JAX_PLATFORMS": "cpu"}, None),
        ({"COLAB_TPU_ADDR": "10.0.0.2:8470"}, "tpu"),
        ({"TPU_ACCELERATOR_TYPE": "v5litepod-1"}, "tpu"),
    ],
)
def test_accelerator_hint(monkeypatch, env, expected):
    for key in ("JAX_PLATFORMS", "COLAB_TPU_ADDR", "TPU_ACCELERATOR_TYPE", "COLAB_GPU"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert devices.accelerator_hint() == expected


def test_describe_is_one_line():
    line = devices.describe()
    assert "\n" not in line
    assert "backend=cpu" in line and "devices=8" in line and f"jax={jax.__version__}" in line


def test_backend_defaults():
    assert devices.defaults_for("cpu").compute_dtype == "float32"
    assert devices.defaults_for("tpu").compute_dtype == "bfloat16"
    assert devices.defaults_for("gpu").compute_dtype == "bfloat16"
    assert devices.defaults_for().backend == "cpu"
    assert all(devices.defaults_for(b).param_dtype == "float32" for b in ("cpu", "gpu", "tpu"))
    with pytest.raises(ValueError, match="Unknown backend 'npu'"):
        devices.defaults_for("npu")


@pytest.mark.parametrize("hint_env, expected", [({"JAX_PLATFORMS": "tpu"}, 0), ({"COLAB_TPU_ADDR": "x"}, 0),
                                                ({"COLAB_GPU": "1"}, 0), ({}, 8)])
def test_setup_uses_an_accelerator_and_simulates_only_on_cpu(monkeypatch, hint_env, expected):
    """The setup cell's logic with the backend faked: TPU and GPU runtimes are left alone."""
    for key in ("JAX_PLATFORMS", "COLAB_TPU_ADDR", "TPU_ACCELERATOR_TYPE", "COLAB_GPU", devices.DEVICES_ENV):
        monkeypatch.delenv(key, raising=False)
    for key, value in hint_env.items():
        monkeypatch.setenv(key, value)
    calls = []
    monkeypatch.setattr(devices, "simulate_cpu_devices", lambda n: calls.append(n))
    monkeypatch.setattr(devices.os.path, "exists", lambda p: False)  # no /dev/accel0 or /dev/nvidia0 here
    assert devices.setup(8) == expected
    assert calls == ([8] if expected else [])
    assert devices.setup(8, simulate_on_accelerator=True) == 8 and calls[-1] == 8


def test_accelerator_device_files_are_recognised(monkeypatch):
    for key in ("JAX_PLATFORMS", "COLAB_TPU_ADDR", "TPU_ACCELERATOR_TYPE", "COLAB_GPU"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(devices.os.path, "exists", lambda p: p == "/dev/accel0")
    assert devices.accelerator_hint() == "tpu"
    monkeypatch.setattr(devices.os.path, "exists", lambda p: p == "/dev/nvidia0")
    assert devices.accelerator_hint() == "gpu"


def test_has_devices_says_what_to_do(capsys, monkeypatch):
    assert devices.has_devices(8) is True
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    assert devices.has_devices(2, "The pmap equivalence check") is False
    out = capsys.readouterr().out
    assert "The pmap equivalence check needs at least 2 devices" in out
    assert "simulate_on_accelerator=True" in out
