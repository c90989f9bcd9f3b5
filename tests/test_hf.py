"""Hugging Face checkpoints: the kit's model against transformers' logits, both ways.

The fixtures in tests/fixtures/hf/ are tiny random Llama, Qwen2 and Qwen3 checkpoints
written by transformers, with the logits transformers computed on fixed tokens
(tests/fixtures/hf/make_fixtures.py; torch and transformers are needed only there).
"""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from tunix_nb import compare, data, hf, model, parallel, train
from tunix_nb import sft as sft_method
from tunix_nb.tokenizer import HFTokenizer, Tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
NAMES = ("llama", "llama_tied", "qwen2", "qwen3")


def tolerance(name, cfg) -> float:
    """float32's bound for two forward passes of one model (compare.forward_pass_terms: 560
    terms for these two-layer fixtures, 6.7e-5 of the logits' largest magnitude, about 3e-4).
    Measured: 2.7e-6 to 5.3e-6, depending on the processor; logits that ignore the left
    padding are 4 to 6 away."""
    ref = reference(name)
    terms = compare.forward_pass_terms(cfg, ref["input_ids"].shape[1])
    functions = compare.forward_pass_transcendentals(cfg)  # the backend's exp and sigmoid (precision policy)
    return compare.float32_bound(terms, transcendentals=functions) * float(np.abs(ref["logits"]).max())


def reference(name):
    return load_file(FIXTURES / name / "reference.safetensors")


def logits_of(graphdef, params, ref):
    with compare.agreement_precision():  # float32 matmuls at float32 precision on any backend
        return np.asarray(model.apply(graphdef, params, jnp.asarray(ref["input_ids"]), jnp.asarray(ref["attention_mask"])))


def max_diff_on_real_tokens(logits, ref):
    real = ref["attention_mask"].astype(bool)
    return float(np.abs(logits - ref["logits"])[real].max())


@pytest.fixture(scope="module")
def loaded():
    return {name: hf.load_pretrained(FIXTURES / name) for name in NAMES}


# ----------------------------------------------------------------- loading


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(loaded, name):
    graphdef, params, cfg = loaded[name]
    ref = reference(name)
    assert ref["attention_mask"][1, 0] == 0, "row 1 is left-padded: padding must not move positions"
    assert max_diff_on_real_tokens(logits_of(graphdef, params, ref), ref) < tolerance(name, cfg)
    # the known-wrong version, positions counted from the padding, fails the bound by far
    no_mask = np.asarray(model.apply(graphdef, params, jnp.asarray(ref["input_ids"])))
    assert max_diff_on_real_tokens(no_mask, ref) > 100 * tolerance(name, cfg)


def test_the_fixtures_cover_each_architecture_option(loaded):
    cfg = {name: loaded[name][2] for name in NAMES}
    assert not cfg["llama"].tie_embeddings and cfg["llama"].kv_heads < cfg["llama"].n_heads
    assert cfg["llama"].rope_scaling is not None
    assert cfg["llama_tied"].tie_embeddings and cfg["llama_tied"].kv_heads == cfg["llama_tied"].n_heads
    assert cfg["qwen2"].qkv_bias and cfg["qwen2"].kv_heads < cfg["qwen2"].n_heads
    assert cfg["qwen3"].qk_norm and cfg["qwen3"].head_size * cfg["qwen3"].n_heads != cfg["qwen3"].d_model
    assert (FIXTURES / "llama" / hf.INDEX_FILE).is_file(), "one fixture is sharded over several files"


def test_llama3_rope_scaling_changes_the_logits_and_is_applied(loaded):
    """Without the scaling the Llama fixture's logits move far past the tolerance."""
    graphdef, params, cfg = loaded["llama"]
    unscaled, _ = hf.abstract_model(model.get_config(cfg, rope_scaling=None))
    ref = reference("llama")
    assert max_diff_on_real_tokens(logits_of(unscaled, params, ref), ref) > 100 * tolerance("llama", cfg)


