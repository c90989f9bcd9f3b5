"""python -m tunix_nb.random_checkpoint: a Hugging Face folder with random weights from a real
model's config.json, which tunix_nb.hf loads and the training command trains (issue 47, item 5):
tests/test_measure_command.py trains the command on such a folder."""

import json

import jax
import numpy as np
import pytest

from tunix_nb import hf, mfu, random_checkpoint
from tunix_nb.tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("random") / "tiny"
    assert random_checkpoint.main(["--preset", "tiny", "--out", str(out)]) == 0
    return out


def named(params) -> dict:
    return {hf.kit_name(p): np.asarray(x, np.float32) for p, x in jax.tree_util.tree_leaves_with_path(params)}


def test_the_folder_loads_with_the_config_s_shapes_and_seeded_weights(tiny_folder):
    graphdef, params, config = hf.load_pretrained(tiny_folder)
    sizes = random_checkpoint.TINY_SIZES
    assert (config.vocab_size, config.d_model, config.n_layers, config.kv_heads, config.head_size) == (
        sizes["vocab_size"], sizes["hidden_size"], sizes["num_hidden_layers"], sizes["num_key_value_heads"],
        sizes["head_dim"])
    assert config.qk_norm and config.tie_embeddings  # Qwen3's architecture
    leaves = named(params)
    embedding = leaves["embed/embedding"]
    assert abs(embedding.std() - random_checkpoint.INIT_STD) < 0.002 and np.all(leaves["final_norm/scale"] == 1)
    _, again = random_checkpoint.random_params(config, seed=0)
    assert np.array_equal(named(again)["embed/embedding"], embedding)  # the seed decides


def test_the_tokenizer_s_ids_fit_the_model_and_round_trip(tiny_folder):
    tokenizer = HFTokenizer.from_dir(tiny_folder)
    ids = tokenizer.encode("Héllo wörld ✓ 12+30=42")
    assert tokenizer.vocab_size == random_checkpoint.TOKENIZER_VOCAB <= random_checkpoint.TINY_SIZES["vocab_size"]
    assert ids[:2] == [ord("H"), 0xC3] and tokenizer.decode(ids) == "Héllo wörld ✓ 12+30=42"
    config = json.loads((tiny_folder / "config.json").read_text())
    assert (tokenizer.eos_id, tokenizer.pad_id) == (config["eos_token_id"], config["pad_token_id"]) == (258, 256)


@pytest.mark.parametrize("preset, shapes", [
    ("qwen3-0.6b", (151_936, 1024, 3072, 28, 16, 8, 128, True)),
    ("llama-3.2-1b", (128_256, 2048, 8192, 16, 32, 8, 64, False)),
])
def test_the_presets_are_the_published_configs(preset, shapes):
    """Values as the publishers' config.json (data/model_configs/) and torchtune's builders."""
    config = hf.model_config(random_checkpoint.preset_config(preset))
    assert (config.vocab_size, config.d_model, config.d_ff, config.n_layers, config.n_heads, config.kv_heads,
            config.head_size, config.qk_norm) == shapes
    # Qwen3-0.6B: 596M parameters, 440M of them in the blocks' matmuls, 156M in the tied embedding
    if preset == "qwen3-0.6b":
        assert mfu.matmul_params(config) == 28 * (1024 * 128 * (16 + 16) + 16 * 128 * 1024 + 3 * 1024 * 3072) \
            + 151_936 * 1024


def test_bad_input_is_refused_with_the_fix(tmp_path, capsys):
    with pytest.raises(ValueError, match="Unknown preset 'qwen9'; choose one of"):
        random_checkpoint.preset_config("qwen9")
    small = {**random_checkpoint.preset_config("tiny"), "vocab_size": 100}
    with pytest.raises(ValueError, match="vocab_size=100 is smaller than the tokenizer's 259 ids"):
        random_checkpoint.write(tmp_path / "small", small)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert random_checkpoint.main(["--preset", "tiny", "--out", str(tmp_path / "full")]) == 2
    assert "is not an empty folder; pass a new --out (nothing was written)" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["keep.txt"]
