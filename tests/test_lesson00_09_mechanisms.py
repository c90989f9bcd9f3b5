"""What lessons 00 and 09 build by hand, checked against the kit.

Lesson 00: the one environment variable behind simulated devices (a fresh process with
and without it), the flag `devices.setup` writes, and `nnx.split` / `nnx.merge` against
the kit's `model.split` / `model.apply`. Lesson 09: with the Qwen3 fixture's tokenizer
pad and bos are the same id, so a mask built with `!= pad_id` loses the bos, and the
kit's masks, built from lengths, keep it; and the solutions' figure cell, which counts
Qwen3-0.6B from one and two layers.
"""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_nb import data, devices, hf, model
from tunix_nb.tokenizer import HFTokenizer

REPO = Path(__file__).resolve().parent.parent
QWEN3_FIXTURE = REPO / "tests" / "fixtures" / "hf" / "qwen3"
HAND_WRITTEN_FLAG = "--xla_force_host_platform_device_count=8"  # lesson 00's MY_XLA_FLAGS
KERNEL_DEVICE_VARS = ("XLA_FLAGS", devices.JAX_COUNT_ENV, devices.DEVICES_ENV)


def fresh_python(code: str, **env_vars) -> subprocess.Popen:
    """Start `python -c code` on the CPU without this process's device settings, plus env_vars (as lesson 00 does)."""
    env = devices.child_env(**env_vars)
    assert not set(KERNEL_DEVICE_VARS) & set(env) - set(env_vars)
    return subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def stdout_of(process: subprocess.Popen) -> str:
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    return out


# ------------------------------------------------------------------ lesson 00: XLA_FLAGS


def test_the_flag_alone_makes_eight_cpu_devices():
    """One fresh interpreter each, started together so the test costs one JAX import's time."""
    count = "import jax; print(jax.device_count())"
    with_flag, without_flag = fresh_python(count, XLA_FLAGS=HAND_WRITTEN_FLAG), fresh_python(count)
    assert int(stdout_of(with_flag).split()[-1]) == 8
    assert int(stdout_of(without_flag).split()[-1]) == 1


def test_devices_setup_writes_the_hand_written_flag():
    # setup only writes the environment: no JAX import needed to see what it sets
    code = "import os; from tunix_nb import devices; devices.setup(8); print(os.environ['XLA_FLAGS'])"
    assert stdout_of(fresh_python(code)).splitlines()[-1] == HAND_WRITTEN_FLAG
    assert f"{devices.DEVICE_COUNT_FLAG}=8" == HAND_WRITTEN_FLAG
    assert devices._with_device_count_flag("", 8) == HAND_WRITTEN_FLAG


def test_lesson00_builds_the_same_flag_by_hand():
    nb = json.loads((REPO / "notebooks" / "00_devices_and_setup.ipynb").read_text())
    sources = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert any(f'MY_XLA_FLAGS = "{HAND_WRITTEN_FLAG}"' in s for s in sources)


# ------------------------------------------------------------------ lesson 00: split and merge


def tiny_batch():
    tokens_BxL = jnp.asarray(np.arange(3, 27).reshape(2, 12), jnp.int32)
    return tokens_BxL, jnp.ones_like(tokens_BxL)


def test_split_holds_the_structure_apart_from_the_arrays():
    graphdef, params = nnx.split(model.make_model("tiny", seed=0))
    assert jax.tree.leaves(graphdef) == []  # the structure holds no arrays
    assert set(nnx.to_pure_dict(params)) == {"blocks", "embed", "final_norm"}
    assert model.count_params(params) == sum(x.size for x in jax.tree.leaves(params))


