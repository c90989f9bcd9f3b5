"""Per-cell compile profile: how many XLA compiles a cell caused and the seconds spent tracing,
lowering and compiling them, from JAX's monitoring events.

On an accelerator a small eager op costs a compile of its own (tens of milliseconds on a TPU),
so a cell that is slower there than on a CPU usually shows it here first. Listening starts
once the lesson has imported JAX (this module never imports it first: the setup cell chooses
the devices).
"""

from __future__ import annotations

import sys

# JAX's event names (jax._src.dispatch): the three stages of turning a function into a program
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_seconds",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_seconds",
          "/jax/core/compile/backend_compile_duration": "compile_seconds"}


class CompileMeter:
    """Counts compiles and sums their stages' seconds; `take()` returns and resets the counts."""

    def __init__(self):
        self.listening = False
        self._reset()

    def _reset(self):
        self.counts = {"compiles": 0, **{name: 0.0 for name in EVENTS.values()}}

    def _on_event(self, event: str, seconds: float, **_):
        name = EVENTS.get(event)
        if name is None:
            return
        self.counts[name] += seconds
        if name == "compile_seconds":
            self.counts["compiles"] += 1

    def listen_once_jax_is_imported(self) -> None:
        if self.listening or "jax" not in sys.modules:
            return
        from jax import monitoring

        monitoring.register_event_duration_secs_listener(self._on_event)
        self.listening = True

    def take(self) -> dict:
        """The counts since the last call, rounded (None before JAX was imported: not measured)."""
        if not self.listening:
            return {"compiles": None}
        taken = {key: (round(value, 3) if isinstance(value, float) else value) for key, value in self.counts.items()}
        self._reset()
        return taken
