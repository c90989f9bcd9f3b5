"""The kv_cache group: greedy decoding with the KV cache against rerunning the whole sequence
for every token."""

from __future__ import annotations

from tunix_nb.bench.common import interleaved_times, medians, spread_of_ratio, timed_figure

FIGURES = {"kv_cache_decode_speedup": (None, None)}


def measure(*, quick: bool, repeats: int) -> dict:
    return bench_kv_cache(repeats, quick=quick)


def bench_kv_cache(repeats, quick=False, batch_size=64):
    """Greedy decoding with the KV cache (sampler.generate) against rerunning the whole
    sequence for every token (model.greedy_generate): same model, prompts and tokens.

    The model is the student, the policy GRPO samples from; the figure is at the kit's
    answer length (data.MAX_NEW_TOKENS), the curve shows how the gap grows with length.
    """
    import jax
    import numpy as np

    from tunix_nb import data, model, sampler
    from tunix_nb.tokenizer import ByteTokenizer

    graphdef, params = model.split(model.make_model("student", seed=0))
    prompts = data.prompt_arrays([e["prompt"] for e in data.load_sft()[:batch_size]], ByteTokenizer(),
                                 data.DEFAULT_PROMPT_LEN)
    tokens_BxP, mask_BxP = prompts["tokens"], prompts["attention_mask"]
    key = jax.random.key(0)
    curve = {}
    for new in (data.MAX_NEW_TOKENS, 32) if quick else (data.MAX_NEW_TOKENS, 32, 128):
        # eos -1: every row decodes all `new` tokens, so both do the same work
        recompute = lambda: model.greedy_generate(graphdef, params, tokens_BxP, mask_BxP, max_new_tokens=new,
                                                  eos_id=-1)
        cached = lambda: sampler.generate(graphdef, params, tokens_BxP, mask_BxP, key, max_new_tokens=new,
                                          temperature=0, eos_id=-1).tokens
        check_greedy(graphdef, params, tokens_BxP, mask_BxP, recompute, cached, new)
        times = interleaved_times({"recompute": recompute, "cached": cached}, repeats=repeats)
        t, speedup = medians(times), spread_of_ratio(times, "recompute", "cached")
        curve[new] = {"cached_tokens_per_second": batch_size * new / t["cached"],
                      "recompute_tokens_per_second": batch_size * new / t["recompute"],
                      "cached_seconds": t["cached"], "recompute_seconds": t["recompute"],
                      "speedup": speedup["median"], "speedup_spread": speedup}
    at = data.MAX_NEW_TOKENS
    return timed_figure(FIGURES, "kv_cache_decode_speedup", curve[at]["speedup_spread"], new_tokens=at,
                        batch_size=batch_size, prompt_len=data.DEFAULT_PROMPT_LEN, model="student",
                        params=model.count_params(params), repeats=repeats, curve=curve, greedy_checked=True,
                        note="greedy decoding, tokens per second with the KV cache / recomputing the sequence")


def check_greedy(graphdef, params, tokens_BxP, mask_BxP, recompute, cached, new):
    """Both decoders' tokens are greedy choices of one full forward pass over the prompt and
    those tokens, to float32 rounding (`compare.greedy_slack`), in float32 at full matmul
    precision on every backend. Equal tokens are not guaranteed: where two logits tie to
    within rounding, either is right and the sequences may part."""
    import jax.numpy as jnp

    from tunix_nb import compare, model

    cfg = model.get_config("student")
    with compare.agreement_precision():
        for name, decode in (("recomputing", recompute), ("cached", cached)):
            new_BxG = jnp.asarray(decode())
            full_BxT = jnp.concatenate([tokens_BxP, new_BxG], axis=1)
            mask_BxT = jnp.concatenate([mask_BxP, jnp.ones_like(new_BxG, dtype=mask_BxP.dtype)], axis=1)
            P = tokens_BxP.shape[1]
            logits_BxGxV = model.apply(graphdef, params, full_BxT, mask_BxT)[:, P - 1:-1]
            terms = compare.forward_pass_terms(cfg, full_BxT.shape[1])
            # two forward passes, each within the bound of the exact logits
            bound = 2 * compare.float32_bound(terms, transcendentals=compare.forward_pass_transcendentals(cfg)) \
                * float(jnp.abs(logits_BxGxV).max())
            slack = compare.greedy_slack(logits_BxGxV, new_BxG)
            if slack > bound:
                raise RuntimeError(f"the {name} decoder's tokens are not greedy choices at {new} new tokens: a "
                                   f"chosen logit falls {slack:.2e} below the largest, over the bound {bound:.2e}")
