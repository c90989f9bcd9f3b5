"""How far a backend's float32 arithmetic strays from float64: elementwise transcendental functions
(in units of float32's eps) and matmuls at the default and the "highest" precision.
Writes JSON to the path given (default: stdout). Run on the chip: python results/precision/probe.py OUT."""
import json, sys, platform
import numpy as np
import jax, jax.numpy as jnp

EPS32 = float(np.finfo(np.float32).eps)
rng = np.random.default_rng(0)
N = 1 << 20

def rel_err(f_jax, f_np, x):
    got = np.asarray(jax.jit(f_jax)(jnp.asarray(x, jnp.float32)), np.float64)
    want = f_np(x.astype(np.float32).astype(np.float64))
    err = np.abs(got - want) / np.maximum(np.abs(want), np.finfo(np.float32).tiny)
    return {"max_rel_in_eps": float(err.max() / EPS32), "p99_rel_in_eps": float(np.quantile(err, 0.99) / EPS32)}

def elementwise():
    x_any = rng.uniform(-30, 30, N); x_pos = np.exp(rng.uniform(-20, 20, N)); x_unit = rng.uniform(-4, 4, N)
    return {
        "exp": rel_err(jnp.exp, np.exp, x_any),
        "log": rel_err(jnp.log, np.log, x_pos),
        "log_near_1": rel_err(jnp.log, np.log, 1 + rng.uniform(-0.5, 0.5, N)),
        "log1p": rel_err(jnp.log1p, np.log1p, rng.uniform(-0.5, 3, N)),
        "expm1": rel_err(jnp.expm1, np.expm1, rng.uniform(-3, 3, N)),
        "tanh": rel_err(jnp.tanh, np.tanh, x_unit),
        "sigmoid": rel_err(jax.nn.sigmoid, lambda v: 1 / (1 + np.exp(-v)), x_unit * 4),
        "rsqrt": rel_err(jax.lax.rsqrt, lambda v: 1 / np.sqrt(v), x_pos),
        "reciprocal": rel_err(lambda v: 1 / v, lambda v: 1 / v, x_pos),
        "sin": rel_err(jnp.sin, np.sin, x_unit),
        "cos": rel_err(jnp.cos, np.cos, x_unit),
    }

def log_softmax_err():
    z = rng.normal(0, 4, (4096, 256))
    got = np.asarray(jax.jit(jax.nn.log_softmax)(jnp.asarray(z, jnp.float32)), np.float64)
    z64 = z.astype(np.float32).astype(np.float64)
    want = z64 - np.log(np.exp(z64 - z64.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z64.max(-1, keepdims=True)
    return {"max_abs_in_eps": float(np.abs(got - want).max() / EPS32)}

def matmul_err():
    a = rng.normal(size=(512, 512)); b = rng.normal(size=(512, 512))
    want = a.astype(np.float32).astype(np.float64) @ b.astype(np.float32).astype(np.float64)
    out = {}
    for prec in ("default", "high", "highest"):
        with jax.default_matmul_precision(prec if prec != "default" else None):
            got = np.asarray(jax.jit(jnp.matmul)(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)), np.float64)
        # relative to the sum of |terms| (the scale a float32 dot product's error is measured against)
        scale = np.abs(a) @ np.abs(b)
        out[prec] = {"max_err_over_abs_terms_in_eps": float((np.abs(got - want) / scale).max() / EPS32)}
    return out

if __name__ == "__main__":
    import importlib.metadata as md
    def version(name):
        try: return md.version(name)
        except md.PackageNotFoundError: return None
    record = {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
              "jax": jax.__version__, "jaxlib": version("jaxlib"), "libtpu": version("libtpu"),
              "python": platform.python_version(), "samples": N,
              "elementwise_float32": elementwise(), "log_softmax_float32": log_softmax_err(), "matmul_float32": matmul_err()}
    text = json.dumps(record, indent=1)
    if len(sys.argv) > 1: open(sys.argv[1], "w").write(text + "\n")
    print(text)
