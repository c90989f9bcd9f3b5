"""The options of a memory plan: which step, at which shapes, with which remedies."""

from __future__ import annotations

import dataclasses

STRATEGIES = ("full", "lora", "qlora")
REMAT_POLICIES = ("full", "save_attention", "save_projections")  # tunix_nb.model's, without importing JAX
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """One training step to compile, not run.

    strategy: "full" (every parameter trained, AdamW, float32 params and state), "lora" or
    "qlora" (nf4 base) with rank `lora_rank` adapters. `base_dtype` is the frozen base's
    dtype under LoRA/QLoRA (the trained parameters are float32 either way). `n_layers`
    compiles that many blocks of the model (None: all of them). `vocab_chunk` is passed
    to the method's objective when it takes one (chunked log-probs); None: today's full
    logits. `seq_chunk`: positions per row at a time on the chunked path (None: all at
    once; it needs `vocab_chunk`). `float32_activations=True` is the kit's step as it was
    before issue 27: nnx.Embed had fixed its output dtype to its initial float32 table, so
    with bfloat16 params every activation after the embedding was float32 (built here as
    `ModelConfig.dtype="float32"`, which computes the same). False builds the model with
    `ModelConfig.dtype=compute_dtype`, so every layer computes in it, as the default config
    (`dtype=None`, following the params) now does too. `scan_layers` plans the step of the
    command's --scan-layers (the trained blocks, and a LoRA base, stacked: `layer_stack`);
    `attention` is the model's ("splash": the command's --attention on one TPU chip);
    `remat_policy` what remat keeps (`ModelConfig.remat_policy`).
    """

    strategy: str = "lora"
    batch_size: int = 8
    seq_len: int = 1024
    compute_dtype: str = "bfloat16"
    base_dtype: str = "bfloat16"
    lora_rank: int = 16
    remat: bool = True
    donate: bool = True
    vocab_chunk: int | None = None
    seq_chunk: int | None = None
    n_layers: int | None = None
    float32_activations: bool = False
    scan_layers: bool = False
    attention: str = "xla"
    remat_policy: str = "full"

    def __post_init__(self):
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"PlanConfig.remat_policy={self.remat_policy!r}; choose one of {REMAT_POLICIES} "
                             "(the model's, tunix_nb.model.REMAT_POLICIES).")
        if self.attention not in ("xla", "splash"):
            raise ValueError(f"PlanConfig.attention={self.attention!r}; choose 'xla' or 'splash' (the model's, "
                             "tunix_nb.fused_attention: a TPU's kernel).")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"PlanConfig.strategy={self.strategy!r}; choose one of {STRATEGIES}.")
        for name in ("compute_dtype", "base_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"PlanConfig.{name}={getattr(self, name)!r}; choose one of {DTYPES}.")
        for name in ("batch_size", "seq_len", "lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PlanConfig.{name} must be a positive int, got {value!r}.")
        for name in ("n_layers", "vocab_chunk", "seq_chunk"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"PlanConfig.{name} must be a positive int or None, got {value!r}.")
        if self.seq_chunk is not None and self.vocab_chunk is None:
            raise ValueError(f"PlanConfig.seq_chunk={self.seq_chunk!r} needs vocab_chunk (it chunks the chunked "
                             "path's positions).")


def before(cfg: PlanConfig) -> PlanConfig:
    """The step as the training command builds it before the memory work (issue 27): no
    donation, a float32 frozen base, full logits, float32 activations after the embedding
    (the default model config); remat as the issue's "today" rows (off for full
    fine-tuning, on for LoRA/QLoRA)."""
    return dataclasses.replace(cfg, donate=False, base_dtype="float32", vocab_chunk=None, seq_chunk=None,
                               remat=cfg.strategy != "full", float32_activations=True)


def after(cfg: PlanConfig, vocab_chunk: int | None = None, seq_chunk: int | None = None) -> PlanConfig:
    """The step with the remedies: donated state, a bfloat16 frozen base, per-block remat,
    layers that compute in the compute dtype (`ModelConfig.dtype`), and chunked log-probs
    where the objective offers them (`vocab_chunk`, `seq_chunk`)."""
    return dataclasses.replace(cfg, donate=True, base_dtype="bfloat16", remat=True, vocab_chunk=vocab_chunk,
                               seq_chunk=seq_chunk, float32_activations=False)
