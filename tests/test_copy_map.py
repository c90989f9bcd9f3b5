"""docs/copy_map.md's copy-ready steps (SFT, DPO, distillation) train as the kit does.

Each block after a `<!-- copy-ready: NAME -->` comment runs as written, in a namespace of
its own (it imports JAX, Flax and optax itself, never tunix_nb), and one step of it is
compared with one step of `train.make_step(<the kit's objective>)` from the same params,
optimizer state and batch: the loss, and the params after the update.

Error analysis (tunix_nb.compare.float32_bound): both sides run the same forward pass and
add the same per-token terms, possibly in another order (the kit differentiates the loss
*sum* and divides the gradient by the weight after; a block differentiates the mean), so
they differ by about n x eps of the terms' size, n the token positions of the batch (2B x L
for DPO's stacked pairs), plus the exp and log of each log-softmax on the value's path. The
loss is compared relative to itself, the params by `relative_distance` (how far apart the
two updates end, per distance the kit's moved: one entry whose gradient sits at the
rounding level, which Adam's first step turns into a full-size one, cannot dominate it), as
tests/test_grad_accum.py does. Each method's known-wrong version (SFT's mean per row, DPO
without its reference, distillation's KL the wrong way round) fails the comparison by at
least 100x. The first two are the kit's compiled step fed other data: no more compiles.

Measured on a CPU (bounds 4.7e-5 SFT, 9.3e-5 DPO, 4.8e-5 distillation): block vs kit, loss
0, 9e-8, 2.3e-7 and params 2.4e-6, 0, 0; the known-wrong versions' params 9,761x, 3,107x and
19,895x the bound, their loss 185x, 237x and 2,368x. A TPU's bounds are 11-22x wider.
"""

import ast
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb import compare, data, distill, dpo, model, sft, train
from tunix_nb.tokenizer import ByteTokenizer

DOC = Path(__file__).resolve().parent.parent / "docs" / "copy_map.md"
BLOCK = re.compile(r"^<!-- copy-ready: (\w+) -->\n```python\n(.*?)^```", re.S | re.M)
B, L = 16, data.DEFAULT_SEQ_LEN
TOK = ByteTokenizer()
# each block's step builder
MAKERS = {"sft": "make_sft_step", "dpo": "make_dpo_step", "distill": "make_distill_step"}


def blocks() -> dict:
    return dict(BLOCK.findall(DOC.read_text()))


def run_block(name: str) -> dict:
    """The block's namespace after running it: nothing but builtins before."""
    namespace = {"__name__": f"copy_ready_{name}"}
    exec(compile(blocks()[name], f"{DOC}:copy-ready:{name}", "exec"), namespace)
    return namespace


def optimizer():
    # no warmup: the kit's schedule starts at learning rate 0, where a first step would not move
    return train.make_optimizer(train.OptimizerConfig(learning_rate=1e-2, warmup_steps=0, total_steps=10))


@pytest.fixture(scope="module")
def tiny():
    return model.split(model.make_model("tiny", seed=0))


@pytest.fixture(scope="module")
def sft_batch():
    """16 rows whose completions hold 3 to 6 tokens, so a mean per row is another loss."""
    return data.sft_arrays(data.load_sft()[:B], TOK, L)


def one_step(step, params, opt, batch, *frozen):
    with compare.agreement_precision():  # float32, full-precision matmuls, on any backend
        new_params, _, metrics = step(params, opt.init(params), batch, *frozen)
    return new_params, {k: float(v) for k, v in metrics.items()}


def distances(mine, kit, start) -> tuple[float, float]:
    """(relative loss difference, `relative_distance` of the params) of two steps' results."""
    (p_mine, m_mine), (p_kit, m_kit) = mine, kit
    return abs(m_mine["loss"] - m_kit["loss"]) / abs(m_kit["loss"]), compare.relative_distance(p_mine, p_kit, start)


def check(name, mine, kit, wrong, start, bound):
    """The block's step within `bound` of the kit's, in loss and params; the known-wrong
    version fails that comparison by at least 100x. The params tell a wrong weighting at
    100x on any backend; the loss need not: at a random start every token's NLL is near
    log V, so SFT's mean per row moves the loss by under 1%, within 100x of a TPU's bound
    (its float32 log adds 4,096 eps, `compare.TRANSCENDENTAL_EPS`)."""
    loss_diff, params_diff = distances(mine, kit, start)
    wrong_loss, wrong_params = distances(mine, wrong, start)
    print(f"\n{name}: bound {bound:.2e}; block vs kit: loss {loss_diff:.2e}, params {params_diff:.2e}; "
          f"known-wrong: loss {wrong_loss:.2e} ({wrong_loss / bound:.0f}x), params {wrong_params:.2e} "
          f"({wrong_params / bound:.0f}x)")
    assert loss_diff <= bound and params_diff <= bound
    assert max(wrong_loss, wrong_params) >= 100 * bound


