"""Exports for transformers and PEFT: merged checkpoints, adapter folders, and what reads them.

tests/fixtures/hf_export/make_fixtures.py (the only place with torch, transformers and
PEFT) loaded the exports that tests/fixtures/hf_export/kit_exports.py builds and recorded
their logits and file hashes. Here the kit rebuilds the same exports, byte for byte, and
its own logits are held to transformers' and PEFT's within float32's bound.
"""

import contextlib
import importlib.util
import io
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from tunix_nb import compare, generate, hf, lora, model, peft_adapter
from tunix_nb.tokenizer import HFTokenizer

HERE = Path(__file__).parent / "fixtures" / "hf_export"
_spec = importlib.util.spec_from_file_location("kit_exports", HERE / "kit_exports.py")
kit_exports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kit_exports)
RECORD = json.loads((HERE / "reference.json").read_text())
BASES = tuple(kit_exports.EXPORTS)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    return kit_exports.build(tmp_path_factory.mktemp("exports"))


@pytest.fixture(scope="module")
def adapted():
    return {name: kit_exports.adapted(name) for name in BASES}


def batch(name):
    return load_file(kit_exports.FIXTURES / name / "reference.safetensors")


def theirs(name, kind):
    """Logits transformers (merged) or PEFT (adapter on the base) computed: [2, 12, V]."""
    return load_file(HERE / "reference.safetensors")[f"{name}/{kind}_logits"]


def max_diff_on_real_tokens(logits, name, kind):
    real = batch(name)["attention_mask"].astype(bool)
    return float(np.abs(np.asarray(logits) - theirs(name, kind))[real].max())


def tolerance(name, config) -> float:
    """float32's bound for two forward passes of one model (as tests/test_hf.py), with the
    adapters' rank-4 sums added to the terms (as lesson 10 bounds its merge)."""
    terms = compare.forward_pass_terms(config, batch(name)["input_ids"].shape[1]) + kit_exports.RANK
    return compare.float32_bound(terms) * float(np.abs(theirs(name, "merged")).max())


def apply(graphdef, params, name):
    b = batch(name)
    return model.apply(graphdef, params, jnp.asarray(b["input_ids"]), jnp.asarray(b["attention_mask"]))


# ----------------------------------------------------------------- what transformers and PEFT compute


def test_the_exports_are_the_bytes_transformers_and_peft_read(exports):
    """The kit rebuilds exactly the files make_fixtures.py handed to transformers and PEFT."""
    for name in BASES:
        for folder, hashes in RECORD["bases"][name]["file_sha256"].items():
            assert kit_exports.file_hashes(exports[folder]) == hashes, f"{folder}: rerun make_fixtures.py"


@pytest.mark.parametrize("name", BASES)
def test_transformers_and_peft_compute_the_kits_logits(exports, adapted, name):
    graphdef, _, config, lora_graphdef, adapters, base = adapted[name]
    merged_graphdef, merged = lora.merge(lora_graphdef, adapters, base, alpha=kit_exports.ALPHA)
    bound = tolerance(name, config)
    kit_merged = apply(merged_graphdef, merged, name)
    kit_adapted = apply(lora_graphdef, lora.combine(adapters, base), name)
    assert max_diff_on_real_tokens(kit_merged, name, "merged") < bound
    assert max_diff_on_real_tokens(kit_merged, name, "merged_4x") < bound  # 4.x's RoPE fields alone
    assert max_diff_on_real_tokens(kit_adapted, name, "peft") < bound
    assert RECORD["bases"][name]["max_abs_diff_peft_vs_merged"] < bound
    # the known-wrong versions fail by far: the base alone, and a scale of 1 instead of alpha / r
    assert RECORD["bases"][name]["max_abs_diff_merged_vs_base"] > 100 * bound
    wrong_graphdef, wrong = lora.merge(lora_graphdef, adapters, base, alpha=float(kit_exports.RANK))
    assert max_diff_on_real_tokens(apply(wrong_graphdef, wrong, name), name, "peft") > 100 * bound


def test_the_kit_reloads_its_own_export_bit_for_bit(exports, adapted):
    for name in BASES:
        _, _, config, lora_graphdef, adapters, base = adapted[name]
        merged_graphdef, merged = lora.merge(lora_graphdef, adapters, base, alpha=kit_exports.ALPHA)
        graphdef2, reloaded, config2 = hf.load_pretrained(exports[f"{name}_merged"])
        assert config2 == config and graphdef2 == merged_graphdef
        assert compare.bitwise_equal(reloaded, merged)


