"""The blocks' trainable parameters stacked on a layer axis, for the training command's state.

The model names its parameters one tree per block (`blocks/0/...`, `blocks/1/...`), as Hugging
Face, PEFT and the lessons do. Trained that way, the optimizer updates each block's leaves
apart, and its compiled program grows with the depth: 8.3 s for the student's step at 28
layers against 2.2 s at 2 (`results/compile_costs/depth_cpu.json`). Stacked, each leaf is one
array [n_layers, ...] (`blocks_stacked/...`): the optimizer updates it once whatever the depth,
the objective slices the blocks back out for the model, and the model's `lax.scan`
(`scan_layers`) stacks them again, which XLA folds away. The same update, bit for bit while
the gradient clip does not act; where it does, its global norm adds the blocks' squares in
another order and AdamW's fused code rounds a stack's elements apart from a block's in the last
bit (tests/test_layer_stack.py bounds it).

The command stacks its trainable state when it scans the layers (`--scan-layers`), saves its
checkpoints so, and unstacks where the plain layout is read: `checkpoint.load_params` (on the
host, no device copy), the exports, and a resume in the other layout (`convert`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

BLOCKS, STACKED = "blocks", "blocks_stacked"


def _holds(key: str):
    return lambda x: isinstance(x, dict) and key in x


def is_stacked(tree) -> bool:
    """True where some mapping of `tree` holds the blocks stacked (a pure dict, or an optimizer
    state holding one)."""
    if isinstance(tree, Mapping):
        return STACKED in tree or any(is_stacked(value) for value in tree.values())
    if isinstance(tree, (tuple, list)):
        return any(is_stacked(value) for value in tree)
    return False


def _block_trees(blocks: dict) -> list:
    order = sorted(blocks, key=int)
    if [int(k) for k in order] != list(range(len(order))):
        raise ValueError(f"The blocks are numbered {order}, not 0..{len(order) - 1}: they cannot be stacked.")
    trees = [blocks[k] for k in order]
    shapes = [jax.tree.map(lambda x: (np.shape(x), np.dtype(x.dtype)), tree) for tree in trees]
    if any(shape != shapes[0] for shape in shapes[1:]):
        raise ValueError("The blocks differ in their parameters (an adapter on some layers only, say): "
                         "they cannot be stacked; train them without --scan-layers.")
    return trees


def _stack_blocks(holder: dict, delete_blocks: bool) -> dict:
    trees = _block_trees(holder[BLOCKS])

    def stack_leaf(*leaves):
        stacked = jnp.stack(leaves)
        if delete_blocks:  # the caller hands the blocks over: free each as soon as it is stacked
            for leaf in leaves:
                if isinstance(leaf, jax.Array):
                    leaf.delete()
        return stacked

    rest = {key: value for key, value in holder.items() if key != BLOCKS}
    return {**rest, STACKED: jax.tree.map(stack_leaf, *trees)}


def stack(tree, *, delete_blocks: bool = False):
    """`tree` (a pure dict, an nnx.State, or an optimizer state holding such dicts) with every
    dict's `blocks` {0: tree, 1: tree, ...} replaced by `blocks_stacked`, one tree of
    [n_layers, ...] arrays. `delete_blocks`: delete the per-block arrays once stacked (for
    a caller that hands them over), so the state is never held twice."""
    def stacked(x):
        x = nnx.to_pure_dict(x) if isinstance(x, nnx.State) else x  # an optimizer state may hold States
        return _stack_blocks(x, delete_blocks) if _holds(BLOCKS)(x) else x

    return jax.tree.map(stacked, tree, is_leaf=lambda x: isinstance(x, nnx.State) or _holds(BLOCKS)(x))


def _unstack_blocks(holder: dict, take) -> dict:
    stacked = holder[STACKED]
    n_layers = int(np.shape(jax.tree.leaves(stacked)[0])[0])
    rest = {key: value for key, value in holder.items() if key != STACKED}
    return {**rest, BLOCKS: {i: jax.tree.map(lambda leaf: take(leaf, i), stacked) for i in range(n_layers)}}


def unstack(tree, *, on_host: bool = False):
    """The inverse of `stack`: every `blocks_stacked` back as `blocks` {0: tree, ...}. On the
    device each block is a slice of the stack (inside a step, XLA folds it into the scan);
    `on_host` brings the arrays to NumPy first, so the slices are views and nothing is copied."""
    take = (lambda leaf, i: np.asarray(leaf)[i]) if on_host else (lambda leaf, i: leaf[i])
    return jax.tree.map(lambda x: _unstack_blocks(x, take) if _holds(STACKED)(x) else x, tree,
                        is_leaf=_holds(STACKED))


def into_state(pure, like: nnx.State) -> nnx.State:
    """A stacked or plain pure dict as an nnx.State of `like`'s structure (the model's own)."""
    state = jax.tree.map(lambda leaf: leaf, like)  # a copy to fill in: `like` may be abstract
    nnx.replace_by_pure_dict(state, unstack(pure))
    return state


def abstract(tree):
    """Shape-dtype structs of `tree`'s arrays, in its structure (nothing allocated)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def objective(objective_fn, params_like: nnx.State, base_like: nnx.State | None = None):
    """`objective_fn(params, batch, frozen)` taking the stacked trainable parameters: the blocks
    are sliced back out into `params_like`'s State before the model sees them. With `base_like`,
    LoRA's frozen base (`frozen["base"]`) comes stacked too and is sliced back out the same way."""
    like = abstract(params_like)
    base = None if base_like is None else abstract(base_like)

    def on_stacked(stacked, batch, frozen=None):
        if base is not None:
            frozen = {**frozen, "base": into_state(frozen["base"], base)}
        return objective_fn(into_state(stacked, like), batch, frozen)

    return on_stacked


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a step trains on stacked blocks: the trainable parameters' structure in the model's own
    layout (`params_like`) and, under LoRA, the frozen base's (`base_like`; None: the base, if
    any, stays one tree per block). Both abstract: nothing is held."""

    params_like: object
    base_like: object = None

    def objective(self, objective_fn):
        return objective(objective_fn, self.params_like, self.base_like)

    def unstack(self, stacked) -> nnx.State:
        return into_state(stacked, self.params_like)

    def base(self, stacked_base) -> nnx.State:
        return into_state(stacked_base, self.base_like)


def _stackable(tree) -> bool:
    try:
        jax.eval_shape(stack, abstract(tree))
        return True
    except ValueError:
        return False


def layout(params, frozen=None) -> Layout:
    """The `Layout` of a step on `params` (and LoRA's `frozen`, `lora.frozen(base)`) stacked. The
    base is stacked as well where it can be: one tree per block, the model's scan would stack
    it inside every step, a copy of the whole base among the step's temporaries (a bfloat16 base
    is not cast on its way in, so no cast absorbs the copy). Raises ValueError where the trainable
    blocks differ."""
    like = abstract(params)
    jax.eval_shape(stack, like)  # nothing computed: can the blocks be stacked?
    base = frozen.get("base") if isinstance(frozen, dict) else None
    return Layout(like, abstract(base) if base is not None and _stackable(base) else None)


def stack_state(params, frozen, layout_: Layout, *, delete_blocks: bool = False):
    """(params, frozen) in `layout_`: the trainable blocks stacked, and the base where the layout
    stacks it. `delete_blocks` as for `stack`."""
    params = stack(params, delete_blocks=delete_blocks)
    if layout_.base_like is not None:
        frozen = {**frozen, "base": stack(frozen["base"], delete_blocks=delete_blocks)}
    return params, frozen


def convert(tree, like):
    """`tree`, read in one layout, in `like`'s (its structure, States and all): on the device, a
    copy, for a resume whose checkpoint was saved in the layout the run does not train in."""
    converted = stack(tree) if is_stacked(like) else unstack(tree)
    leaves, structure = jax.tree.leaves(converted), jax.tree.structure(like)
    if len(leaves) != structure.num_leaves:
        raise ValueError(f"The checkpoint holds {len(leaves)} arrays in this run's layout, the run {structure.num_leaves}.")
    return jax.tree.unflatten(structure, leaves)


def abstract_in_layout(tree, *, stacked: bool):
    """Shape-dtype structs of `tree` in the stacked or plain layout (what a restore reads into)."""
    return jax.eval_shape(lambda t: stack(t) if stacked else unstack(t), tree)

