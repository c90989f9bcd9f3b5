"""Tests for tunix_nb.plots and tunix_nb.widgets: what is drawn, the KL shown, labels."""

import matplotlib

matplotlib.use("Agg")

import ipywidgets  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tunix_nb import compare, losses, plots, widgets  # noqa: E402

V = 16


def _logits(seed, scale=2.0):
    return scale * np.random.default_rng(seed).standard_normal(V).astype(np.float32)


def _kl_from_losses(teacher_V, student_V, temperature):
    """T^2 * KL from the package, for one position."""
    return float(losses.kl_distillation_per_example(
        jnp.asarray(student_V)[None], jnp.asarray(teacher_V)[None], jnp.zeros((1,), jnp.int32),
        jnp.ones((1,)), temperature=temperature, alpha=1.0,
    ))


def _assert_labelled(ax):
    assert ax.get_title(), "every plot needs a title"
    assert ax.get_xlabel() and ax.get_ylabel(), "every plot needs axis labels"


@pytest.fixture
def ax():
    fig, ax = plt.subplots()
    yield ax
    plt.close(fig)


# ------------------------------------------------------------------------- plots


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_plot_temperature_returns_the_packages_kl(ax, temperature):
    teacher, student = _logits(0), _logits(1)
    kl = plots.plot_temperature(ax, teacher, student, temperature)
    np.testing.assert_allclose(temperature**2 * kl, _kl_from_losses(teacher, student, temperature),
                               rtol=1e-5)
    # and it is the KL of the two drawn distributions
    p_teacher, p_student = (line.get_ydata() for line in ax.get_lines()[:2])
    # The package's log-probs are log-softmaxes on the backend, each off by at most float32_bound
    # of a V-term sum, one exp and one log (5.7e-6 for two on a CPU, 1.0e-3 on a TPU, whose log-softmax
    # was measured 867 eps off: results/precision/tpu_v5e.json); p_teacher weighs them and sums to 1.
    bound = 2 * compare.float32_bound(V, transcendentals=compare.log_softmax_transcendentals())
    np.testing.assert_allclose(kl, np.sum(p_teacher * np.log(p_teacher / p_student)), rtol=0, atol=bound)
    assert f"{kl:.4f}" in ax.get_title()
    _assert_labelled(ax)


def test_plot_temperature_draws_softmax_at_t(ax):
    teacher, student = _logits(2), _logits(3)
    plots.plot_temperature(ax, teacher, student, 2.0)
    p_teacher, p_student = (line.get_ydata() for line in ax.get_lines()[:2])
    np.testing.assert_allclose(p_teacher, np.exp(teacher / 2) / np.exp(teacher / 2).sum(), rtol=1e-5)
    np.testing.assert_allclose(p_student, np.exp(student / 2) / np.exp(student / 2).sum(), rtol=1e-5)


def test_plot_temperature_redraws_instead_of_stacking(ax):
    plots.plot_temperature(ax, _logits(0), _logits(1), 1.0)
    plots.plot_temperature(ax, _logits(0), _logits(1), 2.0)
    assert len(ax.get_lines()) == 2


def test_softmax_at_rejects_nonpositive_temperature():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        plots.softmax_at(_logits(0), 0.0)


def test_plot_ratio_curve(ax):
    lines = plots.plot_ratio_curve(ax, [1, 4, 16], {"loop / vmap": [1.0, 3.0, 9.0],
                                                    "vmap / batched": [1.0, 1.1, 0.9]})
    assert [line.get_label() for line in lines] == ["loop / vmap", "vmap / batched"]
    np.testing.assert_array_equal(lines[0].get_xdata(), [1, 4, 16])
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    _assert_labelled(ax)


def test_plot_ratio_curve_rejects_mismatched_lengths(ax):
    with pytest.raises(ValueError, match="one ratio per batch size"):
        plots.plot_ratio_curve(ax, [1, 4, 16], {"loop / vmap": [1.0, 2.0]})


def test_plot_divergence_fits(ax):
    teacher = plots.softmax_at(_logits(4), 1.0)
    fits = {"forward KL": plots.softmax_at(_logits(5), 1.0), "reverse KL": plots.softmax_at(_logits(6), 1.0)}
    lines = plots.plot_divergence_fits(ax, teacher, fits)
    assert [line.get_label() for line in lines] == list(fits)
    np.testing.assert_allclose(lines[1].get_ydata(), fits["reverse KL"])
    _assert_labelled(ax)


def test_plot_grad_norms(ax):
    bars = plots.plot_grad_norms(ax, [0.5, 2.0, 1.0], clip_norm=1.0)
    assert [b.get_height() for b in bars] == [0.5, 2.0, 1.0]
    _assert_labelled(ax)


# ----------------------------------------------------------------------- widgets


def test_temperature_explorer_builds_a_widget():
    explorer = widgets.temperature_explorer(_logits(0), _logits(1), temperatures=(0.5, 4.0, 0.5),
                                            value=1.0)
    assert isinstance(explorer, ipywidgets.Widget)
    assert isinstance(explorer.slider, ipywidgets.FloatSlider)
    assert (explorer.slider.min, explorer.slider.max, explorer.slider.value) == (0.5, 4.0, 1.0)
    _assert_labelled(explorer.ax)


def test_moving_the_slider_changes_the_drawn_data_and_the_kl_text():
    teacher, student = _logits(0), _logits(1)
    explorer = widgets.temperature_explorer(teacher, student, temperatures=(0.5, 4.0, 0.5))
    before_data = [line.get_ydata().copy() for line in explorer.ax.get_lines()[:2]]
    before_kl, before_text = explorer.kl, explorer.kl_text.value

    explorer.slider.value = 3.0  # what dragging the slider does

    after_data = [line.get_ydata() for line in explorer.ax.get_lines()[:2]]
    assert not np.allclose(before_data[0], after_data[0])
    assert not np.allclose(before_data[1], after_data[1])
    assert explorer.kl != pytest.approx(before_kl)
    assert explorer.kl_text.value != before_text and "T = 3" in explorer.kl_text.value
    assert f"{explorer.kl:.4f}" in explorer.kl_text.value
    np.testing.assert_allclose(9.0 * explorer.kl, _kl_from_losses(teacher, student, 3.0), rtol=1e-5)


def test_higher_temperature_flattens_both_distributions():
    explorer = widgets.temperature_explorer(_logits(0, scale=4.0), _logits(1, scale=4.0),
                                            temperatures=(0.5, 8.0), value=0.5)
    peak_cold = [line.get_ydata().max() for line in explorer.ax.get_lines()[:2]]
    explorer.update(8.0)
    peak_hot = [line.get_ydata().max() for line in explorer.ax.get_lines()[:2]]
    assert all(hot < cold for hot, cold in zip(peak_hot, peak_cold))


@pytest.mark.parametrize("temperatures", [(0.0, 2.0), (2.0, 1.0), (1.0,), (0.5, 2.0, 0.0)])
def test_temperature_explorer_rejects_bad_ranges(temperatures):
    with pytest.raises(ValueError, match="temperatures"):
        widgets.temperature_explorer(_logits(0), _logits(1), temperatures=temperatures)


def test_temperature_explorer_rejects_mismatched_logits():
    with pytest.raises(ValueError, match=r"shape \[V\], same V"):
        widgets.temperature_explorer(_logits(0), np.zeros(V + 1))