# ----------------------------------------------------------------- the merged folder


@pytest.mark.parametrize("name", BASES)
def test_the_source_configs_fields_are_kept(exports, name):
    source = hf.read_config(kit_exports.FIXTURES / name)
    written = hf.read_config(exports[f"{name}_merged"])
    for key, value in source.items():
        if key not in hf.NOT_KEPT:
            assert written[key] == value, key
    assert written["max_position_embeddings"] == source["max_position_embeddings"] != 2048
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (None, 319, 317)
    assert "transformers_version" not in written  # the kit wrote it, not transformers


def test_rope_is_written_in_both_config_forms(exports):
    llama = hf.read_config(exports["llama_merged"])
    scaling = {k: v for k, v in llama["rope_parameters"].items() if k != "rope_theta"}
    assert llama["rope_scaling"] == scaling and scaling["rope_type"] == "llama3"
    assert llama["rope_theta"] == llama["rope_parameters"]["rope_theta"] == 500000.0
    qwen3 = hf.read_config(exports["qwen3_merged"])
    assert qwen3["rope_scaling"] is None and qwen3["rope_theta"] == 1e6
    assert qwen3["dtype"] == qwen3["torch_dtype"] == "float32"
    for written in (llama, qwen3):  # the kit reads either form alone to the same model
        legacy = {k: v for k, v in written.items() if k != "rope_parameters"}
        modern = {k: v for k, v in written.items() if k not in ("rope_theta", "rope_scaling")}
        assert hf.model_config(legacy) == hf.model_config(modern) == hf.model_config(written)


@pytest.mark.parametrize("name", BASES)
def test_tokenizer_files_are_copied_and_render_as_transformers_does(exports, name):
    source, out = kit_exports.FIXTURES / name, exports[f"{name}_merged"]
    present = [f for f in hf.TOKENIZER_FILES if (source / f).is_file()]
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(present)
    for file in present:
        assert (out / file).read_bytes() == (source / file).read_bytes(), file
    rendered = HFTokenizer.from_dir(out).apply_chat_template([{"role": "user", "content": "add 2 3"}],
                                                              add_generation_prompt=True)
    assert HFTokenizer.from_dir(out).encode(rendered) == RECORD["bases"][name]["chat_template_ids"]


def test_the_shard_index_is_transformers_format(exports):
    out = exports["llama_merged"]
    index = json.loads((out / hf.INDEX_FILE).read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert [f.name for f in shards] == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                        for i in range(1, len(shards) + 1)] and len(shards) > 1
    assert not (out / hf.SINGLE_FILE).exists()
    total_bytes, total_params, mapped = 0, 0, {}
    for file in shards:
        with safe_open(file, "np") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        mapped.update({k: file.name for k in tensors})
        shard_bytes = sum(t.nbytes for t in tensors.values())
        assert shard_bytes <= hf.size_in_bytes("40KB") or len(tensors) == 1  # a bigger tensor sits alone
        total_bytes += shard_bytes
        total_params += sum(t.size for t in tensors.values())
    assert index["weight_map"] == mapped
    assert index["metadata"] == {"total_size": total_bytes, "total_parameters": total_params}


def test_dtype_and_a_resave_into_the_same_folder(adapted, tmp_path):
    graphdef, params, config, *_ = adapted["qwen3"]
    out = hf.save_pretrained(tmp_path, graphdef, params, config, max_shard_size="40KB")
    assert (out / hf.INDEX_FILE).is_file()
    hf.save_pretrained(tmp_path, graphdef, params, config, dtype="bfloat16")  # one file now: old shards go
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "model.safetensors"]
    assert hf.read_config(out)["dtype"] == "bfloat16"
    _, reloaded, _ = hf.load_pretrained(out)
    cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    assert compare.bitwise_equal(reloaded, cast)


def test_save_merged_writes_the_bases_dtype_by_default(adapted, tmp_path):
    _, params, _, lora_graphdef, adapters, base = adapted["qwen3"]
    bf16_base = jax.tree.map(lambda x: x.astype(jnp.bfloat16), base)
    out = hf.save_merged(tmp_path, lora_graphdef, adapters, bf16_base, alpha=kit_exports.ALPHA)
    with safe_open(out / hf.SINGLE_FILE, "np") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"BF16"}
    assert hf.read_config(out)["dtype"] == "bfloat16"