def test_merge_of_split_computes_the_same_logits_as_the_kit():
    module = model.make_model("tiny", seed=0)
    tokens_BxL, mask_BxL = tiny_batch()
    graphdef, params = nnx.split(module)
    original = module(tokens_BxL, mask_BxL)
    assert np.array_equal(nnx.merge(graphdef, params)(tokens_BxL, mask_BxL), original)
    kit_graphdef, kit_params = model.split(model.make_model("tiny", seed=0))
    assert kit_graphdef == graphdef
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(kit_params), jax.tree.leaves(params)))
    # eagerly, model.apply runs the merge and call as one jitted program: compare with the same
    merged_jit = jax.jit(lambda p, t, m: nnx.merge(graphdef, p)(t, m))(params, tokens_BxL, mask_BxL)
    assert np.array_equal(model.apply(kit_graphdef, kit_params, tokens_BxL, mask_BxL), merged_jit)
    np.testing.assert_allclose(merged_jit, original, rtol=0, atol=1e-5)
    # merge reads the params it is given, not a copy kept in the graphdef
    shifted = jax.tree.map(lambda x: x + 1.0, params)
    assert not np.allclose(nnx.merge(graphdef, shifted)(tokens_BxL, mask_BxL), original)


# ------------------------------------------------------------------ lesson 09: pad == bos


def test_pad_equal_to_bos_is_lost_by_an_id_mask_and_kept_by_the_kits_length_mask():
    tok = HFTokenizer.from_dir(QWEN3_FIXTURE)
    assert tok.pad_id == tok.bos_id == 317
    rows = data.sft_arrays(data.load_sft()[:2], tok, seq_len=12)
    inputs_2xL, by_length_2xL = rows["inputs"], rows["attention_mask"]
    by_id_2xL = (inputs_2xL != tok.pad_id).astype(np.int32)
    assert (inputs_2xL[:, 0] == tok.bos_id).all()
    rows_differ, positions_differ = np.nonzero(by_id_2xL != by_length_2xL)
    assert rows_differ.tolist() == [0, 1] and positions_differ.tolist() == [0, 0]
    assert by_length_2xL[:, 0].all() and not by_id_2xL[:, 0].any()


def test_left_padded_prompts_keep_their_bos_too():
    tok = HFTokenizer.from_dir(QWEN3_FIXTURE)
    prompts = ["rev abus=", "add 50+33="]
    batch = data.prompt_arrays(prompts, tok, prompt_len=12)
    lengths = [1 + len(tok.encode(p)) for p in prompts]
    for row, n in enumerate(lengths):
        bos_at = 12 - n
        assert batch["tokens"][row, bos_at] == tok.bos_id and batch["attention_mask"][row, bos_at] == 1
        assert batch["attention_mask"][row].sum() == n
        assert (batch["tokens"][row] != tok.pad_id).sum() == n - 1  # the id mask loses the bos


def test_hiding_the_bos_changes_the_real_tokens_logits():
    tok = HFTokenizer.from_dir(QWEN3_FIXTURE)
    graphdef, params, _ = hf.load_pretrained(QWEN3_FIXTURE, dtype="float32")
    rows = data.sft_arrays(data.load_sft()[:2], tok, seq_len=12)
    inputs_2xL = jnp.asarray(rows["inputs"])
    by_id = model.apply(graphdef, params, inputs_2xL, jnp.asarray((rows["inputs"] != tok.pad_id).astype(np.int32)))
    by_length = model.apply(graphdef, params, inputs_2xL, jnp.asarray(rows["attention_mask"]))
    real_2xL = rows["attention_mask"].astype(bool)
    assert np.abs(np.asarray(by_id) - np.asarray(by_length))[real_2xL].max() > 1.0


# ------------------------------------------------------------------ lesson 09: the solutions' figures


def count_from_two_layers(hf_config: dict) -> int:
    """Lesson 09's figures cell: every layer has the same shapes, so one layer's count
    is the difference between a 2-layer and a 1-layer model."""
    from solutions import lesson09

    one, two = (lesson09.param_count({**hf_config, "num_hidden_layers": n})["params"] for n in (1, 2))
    return one + (hf_config["num_hidden_layers"] - 1) * (two - one)


def test_counting_from_two_layers_gives_the_full_count():
    from solutions import lesson09

    _, params, _ = hf.load_pretrained(QWEN3_FIXTURE)
    assert count_from_two_layers(hf.read_config(QWEN3_FIXTURE)) == model.count_params(params) == 31_968
    # the full 28-layer count, asserted by tests/test_solutions.py (it takes seconds to build)
    assert count_from_two_layers(lesson09.QWEN3_0_6B) == 596_049_920