def test_each_method_has_one_short_self_contained_block():
    found = blocks()
    assert sorted(found) == sorted(MAKERS), f"docs/copy_map.md's copy-ready blocks: {sorted(found)}"
    for name, code in found.items():
        imported = set()
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add(node.module.split(".")[0])
        assert imported <= {"jax", "flax", "optax"}, f"the {name} block imports {sorted(imported)}"
        assert len(code.splitlines()) <= 40, f"the {name} block has {len(code.splitlines())} lines"
        assert callable(run_block(name)[MAKERS[name]])


def test_sft_block_is_the_kits_step(tiny, sft_batch):
    graphdef, params = tiny
    opt = optimizer()
    mine = one_step(run_block("sft")["make_sft_step"](graphdef, opt), params, opt, sft_batch)
    kit_step = train.make_step(sft.objective(graphdef, compute_dtype="float32"), opt)
    kit = one_step(kit_step, params, opt, sft_batch)
    # The known-wrong, each row's token mean then a mean over rows: the kit's token mean with
    # every row's mask divided by its token count is sum_r (NLL_r / n_r) / B, exactly that
    mask_BxL = sft_batch["loss_mask"]
    per_row = {**sft_batch, "loss_mask": mask_BxL / mask_BxL.sum(axis=-1, keepdims=True)}
    assert len(np.unique(mask_BxL.sum(axis=-1))) > 1  # rows of unequal lengths, or both means agree
    wrong = one_step(kit_step, params, opt, per_row)
    bound = compare.float32_bound(B * L, transcendentals=compare.log_softmax_transcendentals())
    check("sft", mine, kit, wrong, params, bound)


def test_dpo_block_is_the_kits_step(tiny):
    graphdef, params = tiny
    # The frozen reference is another model, not the policy: with policy == reference every
    # margin is 0 at the first step, where a wrong margin could not show.
    ref_graphdef, ref_params = model.split(model.make_model("tiny", seed=1))
    pairs = data.preference_arrays(data.load_preferences()[:B], TOK, L)
    block = run_block("dpo")
    with compare.agreement_precision():
        batch = dpo.reference_log_probs(ref_graphdef, ref_params, pairs, compute_dtype="float32")  # the kit's
        # the reference log-probs as the doc says to compute them are the kit's
        ref_c_B, ref_r_B = jax.jit(block["pair_logps"], static_argnums=1)(ref_params, ref_graphdef, batch)
    sums_bound = compare.float32_bound(L, transcendentals=compare.log_softmax_transcendentals())
    for mine_B, key in ((ref_c_B, "ref_chosen_logps"), (ref_r_B, "ref_rejected_logps")):
        assert compare.max_abs_diff(mine_B, batch[key]) <= sums_bound * float(np.abs(batch[key]).max())

    opt = optimizer()
    mine = one_step(block["make_dpo_step"](graphdef, opt), params, opt, batch)
    kit_step = train.make_step(dpo.objective(graphdef, compute_dtype="float32"), opt)
    kit = one_step(kit_step, params, opt, batch)
    # the known-wrong: the reference left out (its log-probs 0), the margin the policy's alone
    no_reference = {**batch, "ref_chosen_logps": 0 * ref_c_B, "ref_rejected_logps": 0 * ref_r_B}
    wrong = one_step(kit_step, params, opt, no_reference)
    bound = compare.float32_bound(2 * B * L, transcendentals=compare.log_softmax_transcendentals())
    check("dpo", mine, kit, wrong, params, bound)
    # a reward is beta x a difference of summed log-probs: its rounding is relative to their size
    scale = 0.1 * float(max(np.abs(batch["ref_chosen_logps"]).max(), np.abs(batch["ref_rejected_logps"]).max()))
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margin"):
        assert abs(mine[1][key] - kit[1][key]) <= bound * scale, key
    assert mine[1]["rewards/accuracy"] == kit[1]["rewards/accuracy"]


def test_distill_block_is_the_kits_step(tiny, sft_batch):
    graphdef, params = tiny
    # A sharp teacher. A fresh model's logits spread about 1 unit: its distributions are near
    # uniform, where KL(teacher || student) ~ KL(student || teacher) (measured 1.005 and 1.012).
    # Its final norm's scale x 5 spreads them about 5 units, as a trained model's (10.5, 12.7).
    teacher = model.make_model("tiny", seed=1)
    teacher.final_norm.scale[...] = 5.0 * teacher.final_norm.scale[...]
    teacher_graphdef, teacher_params = model.split(teacher)
    opt = optimizer()
    mine = one_step(run_block("distill")["make_distill_step"](graphdef, teacher_graphdef, opt), params, opt,
                    sft_batch, teacher_params)

    def kit_step(**options):
        objective = distill.objective(graphdef, teacher_graphdef, compute_dtype="float32", **options)
        return one_step(train.make_step(objective, opt), params, opt, sft_batch, teacher_params)

    kit = kit_step()
    wrong = kit_step(beta=1.0)  # the known-wrong: KL(student || teacher), the other way round
    # two log-softmaxes (teacher's and student's) and the KL's exp on the soft term's path
    bound = compare.float32_bound(B * L, transcendentals={"exp": 3, "log": 2})
    check("distill", mine, kit, wrong, params, bound)
    for key in ("distill/soft_loss", "distill/hard_loss"):
        assert abs(mine[1][key] - kit[1][key]) <= bound * abs(kit[1][key]), key