def test_a_qlora_model_exports_merged_on_its_dequantised_base(adapted, tmp_path):
    graphdef, params, config, *_ = adapted["qwen3"]
    lora_graphdef, adapters, base = lora.apply(graphdef, params, rank=4, alpha=8.0, quantize="nf4", tile_size=16)
    adapters = kit_exports.dyadic(adapters, seed=1)
    out = hf.save_merged(tmp_path, lora_graphdef, adapters, base, alpha=8.0, source=kit_exports.FIXTURES / "qwen3")
    merged_graphdef, merged = lora.merge(lora_graphdef, adapters, base, alpha=8.0)
    _, reloaded, _ = hf.load_pretrained(out)
    assert compare.bitwise_equal(reloaded, merged)
    qlora = apply(lora_graphdef, lora.combine(adapters, base), "qwen3")
    real = batch("qwen3")["attention_mask"].astype(bool)
    assert np.abs(np.asarray(qlora - apply(merged_graphdef, reloaded, "qwen3")))[real].max() < tolerance("qwen3", config)
    # the dequantised base is not the float32 one: nf4's error shows in the logits
    assert max_diff_on_real_tokens(apply(merged_graphdef, reloaded, "qwen3"), "qwen3", "merged") > 0.01


def test_export_errors_name_the_problem(adapted, tmp_path):
    graphdef, params, config, *_ = adapted["qwen3"]
    with pytest.raises(hf.CheckpointError,
                       match=r"describes another model: architectures is \[.LlamaForCausalLM.\] there"):
        hf.save_pretrained(tmp_path / "a", graphdef, params, config, source=kit_exports.FIXTURES / "llama")
    with pytest.raises(hf.CheckpointError, match="is the source checkpoint itself"):
        hf.save_pretrained(kit_exports.FIXTURES / "qwen3", graphdef, params, config,
                           source=kit_exports.FIXTURES / "qwen3")
    with pytest.raises(hf.CheckpointError, match=r"max_shard_size='5 parsecs'"):
        hf.save_pretrained(tmp_path / "b", graphdef, params, config, max_shard_size="5 parsecs")
    with pytest.raises(hf.CheckpointError, match=r"dtype='int8'; choose one of"):
        hf.save_pretrained(tmp_path / "c", graphdef, params, config, dtype="int8")
    with pytest.raises(hf.CheckpointError, match=r"dtype='float64'; choose one of \('float32', 'bfloat16'\)"):
        hf.load_pretrained(kit_exports.FIXTURES / "qwen3", dtype="float64")
    assert not any((tmp_path / d).exists() for d in "abc")


# ----------------------------------------------------------------- the PEFT adapter folder


@pytest.mark.parametrize("name", BASES)
def test_adapter_names_shapes_and_config_are_pefts_own(exports, name):
    peft_own = RECORD["bases"][name]["peft_writes"]
    out = exports[f"{name}_adapter"]
    with safe_open(out / peft_adapter.WEIGHTS_FILE, "np") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes == peft_own["tensor_shapes"]
    written = json.loads((out / peft_adapter.CONFIG_FILE).read_text())
    assert {k: peft_own["adapter_config"].get(k) for k in written} == written
    assert written["lora_alpha"] / written["r"] == kit_exports.ALPHA / kit_exports.RANK  # PEFT's scale = the kit's


