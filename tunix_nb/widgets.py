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
        from IPython import get_ipython
        from IPython.display import display

        if get_ipython() is None:  # plain Python (a test, a script): nothing to show
            return
        self.output.clear_output(wait=True)
        with self.output:
            display(self.figure)


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
