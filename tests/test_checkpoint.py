"""tunix_nb.checkpoint: exact round trips, retention, damaged checkpoints, other device counts."""

import json
import logging
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

from tunix_nb import checkpoint, model, parallel, train

REPO = Path(__file__).resolve().parent.parent


def leaves_equal(a, b) -> bool:
    """Bitwise: same tree of leaves, every leaf equal in dtype, shape and every bit."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def state():
    """A tiny model's params and an optimizer state a few steps in (nonzero moments, count 3)."""
    _, params = model.split(model.make_model("tiny", seed=0))
    opt = train.make_optimizer(train.OptimizerConfig(warmup_steps=1, total_steps=10))
    opt_state = opt.init(params)
    grads = jax.tree.map(lambda x: 0.01 * jax.numpy.ones_like(x), params)
    for _ in range(3):
        updates, opt_state = opt.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
    return params, opt_state


def saved_run(ckpt_dir, state, steps=(2, 4), keep=3, async_save=True):
    params, opt_state = state
    manager = checkpoint.make_manager(ckpt_dir, keep=keep, async_save=async_save)
    for s in steps:
        bump = jax.tree.map(lambda x: x + s, params)  # a different state per step
        checkpoint.save(manager, s, params=bump, opt_state=opt_state, meta={"seed": 7},
                        rng=jax.random.fold_in(jax.random.key(7), s))
    manager.wait_until_finished()
    return manager


def test_round_trip_is_exact_latest_or_given_step(tmp_path, state):
    params, opt_state = state
    manager = saved_run(tmp_path / "run", state)  # async saves, the default
    got_params, got_opt, meta = checkpoint.restore(manager, params_like=params, opt_state_like=opt_state)
    assert meta["step"] == 4 and meta["seed"] == 7
    assert leaves_equal(got_params, jax.tree.map(lambda x: x + 4, params))
    assert leaves_equal(got_opt, opt_state)
    assert int(got_opt[1][0].count) == 3  # the schedule's step count comes back as saved
    assert np.array_equal(jax.random.key_data(meta["rng"]),
                          jax.random.key_data(jax.random.fold_in(jax.random.key(7), 4)))
    got_params, _, meta = checkpoint.restore(manager, params_like=params, opt_state_like=opt_state, step=2)
    assert meta["step"] == 2 and leaves_equal(got_params, jax.tree.map(lambda x: x + 2, params))
    loaded = checkpoint.load_params(tmp_path / "run")  # host NumPy, no model needed
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(loaded))
    assert leaves_equal(checkpoint.params_into(params, loaded), jax.tree.map(lambda x: x + 4, params))
    assert checkpoint.load_meta(tmp_path / "run", step=2)["step"] == 2
    with pytest.raises(FileNotFoundError, match=r"No checkpoint for step 3 .* have \[2, 4\]"):
        checkpoint.restore(manager, params_like=params, opt_state_like=opt_state, step=3)


def test_retention_keeps_exactly_the_newest_n(tmp_path, state):
    saved_run(tmp_path / "run", state, steps=range(1, 8), keep=3)
    on_disk = sorted(int(p.name) for p in (tmp_path / "run").iterdir() if p.name.isdigit())
    assert on_disk == [5, 6, 7]
    with pytest.raises(ValueError, match="keep=0 must be at least 1"):
        checkpoint.make_manager(tmp_path / "other", keep=0)


def test_save_refuses_a_step_that_orbax_would_skip(tmp_path, state):
    params, opt_state = state
    manager = saved_run(tmp_path / "run", state)
    with pytest.raises(ValueError, match=r"Step 4 is not newer than the latest checkpoint \(4\)"):
        checkpoint.save(manager, 4, params=params, opt_state=opt_state, meta={})


