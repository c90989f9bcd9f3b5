"""What every post-training method shares: the optimizer, the step builder and the loop.

A method (`tunix_nb.sft`, `tunix_nb.distill`, `tunix_nb.dpo`, `tunix_nb.grpo`) supplies
an objective `(params, batch, frozen) -> (loss_sum, weight, metrics)`; `make_step` turns
it into a compiled step under any of `PARALLEL_MODES`, and `run` trains with it on
step-indexed batches, `run_on_policy` on batches the policy samples itself (GRPO).
Nothing here knows which method it runs. `python -m tunix_nb.train` is the command line
(`tunix_nb.cli`).
"""

from tunix_nb.train.loop import Placement, run, run_on_policy
from tunix_nb.train.optimizer import OptimizerConfig, make_optimizer
from tunix_nb.train.step import PARALLEL_MODES, MeshStep, make_step

__all__ = ["PARALLEL_MODES", "MeshStep", "Placement", "OptimizerConfig", "make_optimizer", "make_step", "run", "run_on_policy"]
