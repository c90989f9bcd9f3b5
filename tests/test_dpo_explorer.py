"""DPO loss explorer tests: plots.dpo_loss_curve, plots.plot_dpo_loss, widgets.dpo_explorer."""

import matplotlib

matplotlib.use("Agg")

import ipywidgets  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tunix_nb import compare, losses, plots, widgets  # noqa: E402

# the curves are computed in float32 on the backend: a few roundings and one exp and one log
# (log_sigmoid) along each point's path: 1.2e-6 on a CPU, 5.0e-4 on a TPU, whose float32 log is
# within about 2**-11
RTOL = compare.float32_bound(2, transcendentals={"exp": 1, "log": 1})
H = np.linspace(-30.0, 30.0, 121)  # includes h = 0; avoids the hinge kinks at 1/beta


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


@pytest.fixture
def ax():
    fig, ax = plt.subplots()
    yield ax
    plt.close(fig)


# ------------------------------------------------------------------ dpo_loss_curve


@pytest.mark.parametrize("beta", [0.05, 0.1, 0.7])
def test_sigmoid_curve_matches_closed_forms(beta):
    loss, weight = plots.dpo_loss_curve(H, beta, "sigmoid")
    np.testing.assert_allclose(loss, -np.log(_sigmoid(beta * H)), rtol=RTOL, atol=1e-6)
    np.testing.assert_allclose(weight, beta * _sigmoid(-beta * H), rtol=RTOL, atol=1e-7)


