"""Lesson 00 (devices and setup): a psum on two devices, pmean and all_gather, right padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tunix_nb import model
from tunix_nb.tokenizer import ByteTokenizer

AXIS = "devices"


def psum_on_two_devices() -> np.ndarray:
    """Lesson 00, exercise 1: the lesson's psum cell on 2 devices -> [2], what each device holds.

    Device i holds the number i, so both hold 0 + 1 = 1.0. Runs on the first 2 devices
    of however many this process has (a 2-device kernel, or 2 of 8 simulated ones).
    """
    values_N = jnp.arange(2.0)
    totals_N = jax.pmap(lambda x: lax.psum(x, AXIS), axis_name=AXIS, devices=jax.devices()[:2])(values_N)
    return np.asarray(totals_N)


def pmean_and_all_gather(n_devices: int | None = None) -> dict[str, np.ndarray]:
    """Lesson 00, exercise 2: the psum cell with `lax.pmean` and with `lax.all_gather`.

    Device i holds i, for n devices (default: all). Returns {"pmean": [n], one value per
    device, each (n - 1) / 2; "all_gather": [n, n], row i what device i holds, each row
    [0, 1, ..., n-1]}.
    """
    devices = jax.devices()[: n_devices or jax.device_count()]
    n = len(devices)
    values_N = jnp.arange(float(n))
    pmean_N = jax.pmap(lambda x: lax.pmean(x, AXIS), axis_name=AXIS, devices=devices)(values_N)
    gathered_NxN = jax.pmap(lambda x: lax.all_gather(x, AXIS), axis_name=AXIS, devices=devices)(values_N)
    return {"pmean": np.asarray(pmean_N), "all_gather": np.asarray(gathered_NxN)}


def right_padding_logit_change(n_pad: int = 3, preset: str = "student", text: str = "add 2+2=") -> float:
    """Lesson 00, exercise 3: largest change of the real tokens' logits [1, L, V] from n_pad right pads.

    The lesson's check with the padding on the right: `plain` is `[bos] + prompt` ([1, L]),
    `padded` appends `n_pad` pad tokens ([1, L + n_pad]) with `mask = padded != pad`, and
    the first L positions of its logits are compared with the unpadded logits.
    """
    tok = ByteTokenizer()
    graphdef, params = model.split(model.make_model(preset, seed=0))
    prompt = tok.encode(text)
    plain_1xL = jnp.array([[tok.bos_id, *prompt]])
    padded_1xLp = jnp.array([[tok.bos_id, *prompt] + [tok.pad_id] * n_pad])
    mask_1xLp = (padded_1xLp != tok.pad_id).astype(jnp.int32)
    L = plain_1xL.shape[1]

    @jax.jit
    def largest_change(params):
        logits_padded = model.apply(graphdef, params, padded_1xLp, mask_1xLp)[:, :L]
        return jnp.abs(logits_padded - model.apply(graphdef, params, plain_1xL)).max()

    return float(largest_change(params))
