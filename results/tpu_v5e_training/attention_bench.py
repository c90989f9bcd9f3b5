"""Attention and the loss alone, forward and backward, at Qwen3-0.6B's shapes on the chip (issue 47,
item 5): which remedy the profile's two slow parts have, measured before one is built.

    python results/tpu_v5e_training/attention_bench.py --out FILE [--batch 8 --length 1024 --repeats 10]
    python results/tpu_v5e_training/attention_bench.py --out FILE --only splash_b512,full_logits  # some variants
    python results/tpu_v5e_training/attention_bench.py --check     # on a CPU: every variant's
        output and gradients against the kit's `model.attend` at small shapes (Pallas in interpret mode)

Attention (bfloat16 q, k, v; 16 query heads sharing 8 key/value heads, head size 128; causal with
padding as segment ids), each the gradient of sum(output * a fixed cotangent) for q, k and v:
- `kit`: `tunix_nb.model.attend` with its [B, L, L] mask, the step's own;
- `grouped_einsum`: the same math without repeating the key/value heads (queries grouped per
  key/value head, as Tunix's Qwen3 and transformers' SDPA path compute);
- `xla_dpa`: `jax.nn.dot_product_attention(implementation="xla", is_causal=True)`;
- `splash_bN`: Pallas's TPU splash attention (causal mask, segment ids), blocks of N, the
  key/value heads repeated (multi-head kernel) or, `splash_mqa_bN`, one multi-query kernel per
  key/value head over its group of query heads;
- `flash`: Pallas's TPU flash attention (causal, segment ids), key/value heads repeated.
The loss (hidden [B, L, 1024] bfloat16 and Qwen3's head [151936, 1024]): the kit's `vocab_chunks.sft_loss`
with the step's chunks (8192, 256), with vocabulary chunks only, and the full float32 logits' cross-entropy.

Each variant: its compile, the median of `repeats` timed calls (each fetched), useful FLOPs per
second (attention: the causal half of the score and mix products, forward and backward; the loss:
its three head products) and the compiled program's XLA peak memory.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

HEADS, KV_HEADS, HEAD_SIZE, D_MODEL, VOCAB = 16, 8, 128, 1024, 151_936


def segment_ids(batch: int, length: int):
    """1 for real tokens, 0 for right padding: the last row ends 100 tokens early."""
    import jax.numpy as jnp

    ids = jnp.ones((batch, length), jnp.int32)
    return ids.at[-1, length - min(100, length // 4):].set(0)


def kit_mask(seg_BxL):
    import jax.numpy as jnp

    L = seg_BxL.shape[1]
    return jnp.tril(jnp.ones((L, L), bool))[None] & (seg_BxL[:, :, None] == seg_BxL[:, None, :]) & (
        seg_BxL > 0)[:, None, :]


def splash_block_choices(length: int) -> dict:
    """name -> splash.BlockSizes beyond one block size everywhere: the fused backward kernel (dq,
    dk and dv in one pass over the blocks) and blocks of the whole length (no causal skip, fewer
    grid steps), each where the length allows."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    def sizes(q, kv, fused):
        dq = {} if fused else {"block_q_dq": q, "block_kv_dq": kv}
        return splash.BlockSizes(block_q=q, block_kv=kv, block_kv_compute=kv, block_q_dkv=q, block_kv_dkv=kv,
                                 block_kv_dkv_compute=kv, use_fused_bwd_kernel=fused, **dq)

    choices = {}
    for q, kv in ((512, 512), (512, 1024), (1024, 512), (1024, 1024), (256, 512)):
        if length % q == 0 and length % kv == 0 and max(q, kv) <= length:
            if (q, kv) != (512, 512):
                choices[f"q{q}_kv{kv}"] = sizes(q, kv, False)
            choices[f"q{q}_kv{kv}_fused"] = sizes(q, kv, True)
    return choices