def test_replicated_state_is_saved_once_and_replicated_again(tmp_path, state):
    params, opt_state = state
    n = jax.local_device_count()
    rep_params, rep_opt = parallel.replicate((params, opt_state), n)
    manager = checkpoint.make_manager(tmp_path / "run")
    checkpoint.save(manager, 1, params=rep_params, opt_state=rep_opt, meta={}, replicated=True)
    manager.wait_until_finished()
    assert checkpoint.load_params(tmp_path / "run")["embed"]["embedding"].shape == params["embed"]["embedding"].shape
    got_params, got_opt, _ = checkpoint.restore(manager, params_like=params, opt_state_like=opt_state,
                                                replicate_to=n)
    assert got_params["embed"]["embedding"].shape == (n, *params["embed"]["embedding"].shape)
    for i in range(n):  # every device holds the saved state, bit for bit
        copy = jax.tree.map(lambda x: x.addressable_shards[i].data[0], (got_params, got_opt))
        assert leaves_equal(copy, (params, opt_state))


def _truncate_params_data(step_dir: Path):
    files = [p for p in (step_dir / "params").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files
    for p in files:
        with p.open("r+b") as f:
            f.truncate(p.stat().st_size // 3)


def _flip_a_byte_of_params_data(step_dir: Path):
    """Damage that still parses: Orbax reads other numbers, only the checksum notices."""
    for p in (step_dir / "params").rglob("*"):
        if p.is_file() and p.parent.name == "d" and p.parent.parent.name.startswith("ocdbt"):
            data = bytearray(p.read_bytes())
            data[len(data) // 2] ^= 0x5A
            p.write_bytes(data)


def _garble_meta(step_dir: Path):
    (step_dir / "meta" / "metadata").write_text('{"step": 4, "config": ')


@pytest.mark.parametrize("damage, error", [
    (_truncate_params_data, "OUT_OF_RANGE"),
    (_flip_a_byte_of_params_data, "DamagedCheckpointError: params read back with checksum"),
    (_garble_meta, "JSONDecodeError"),
], ids=["truncated-files", "flipped-byte", "garbled-meta"])
def test_damaged_latest_warns_and_falls_back_deleting_nothing(tmp_path, state, damage, error):
    params, opt_state = state
    run = tmp_path / "run"
    saved_run(run, state)
    damage(run / "4")
    files_before = {p: p.stat().st_size for p in run.rglob("*")}
    manager = checkpoint.make_manager(run)  # a fresh process would start like this
    with pytest.warns(checkpoint.DamagedCheckpointWarning,
                      match=r"Checkpoint at step 4 in run could not be restored \(.*" + error) as record:
        got_params, got_opt, meta = checkpoint.restore(manager, params_like=params, opt_state_like=opt_state)
    assert "falling back to step 2" in str(record[0].message)
    assert not any(s in str(w.message) for w in record for s in ("/tmp", "/root", str(tmp_path)))
    assert meta["step"] == 2 and leaves_equal(got_params, jax.tree.map(lambda x: x + 2, params))
    assert leaves_equal(got_opt, opt_state)
    assert {p: p.stat().st_size for p in run.rglob("*")} == files_before  # nothing deleted or changed
    with pytest.raises(checkpoint.DamagedCheckpointError, match="step 4"):  # asked for by step: no fallback
        checkpoint.restore(manager, params_like=params, opt_state_like=opt_state, step=4)
    if damage is not _garble_meta:
        with pytest.warns(checkpoint.DamagedCheckpointWarning, match="step 4"):
            assert leaves_equal(checkpoint.load_params(run), jax.tree.map(lambda x: x + 2, params))


def test_set_aside_moves_a_damaged_step_out_of_the_way_and_keeps_it(tmp_path, state):
    params, opt_state = state
    run = tmp_path / "run"
    manager = saved_run(run, state, keep=2)
    _truncate_params_data(run / "4")
    with pytest.warns(checkpoint.DamagedCheckpointWarning):
        checkpoint.restore(manager, params_like=params, opt_state_like=opt_state)
    moved = checkpoint.set_aside(manager, 4)
    assert moved.name.startswith("4.damaged-") and moved.is_dir() and not (run / "4").exists()
    assert manager.all_steps() == [2]
    for s in (4, 6, 8):  # the step saves again; retention never touches the damaged copy
        checkpoint.save(manager, s, params=params, opt_state=opt_state, meta={})
    manager.wait_until_finished()
    assert manager.all_steps() == [6, 8] and moved.is_dir()
    with pytest.raises(FileNotFoundError, match="No checkpoint directory for step 5"):
        checkpoint.set_aside(manager, 5)


def test_all_damaged_raises_a_clear_error(tmp_path, state):
    params, opt_state = state
    run = tmp_path / "run"
    saved_run(run, state)
    for s in ("2", "4"):
        _garble_meta(run / s)
    with pytest.warns(checkpoint.DamagedCheckpointWarning):
        with pytest.raises(checkpoint.DamagedCheckpointError, match="No checkpoint in run could be restored"):
            checkpoint.restore(checkpoint.make_manager(run), params_like=params, opt_state_like=opt_state)


def test_checksum_ignores_key_types_and_placement_but_not_values(state):
    params, _ = state
    pure = checkpoint._pure(params)
    as_strings = {"blocks": {str(k): v for k, v in pure["blocks"].items()},
                  **{k: v for k, v in pure.items() if k != "blocks"}}
    host = jax.tree.map(np.asarray, as_strings)
    assert checkpoint.checksum(pure) == checkpoint.checksum(host)
    host["embed"]["embedding"] = host["embed"]["embedding"].copy()
    host["embed"]["embedding"].flat[0] = np.nextafter(host["embed"]["embedding"].flat[0], np.float32(1))
    assert checkpoint.checksum(pure) != checkpoint.checksum(host)


# ------------------------------------------- another device count, in separate processes

ELASTIC = textwrap.dedent("""
    import json, sys
    from tunix_nb import devices
    n, mode, ckpt, start, steps, dump_in, dump_out = json.loads(sys.argv[1])
    devices.simulate_cpu_devices(n)
    import jax, numpy as np
    from tunix_nb import checkpoint, data, model, parallel, sft, train
    from tunix_nb.tokenizer import ByteTokenizer

    graphdef, params = model.split(model.make_model("tiny", seed=0))
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=3e-3, warmup_steps=2, total_steps=12))
    opt_state = opt.init(params)
    manager = checkpoint.make_manager(ckpt, keep=5)
    if start:  # restore onto this process's devices and check every copy against the dump
        rep_params, rep_opt, meta = checkpoint.restore(manager, params_like=params, opt_state_like=opt_state,
                                                       replicate_to=n if mode == "pmap" else None)
        assert meta["step"] == start, meta
        saved = np.load(dump_in)
        copies = range(n) if mode == "pmap" else [None]
        for i in copies:
            got = jax.tree.leaves((rep_params, rep_opt)) if i is None else [
                x.addressable_shards[i].data[0] for x in jax.tree.leaves((rep_params, rep_opt))]
            assert len(got) == len(saved.files)
            for k, x in enumerate(got):
                want = saved[f"leaf{k}"]
                assert x.dtype == want.dtype and np.array_equal(np.asarray(x), want), (i, k)
        params, opt_state, _ = checkpoint.restore(manager, params_like=params, opt_state_like=opt_state)
    rows = data.sft_arrays(data.load_sft(), ByteTokenizer(), data.DEFAULT_SEQ_LEN)
    step_fn = train.make_step(sft.objective(graphdef), opt, parallel_mode=mode)
    params, opt_state, hist = train.run(step_fn, params, opt_state,
                                        lambda s: data.batch_at(rows, s, 16, seed=0),
                                        steps=steps, start_step=start, parallel_mode=mode, progress=False)
    checkpoint.save(manager, start + steps, params=params, opt_state=opt_state, meta={"devices": n})
    manager.wait_until_finished()
    np.savez(dump_out, **{f"leaf{k}": np.asarray(x) for k, x in enumerate(jax.tree.leaves((params, opt_state)))})
    print(f"ok {n} {mode} step {start + steps} loss {hist[-1]['loss']:.4f}")
""")


def run_on(n, mode, ckpt, start, steps, dump_in, dump_out):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", ELASTIC, json.dumps([n, mode, str(ckpt), start, steps,
                                                                       str(dump_in), str(dump_out)])],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_restore_onto_8_then_4_then_1_devices_is_exact(tmp_path):
    """Train on 8 devices (pmap), resume on 4 (pmap), then on 1 (jit): each restore equals
    the state the previous process held in memory when it saved, bit for bit, on every device."""
    ckpt = tmp_path / "run"
    assert "ok 8 pmap step 4" in run_on(8, "pmap", ckpt, 0, 4, None, tmp_path / "s4.npz")
    assert "ok 4 pmap step 8" in run_on(4, "pmap", ckpt, 4, 4, tmp_path / "s4.npz", tmp_path / "s8.npz")
    assert "ok 1 jit step 12" in run_on(1, "jit", ckpt, 8, 4, tmp_path / "s8.npz", tmp_path / "s12.npz")
    final = np.load(tmp_path / "s12.npz")
    loaded = jax.tree.leaves(checkpoint.load_params(ckpt))
    assert checkpoint.load_meta(ckpt)["devices"] == 1
    # the params are the first leaves of (params, opt_state), in the same order
    assert all(np.array_equal(x, final[f"leaf{k}"]) for k, x in enumerate(loaded))