@pytest.mark.parametrize("name", NAMES)
def test_loading_reads_every_tensor_into_its_place(loaded, name):
    """Each kit parameter equals its checkpoint tensor (transposed for kernels)."""
    _, params, _ = loaded[name]
    files = hf.tensor_files(FIXTURES / name)
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        kit = hf.kit_name(path)
        with safe_open(files[hf.hf_name(kit)], "np") as f:
            stored = f.get_tensor(hf.hf_name(kit))
        np.testing.assert_array_equal(np.asarray(x), stored.T if hf.is_transposed(kit) else stored)


def test_dtype_casts_and_none_keeps_the_files_dtype():
    _, params, _ = hf.load_pretrained(FIXTURES / "qwen3", dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("bfloat16")}
    _, params, _ = hf.load_pretrained(FIXTURES / "qwen3")
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}


@pytest.mark.needs_devices(8)
def test_sharded_load_puts_each_slice_on_its_device_and_gives_the_same_logits(loaded):
    mesh = parallel.make_mesh()
    graphdef, params, _ = hf.load_pretrained(FIXTURES / "qwen3",
                                             sharding=lambda like: parallel.fsdp_shardings(like, mesh))
    want = parallel.fsdp_shardings(params, mesh)
    split = 0
    for x, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        assert x.sharding == sharding
        if not sharding.is_fully_replicated:
            split += 1
            assert {s.data.shape for s in x.addressable_shards} == {sharding.shard_shape(x.shape)}
    assert split > 0
    ref = reference("qwen3")
    same = compare.max_abs_diff(params, loaded["qwen3"][1])
    assert same == 0.0
    assert max_diff_on_real_tokens(logits_of(graphdef, params, ref), ref) < tolerance("qwen3", loaded["qwen3"][2])


def test_no_random_initialisation_runs(monkeypatch):
    """The structure comes from nnx.eval_shape: initialisers never run on real arrays."""
    calls = []
    real_init = jax.nn.initializers.lecun_normal

    def counting(*args, **kwargs):
        init = real_init(*args, **kwargs)
        return lambda key, shape, dtype=jnp.float32: calls.append(isinstance(key, jax.core.Tracer)) or init(key, shape, dtype)

    monkeypatch.setattr(jax.nn.initializers, "lecun_normal", counting)
    hf.load_pretrained(FIXTURES / "llama")
    assert all(calls)  # any initialiser call was traced under eval_shape, none computed


# ----------------------------------------------------------------- saving


@pytest.mark.parametrize("name", NAMES)
def test_save_then_load_gives_the_same_bits_names_and_config(loaded, name, tmp_path):
    graphdef, params, cfg = loaded[name]
    out = hf.save_pretrained(tmp_path / name, graphdef, params, cfg)
    g2, p2, cfg2 = hf.load_pretrained(out)
    assert cfg2 == cfg and g2 == graphdef
    assert compare.bitwise_equal(params, p2)
    with safe_open(out / hf.SINGLE_FILE, "np") as f:
        saved = set(f.keys())
    originals = set(hf.tensor_files(FIXTURES / name))
    assert saved == originals - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    assert not any(k.startswith("lm_head") for k in saved) or not cfg.tie_embeddings


def test_a_preset_model_saves_as_a_llama_checkpoint(tmp_path):
    """The kit's own models are tied Llamas: they export, and load back to the same logits."""
    graphdef, params = model.split(model.make_model("tiny", seed=3))
    out = hf.save_pretrained(tmp_path / "tiny", graphdef, params, model.get_config("tiny"))
    written = json.loads((out / hf.CONFIG_FILE).read_text())
    assert written["architectures"] == ["LlamaForCausalLM"] and written["tie_word_embeddings"] is True
    g2, p2, _ = hf.load_pretrained(out)
    tokens = jnp.asarray(np.arange(3, 19).reshape(2, 8), jnp.int32)
    assert np.array_equal(model.apply(graphdef, params, tokens), model.apply(g2, p2, tokens))


@pytest.mark.parametrize("name", NAMES)
def test_config_json_round_trips_through_the_kit_config(loaded, name):
    cfg = loaded[name][2]
    written = hf.hf_config_for(cfg, dtype="float32")
    assert hf.model_config(written) == cfg
    original = hf.read_config(FIXTURES / name)
    for key in ("architectures", "model_type", "hidden_size", "num_key_value_heads", "rope_parameters",
                "tie_word_embeddings", "rms_norm_eps"):
        assert written[key] == original[key], key


