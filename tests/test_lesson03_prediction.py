"""Lesson 03's prediction of the all-reduce's share, and its ring all-reduce by hand.

The lesson defines these functions in its own cells (they are the lesson's teaching, not
a package API), so the tests run those cells' code: a cell is found by the function it
defines and executed alone, with only NumPy and `tunix_nb.comm_cost` given to it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tunix_nb import comm_cost

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "03_pmap_sft.ipynb"


def cell_defining(name: str) -> str:
    """The source of the lesson's code cell that defines `name`."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    found = [c for c in cells if c["cell_type"] == "code" and f"def {name}(" in "".join(c["source"])]
    assert len(found) == 1, f"lesson 03 has {len(found)} cells defining {name}"
    return "".join(found[0]["source"])


def lesson_functions(*names: str) -> dict:
    namespace = {"np": np, "comm_cost": comm_cost}
    for name in names:
        exec(cell_defining(name), namespace)
    return namespace


@pytest.fixture(scope="module")
def share():
    return lesson_functions("predicted_allreduce_share")["predicted_allreduce_share"]


# ------------------------------------------------------------------ the prediction


def test_the_share_is_a_fraction_on_several_devices(share):
    for n in (2, 4, 8, 256):
        for compute in (1e-4, 0.02, 10.0):
            value = share(493_568, n, 1e9, compute)
            assert 0.0 < value < 1.0, (n, compute, value)


def test_one_device_sends_nothing(share):
    assert share(493_568, 1, 1e9, 0.02) == 0.0
    assert share(0, 8, 1e9, 0.02) == 0.0


def test_the_closed_form():
    """t_comm = 2(n-1)/n * bytes / bandwidth; share = t_comm / (t_compute + t_comm)."""
    fns = lesson_functions("predicted_allreduce_share")
    grad_bytes, n, bandwidth, compute = 493_568, 8, 1e9, 0.02
    comm = 2 * (n - 1) / n * grad_bytes / bandwidth  # 863,744 bytes: 0.86 ms at 1 GB/s
    assert comm == pytest.approx(863_744e-9)
    assert fns["predicted_allreduce_share"](grad_bytes, n, bandwidth, compute) == pytest.approx(comm / (compute + comm))
    # no compute at all: the step is all communication
    assert fns["predicted_allreduce_share"](grad_bytes, n, bandwidth, 0.0) == 1.0


def test_more_bytes_or_less_bandwidth_raise_the_share_and_more_compute_lowers_it(share):
    base = share(493_568, 8, 1e9, 0.02)
    assert share(2 * 493_568, 8, 1e9, 0.02) > base
    assert share(493_568, 8, 0.5e9, 0.02) > base
    assert share(493_568, 8, 1e9, 0.04) < base
    # more devices: each sends a larger part of the gradient, 2(n-1)/n, towards twice it
    by_n = [share(493_568, n, 1e9, 0.02) for n in (2, 4, 8, 64)]
    assert by_n == sorted(by_n) and share(493_568, 10**6, 1e9, 0.02) < share(2 * 493_568, 2, 1e9, 0.02)


def test_doubling_bytes_and_bandwidth_together_changes_nothing(share):
    assert share(493_568, 8, 1e9, 0.02) == pytest.approx(share(2 * 493_568, 8, 2e9, 0.02))


def test_a_bad_rate_is_refused(share):
    with pytest.raises(ValueError, match="bandwidth"):
        share(493_568, 8, 0.0, 0.02)
    with pytest.raises(ValueError, match="compute_seconds"):
        share(493_568, 8, 1e9, -1.0)


def test_step_flops_is_six_per_parameter_per_token():
    step_flops = lesson_functions("predicted_allreduce_share")["step_flops"]
    assert step_flops(123_392, 64 * 24) == 6 * 123_392 * 1536
    assert step_flops(10, 2 * 7) == 2 * step_flops(10, 7)


# ------------------------------------------------------------------ the ring, by hand


@pytest.fixture(scope="module")
def ring():
    return lesson_functions("ring_step", "ring_all_reduce")["ring_all_reduce"]


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_the_ring_sums_and_sends_what_comm_cost_says(ring, n):
    grads_nxS = np.random.default_rng(n).normal(size=(n, 24 * n)).astype(np.float32)
    reduced_nxS, sent_n, _ = ring(grads_nxS)
    np.testing.assert_allclose(reduced_nxS, np.broadcast_to(grads_nxS.sum(axis=0), grads_nxS.shape),
                               rtol=1e-5, atol=1e-5)
    assert sent_n.tolist() == [comm_cost.all_reduce_bytes(grads_nxS[0].nbytes, n)] * n


def test_the_ring_leaves_the_inputs_alone(ring):
    grads_4xS = np.arange(32, dtype=np.float32).reshape(4, 8)
    before = grads_4xS.copy()
    ring(grads_4xS)
    np.testing.assert_array_equal(grads_4xS, before)


def test_the_phases_hold_what_the_lesson_says(ring):
    """After the reduce-scatter device i holds chunk (i + 1) mod n complete; after the
    all-gather every device holds every chunk complete; 2(n - 1) steps in all."""
    n = 4
    _, _, snapshots = ring(np.ones((n, 4 * n), np.float32))
    assert [name for name, _ in snapshots] == ["start"] + [f"reduce-scatter {s}" for s in (1, 2, 3)] + [
        f"all-gather {s}" for s in (1, 2, 3)]
    everyone = frozenset(range(n))
    _, after_reduce_scatter = snapshots[n - 1]
    for i in range(n):
        complete = [c for c in range(n) if after_reduce_scatter[i][c] == everyone]
        assert complete == [(i + 1) % n]
    assert all(who == everyone for row in snapshots[-1][1] for who in row)
    # the start: every device holds only its own gradient
    assert all(who == frozenset({i}) for i, row in enumerate(snapshots[0][1]) for who in row)