# ------------------------------------------- no lasting side effects on logging and hooks

IMPORT_SIDE_EFFECTS = textwrap.dedent("""
    import logging, sys, warnings
    import jax, orbax.checkpoint, flax.nnx  # what the dependencies change on import is theirs
    from tunix_nb import model, parallel

    def settings():
        loggers = {name: (lg.level, list(lg.filters), list(lg.handlers))
                   for name, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger)}
        loggers["(root)"] = (logging.root.level, list(logging.root.filters), list(logging.root.handlers))
        return loggers, sys.unraisablehook, list(warnings.filters)

    (loggers, hook, filters) = settings()
    import tunix_nb.checkpoint
    (loggers_after, hook_after, filters_after) = settings()
    changed = sorted(name for name, s in loggers.items() if loggers_after[name] != s)
    new_set = sorted(name for name, s in loggers_after.items() if name not in loggers and s != (0, [], []))
    assert not changed and not new_set, (changed, new_set)
    assert hook_after is hook and filters_after == filters
    print("unchanged")
""")


def test_importing_checkpoint_changes_no_logging_setting_or_hook():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", IMPORT_SIDE_EFFECTS], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=240)
    assert out.returncode == 0 and "unchanged" in out.stdout, out.stderr[-3000:]


def logging_and_hooks():
    asyncio_logger, absl_logger = logging.getLogger("asyncio"), logging.getLogger("absl")
    return (sys.unraisablehook, list(asyncio_logger.filters), asyncio_logger.level, absl_logger.level,
            list(warnings.filters))


