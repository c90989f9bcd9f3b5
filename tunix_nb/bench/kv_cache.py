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
        if not np.array_equal(recompute(), cached()):
            raise RuntimeError(f"the cached and recomputing decoders disagree at {new} new tokens")
        times = interleaved_times({"recompute": recompute, "cached": cached}, repeats=repeats)
        t, speedup = medians(times), spread_of_ratio(times, "recompute", "cached")
        curve[new] = {"cached_tokens_per_second": batch_size * new / t["cached"],
                      "recompute_tokens_per_second": batch_size * new / t["recompute"],
                      "cached_seconds": t["cached"], "recompute_seconds": t["recompute"],
                      "speedup": speedup["median"], "speedup_spread": speedup}
    at = data.MAX_NEW_TOKENS
    return timed_figure(FIGURES, "kv_cache_decode_speedup", curve[at]["speedup_spread"], new_tokens=at,
                        batch_size=batch_size, prompt_len=data.DEFAULT_PROMPT_LEN, model="student",
                        params=model.count_params(params), repeats=repeats, curve=curve, same_tokens=True,
                        note="greedy decoding, tokens per second with the KV cache / recomputing the sequence")