def test_save_pretrained_keeps_extra_config_keys(loaded, tmp_path):
    graphdef, params, cfg = loaded["qwen3"]
    extra = {k: hf.read_config(FIXTURES / "qwen3")[k] for k in ("eos_token_id", "pad_token_id", "max_position_embeddings")}
    out = hf.save_pretrained(tmp_path, graphdef, params, cfg, extra_config=extra)
    assert {k: json.loads((out / hf.CONFIG_FILE).read_text())[k] for k in extra} == extra


def test_transformers_read_the_kits_saves_to_the_same_logits(loaded):
    """Recorded by make_fixtures.py, which has transformers: every fixture saved by
    hf.save_pretrained, and the kit's trained student exported, then loaded by
    AutoModelForCausalLM. The record must be for the fixtures as they are now. The
    student is held to the smallest fixture bound (its own, deeper model's is larger)."""
    record = json.loads((FIXTURES / "transformers_reads_kit.json").read_text())
    assert set(record["fixtures"]) == set(NAMES) | {"sft_student"}
    bounds = {name: tolerance(name, loaded[name][2]) for name in NAMES}
    for name, entry in record["fixtures"].items():
        assert entry["max_abs_diff"] < bounds.get(name, min(bounds.values())), name
    for name in NAMES:
        digest = hf_digest(FIXTURES / name)
        assert record["fixtures"][name]["fixture_sha256"] == digest, f"{name}: rerun make_fixtures.py"


def hf_digest(directory: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for file in sorted(directory.glob("*.safetensors")):
        h.update(file.name.encode() + file.read_bytes())
    return h.hexdigest()


# ----------------------------------------------------------------- errors


def copy_fixture(name, tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def edit_config(directory: Path, **changes):
    config = hf.read_config(directory)
    config.update(changes)
    (directory / hf.CONFIG_FILE).write_text(json.dumps(config))


def rewrite_tensors(directory: Path, edit):
    tensors = load_file(directory / hf.SINGLE_FILE)
    edit(tensors)
    save_file(tensors, directory / hf.SINGLE_FILE, metadata={"format": "pt"})


def test_unknown_architecture_is_named(tmp_path):
    d = copy_fixture("qwen3", tmp_path)
    edit_config(d, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text")
    with pytest.raises(hf.CheckpointError, match=r"Unsupported architecture \['Gemma3ForCausalLM'\]"):
        hf.load_pretrained(d)


def test_a_missing_tensor_is_named(tmp_path):
    d = copy_fixture("qwen3", tmp_path)
    rewrite_tensors(d, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(hf.CheckpointError, match=r"lacks 1 tensor.*model\.layers\.1\.self_attn\.k_norm\.weight"):
        hf.load_pretrained(d)


def test_an_unexpected_tensor_is_named(tmp_path):
    d = copy_fixture("qwen3", tmp_path)
    rewrite_tensors(d, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros(32, np.float32)}))
    with pytest.raises(hf.CheckpointError, match=r"no place for.*model\.layers\.0\.self_attn\.o_proj\.bias"):
        hf.load_pretrained(d)


def test_a_tied_checkpoint_may_keep_an_lm_head_copy_and_rotary_buffers(tmp_path):
    d = copy_fixture("qwen3", tmp_path)
    rewrite_tensors(d, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"],
                                           "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}))
    hf.load_pretrained(d)


def test_a_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path):
    d = copy_fixture("qwen3", tmp_path)
    edit_config(d, intermediate_size=64)
    with pytest.raises(hf.CheckpointError, match=r"model\.layers\.0\.mlp\.down_proj\.weight has shape \(32, 48\) "
                                                 r"in the checkpoint, but config\.json implies \(32, 64\)"):
        hf.load_pretrained(d)


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"use_sliding_window": True}, "use_sliding_window=true"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "RoPE scaling 'yarn'"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_attention"),
])
def test_unsupported_options_are_refused_by_name(tmp_path, change, message):
    d = copy_fixture("qwen3", tmp_path)
    edit_config(d, **change)
    with pytest.raises(hf.CheckpointError, match=message):
        hf.load_pretrained(d)