def test_a_failed_read_leaves_no_hook_or_filter_behind(tmp_path, state):
    params, opt_state = state
    run = tmp_path / "run"
    saved_run(run, state)
    _truncate_params_data(run / "4")
    with pytest.warns(checkpoint.DamagedCheckpointWarning):
        before = logging_and_hooks()
        checkpoint.restore(checkpoint.make_manager(run), params_like=params, opt_state_like=opt_state)
        assert logging_and_hooks() == before
        with pytest.raises(checkpoint.DamagedCheckpointError):
            checkpoint.load_params(run, step=4)
        assert logging_and_hooks() == before


# ------------------------------------------- the one fallback over damaged checkpoints


def test_newest_readable_falls_back_and_names_each_damaged_step(tmp_path, state):
    run = tmp_path / "run"
    saved_run(run, state, steps=(2, 4, 6))
    tried = []

    def read(manager, step):
        tried.append(step)
        if step > 2:
            raise ValueError(f"unreadable {run}/{step}")  # the machine's path is left out of the warning
        return step

    with pytest.warns(checkpoint.DamagedCheckpointWarning) as record:
        assert checkpoint.newest_readable(run, read) == 2
    assert tried == [6, 4, 2]
    assert [str(w.message)[:40] for w in record] == ["Checkpoint at step 6 in run could not be",
                                                     "Checkpoint at step 4 in run could not be"]
    assert "falling back to step 4" in str(record[0].message) and str(tmp_path) not in str(record[0].message)
    assert all(w.filename == __file__ for w in record)  # the warning names the caller's line
    with pytest.raises(checkpoint.DamagedCheckpointError, match="Checkpoint at step 4 in run is damaged"):
        checkpoint.newest_readable(checkpoint.make_manager(run), read, step=4)
    with pytest.raises(FileNotFoundError, match=r"No checkpoint for step 5 .* have \[2, 4, 6\]"):
        checkpoint.newest_readable(run, read, step=5)
    with pytest.raises(FileNotFoundError, match="No checkpoints in .*empty; save one there first"):
        checkpoint.newest_readable(checkpoint.make_manager(tmp_path / "empty"), read)