@pytest.mark.parametrize("beta", [0.05, 0.1, 0.7])
def test_ipo_curve_matches_closed_forms(beta):
    loss, weight = plots.dpo_loss_curve(H, beta, "ipo")
    np.testing.assert_allclose(loss, (H - 1 / (2 * beta)) ** 2, rtol=1e-5)
    np.testing.assert_allclose(weight, -2 * (H - 1 / (2 * beta)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("beta", [0.05, 0.1, 0.7])
def test_hinge_curve_matches_closed_forms(beta):
    h = H[np.abs(beta * H - 1) > 1e-3]  # off the kink, where the derivative is undefined
    loss, weight = plots.dpo_loss_curve(h, beta, "hinge")
    np.testing.assert_allclose(loss, np.maximum(0.0, 1 - beta * h), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(weight, np.where(beta * h < 1, beta, 0.0), rtol=1e-6)


def test_label_smoothing_is_conservative_dpo():
    beta, eps = 0.1, 0.2
    loss, weight = plots.dpo_loss_curve(H, beta, "sigmoid", label_smoothing=eps)
    expected = -(1 - eps) * np.log(_sigmoid(beta * H)) - eps * np.log(_sigmoid(-beta * H))
    np.testing.assert_allclose(loss, expected, rtol=RTOL)
    # d/dh: -(1-eps) beta sigmoid(-beta h) + eps beta sigmoid(beta h)
    np.testing.assert_allclose(weight, beta * ((1 - eps) * _sigmoid(-beta * H)
                                               - eps * _sigmoid(beta * H)), rtol=RTOL, atol=1e-7)


def test_curve_is_the_per_pair_dpo_loss():
    """Each point is dpo_loss of its own one-pair batch: their mean is the batch loss."""
    h = np.array([-3.0, 0.5, 8.0], np.float32)
    loss, _ = plots.dpo_loss_curve(h, 0.3, "sigmoid")
    zeros = np.zeros_like(h)
    batch_loss, _ = losses.dpo_loss(h, zeros, zeros, zeros, beta=0.3)
    np.testing.assert_allclose(loss.mean(), float(batch_loss), rtol=1e-6)
    assert loss.shape == h.shape


@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0])
def test_loss_at_zero_margin(beta):
    at_0 = {t: plots.dpo_loss_curve(np.zeros(1), beta, t)[0][0] for t in losses.DPO_LOSS_TYPES}
    assert at_0["sigmoid"] == pytest.approx(np.log(2), rel=1e-6)
    assert at_0["hinge"] == pytest.approx(1.0)
    assert at_0["ipo"] == pytest.approx(1 / (4 * beta**2), rel=1e-5)


# ------------------------------------------------------------------ plot_dpo_loss


def test_plot_dpo_loss_draws_loss_and_weight(ax):
    drawn = plots.plot_dpo_loss(ax, 0.1, "sigmoid", h_range=(-20, 20))
    twin = drawn["twin_ax"]
    np.testing.assert_allclose(drawn["loss_line"].get_xdata(), drawn["h"])
    np.testing.assert_allclose(drawn["loss_line"].get_ydata(), drawn["loss"])
    np.testing.assert_allclose(drawn["weight_line"].get_ydata(), drawn["weight"])
    assert drawn["loss_line"] in ax.get_lines() and drawn["weight_line"] in twin.get_lines()
    assert drawn["h"][0] == -20 and drawn["h"][-1] == 20
    np.testing.assert_allclose(drawn["zero_line"].get_xdata(), [0, 0])
    assert "sigmoid" in ax.get_title() and "0.1" in ax.get_title()
    assert ax.get_xlabel() == "margin h = Δ log-ratio (nats)"
    assert ax.get_ylabel() == "loss"
    assert twin.get_ylabel() == "gradient weight −dL/dh"
    assert twin.yaxis.get_label_position() == "right"


def test_plot_dpo_loss_redraws_instead_of_stacking(ax):
    first = plots.plot_dpo_loss(ax, 0.1, "sigmoid")
    counts = (len(ax.get_lines()), len(first["twin_ax"].get_lines()))
    second = plots.plot_dpo_loss(ax, 0.5, "ipo")
    third = plots.plot_dpo_loss(ax, 0.2, "hinge")
    assert second["twin_ax"] is first["twin_ax"] is third["twin_ax"]
    assert len(ax.figure.axes) == 2  # the twin is reused, not made again
    assert (len(ax.get_lines()), len(third["twin_ax"].get_lines())) == counts
    assert "hinge" in ax.get_title()
    assert third["twin_ax"].yaxis.get_label_position() == "right"  # clear() would reset it


# ------------------------------------------------------------------ widgets


def test_dpo_explorer_builds_a_widget():
    explorer = widgets.dpo_explorer(beta=0.1, loss_type="sigmoid")
    assert isinstance(explorer, ipywidgets.VBox)
    assert isinstance(explorer.beta_slider, ipywidgets.FloatLogSlider)
    assert explorer.beta_slider.value == pytest.approx(0.1)
    assert 10**explorer.beta_slider.min == pytest.approx(0.01)
    assert 10**explorer.beta_slider.max == pytest.approx(1.0)
    assert tuple(explorer.loss_type_picker.options) == losses.DPO_LOSS_TYPES
    assert explorer.loss_type_picker.value == "sigmoid"
    assert explorer.drawn["twin_ax"] in explorer.figure.axes and explorer.ax in explorer.figure.axes
    assert "0.6931" in explorer.summary.value  # ln 2 at h = 0
    assert f"{0.1 * 0.5:.4f}" in explorer.summary.value  # weight beta * sigmoid(0)


def test_moving_the_beta_slider_changes_the_drawn_data_and_summary():
    explorer = widgets.dpo_explorer(beta=0.1, loss_type="sigmoid")
    before_weight, before_summary = explorer.drawn["weight"].copy(), explorer.summary.value

    explorer.beta_slider.value = 0.5  # what dragging the slider does

    assert explorer.drawn["beta"] == pytest.approx(0.5)
    assert not np.allclose(explorer.drawn["weight"], before_weight)
    np.testing.assert_allclose(explorer.drawn["weight_line"].get_ydata(),
                               0.5 * _sigmoid(-0.5 * explorer.drawn["h"]), rtol=RTOL, atol=1e-7)
    assert explorer.summary.value != before_summary and "β = 0.5" in explorer.summary.value
    assert explorer.drawn["weight_at_0"] == pytest.approx(0.25)
    assert "0.5" in explorer.ax.get_title()


def test_changing_the_loss_type_changes_the_drawn_data_and_summary():
    explorer = widgets.dpo_explorer(beta=0.25, loss_type="sigmoid")
    before_loss, before_summary = explorer.drawn["loss"].copy(), explorer.summary.value
    counts = (len(explorer.ax.get_lines()), len(explorer.drawn["twin_ax"].get_lines()))

    explorer.loss_type_picker.value = "ipo"

    assert not np.allclose(explorer.drawn["loss"], before_loss)
    assert explorer.drawn["loss_at_0"] == pytest.approx(1 / (4 * 0.25**2))  # = 4
    assert explorer.summary.value != before_summary and "ipo" in explorer.summary.value
    assert "4.0000" in explorer.summary.value
    assert "ipo" in explorer.ax.get_title()

    explorer.loss_type_picker.value = "hinge"
    assert explorer.drawn["loss_at_0"] == pytest.approx(1.0)
    assert explorer.drawn["weight_at_0"] == pytest.approx(0.25)
    explorer.update()
    # redrawing (three times now) does not stack lines on either axis
    assert (len(explorer.ax.get_lines()), len(explorer.drawn["twin_ax"].get_lines())) == counts
    assert len(explorer.figure.axes) == 2


# ------------------------------------------------------------------ errors


def test_unknown_loss_type_names_the_valid_ones(ax):
    for call in (lambda: plots.dpo_loss_curve(H, 0.1, "kto"),
                 lambda: plots.plot_dpo_loss(ax, 0.1, "kto"),
                 lambda: widgets.dpo_explorer(loss_type="kto")):
        with pytest.raises(ValueError, match="unknown DPO loss_type 'kto'.*sigmoid.*ipo.*hinge"):
            call()


@pytest.mark.parametrize("beta", [0.0, -0.1])
def test_nonpositive_beta_is_rejected(ax, beta):
    with pytest.raises(ValueError, match="beta must be a number > 0"):
        plots.dpo_loss_curve(H, beta, "sigmoid")
    with pytest.raises(ValueError, match="beta must be a number > 0"):
        plots.plot_dpo_loss(ax, beta, "sigmoid")
    with pytest.raises(ValueError, match="beta must be a number > 0"):
        widgets.dpo_explorer(beta=beta)


@pytest.mark.parametrize("betas", [(0.0, 1.0), (1.0, 0.1), (0.1,), (0.01, 1.0, 0.0)])
def test_dpo_explorer_rejects_bad_beta_ranges(betas):
    with pytest.raises(ValueError, match="betas"):
        widgets.dpo_explorer(beta=0.1, betas=betas)


def test_dpo_explorer_rejects_a_beta_outside_the_range():
    with pytest.raises(ValueError, match="outside betas"):
        widgets.dpo_explorer(beta=5.0)


def test_plot_dpo_loss_rejects_a_range_without_zero(ax):
    with pytest.raises(ValueError, match="h_range"):
        plots.plot_dpo_loss(ax, 0.1, "sigmoid", h_range=(1, 20))


@pytest.mark.parametrize("loss_type, eps", [("sigmoid", 0.5), ("sigmoid", -0.1), ("ipo", 0.1)])
def test_bad_label_smoothing_is_rejected(loss_type, eps):
    with pytest.raises(ValueError, match="label_smoothing"):
        plots.dpo_loss_curve(H, 0.1, loss_type, label_smoothing=eps)
