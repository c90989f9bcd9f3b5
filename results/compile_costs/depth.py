"""Does the SFT step's compile time grow with depth? Issue 47, item 3.

The student's shapes at 2 and at 28 layers, blocks run as one `lax.scan` (`scan_layers=True`),
compiled ahead of time in one process with JAX's persistent cache off, two ways:

- per_layer: the training state as the model names it, one tree per block (the command before
  `tunix_nb.layer_stack`, and without --scan-layers). The scan stacks the blocks' trees inside
  the step, and AdamW updates every block's leaves apart, so the optimizer's program grows
  with depth.
- stacked: what the command trains with --scan-layers (`cli.methods.stack_layers`): the same
  parameters stacked on a leading layer axis ([n_layers, ...] a leaf), which the optimizer then
  updates as one leaf each; the objective slices the blocks back out for the model, and the
  scan stacks them again, which XLA folds away.

It also runs one step both ways at 28 layers from the same parameters and batch, and reports
how far apart the updated parameters and the losses are ("same_step").

    python results/compile_costs/depth.py > results/compile_costs/depth_cpu.json
"""

import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_nb import layer_stack, model, sft, train
from tunix_nb.cli.methods import Method, stack_layers

jax.config.update("jax_enable_compilation_cache", False)
BATCH, LENGTH = 4, 64
DEPTHS = (2, 28)


def step_and_state(n_layers: int, layout: str):
    """(the compiled step's jit function, its state, an optimizer state, a batch)."""
    graphdef, params = model.split(model.make_model("student", n_layers=n_layers, scan_layers=True))
    method = Method(graphdef, params, {}, sft.objective(graphdef))
    method = stack_layers(method) if layout == "stacked" else method
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=1e-3, warmup_steps=1, total_steps=10))
    objective, state = method.objective, method.params
    tokens_BxL = jax.random.randint(jax.random.key(0), (BATCH, LENGTH), 0, 200)
    batch = {"inputs": tokens_BxL, "targets": jnp.roll(tokens_BxL, -1, axis=1),
             "attention_mask": jnp.ones_like(tokens_BxL), "loss_mask": jnp.ones((BATCH, LENGTH), jnp.float32)}
    return train.make_step(objective, opt), state, opt.init(state), batch


def compile_seconds(n_layers: int, layout: str) -> float:
    step, state, opt_state, batch = step_and_state(n_layers, layout)
    start = time.perf_counter()
    step.lower(state, opt_state, batch, None).compile()
    return time.perf_counter() - start


def same_step(n_layers: int) -> dict:
    """One step each way from the same parameters: the largest parameter difference, the losses."""
    results = {}
    for layout in ("per_layer", "stacked"):
        step, state, opt_state, batch = step_and_state(n_layers, layout)
        new_state, _, metrics = step(state, opt_state, batch, None)
        pure = nnx.to_pure_dict(new_state) if layout == "per_layer" else layer_stack.unstack(new_state)
        results[layout] = (pure, float(metrics["loss"]))
    differences = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), results["per_layer"][0],
                               results["stacked"][0])
    return {"largest_parameter_difference": max(jax.tree.leaves(differences)),
            "loss": {layout: loss for layout, (_, loss) in results.items()}}


def main():
    out = {"jax": jax.__version__, "backend": jax.default_backend(), "preset": "student", "batch": [BATCH, LENGTH]}
    for layout in ("per_layer", "stacked"):
        seconds = {n: round(compile_seconds(n, layout), 2) for n in DEPTHS}
        out[layout] = {"compile_seconds": seconds, "ratio": round(seconds[DEPTHS[1]] / seconds[DEPTHS[0]], 2)}
    out["same_step"] = same_step(DEPTHS[1])
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