def test_newest_readable_meta_is_quiet_and_none_when_nothing_reads(tmp_path, state, recwarn):
    run = tmp_path / "run"
    manager = saved_run(run, state)
    assert checkpoint.newest_readable_meta(checkpoint.make_manager(tmp_path / "empty")) is None
    _garble_meta(run / "4")
    assert checkpoint.newest_readable_meta(manager)["step"] == 2
    _garble_meta(run / "2")
    assert checkpoint.newest_readable_meta(manager) is None
    assert not recwarn.list


# ------------------------------------------- a model from a checkpoint


@pytest.mark.parametrize("name, preset", [("teacher", "teacher"), ("sft_student", "student")])
def test_load_model_builds_the_shipped_checkpoints(name, preset):
    from tunix_nb import data

    ckpt = data.DATA_DIR / name
    graphdef, params, meta = checkpoint.load_model(ckpt)
    assert meta == checkpoint.load_meta(ckpt) and meta["model"] == preset
    # the same as building the preset, splitting it and filling it in by hand
    graphdef_by_hand, like = model.split(model.make_model(preset))
    by_hand = checkpoint.params_into(like, checkpoint.load_params(ckpt))
    assert leaves_equal(params, by_hand)
    tokens = np.arange(2 * 8, dtype=np.int32).reshape(2, 8) % 97
    np.testing.assert_array_equal(model.apply(graphdef, params, tokens),
                                  model.apply(graphdef_by_hand, by_hand, tokens))


def test_load_model_reads_the_run_config_and_names_a_missing_or_unknown_preset(tmp_path):
    _, params = model.split(model.make_model("tiny", seed=3))
    checkpoint.export_params(params, tmp_path / "in_config", step=1, meta={"config": {"model": "tiny"}})
    graphdef, got, meta = checkpoint.load_model(tmp_path / "in_config")
    assert meta["step"] == 1 and leaves_equal(got, params)
    checkpoint.export_params(params, tmp_path / "none", step=1, meta={})
    with pytest.raises(ValueError, match="names no model preset.*params_into"):
        checkpoint.load_model(tmp_path / "none")
    checkpoint.export_params(params, tmp_path / "unknown", step=1, meta={"model": "giant"})
    with pytest.raises(ValueError, match=r"names the model 'giant', which is not a preset; the presets are \["):
        checkpoint.load_model(tmp_path / "unknown")
    checkpoint.export_params(params, tmp_path / "other", step=1, meta={"model": "student"})
    with pytest.raises(ValueError, match="do not fit that preset"):
        checkpoint.load_model(tmp_path / "other")


# ------------------------------------------- checkpoints to ship


