"""Model FLOPs utilisation: the FLOPs a training step needs by the model's shapes, and the
chip's peak to divide them by.

MFU = model FLOPs per step / step seconds / the chip's peak (PaLM, Chowdhery et al. 2022,
appendix B). Model FLOPs count what the model needs, not what the program does: remat's
recomputation is left out (XLA's `cost_analysis()` counts it; that ratio is hardware FLOPs
utilisation). The count, per token, for the step `tunix_nb.train` builds:

- the matmul weights N: per block q, k, v, out, gate, up, down; plus the LM head (vocabulary
  x d_model, tied or not). Embedding lookups, norms and biases are not counted. As MaxText's
  `calculate_tflops_training_per_device` (maxtext_utils.py) counts its learnable weights.
- full fine-tuning: 6N (forward 2N, activation gradients 2N, weight gradients 2N);
- a frozen base (LoRA, QLoRA): 4N (no weight gradients) plus 6 x the adapters' parameters
  (an adapter is a matmul pair, trained). The first block's input gradient, which nothing
  needs when the embedding is frozen, is counted all the same;
- attention: 12 x layers x seq x heads x head_dim (scores and weighted values, forward and
  backward), the same with a frozen base: attention has no weights. PaLM's convention,
  without causal halving: the kit computes all L x L scores and masks them, so this is what
  the chip does. MaxText and Megatron halve it for the causal mask; `causal_halving=True`
  gives their count.
"""

from __future__ import annotations

import dataclasses
import re

# Dense peak FLOP/s per chip by JAX's device_kind, bfloat16 (the T4: float16, it has no
# bfloat16), from the vendors' data sheets. TPUs by exact name ("TPU v4 lite" is another chip).
PEAK_FLOPS = (
    (r"TPU v5 lite|TPU v5e", 197e12, "bfloat16", "TPU v5e"),
    (r"TPU v5|TPU v5p", 459e12, "bfloat16", "TPU v5p"),
    (r"TPU v6 lite|TPU v6e", 918e12, "bfloat16", "TPU v6e"),
    (r"TPU v4", 275e12, "bfloat16", "TPU v4"),
    (r".*\bA100\b.*", 312e12, "bfloat16", "A100"),
    (r".*\bH100\b.*", 989e12, "bfloat16", "H100"),
    (r".*\bL4\b.*", 121e12, "bfloat16", "L4"),
    (r".*\bT4\b.*", 65e12, "float16", "T4"),
)


@dataclasses.dataclass(frozen=True)
class Peak:
    flops_per_second: float
    dtype: str
    chip: str
    device_kind: str


def peak_for(device_kind: str) -> Peak | None:
    """The chip's dense peak for JAX's `device.device_kind`, or None for a chip not in the table
    (a CPU, whose peak the bench measures instead)."""
    for pattern, flops, dtype, chip in PEAK_FLOPS:
        if re.fullmatch(pattern, device_kind.strip()):
            return Peak(flops, dtype, chip, device_kind)
    return None


def device_peak(device=None) -> Peak | None:
    """`peak_for` the first device JAX sees (or `device`)."""
    import jax

    return peak_for((device or jax.devices()[0]).device_kind)


def matmul_params(config) -> int:
    """N: the blocks' matmul weights plus the LM head (vocabulary x d_model)."""
    d, heads, kv_heads, head = config.d_model, config.n_heads, config.kv_heads, config.head_size
    attention = d * head * (heads + 2 * kv_heads) + heads * head * d  # q, k, v; out
    mlp = 3 * d * config.d_ff  # gate, up, down
    return config.n_layers * (attention + mlp) + config.vocab_size * d


def attention_flops_per_token(config, seq_len: int, *, causal_halving: bool = False) -> float:
    """Scores and weighted values, forward and backward: 12 x layers x seq x heads x head_dim."""
    full = 12 * config.n_layers * seq_len * config.n_heads * config.head_size
    return full / 2 if causal_halving else full


def step_flops(config, *, batch: int, seq_len: int, adapter_params: int | None = None,
               causal_halving: bool = False) -> float:
    """Model FLOPs of one training step on `batch` rows of `seq_len` tokens.

    adapter_params: None for full fine-tuning (6N per token); the trained adapters' parameter
    count for a frozen base (4N + 6 x adapter_params per token). Gradient accumulation
    splits the same batch: the count is the same.
    """
    for name, value in (("batch", batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    if adapter_params is not None and (not isinstance(adapter_params, int) or adapter_params < 0):
        raise ValueError(f"adapter_params must be None (full fine-tuning) or a count >= 0, got {adapter_params!r}.")
    n = matmul_params(config)
    weights = 6 * n if adapter_params is None else 4 * n + 6 * adapter_params
    per_token = weights + attention_flops_per_token(config, seq_len, causal_halving=causal_halving)
    return float(per_token * batch * seq_len)


def utilisation(flops_per_step: float, step_seconds: float, peak: Peak | float) -> float:
    """FLOPs per step / step seconds / peak FLOP/s."""
    peak_flops = peak.flops_per_second if isinstance(peak, Peak) else float(peak)
    if step_seconds <= 0 or peak_flops <= 0:
        raise ValueError(f"step_seconds and the peak must be positive, got {step_seconds!r} and {peak_flops!r}.")
    return flops_per_step / step_seconds / peak_flops
