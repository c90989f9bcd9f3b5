"""Progress bars that a saved notebook shows as they ended.

tqdm's notebook widget stores its first state as the text a page shows where widgets do not
run (GitHub, nbviewer, a notebook reopened later): "0/200" for a loop that finished. In a
Jupyter kernel the bar here is tqdm's text bar drawn into one display output, updated in
place (`update_display`), so the saved output is the bar's last line: "200/200 [...]".
Elsewhere (a terminal, a script) it is tqdm's usual bar on stderr.
"""

from __future__ import annotations

import io

from tqdm.std import tqdm as text_tqdm


def bar(iterable=None, *, total: int | None = None, desc: str = "", disable: bool = False):
    """A tqdm bar over `iterable` (or `total` steps): a display updated in place in a Jupyter
    kernel, tqdm's stderr bar elsewhere."""
    cls = DisplayBar if _in_jupyter_kernel() else text_tqdm
    return cls(iterable, total=total, desc=desc, disable=disable)


def _in_jupyter_kernel() -> bool:
    """Whether this runs in a Jupyter kernel (the test tqdm.autonotebook uses)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and "IPKernelApp" in shell.config


class DisplayBar(text_tqdm):
    """tqdm's text bar drawn into one Jupyter display, replaced at each refresh, so that the
    notebook keeps the last line as its output."""

    def __init__(self, *args, **kwargs):
        self._handle = None  # set before tqdm's __init__, which draws the first line
        kwargs["file"] = io.StringIO()  # the display is the bar; nothing goes to stderr
        kwargs.setdefault("ascii", False)  # a StringIO names no encoding, so tqdm would draw '#'
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        from IPython.display import display

        text = self.__str__() if msg is None else msg
        if not text:  # tqdm clears a bar that is not left with an empty line: keep the last one
            return True
        if self._handle is None:
            self._handle = display({"text/plain": text}, raw=True, display_id=True)
        else:
            self._handle.update({"text/plain": text}, raw=True)
        return True
