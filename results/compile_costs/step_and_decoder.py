"""What one compile of a lesson-sized program costs on this backend, and what the precision
setting adds: the SFT training step and the greedy decoder of the lessons' student model
(data/sft_student), each lowered and compiled ahead of time under three settings:

- "auto": the backend's own compute dtype (bfloat16 on a TPU) and matmul precision;
- "float32": float32 compute, the backend's default matmul precision;
- "agreement": float32 compute at 'highest' (compare.agreement_precision, what the lessons
  of checks run under).

Run it in a fresh process, JAX's persistent compilation cache off:

    python results/compile_costs/step_and_decoder.py > step_and_decoder_BACKEND.json
"""

import contextlib
import json
import time

import jax
import jax.numpy as jnp

from tunix_nb import checkpoint, compare, data, model, precision, sft, train
from tunix_nb.tokenizer import ByteTokenizer

jax.config.update("jax_enable_compilation_cache", False)


@contextlib.contextmanager
def setting(name: str):
    if name == "agreement":
        with compare.agreement_precision():
            yield
        return
    previous = precision.set_auto_compute_dtype("float32" if name == "float32" else None)
    try:
        yield
    finally:
        precision.set_auto_compute_dtype(previous)


def seconds(lowered_fn) -> dict:
    start = time.perf_counter()
    lowered = lowered_fn()
    lowered_at = time.perf_counter()
    lowered.compile()
    return {"lower_s": round(lowered_at - start, 3), "compile_s": round(time.perf_counter() - lowered_at, 3)}


def main() -> dict:
    graphdef, params, _ = checkpoint.load_model(data.DATA_DIR / "sft_student")
    rows = data.sft_arrays(data.load_sft()[:64], ByteTokenizer(), data.DEFAULT_SEQ_LEN)
    batch = {k: jnp.asarray(v) for k, v in rows.items()}
    prompts = data.prompt_arrays([e["prompt"] for e in data.load_sft()[:200]], ByteTokenizer(), data.DEFAULT_PROMPT_LEN)
    out = {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
           "params": model.count_params(params)}
    for name in ("auto", "float32", "agreement"):
        with setting(name):
            opt = train.make_optimizer(train.OptimizerConfig(learning_rate=1e-3, warmup_steps=1, total_steps=10))
            step = jax.jit(train.make_step(sft.objective(graphdef), opt, parallel_mode="jit"))
            opt_state = opt.init(params)
            out[f"{name}/sft_step"] = seconds(lambda: step.lower(params, opt_state, batch))
            out[f"{name}/greedy_generate"] = seconds(lambda: model.greedy_generate.lower(
                graphdef, params, jnp.asarray(prompts["tokens"]), jnp.asarray(prompts["attention_mask"]),
                max_new_tokens=data.MAX_NEW_TOKENS, eos_id=2, pad_id=0))
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
