"""What XLA's optimisation settings do to a lesson-sized program's compile time and run time.

One setting per fresh process, chosen through JAX's own environment variables before JAX
starts (so that every program of the process, eager ops included, gets it):

- default: nothing set;
- effort-1: JAX_EXEC_TIME_OPTIMIZATION_EFFORT=-1 (XLA's "least effort on execution time");
- O0, O1: JAX_OPTIMIZATION_LEVEL (XLA's effort levels);
- no-opt: JAX_DISABLE_MOST_OPTIMIZATIONS=1 (backend optimisation level 0).

Measured for the lessons' student model (data/sft_student): the SFT training step under
"auto" and under agreement precision, the greedy decoder under agreement precision (each
lowered, compiled ahead of time, then run), and 40 eager operations on fresh shapes (each
compiles a small program, as a lesson's cells do). JAX's persistent cache is off.

    python results/compile_costs/effort.py SETTING > effort_SETTING.json  (effort_BACKEND.json gathers them)
"""

import json
import os
import sys
import time

SETTINGS = {"default": {}, "effort-1": {"JAX_EXEC_TIME_OPTIMIZATION_EFFORT": "-1"},
            "O0": {"JAX_OPTIMIZATION_LEVEL": "O0"}, "O1": {"JAX_OPTIMIZATION_LEVEL": "O1"},
            "no-opt": {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}}

if __name__ == "__main__":
    os.environ.update(SETTINGS[sys.argv[1]])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tunix_nb import checkpoint, compare, data, model, sft, train  # noqa: E402
from tunix_nb.tokenizer import ByteTokenizer  # noqa: E402

jax.config.update("jax_enable_compilation_cache", False)


def compile_and_run(lower, args, runs: int = 20) -> dict:
    """Seconds to lower and to compile, and the median of `runs` calls after one warm-up."""
    start = time.perf_counter()
    lowered = lower()
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t)
    return {"lower_s": round(lowered_at - start, 3), "compile_s": round(compiled_at - lowered_at, 3),
            "run_median_ms": round(1e3 * float(np.median(times)), 3)}


def eager_ops(n: int = 40) -> dict:
    """`n` eager operations, each on a shape not seen before: each compiles a small program."""
    start = time.perf_counter()
    for i in range(n):
        x = jnp.ones((i + 3, 5))
        float(jnp.sum(jnp.exp(x) * 2.0))
    return {"ops": n, "seconds": round(time.perf_counter() - start, 3)}


def measure() -> dict:
    graphdef, params, _ = checkpoint.load_model(data.DATA_DIR / "sft_student")
    rows = data.sft_arrays(data.load_sft()[:64], ByteTokenizer(), data.DEFAULT_SEQ_LEN)
    batch = {k: jnp.asarray(v) for k, v in rows.items()}
    prompts = data.prompt_arrays([e["prompt"] for e in data.load_sft()[:200]], ByteTokenizer(),
                                 data.DEFAULT_PROMPT_LEN)
    tokens, mask = jnp.asarray(prompts["tokens"]), jnp.asarray(prompts["attention_mask"])
    out = {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
           "jax": jax.__version__, "eager": eager_ops()}
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=1e-3, warmup_steps=1, total_steps=10))
    opt_state = opt.init(params)
    step = jax.jit(train.make_step(sft.objective(graphdef), opt, parallel_mode="jit"))
    out["auto/sft_step"] = compile_and_run(lambda: step.lower(params, opt_state, batch), (params, opt_state, batch))
    with compare.agreement_precision():
        step = jax.jit(train.make_step(sft.objective(graphdef), opt, parallel_mode="jit"))
        out["agreement/sft_step"] = compile_and_run(lambda: step.lower(params, opt_state, batch),
                                                    (params, opt_state, batch))
        decode = jax.jit(lambda p, t, m: model.greedy_generate(graphdef, p, t, m, max_new_tokens=data.MAX_NEW_TOKENS,
                                                               eos_id=2, pad_id=0))
        out["agreement/greedy_generate"] = compile_and_run(lambda: decode.lower(params, tokens, mask),
                                                           (params, tokens, mask), runs=5)
    return out


if __name__ == "__main__":
    print(json.dumps({"setting": sys.argv[1], "env": SETTINGS[sys.argv[1]], **measure()}, indent=1))
