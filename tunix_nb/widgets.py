"""Widgets: ipywidgets explorers the notebooks share.

An explorer is a small `ipywidgets` box: sliders on top, a figure drawn by a
`tunix_nb.plots` function below. The drawing lives in `plots` so tests (and readers
without a live kernel) can call it directly; the explorer only wires a slider to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import ipywidgets
import numpy as np
from matplotlib.figure import Figure

from tunix_nb import plots


def _display_in(output, figure):
    """Show `figure` in the `output` widget, replacing what it showed before."""
    from IPython import get_ipython
    from IPython.display import display

    if get_ipython() is None:  # plain Python (a test, a script): nothing to show
        return
    output.clear_output(wait=True)
    with output:
        display(figure)


class TemperatureExplorer(ipywidgets.VBox):
    """A temperature slider above teacher and student distributions and their KL.

    Attributes a caller (or a test) can use: `slider` (an `ipywidgets.FloatSlider`),
    `kl_text` (an `ipywidgets.HTML` naming T and the KL), `figure` and `ax` (the
    matplotlib figure redrawn on every change), `kl` (the KL now shown) and
    `update(temperature)`, which the slider calls.
    """

    def __init__(self, teacher_logits_V, student_logits_V, temperatures=(0.25, 8.0, 0.25),
                 *, value: float = 1.0, figsize=(7, 3)):
        teacher = np.asarray(teacher_logits_V, dtype=np.float32)
        student = np.asarray(student_logits_V, dtype=np.float32)
        if teacher.ndim != 1 or teacher.shape != student.shape:
            raise ValueError(
                f"teacher_logits_V has shape {teacher.shape} and student_logits_V has shape "
                f"{student.shape}: both must be one position's logits, shape [V], same V"
            )
        t_min, t_max, t_step = _temperature_range(temperatures)
        self.teacher_logits_V, self.student_logits_V = teacher, student
        self.slider = ipywidgets.FloatSlider(
            value=float(np.clip(value, t_min, t_max)), min=t_min, max=t_max, step=t_step,
            description="temperature T", continuous_update=False,
            style={"description_width": "initial"},
        )
        self.kl_text = ipywidgets.HTML()
        self.output = ipywidgets.Output()
        # A Figure made without pyplot: no global state, never auto-shown by the
        # inline backend; it is displayed inside `output` on every update.
        self.figure = Figure(figsize=figsize, layout="constrained")
        self.ax = self.figure.add_subplot()
        self.kl = float("nan")
        super().__init__([self.slider, self.kl_text, self.output])
        self.slider.observe(lambda change: self.update(change["new"]), names="value")
        self.update(self.slider.value)

    def update(self, temperature: float) -> float:
        """Redraw at `temperature`; return KL(teacher_T || student_T)."""
        self.kl = plots.plot_temperature(self.ax, self.teacher_logits_V, self.student_logits_V,
                                         float(temperature))
        self.kl_text.value = (f"T = {float(temperature):g}: KL(teacher || student) = "
                              f"{self.kl:.4f}, T² · KL = {float(temperature) ** 2 * self.kl:.4f}")
        self._show()
        return self.kl

    def _show(self):
        _display_in(self.output, self.figure)


def _temperature_range(temperatures) -> tuple[float, float, float]:
    """(min, max, step) from a (min, max) or (min, max, step) tuple."""
    if not isinstance(temperatures, Sequence) or len(temperatures) not in (2, 3):
        raise ValueError(
            f"temperatures must be (min, max) or (min, max, step), got {temperatures!r}"
        )
    t_min, t_max = float(temperatures[0]), float(temperatures[1])
    t_step = float(temperatures[2]) if len(temperatures) == 3 else (t_max - t_min) / 40
    if not 0 < t_min < t_max or not t_step > 0:
        raise ValueError(
            f"temperatures={temperatures!r}: need 0 < min < max and step > 0 "
            "(a temperature of 0 or below is not a distribution)"
        )
    return t_min, t_max, t_step


def temperature_explorer(teacher_logits_V, student_logits_V, temperatures=(0.25, 8.0, 0.25),
                         *, value: float = 1.0, figsize=(7, 3)) -> TemperatureExplorer:
    """A slider over the softmax temperature T showing teacher and student at T.

    `teacher_logits_V` and `student_logits_V` are one position's logits, shape [V].
    `temperatures` is (min, max) or (min, max, step) for the slider; `value` is the
    starting T. Display the returned widget (the last line of a cell) to use it.
    """
    return TemperatureExplorer(teacher_logits_V, student_logits_V, temperatures,
                               value=value, figsize=figsize)


class DpoExplorer(ipywidgets.VBox):
    """Sliders for DPO's beta and loss type over its loss and gradient weight vs margin h.

    h = (pi_c - pi_r) - (ref_c - ref_r) is how much more the policy prefers the chosen
    completion than the reference does (nats). The plot (`plots.plot_dpo_loss`) shows
    the per-pair loss and -dL/dh, how hard a pair at that margin still pushes.

    beta moves on an `ipywidgets.FloatLogSlider` (base 10): the interesting betas span
    orders of magnitude (0.01 to 1), and a linear slider would squeeze 0.01-0.1 into
    its first tenth. The loss type is picked with `ipywidgets.ToggleButtons` over
    `losses.DPO_LOSS_TYPES`.

    Attributes a caller (or a test) can use: `beta_slider`, `loss_type_picker`,
    `summary` (an `ipywidgets.HTML` with the loss and weight at h = 0), `figure` and
    `ax` (redrawn on every change; the weight's twin axis is `drawn["twin_ax"]`),
    `drawn` (the dict `plots.plot_dpo_loss` returned last, plus "beta", "loss_type",
    "loss_at_0" and "weight_at_0") and `update()`, which the widgets call and which
    redraws at their current values.
    """

    def __init__(self, beta: float = 0.1, loss_type: str = "sigmoid",
                 betas=(0.01, 1.0, 0.01), *, h_range=(-20, 20), figsize=(7, 3.2)):
        from tunix_nb import losses

        b_min, b_max, log_step = _beta_range(betas)
        if loss_type not in losses.DPO_LOSS_TYPES:
            raise ValueError(
                f"unknown DPO loss_type {loss_type!r}: choose one of {losses.DPO_LOSS_TYPES}"
            )
        if not isinstance(beta, (int, float, np.integer, np.floating)) or not beta > 0:
            raise ValueError(f"beta must be a number > 0, got {beta!r}")
        if not b_min <= beta <= b_max:
            raise ValueError(f"beta={beta!r} is outside betas={betas!r}: widen the range "
                             "or pick a beta inside it")
        self.h_range = h_range
        self.beta_slider = ipywidgets.FloatLogSlider(
            value=float(beta), base=10, min=np.log10(b_min), max=np.log10(b_max),
            step=log_step, description="β (beta)", readout_format=".3g",
            continuous_update=False, style={"description_width": "initial"},
        )
        self.loss_type_picker = ipywidgets.ToggleButtons(
            options=list(losses.DPO_LOSS_TYPES), value=loss_type, description="loss type",
            style={"description_width": "initial", "button_width": "6em"},
        )
        self.summary = ipywidgets.HTML()
        self.output = ipywidgets.Output()
        # A Figure made without pyplot: no global state, never auto-shown by the
        # inline backend; it is displayed inside `output` on every update.
        self.figure = Figure(figsize=figsize, layout="constrained")
        self.ax = self.figure.add_subplot()
        self.drawn: dict = {}
        super().__init__([self.beta_slider, self.loss_type_picker, self.summary, self.output])
        self.beta_slider.observe(lambda change: self.update(), names="value")
        self.loss_type_picker.observe(lambda change: self.update(), names="value")
        self.update()

    def update(self) -> dict:
        """Redraw at the widgets' beta and loss type; return what was drawn."""
        beta, loss_type = float(self.beta_slider.value), self.loss_type_picker.value
        self.drawn = plots.plot_dpo_loss(self.ax, beta, loss_type, self.h_range)
        (loss_0,), (weight_0,) = plots.dpo_loss_curve(np.zeros(1), beta, loss_type)
        self.drawn.update(beta=beta, loss_type=loss_type, loss_at_0=float(loss_0),
                          weight_at_0=float(weight_0))
        self.summary.value = (
            f"{loss_type}, β = {beta:.3g}: at h = 0 the loss is {loss_0:.4f} and the "
            f"gradient weight −dL/dh is {weight_0:.4f}; {_dpo_note(beta, loss_type)}"
        )
        self._show()
        return self.drawn

    def _show(self):
        _display_in(self.output, self.figure)


def _dpo_note(beta: float, loss_type: str) -> str:
    """One line on where each loss type stops pushing."""
    if loss_type == "sigmoid":
        return "the weight never reaches 0: it keeps pushing h up, ever more gently"
    if loss_type == "ipo":
        return (f"the loss is smallest at h = 1/(2β) = {1 / (2 * beta):.3g}, and pairs past it "
                "are pulled back")
    return f"the loss and weight are 0 from h = 1/β = {1 / beta:.3g} on: such pairs stop pushing"


def _beta_range(betas) -> tuple[float, float, float]:
    """(min, max, step of log10 beta) from a (min, max) or (min, max, step) tuple."""
    if not isinstance(betas, Sequence) or len(betas) not in (2, 3):
        raise ValueError(f"betas must be (min, max) or (min, max, step), got {betas!r}")
    b_min, b_max = float(betas[0]), float(betas[1])
    log_step = float(betas[2]) if len(betas) == 3 else 0.01
    if not 0 < b_min < b_max or not log_step > 0:
        raise ValueError(
            f"betas={betas!r}: need 0 < min < max and step > 0 (beta must be > 0: it "
            "scales the implicit reward beta * log(pi / ref))"
        )
    return b_min, b_max, log_step


def dpo_explorer(beta: float = 0.1, loss_type: str = "sigmoid", betas=(0.01, 1.0, 0.01), *,
                 h_range=(-20, 20), figsize=(7, 3.2)) -> DpoExplorer:
    """Sliders for DPO's beta and loss type over the loss and gradient weight vs margin h.

    `beta` and `loss_type` (one of `losses.DPO_LOSS_TYPES`) are the starting values.
    `betas` is (min, max) or (min, max, step) for the beta slider, which is
    logarithmic: `step` is in log10(beta), so the default 0.01 moves beta by about
    2.3% per step. `h_range` is the plotted margin range (nats). Display the
    returned widget (the last line of a cell) to use it.
    """
    return DpoExplorer(beta, loss_type, betas, h_range=h_range, figsize=figsize)
