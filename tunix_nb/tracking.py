"""Where a run's metrics go (`--report-to`): JSON lines, TensorBoard event files, or both.

Each tracker takes the same records, `{"step": k, "loss": ..., ...}` of Python numbers,
one per step (and the eval metrics on the steps that evaluate). A resumed run keeps
what the steps up to its checkpoint logged and drops what later steps of the killed run
had logged, so the metrics read as one uninterrupted run's:

- JSON lines (`--metrics-file`): the file is rewritten with the lines of steps <= the
  resumed step; a line cut short by a kill is dropped.
- TensorBoard (`--logging-dir`): every run segment writes its own event file with
  tensorboard's `EventFileWriter` (no TensorFlow needed; the writer PyTorch's
  `SummaryWriter` uses) and each metric as a scalar summary (the scalar plugin's
  metadata on a float64 tensor, as `tensorboard.summary.Writer` writes them but without
  its cast to float32: the JSONL's value exactly). A resumed segment starts
  with a `SessionLog.START` event at its first step, TensorBoard's signal that a run
  restarted there: its reader (`plugin_event_accumulator.EventAccumulator`, what the
  TensorBoard UI loads runs with) discards the earlier events of that step and later.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class JsonlTracker:
    """One JSON line per record in `path`, keeping the lines of steps <= `start`."""

    def __init__(self, path, start: int):
        self.path = Path(path)
        kept = read_jsonl_upto(self.path, start) if self.path.exists() and start > 0 else []
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        pass


def read_jsonl_upto(path: Path, upto: int) -> list[str]:
    """The lines of steps <= upto; a line cut short by a kill is dropped."""
    kept = []
    for line in Path(path).read_text().splitlines():
        try:
            if json.loads(line)["step"] <= upto:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    return kept


class TensorBoardTracker:
    """Scalar summaries of every number in each record, at the record's step, in `logdir`."""

    def __init__(self, logdir, start: int):
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        Path(logdir).mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(str(logdir))
        # each segment starts a session: on a resume, the steps after `start` that the killed run
        # had logged are orphaned, and TensorBoard's readers drop them
        self.writer.add_event(event_pb2.Event(wall_time=time.time(), step=start + 1, session_log=event_pb2.SessionLog(
                status=event_pb2.SessionLog.START)))

    def log(self, record: dict) -> None:
        import numpy as np
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.scalar import metadata as scalar_metadata
        from tensorboard.util import tensor_util

        event = event_pb2.Event(wall_time=time.time(), step=int(record["step"]))
        for tag, value in record.items():
            if tag != "step" and isinstance(value, (int, float)):
                event.summary.value.add(tag=tag, tensor=tensor_util.make_tensor_proto(np.float64(value)),
                                        metadata=summary_pb2.SummaryMetadata(
                                            plugin_data=summary_pb2.SummaryMetadata.PluginData(
                                                plugin_name=scalar_metadata.PLUGIN_NAME),
                                            data_class=summary_pb2.DataClass.DATA_CLASS_SCALAR))
        self.writer.add_event(event)

    def close(self) -> None:
        self.writer.close()


class Trackers:
    """The trackers of `--report-to`, called as one."""

    def __init__(self, trackers):
        self.trackers = list(trackers)

    def log(self, record: dict) -> None:
        for tracker in self.trackers:
            tracker.log(record)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def open_trackers(report_to: str, *, start: int, metrics_file=None, logging_dir=None) -> Trackers:
    """Trackers for the comma-separated `report_to` (jsonl: `metrics_file`, if given; tensorboard:
    `logging_dir`, required), resumed at step `start`."""
    names = report_to.split(",")
    trackers = []
    if "jsonl" in names and metrics_file:
        trackers.append(JsonlTracker(metrics_file, start))
    if "tensorboard" in names:
        if not logging_dir:
            raise ValueError("--report-to tensorboard needs --logging-dir (or --ckpt-dir, whose tensorboard/ "
                             "folder is the default)")
        trackers.append(TensorBoardTracker(logging_dir, start))
    return Trackers(trackers)


def read_tensorboard_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of the scalar summaries in `logdir`, as TensorBoard reads them
    (the UI's `EventAccumulator`, which drops the events a resumed run orphaned)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    accumulator = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    accumulator.Reload()
    return {tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in accumulator.Tensors(tag)]
            for tag in accumulator.Tags()["tensors"]}