def test_missing_files_say_what_a_checkpoint_directory_holds(tmp_path):
    with pytest.raises(hf.CheckpointError, match="config.json"):
        hf.load_pretrained(tmp_path)
    d = copy_fixture("qwen3", tmp_path)
    (d / hf.SINGLE_FILE).unlink()
    with pytest.raises(hf.CheckpointError, match="neither model.safetensors nor"):
        hf.load_pretrained(d)
    d = copy_fixture("llama", tmp_path)
    (d / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(hf.CheckpointError, match="model-00002-of-00004.safetensors, which does not exist"):
        hf.load_pretrained(d)
    with pytest.raises(hf.CheckpointError, match="neither a checkpoint directory nor a Hub id"):
        hf.load_pretrained(tmp_path / "no" / "such" / "dir")


def test_save_refuses_a_config_that_is_not_the_models(loaded, tmp_path):
    graphdef, params, cfg = loaded["qwen3"]
    with pytest.raises(hf.CheckpointError, match="graphdef does not match config"):
        hf.save_pretrained(tmp_path, graphdef, params, loaded["qwen2"][2])
    with pytest.raises(hf.CheckpointError, match="mix dtypes"):
        mixed = jax.tree_util.tree_map_with_path(
            lambda path, x: x.astype(jnp.bfloat16) if hf.kit_name(path) == "embed/embedding" else x, params)
        hf.save_pretrained(tmp_path, graphdef, mixed, cfg)
    with pytest.raises(hf.CheckpointError, match="no Hugging Face architecture"):
        hf.family_for(model.get_config("tiny", qkv_bias=True, qk_norm=True))
    assert not (tmp_path / hf.SINGLE_FILE).exists()


# ----------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return HFTokenizer.from_dir(FIXTURES / "qwen3")


def test_tokenizer_meets_the_protocol_and_matches_transformers(tokenizer):
    assert isinstance(tokenizer, Tokenizer)
    ref = json.loads((FIXTURES / "qwen3" / "reference.json").read_text())["tokenizer"]
    for text, ids in ref["encode_samples"].items():
        assert tokenizer.encode(text) == ids
        assert tokenizer.decode(ids) == text.replace("<|im_end|>", "")  # special tokens are skipped
    rendered = tokenizer.apply_chat_template(ref["chat_template_messages"], add_generation_prompt=True)
    assert rendered == ref["chat_template_rendered"]
    assert tokenizer.encode(rendered) == ref["chat_template_ids"]


def test_tokenizer_special_tokens_follow_the_config(tokenizer):
    vocab = tokenizer.tokenizer.get_vocab()
    assert tokenizer.eos_id == vocab["<|im_end|>"] and tokenizer.pad_id == vocab["<|endoftext|>"]
    assert tokenizer.bos_id == tokenizer.pad_id  # no bos token (as Qwen): rows start with <|endoftext|>
    assert tokenizer.decode([tokenizer.bos_id, *tokenizer.encode("add 2 3"), tokenizer.eos_id]) == "add 2 3"
    with pytest.raises(ValueError, match="token id 320 is out of range"):
        tokenizer.decode([320])
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        HFTokenizer.from_dir(FIXTURES)


# ----------------------------------------------------------------- training


def test_sft_steps_on_a_loaded_checkpoint_under_jit_and_fsdp_agree_and_learn(loaded, tokenizer):
    graphdef, params, _ = loaded["qwen3"]
    rows = data.sft_arrays(data.load_sft()[:64], tokenizer, seq_len=24)
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=3e-3, warmup_steps=1, total_steps=10))
    objective = sft_method.objective(graphdef, compute_dtype=None)
    batch_fn = lambda s: data.batch_at(rows, s, 16, seed=0)  # noqa: E731
    results = {}
    for mode in ("jit", "fsdp"):
        step = train.make_step(objective, opt, parallel_mode=mode)
        results[mode] = train.run(step, params, opt.init(params), batch_fn, steps=6, parallel_mode=mode,
                                  progress=False)
    losses = [h["loss"] for h in results["jit"][2]]
    assert losses[-1] < losses[0]
    assert compare.max_abs_diff(results["jit"][0], results["fsdp"][0]) < 1e-5