def test_exported_checkpoint_holds_no_machine_path_and_loads_without_commit_files(tmp_path):
    _, params = model.split(model.make_model("tiny", seed=0))
    out = tmp_path / "export"
    checkpoint.export_params(params, out, step=7, meta={"model": "tiny"})
    assert not list(out.rglob("commit_success.txt"))
    assert not [p for p in out.rglob("*") if p.is_file() and str(tmp_path).encode() in p.read_bytes()]
    _, got, meta = checkpoint.load_model(out)
    assert meta["step"] == 7 and leaves_equal(got, params)


# ------------------------------------------- the checksum gathers nothing


@pytest.mark.needs_devices(8)
def test_a_save_on_8_devices_checksums_each_shard_where_it_lives(tmp_path, monkeypatch):
    """FSDP state on 8 simulated devices (1 MiB a shard, 8 MiB an array): a save copies no array whole
    to the host (the checksum of before gathered each one), and the host memory it allocates
    (tracemalloc's peak, around the save and its commit) stays under 2 shards. The checksum equals
    the host copy's, and a restore onto the mesh verifies each array as each device read it."""
    import tracemalloc

    import optax
    from jax._src import array as jax_array

    mesh = parallel.make_mesh(8)
    keys = jax.random.split(jax.random.key(0), 2)
    params = {name: jax.random.normal(k, (8192, 256)) for name, k in zip("wv", keys)}
    params = jax.device_put(params, parallel.fsdp_shardings(params, mesh))
    opt_state = optax.adam(1e-3).init(params)
    shard_bytes = max(s.data.nbytes for x in jax.tree.leaves((params, opt_state)) for s in x.addressable_shards)
    assert shard_bytes == 8192 * 256 * 4 // 8 == 2**20  # every leaf split 8 ways
    manager = checkpoint.make_manager(tmp_path / "run")
    checkpoint.save(manager, 1, params=params, opt_state=opt_state, meta={})  # compiles, imports: not measured
    manager.wait_until_finished()
    # tracemalloc does not see JAX's own host buffers: list the arrays larger than a shard copied to the host
    whole_copies, value = [], jax_array.ArrayImpl._value
    monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(
        lambda x: (whole_copies.append(x.shape) if x.nbytes > shard_bytes else None, value.fget(x))[1]))
    tracemalloc.start()
    try:
        checkpoint.save(manager, 2, params=params, opt_state=opt_state, meta={})
        manager.wait_until_finished()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        monkeypatch.undo()
    print(f"tracemalloc peak during a save: {peak / shard_bytes:.2f} shards ({peak:,} bytes); "
          f"arrays copied whole to the host: {whole_copies}")
    assert whole_copies == [] and peak <= 2 * shard_bytes
    sums = checkpoint.load_meta(tmp_path / "run")["checksums"]
    assert sums["params"] == checkpoint.checksum(jax.tree.map(np.asarray, params))
    got, _, _ = checkpoint.restore(manager, params_like=params, opt_state_like=opt_state, mesh=mesh,
                                   parallel_mode="fsdp")
    assert leaves_equal(got, params) and got["w"].sharding.is_equivalent_to(params["w"].sharding, 2)


def test_a_checkpoint_with_the_older_whole_array_checksum_is_still_verified(tmp_path, state):
    params, opt_state = state
    manager = saved_run(tmp_path / "run", state, steps=(2,), async_save=False)
    meta_file = tmp_path / "run" / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    assert meta["checksums"]["params"].startswith(checkpoint.CHECKSUM_PREFIX)
    bumped = jax.tree.map(lambda x: x + 2, params)
    meta["checksums"]["params"] = checkpoint._crc32_of_whole_arrays(bumped)  # as written before the prefix
    meta_file.write_text(json.dumps(meta))
    assert leaves_equal(checkpoint.restore(manager, params_like=params, opt_state_like=opt_state, step=2)[0], bumped)
    meta["checksums"]["params"] = checkpoint._crc32_of_whole_arrays(params)  # other numbers: caught
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(checkpoint.DamagedCheckpointError, match="params read back with checksum"):
        checkpoint.restore(manager, params_like=params, opt_state_like=opt_state, step=2)