def test_target_modules_are_short_names_only_when_every_layer_is_adapted(exports):
    read = lambda name: json.loads((exports[f"{name}_adapter"] / peft_adapter.CONFIG_FILE).read_text())  # noqa: E731
    assert read("qwen3")["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                               "v_proj"]
    assert read("llama")["target_modules"] == ["model.layers.1.mlp.down_proj", "model.layers.1.self_attn.q_proj"]


@pytest.mark.parametrize("name", BASES)
def test_an_adapter_loads_back_into_the_kit(exports, adapted, name):
    graphdef, params, _, lora_graphdef, adapters, base = adapted[name]
    lora_graphdef2, adapters2, base2, alpha = peft_adapter.load_adapter(exports[f"{name}_adapter"], graphdef, params)
    assert alpha == kit_exports.ALPHA and compare.bitwise_equal(adapters2, adapters)
    assert compare.bitwise_equal(base2, base)
    assert np.array_equal(apply(lora_graphdef2, lora.combine(adapters2, base2), name),
                          apply(lora_graphdef, lora.combine(adapters, base), name))


def copy_adapter(exports, tmp_path, name="qwen3") -> Path:
    return Path(shutil.copytree(exports[f"{name}_adapter"], tmp_path / f"{name}_adapter"))


def edit_adapter_config(directory: Path, **changes):
    path = directory / peft_adapter.CONFIG_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("change, message", [
    ({"peft_type": "IA3"}, "peft_type is 'IA3'"),
    ({"use_dora": True}, "use_dora=True has no counterpart"),
    ({"bias": "all"}, "bias='all' has no counterpart"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save="),
])
def test_adapter_configs_the_kit_cannot_represent_are_refused(exports, adapted, tmp_path, change, message):
    graphdef, params, *_ = adapted["qwen3"]
    directory = copy_adapter(exports, tmp_path)
    edit_adapter_config(directory, **change)
    with pytest.raises(peft_adapter.AdapterError, match=message):
        peft_adapter.load_adapter(directory, graphdef, params)


def test_adapter_files_that_do_not_fit_are_named(exports, adapted, tmp_path):
    qwen3, llama = adapted["qwen3"][:2], adapted["llama"][:2]
    with pytest.raises(peft_adapter.AdapterError, match="adapter_config.json does not exist"):
        peft_adapter.load_adapter(tmp_path, *qwen3)
    with pytest.raises(peft_adapter.AdapterError, match=r"layers\.0\.self_attn\.k_proj\.lora_B\.weight has shape "
                                                         r"\(32, 4\), but the base model and r imply \(16, 4\)"):
        peft_adapter.load_adapter(copy_adapter(exports, tmp_path), *llama)  # k's outputs: qwen3 2 x 16, llama 2 x 8
    directory = copy_adapter(exports, tmp_path, "llama")
    edit_adapter_config(directory, r=2)
    with pytest.raises(peft_adapter.AdapterError, match="has shape"):
        peft_adapter.load_adapter(directory, *llama)
    (directory / peft_adapter.WEIGHTS_FILE).unlink()
    with pytest.raises(peft_adapter.AdapterError, match="adapter_model.safetensors does not exist"):
        peft_adapter.load_adapter(directory, *llama)


def test_rslora_scale_is_converted_to_the_kits_alpha():
    plain = {"r": 16, "lora_alpha": 32}
    assert peft_adapter.kit_alpha(plain) / 16 == 32 / 16
    assert peft_adapter.kit_alpha({**plain, "use_rslora": True}) / 16 == pytest.approx(32 / 4)


def test_save_adapter_refuses_what_peft_cannot_hold(adapted, tmp_path):
    graphdef, params, config, _, adapters, _ = adapted["qwen3"]
    with pytest.raises(peft_adapter.AdapterError, match="alpha must be positive"):
        peft_adapter.save_adapter(tmp_path, adapters, config, alpha=0.0, base_model_name_or_path="b")
    with pytest.raises(peft_adapter.AdapterError, match="is not a LoRA factor"):
        peft_adapter.save_adapter(tmp_path, params, config, alpha=8.0, base_model_name_or_path="b")
    assert not (tmp_path / peft_adapter.WEIGHTS_FILE).exists()


# ----------------------------------------------------------------- source_fingerprint and resolve


def test_source_fingerprint_follows_the_content_not_the_path(tmp_path):
    one = Path(shutil.copytree(kit_exports.FIXTURES / "qwen3", tmp_path / "one"))
    two = Path(shutil.copytree(kit_exports.FIXTURES / "qwen3", tmp_path / "elsewhere" / "two"))
    original = hf.source_fingerprint(kit_exports.FIXTURES / "qwen3")
    assert hf.source_fingerprint(one) == hf.source_fingerprint(two) == original
    assert hf.source_fingerprint(one).startswith("sha256:") and len(hf.source_fingerprint(one)) == 7 + 64
    (two / "tokenizer.json").write_text("{}")  # not part of the model
    assert hf.source_fingerprint(two) == hf.source_fingerprint(one)
    weights = bytearray((two / hf.SINGLE_FILE).read_bytes())
    weights[-1] ^= 1  # one bit of the last weight
    (two / hf.SINGLE_FILE).write_bytes(bytes(weights))
    assert hf.source_fingerprint(two) != hf.source_fingerprint(one)
    config = (one / hf.CONFIG_FILE).read_text()
    (one / hf.CONFIG_FILE).write_text(config.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    assert hf.source_fingerprint(one) != original
    sharded = hf.source_fingerprint(kit_exports.FIXTURES / "llama")
    assert sharded not in (hf.source_fingerprint(one), hf.source_fingerprint(two))
    with pytest.raises(hf.CheckpointError, match="is not a directory"):
        hf.source_fingerprint(tmp_path / "missing")
    with pytest.raises(hf.CheckpointError, match="config.json"):
        hf.source_fingerprint(tmp_path / "elsewhere")


def test_a_revision_is_for_hub_ids(tmp_path):
    with pytest.raises(hf.CheckpointError, match="revision='abc123' pins a Hub commit, but .* is a local directory"):
        hf.load_pretrained(kit_exports.FIXTURES / "qwen3", revision="abc123")


def test_offline_hub_ids_say_to_go_online_or_pass_a_folder(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(hf.CheckpointError, match=r"Could not download 'someone/no-such-model' at revision 'v1'.*"
                                                 r"run online once .*HF_TOKEN.*pass a local checkpoint directory"):
        hf.resolve("someone/no-such-model", revision="v1")


def hub_cache_holding(cache: Path, repo_id: str, folder: Path, commit: str = "0" * 40) -> Path:
    """A Hugging Face Hub cache in which `repo_id` at `main` is `folder`'s files, in the layout
    huggingface_hub writes (refs/main names the commit; snapshots/<commit>/ holds the files)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(folder, repo / "snapshots" / commit)
    return repo / "snapshots" / commit


def test_a_hub_id_resolves_through_the_hub_cache_and_trains(monkeypatch, tmp_path):
    """The online path without a network: a Hub id (and a pinned commit) found in the Hub cache
    is what `--model` loads, with the same fingerprint as the folder it holds."""
    from huggingface_hub import constants

    from tunix_nb import cli

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = hub_cache_holding(tmp_path / "hub", "someone/tiny-qwen3", kit_exports.FIXTURES / "qwen3")
    assert hf.resolve("someone/tiny-qwen3") == snapshot
    assert hf.resolve("someone/tiny-qwen3", revision="0" * 40) == snapshot
    assert hf.source_fingerprint(snapshot) == hf.source_fingerprint(kit_exports.FIXTURES / "qwen3")
    with pytest.raises(hf.CheckpointError, match="at revision 'v2'"):
        hf.resolve("someone/tiny-qwen3", revision="v2")
    metrics = tmp_path / "m.jsonl"
    assert cli.main(["sft", "--model", "someone/tiny-qwen3", "--steps", "1", "--batch-size", "4",
                     "--metrics-file", str(metrics)]) == 0
    assert np.isfinite(json.loads(metrics.read_text().splitlines()[0])["loss"])


@pytest.mark.parametrize("error, message", [
    ("GatedRepoError", "gated model: accept its licence .* set HF_TOKEN"),
    ("RepositoryNotFoundError", "No such repository, or a private/gated one .* set HF_TOKEN"),
    ("RevisionNotFoundError", "revision does not exist there"),
])
def test_hub_refusals_say_what_to_do(monkeypatch, error, message):
    import httpx
    import huggingface_hub
    from huggingface_hub import errors

    response = httpx.Response(401, request=httpx.Request("GET", "https://huggingface.co/api/models/x/y"))

    def refuse(*args, **kwargs):
        raise getattr(errors, error)("refused", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(hf.CheckpointError, match=f"Could not download 'meta-llama/x' .*{error}.*{message}"):
        hf.resolve("meta-llama/x")


# ----------------------------------------------------------------- generate


def run_generate(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = generate.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_generate_prints_the_greedy_completion_of_the_chat_prompt(exports, adapted):
    folder = exports["qwen3_merged"]
    code, printed, _ = run_generate("--model", str(folder), "--prompt", "add 2 3", "--max-new-tokens", "6")
    assert code == 0
    tokenizer = generate.load_tokenizer(folder, 320)
    ids = generate.prompt_ids(tokenizer, "add 2 3")
    assert ids == RECORD["bases"]["qwen3"]["chat_template_ids"]  # transformers' apply_chat_template
    graphdef, params, _ = hf.load_pretrained(folder)
    prompt = jnp.asarray([ids], jnp.int32)
    greedy = model.greedy_generate(graphdef, params, prompt, jnp.ones_like(prompt), max_new_tokens=6,
                                   eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)  # no KV cache: another path
    new = [int(t) for t in np.asarray(greedy)[0]]
    new = new[: new.index(tokenizer.eos_id)] if tokenizer.eos_id in new else new
    assert new, "the completion is not empty, so the comparison says something"
    assert printed == tokenizer.decode(new) + "\n"


def test_generate_samples_by_seed_and_reads_chat_template_jinja(exports, tmp_path):
    folder = Path(shutil.copytree(exports["qwen3_merged"], tmp_path / "jinja"))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    (folder / "chat_template.jinja").write_text(config.pop("chat_template"))  # as transformers 5 saves it
    config_path.write_text(json.dumps(config))
    tokenizer = generate.load_tokenizer(folder, 320)
    assert generate.prompt_ids(tokenizer, "add 2 3") == RECORD["bases"]["qwen3"]["chat_template_ids"]
    args = ("--model", str(folder), "--prompt", "add 2 3", "--max-new-tokens", "8", "--temperature", "1.5")
    runs = [run_generate(*args, "--seed", seed)[1] for seed in ("1", "1", "2")]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    (folder / "chat_template.jinja").unlink()  # no template: the raw text (this tokenizer has no bos)
    assert generate.prompt_ids(generate.load_tokenizer(folder, 320), "add 2 3") == tokenizer.encode("add 2 3")


def test_generate_errors_name_the_folder(exports, tmp_path):
    code, _, err = run_generate("--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert code == 2 and "nope: no such folder" in err
    folder = Path(shutil.copytree(exports["qwen3_merged"], tmp_path / "no_tokenizer"))
    (folder / "tokenizer.json").unlink()
    code, _, err = run_generate("--model", str(folder), "--prompt", "hi")
    assert code == 2 and "has no tokenizer.json and its vocabulary (320)" in err


def merge_error_over_bound(merged_dir, adapter_dir, source_dir, *, scale: float, rank: int) -> float:
    """The largest |written - W - scale B A| over its bound, across every adapted weight of a
    merged export, by PEFT's formula in float64 on the files alone. W is the source's weight
    in the export's dtype (the base the command held); the bound is half a unit in the
    export dtype's last place plus float32's rounding of the rank-r sum."""
    from safetensors.flax import load_file as load_arrays  # bfloat16 too

    written, pieces = load_arrays(merged_dir / hf.SINGLE_FILE), load_arrays(adapter_dir / "adapter_model.safetensors")
    source = load_arrays(source_dir / hf.SINGLE_FILE)
    worst = 0.0
    for key, a in pieces.items():
        if ".lora_A." not in key:
            continue
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        dtype = written[name].dtype
        w = np.asarray(source[name].astype(dtype), np.float64)
        b = np.asarray(pieces[key.replace(".lora_A.", ".lora_B.")], np.float64)
        a = np.asarray(a, np.float64)
        exact = w + scale * (b @ a)
        bound = (float(jnp.finfo(dtype).eps) / 2 * np.abs(exact)
                 + compare.float32_bound(rank + 2) * (np.abs(w) + scale * (np.abs(b) @ np.abs(a))))
        worst = max(worst, float((np.abs(np.asarray(written[name], np.float64) - exact) / bound).max()))
    return worst


def test_a_bfloat16_merged_export_is_pefts_merge_rounded_to_bfloat16(adapted, tmp_path):
    """On a TPU the command holds the base in bfloat16 and writes the merged export in it
    (lesson 12's float32 logit check of the export failed there): each adapted weight must
    be W + (alpha / r) B A of the bfloat16 base, rounded to bfloat16, and a wrong scale must
    show. Adapters drawn from a normal, not dyadic: the rounding really happens."""
    _, _, config, lora_graphdef, adapters, base = adapted["qwen3"]
    rng = np.random.default_rng(3)
    adapters = jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, 0.3, x.shape), jnp.float32), adapters)
    bf16_base = jax.tree.map(lambda x: x.astype(jnp.bfloat16), base)
    merged_dir = hf.save_merged(tmp_path / "merged", lora_graphdef, adapters, bf16_base, alpha=kit_exports.ALPHA)
    adapter_dir = peft_adapter.save_adapter(tmp_path / "adapter", adapters, config, alpha=kit_exports.ALPHA,
                                            base_model_name_or_path="qwen3")
    source, scale = kit_exports.FIXTURES / "qwen3", kit_exports.ALPHA / kit_exports.RANK
    ratio = merge_error_over_bound(merged_dir, adapter_dir, source, scale=scale, rank=kit_exports.RANK)
    assert 0.1 < ratio <= 1.0  # within the bound, and bfloat16's rounding is a visible part of it
    assert merge_error_over_bound(merged_dir, adapter_dir, source, scale=1.01 * scale, rank=kit_exports.RANK) > 1.0