def attention_variants(interpret: bool, length: int) -> dict:
    """name -> f(q [B,L,H,D], k [B,L,K,D], v [B,L,K,D], seg [B,L]) -> [B,L,H,D]."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu import flash_attention as flash
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    from tunix_nb import model

    def kit(q, k, v, seg):
        return model.attend(q, k, v, kit_mask(seg))

    def grouped_einsum(q, k, v, seg):
        B, L, H, D = q.shape
        q_BxLxKxGxD = q.reshape(B, L, k.shape[2], H // k.shape[2], D)
        scores = jnp.einsum("blkgd,bskd->bkgls", q_BxLxKxGxD, k) / jnp.sqrt(D).astype(q.dtype)
        scores = jnp.where(kit_mask(seg)[:, None, None], scores, -1e9)
        weights = model.low_precision_softmax(scores)
        return jnp.einsum("bkgls,bskd->blkgd", weights, v).reshape(B, L, H, D)

    def xla_dpa(q, k, v, seg):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    def splash_kernel(block, mqa: bool, heads: int):
        sizes = block if isinstance(block, splash.BlockSizes) else splash.BlockSizes(
            block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block, block_kv_dkv=block,
            block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
        mask = splash.MultiHeadMask([splash.CausalMask((length, length))] * heads)
        make = splash.make_splash_mqa_single_device if mqa else splash.make_splash_mha_single_device
        return make(mask, block_sizes=sizes, interpret=interpret)

    def splash_mha(block):
        kernel = splash_kernel(block, False, HEADS)

        def run(q, k, v, seg):
            group = q.shape[2] // k.shape[2]
            q_BxHxLxD = jnp.swapaxes(q, 1, 2) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
            k_BxHxLxD, v_BxHxLxD = (jnp.swapaxes(jnp.repeat(x, group, axis=2), 1, 2) for x in (k, v))
            ids = jax.vmap(lambda s: splash.SegmentIds(q=s, kv=s))(seg)
            out = jax.vmap(kernel)(q_BxHxLxD, k_BxHxLxD, v_BxHxLxD, segment_ids=ids)
            return jnp.swapaxes(out, 1, 2)
        return run

    def splash_mqa(block):
        kernel = splash_kernel(block, True, HEADS // KV_HEADS)

        def run(q, k, v, seg):
            B, L, H, D = q.shape
            K = k.shape[2]
            q_BxKxGxLxD = (q.reshape(B, L, K, H // K, D) / jnp.sqrt(D).astype(q.dtype)).transpose(0, 2, 3, 1, 4)
            k_BxKxLxD, v_BxKxLxD = (jnp.swapaxes(x, 1, 2) for x in (k, v))
            ids = jax.vmap(lambda s: splash.SegmentIds(q=s, kv=s))(seg)
            per_head = jax.vmap(kernel, in_axes=(0, 0, 0, None))  # over the key/value heads
            out = jax.vmap(per_head)(q_BxKxGxLxD, k_BxKxLxD, v_BxKxLxD, ids)
            return out.transpose(0, 3, 1, 2, 4).reshape(B, L, H, D)
        return run

    def flash_mha(q, k, v, seg):
        group = q.shape[2] // k.shape[2]
        q_BxHxLxD = jnp.swapaxes(q, 1, 2)
        k_BxHxLxD, v_BxHxLxD = (jnp.swapaxes(jnp.repeat(x, group, axis=2), 1, 2) for x in (k, v))
        out = flash.flash_attention(q_BxHxLxD, k_BxHxLxD, v_BxHxLxD, segment_ids=flash.SegmentIds(q=seg, kv=seg),
                                    causal=True, sm_scale=q.shape[-1] ** -0.5, debug=False)
        return jnp.swapaxes(out, 1, 2)

    variants = {"kit": kit, "grouped_einsum": grouped_einsum, "xla_dpa": xla_dpa}
    for block in (128, 512):
        if length % block == 0:
            variants[f"splash_b{block}"] = splash_mha(block)
            variants[f"splash_mqa_b{block}"] = splash_mqa(block)
    # the block tuning (README, "The fused backward and the online softmax")
    for name, sizes in splash_block_choices(length).items():
        variants[f"splash_{name}"] = splash_mha(sizes)
        variants[f"splash_mqa_{name}"] = splash_mqa(sizes)
    if not interpret:  # flash_attention's interpret path is not a flag of its public function
        variants["flash"] = flash_mha
    return variants


def attention_inputs(batch: int, length: int, dtype):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, length, HEADS, HEAD_SIZE), dtype)
    k = jax.random.normal(keys[1], (batch, length, KV_HEADS, HEAD_SIZE), dtype)
    v = jax.random.normal(keys[2], (batch, length, KV_HEADS, HEAD_SIZE), dtype)
    seg = segment_ids(batch, length)
    # padded queries' outputs are never read (the loss masks them), and each kernel fills them differently
    cotangent = jax.random.normal(keys[3], (batch, length, HEADS, HEAD_SIZE), dtype) * seg[:, :, None, None].astype(dtype)
    return q, k, v, seg, cotangent


def value_and_grads(attention):
    import jax
    import jax.numpy as jnp

    def loss(q, k, v, seg, cotangent):
        return jnp.sum(attention(q, k, v, seg).astype(jnp.float32) * cotangent.astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def loss_variants() -> dict:
    """name -> f(hidden [B,L,D] bf16, head [V,D] bf16, targets [B,L], mask [B,L]) -> mean loss."""
    import jax
    import jax.numpy as jnp

    from tunix_nb import model, vocab_chunks

    def chunked(vocab_chunk, seq_chunk):
        chunks = vocab_chunks.chunking(vocab_chunk, seq_chunk)

        def loss(h, head_VxD, t, m):  # the model's head as `model.output_head` gives it
            project = lambda x: jnp.einsum("...d,vd->...v", x, head_VxD).astype(jnp.float32)
            total, count = vocab_chunks.sft_loss(h, model.OutputHead(project, head_VxD, jnp.bfloat16), t, m,
                                                 chunks=chunks)
            return total / count
        return loss

    def full_logits(h, head, t, m):
        logits = jnp.einsum("bld,vd->blv", h, head).astype(jnp.float32)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), t[..., None], axis=-1)[..., 0]
        return -jnp.sum(logp * m) / jnp.sum(m)

    variants = {"kit_chunks_8192_256": chunked(8192, 256), "full_logits": full_logits}
    for size in (8192, 16384, VOCAB // 4, VOCAB // 2):  # bigger chunks: fewer, longer matmuls
        variants[f"kit_chunks_{size}"] = chunked(size, None)
    return variants


def timed(fn, args, repeats: int) -> dict:
    import jax

    from tunix_nb.memory_plan.analysis import memory_of

    started = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_seconds = time.perf_counter() - started
    jax.block_until_ready(compiled(*args))
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        seconds.append(time.perf_counter() - started)
    return {"compile_seconds": compile_seconds, "median_seconds": statistics.median(seconds),
            "seconds": seconds, "peak_bytes": memory_of(compiled)["peak_bytes"]}


def chosen(variants: dict, only: list[str] | None, keep: str | None = None) -> dict:
    """The variants named in `only` (all where None), and `keep` (the reference) always."""
    if only is None:
        return variants
    unknown = set(only) - set(variants) - set(loss_variants()) - set(attention_variants(True, 1024)) - {"kit"}
    if unknown:
        raise SystemExit(f"--only: no variant named {sorted(unknown)}")
    return {name: f for name, f in variants.items() if name in only or name == keep}


def bench(args) -> dict:
    import jax
    import jax.numpy as jnp

    B, L = args.batch, args.length or 1024
    inputs = attention_inputs(B, L, jnp.bfloat16)
    # the causal half of QK^T and PV (2 products of 2*B*H*L*L*D/2), forward and twice that backward
    attention_flops = 3 * 2 * 2 * B * HEADS * L * L * HEAD_SIZE / 2
    record = {"batch": B, "length": L, "heads": HEADS, "kv_heads": KV_HEADS, "head_size": HEAD_SIZE,
              "attention_useful_flops": attention_flops, "attention": {}, "loss": {}}
    for name, attention in chosen(attention_variants(False, L), args.only).items():
        try:
            record["attention"][name] = timed(value_and_grads(attention), inputs, args.repeats)
            record["attention"][name]["useful_tflops"] = attention_flops / record["attention"][name]["median_seconds"] / 1e12
        except Exception as error:  # a kernel that does not lower here is a finding, not a stop
            record["attention"][name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        print(name, {k: v for k, v in record["attention"][name].items() if k != "seconds"}, flush=True)
    keys = jax.random.split(jax.random.key(1), 3)
    hidden = jax.random.normal(keys[0], (B, L, D_MODEL), jnp.bfloat16)
    head = (jax.random.normal(keys[1], (VOCAB, D_MODEL), jnp.float32) * 0.02).astype(jnp.bfloat16)
    targets = jax.random.randint(keys[2], (B, L), 0, VOCAB)
    mask = segment_ids(B, L).astype(jnp.float32)
    loss_flops = 3 * 2 * B * L * D_MODEL * VOCAB  # the head's product forward, and its two gradients
    record["loss_useful_flops"] = loss_flops
    for name, loss in chosen(loss_variants(), args.only).items():
        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        try:
            record["loss"][name] = timed(grad, (hidden, head, targets, mask), args.repeats)
            record["loss"][name]["useful_tflops"] = loss_flops / record["loss"][name]["median_seconds"] / 1e12
        except Exception as error:
            record["loss"][name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        print(name, {k: v for k, v in record["loss"][name].items() if k != "seconds"}, flush=True)
    return record


def check(only: list[str] | None = None, length: int = 256) -> dict:
    """At small shapes, each variant's output and gradients against `kit` (float32 inputs, the
    Pallas kernels interpreted): the largest relative distance per variant. The cotangent is 0 on
    padded queries, so the value and the gradients read real queries' outputs only."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    with jax.default_matmul_precision("highest"):
        inputs = attention_inputs(2, length, jnp.float32)
        results = {}
        for name, attention in chosen(attention_variants(True, length), only, keep="kit").items():
            value, grads = value_and_grads(attention)(*inputs)
            results[name] = (np.asarray(value), [np.asarray(g) for g in grads])
    reference = results["kit"]
    distance = {}
    for name, (value, grads) in results.items():
        parts = [abs(value - reference[0]) / abs(reference[0])]
        parts += [float(np.max(np.abs(g - r)) / np.max(np.abs(r))) for g, r in zip(grads, reference[1])]
        distance[name] = max(float(p) for p in parts)
    return distance


def jax_version() -> str:
    import jax

    return jax.__version__


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, help="default 1024; 256 with --check")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--only", type=lambda text: text.split(","), help="comma-separated variant names")
    args = parser.parse_args(argv)
    if args.check:
        record = {"script": "results/tpu_v5e_training/attention_bench.py --check", "jax": jax_version(),
                  "length": args.length or 256,
                  "relative_distance_to_kit": check(args.only, args.length or 256)}
        print(json.dumps(record, indent=1))
        if args.out:
            args.out.write_text(json.dumps(record, indent=1) + "\n")
        return 0
    import jax

    record = {"script": "results/tpu_v5e_training/attention_bench.py", "argv": sys.argv[1:] if argv is None else argv,
              "device": jax.devices()[0].device_kind, "jax": jax.__version__, **bench(args)}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
