"""Lesson 05 (Orbax checkpointing): a kill during the first save, a flipped byte, async saves.

Every function writes under a `workdir` it is given (a temporary directory in the
tests). The kill-and-resume drills of the lesson itself, and the damaged-checkpoint
cases, are tested at full length in tests/test_cli.py and tests/test_checkpoint.py;
these functions answer the exercises with shorter runs of the same tools
(`preempt.run_and_kill`, the training command, `checkpoint.save`/`restore`).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from tunix_nb import checkpoint, compare, data, model, preempt, train
from solutions import lesson03
from tunix_nb.tokenizer import ByteTokenizer




def _steps_on_disk(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.name[0].isdigit()) if run.is_dir() else []


def _cli_beside_the_killed_run(argv) -> str:
    """Run `python -m tunix_nb.train *argv` in a child process, where the killed run ran
    (`preempt.run_beside`), so that its losses can equal the killed run's bit for bit also where
    this process holds a chip; returns its stdout."""
    done = preempt.run_beside(argv)
    if done.returncode:
        raise RuntimeError(f"the CLI exited with {done.returncode}: {(done.stdout + done.stderr)[-2000:]}")
    return done.stdout


# ------------------------------------------------------------------------- exercise 1


def _metrics_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _argv(workdir: Path, steps: int, save_every: int) -> list[str]:
    return ["sft", "--model", "tiny", "--batch-size", "16", "--steps", str(steps), "--save-every", str(save_every),
            "--ckpt-dir", str(workdir / "preempted"), "--metrics-file", str(workdir / "preempted.jsonl")]


def kill_during_first_save(workdir, *, steps: int = 40, save_every: int = 20, timeout: float = 120.0) -> dict:
    """The first half of exercise 1: the CLI in a child process, SIGKILLed during its first save.

    Returns `preempt.run_and_kill`'s report plus "committed_at_kill" (the checkpoints on disk then)
    and "metrics" (the lines the killed run had logged; a line cut by the kill is dropped).
    """
    workdir = Path(workdir)
    argv = _argv(workdir, steps, save_every)
    # the CLI on one CPU device: run_and_kill's default environment, devices.child_env()
    killed = preempt.run_and_kill(argv, ckpt_dir=workdir / "preempted", metrics_file=workdir / "preempted.jsonl",
                         when="during_save", after_step=0, timeout=timeout)
    if not killed["killed"]:
        raise RuntimeError(f"the run finished before it could be killed during a save: {killed}")
    killed["committed_at_kill"] = [name for name in _steps_on_disk(workdir / "preempted") if name.isdigit()]
    killed["metrics"] = [line for line in _metrics_lines(workdir / "preempted.jsonl") if line.endswith("}")]
    return {**killed, "steps": steps, "save_every": save_every}


def restart_after_kill(workdir, killed: dict, *, uninterrupted: bool = False) -> dict:
    """The second half of exercise 1: run the killed command again, to the end; compare.

    `killed` is `kill_during_first_save`'s report. Returns "in_flight" (the temporary
    directories at the kill), "committed_at_kill", "resumed" (whether the restart printed
    a "Resuming" line), "left_over" (temporary directories after it), "killed_steps"
    (steps the killed run had logged) and "same_losses" (the restart's loss at each of
    those steps equals the killed run's, bit for bit: the same run). With
    `uninterrupted`, also "bit_identical": the restart's final parameters against those
    of the same command run uninterrupted (tests/test_cli.py checks resumes after kills
    against an uninterrupted run at length).
    """
    workdir = Path(workdir)
    argv = _argv(workdir, killed["steps"], killed["save_every"])
    restart = _cli_beside_the_killed_run(argv)
    run, logged = workdir / "preempted", killed["metrics"]
    out = {"in_flight": killed["in_flight"], "committed_at_kill": killed["committed_at_kill"],
           "resumed": "Resuming" in restart, "left_over": [n for n in _steps_on_disk(run) if preempt.TMP_SUFFIX in n],
           "killed_steps": len(logged),
           "same_losses": logged == _metrics_lines(workdir / "preempted.jsonl")[:len(logged)]}
    if uninterrupted:
        reference = workdir / "uninterrupted"
        _cli_beside_the_killed_run([*argv[:9], "--ckpt-dir", str(reference)])
        out["bit_identical"] = compare.bitwise_equal(checkpoint.load_params(run), checkpoint.load_params(reference))
    return out


def killed_during_first_save(workdir, *, steps: int = 40, save_every: int = 20, uninterrupted: bool = False,
                             timeout: float = 120.0) -> dict:
    """Lesson 05, exercise 1: SIGKILL the CLI during its first save, restart it, compare.

    The lesson's tiny SFT run (batches [16, 24]), `steps` steps with a save every
    `save_every`: killed in a child process by `preempt.run_and_kill(when="during_save",
    after_step=0)` (`kill_during_first_save`), then run again to the end in this process
    (`restart_after_kill`, which says what is returned).
    """
    killed = kill_during_first_save(workdir, steps=steps, save_every=save_every, timeout=timeout)
    return restart_after_kill(workdir, killed, uninterrupted=uninterrupted)


# ------------------------------------------------------------------------- exercise 2


def _tiny_state():
    graphdef, params = model.split(model.make_model("tiny", seed=0))
    opt = train.make_optimizer(train.OptimizerConfig(warmup_steps=1, total_steps=10))
    return graphdef, params, opt


def flip_one_byte(step_dir) -> Path:
    """XOR the middle byte of the largest data file of `params/ocdbt.process_0/d/`; returns it."""
    files = [p for p in (Path(step_dir) / "params").rglob("*")
             if p.is_file() and p.parent.name == "d" and p.parent.parent.name.startswith("ocdbt")]
    target = max(files, key=lambda p: p.stat().st_size)
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    target.write_bytes(bytes(raw))
    return target


def flipped_byte_caught_by_checksum(workdir) -> dict:
    """Lesson 05, exercise 2: flip one byte of the newest checkpoint's params data; who notices?

    Saves the tiny model's state at steps 2 and 4 (params + 2 and + 4), flips one byte in
    the middle of a data file of step 4's `params/ocdbt.process_0/d/`, then reads it back
    with Orbax alone ("orbax_read_ok": no error; "orbax_values_changed": other numbers
    than saved) and with `checkpoint.restore` ("warnings": its messages; "restored_step").
    """
    workdir = Path(workdir)
    _, params, opt = _tiny_state()
    opt_state = opt.init(params)
    manager = checkpoint.make_manager(workdir / "run", async_save=False)
    params = nnx.to_pure_dict(params)
    for step in (2, 4):  # host (NumPy) arrays: nothing to compile
        checkpoint.save(manager, step, params=jax.tree.map(lambda x, s=step: np.asarray(x) + s, params),
                        opt_state=opt_state, meta={})
    manager.wait_until_finished()
    flip_one_byte(workdir / "run" / "4")
    saved = jax.tree.map(lambda x: np.asarray(x) + 4, params)
    out = {"orbax_read_ok": False, "orbax_values_changed": None}
    reader = checkpoint.make_manager(workdir / "run")  # as a fresh process would
    try:
        raw = reader.restore(4, args=ocp.args.Composite(params=ocp.args.StandardRestore(saved)))["params"]
        out["orbax_read_ok"] = True
        out["orbax_values_changed"] = not compare.bitwise_equal(raw, saved)
    except Exception as err:  # noqa: BLE001  (reported, not raised: the exercise asks whether Orbax notices)
        out["orbax_error"] = f"{type(err).__name__}: {err}"[:300]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", checkpoint.DamagedCheckpointWarning)
        _, _, meta = checkpoint.restore(reader, params_like=params, opt_state_like=opt_state)
    out["warnings"] = [str(w.message) for w in caught
                       if issubclass(w.category, checkpoint.DamagedCheckpointWarning)]
    out["restored_step"] = meta["step"]
    reader.close()
    manager.close()
    return out


# ------------------------------------------------------------------------- exercise 3


def sync_against_async_saves(workdir, *, steps: int = 60, save_every: int = 5, preset: str = "tiny",
                             batch_size: int = 32) -> dict:
    """Lesson 05, exercise 3: the CLI's loop with a save every `save_every` steps, sync and async.

    The SFT step of the `preset` model on batches [batch_size, 24] of the SFT data (the
    CLI's defaults are "student" and 64), compiled before timing, trained `steps` steps
    in chunks of `save_every`, saving after each chunk with `checkpoint.save`, once with
    a synchronous and once with an asynchronous manager. Returns "saves", the wall times
    of the two runs ("sync_seconds", "async_seconds"), the median time one save blocked
    the loop ("sync_blocked_per_save", "async_blocked_per_save"), and
    "predicted_difference", (sync - async blocked) x saves, against "measured_difference"
    of the run times.
    """
    workdir = Path(workdir)
    params0, opt, step_fn = lesson03.sft_step(preset, "float32", "jit")  # lesson 03's step, built once
    rows = data.sft_arrays(data.load_sft(), ByteTokenizer(), data.DEFAULT_SEQ_LEN)
    batch_fn = lambda step: data.batch_at(rows, step, batch_size, seed=0)  # noqa: E731
    train.run(step_fn, params0, opt.init(params0), batch_fn, steps=1, progress=False)  # compile before timing
    out = {}
    for name, async_save in (("sync", False), ("async", True)):
        manager = checkpoint.make_manager(workdir / name, keep=3, save_every=save_every, async_save=async_save)
        params, opt_state, blocked, saves = params0, opt.init(params0), [], 0
        t0 = time.perf_counter()
        for start in range(0, steps, save_every):
            chunk = min(save_every, steps - start)
            params, opt_state, _ = train.run(step_fn, params, opt_state, batch_fn, steps=chunk, start_step=start,
                                             progress=False)
            t_save = time.perf_counter()
            saves += checkpoint.save(manager, start + chunk, params=params, opt_state=opt_state, meta={},
                                     force=start + chunk == steps)
            blocked.append(time.perf_counter() - t_save)
        manager.wait_until_finished()
        out[f"{name}_seconds"] = time.perf_counter() - t0
        out[f"{name}_blocked_per_save"] = float(np.median(blocked))
        out["saves"] = saves
        manager.close()
    out["predicted_difference"] = (out["sync_blocked_per_save"] - out["async_blocked_per_save"]) * out["saves"]
    out["measured_difference"] = out["sync_seconds"] - out["async_seconds"]
    return out
