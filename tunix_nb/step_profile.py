"""Where a compiled step's device time goes, read from a `jax.profiler` trace.

Each traced op is matched by name to its instruction in the compiled HLO, and from there to
- its kind: a matmul (a dot or convolution, alone or inside the fusion it calls), a layout copy
  (copy or transpose), a container (while, call, conditional: its body's ops are traced on
  their own, so the container's time is left out of the sums), or other work;
- the kit's function it comes from: the innermost frame of the HLO's stack trace in a file of
  `tunix_nb` (e.g. "model.py:attend"), else the innermost frame (e.g. optax's "apply_updates").

Beside the ops, the device's own timeline of whole programs (the TPU's "XLA Modules" line) gives
the gaps between one step's program and the next: time the device waited on the host.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

CONTAINERS = ("while", "call", "conditional", "async-start", "async-done")
MATMUL_OPCODES = ("dot", "convolution")
LAYOUT_OPCODES = ("copy", "transpose", "copy-start", "copy-done")
KIT_FILE = re.compile(r"tunix_nb/(?P<file>[\w/]+\.py)$")


def trace_events(trace_dir) -> list[dict]:
    """The events of the newest `*.trace.json.gz` under `trace_dir` (what `jax.profiler` writes)."""
    traces = sorted(Path(trace_dir).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    return json.loads(gzip.decompress(traces[-1].read_bytes()))["traceEvents"] if traces else []


@dataclass
class HloIndex:
    """The compiled HLO's instructions by name, with each one's opcode, the opcodes of the
    computation it calls, and the function it comes from."""

    lines: dict = field(default_factory=dict)      # instruction name -> its line
    opcode: dict = field(default_factory=dict)     # instruction name -> opcode
    calls: dict = field(default_factory=dict)      # instruction name -> called computation
    body_opcodes: dict = field(default_factory=dict)  # computation -> set of opcodes in it
    frames: dict = field(default_factory=dict)     # stack frame id -> "file:function"

    def kind(self, name: str) -> str:
        opcode = self.opcode.get(name, "")
        called = self.body_opcodes.get(self.calls.get(name, ""), set())
        if opcode in CONTAINERS:
            return "container"
        if opcode in MATMUL_OPCODES or called & set(MATMUL_OPCODES):
            return "matmul"
        if opcode in LAYOUT_OPCODES or (called and called <= set(LAYOUT_OPCODES) | {"parameter", "bitcast"}):
            return "layout copy"
        return "other"

    def source(self, name: str) -> str:
        """"file:function" of the op's stack frame; else "op:" and the JAX operation it lowers
        (the op_name's last part, e.g. "op:dynamic_update_slice"); else ""."""
        line = self.lines.get(name, "")
        found = re.search(r"stack_frame_id=(\d+)", line)
        if found and int(found.group(1)) in self.frames:
            return self.frames[int(found.group(1))]
        op_name = re.search(r'op_name="([^"]*)"', line)
        return "op:" + op_name.group(1).rsplit("/", 1)[-1] if op_name else ""


INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?(?P<name>[\w.\-]+) = (?P<shape>.+?) (?P<opcode>[\w\-]+)\(")
COMPUTATION = re.compile(r"^(?:ENTRY )?%?(?P<name>[\w.\-]+) .*\{$")


def _numbered(section: str, hlo_text: str) -> dict:
    """A table of the HLO's stack-trace sections ("FileNames", "FunctionNames", ...): id -> text."""
    found = re.search(rf"^{section}\n(.*?)(?:\n\n|\Z)", hlo_text, re.M | re.S)
    return {int(i): rest for i, rest in (line.split(" ", 1) for line in found.group(1).splitlines())} if found else {}


def _frames(hlo_text: str) -> dict:
    """Stack frame id -> "file:function" of its innermost frame in the kit, else its innermost."""
    files = {i: name.strip('"') for i, name in _numbered("FileNames", hlo_text).items()}
    functions = {i: name.strip('"') for i, name in _numbered("FunctionNames", hlo_text).items()}
    locations = {i: dict(re.findall(r"(\w+)=(\d+)", text)) for i, text in _numbered("FileLocations", hlo_text).items()}
    stack = {i: dict(re.findall(r"(\w+)=(\d+)", text)) for i, text in _numbered("StackFrames", hlo_text).items()}

    def where(frame_id: int) -> tuple[str, str]:
        location = locations.get(int(stack[frame_id]["file_location_id"]), {})
        return files.get(int(location.get("file_name_id", 0)), ""), functions.get(int(location.get("function_name_id", 0)), "")

    named = {}
    for start_id in stack:
        chain, frame_id, seen = [], start_id, set()
        while frame_id in stack and frame_id not in seen:  # a root frame is its own parent
            seen.add(frame_id)
            chain.append(where(frame_id))
            frame_id = int(stack[frame_id]["parent_frame_id"])
        kit = [(found.group("file"), function) for file, function in chain if (found := KIT_FILE.search(file))]
        file, function = kit[0] if kit else (Path(chain[0][0]).name, chain[0][1])
        named[start_id] = f"{file}:{function}"
    return named


def hlo_index(hlo_text: str) -> HloIndex:
    """Index a compiled program's HLO text (`compiled.as_text()`)."""
    index, computation = HloIndex(), ""
    for line in hlo_text.splitlines():
        header = COMPUTATION.match(line)
        if header and "=" not in line.split("{")[0]:
            computation = header.group("name")
            index.body_opcodes.setdefault(computation, set())
            continue
        found = INSTRUCTION.match(line)
        if not found:
            continue
        name, opcode = found.group("name"), found.group("opcode")
        index.lines[name], index.opcode[name] = line, opcode
        index.body_opcodes[computation].add(opcode)
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if called:
            index.calls[name] = called.group(1)
    index.frames = _frames(hlo_text)
    return index


def op_seconds(events, index: HloIndex, calls: float) -> Counter:
    """Seconds per call of each traced op that is an instruction of the program (`calls` may be
    a fraction: the calls' worth of time the trace window holds)."""
    seconds = Counter()
    for event in events:
        name = str(event.get("name", "")).lstrip("%")
        if "dur" in event and name in index.lines:
            seconds[name] += event["dur"] * 1e-6 / calls
    return seconds


def summarise(events, hlo_text: str, *, calls: float, top: int = 10) -> dict:
    """The traced ops of `calls` calls of one program, per call: by kind, by the function they
    come from, and the slowest ops. Containers' own time is left out (their body's ops count)."""
    index = hlo_index(hlo_text)
    seconds = op_seconds(events, index, calls)
    containers = {n for n in seconds if index.kind(n) == "container"}
    for name in containers:
        del seconds[name]
    total = sum(seconds.values())
    if not total:
        return {"calls": calls, "traced_seconds": 0.0, "note": "the trace names none of the program's ops"}
    by_kind, by_source = Counter(), Counter()
    for name, t in seconds.items():
        by_kind[index.kind(name)] += t
        by_source[index.source(name) or "(no source)"] += t

    def shares(counter, n):
        return [{"name": k, "seconds": t, "share": t / total} for k, t in counter.most_common(n)]

    def described(name, t):
        shape = INSTRUCTION.match(index.lines[name]).group("shape")
        return {"op": name, "seconds": t, "share": t / total, "kind": index.kind(name), "shape": shape,
                "source": index.source(name)}

    return {"calls": calls, "traced_seconds": total, "ops": len(seconds),
            "by_kind": shares(by_kind, None), "by_source": shares(by_source, top),
            "top_ops": [described(n, t) for n, t in seconds.most_common(top)]}


def thread_names(events) -> dict:
    """(pid, tid) -> "process / thread", from the trace's metadata events."""
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return {(e["pid"], e["tid"]): f"{processes.get(e['pid'], e['pid'])} / {e['args']['name']}"
            for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}


def program_gaps(events, program: str = "jit_step") -> dict | None:
    """The device's timeline of whole programs (a thread named "XLA Modules"): how long each run of
    `program` took, and the device's idle time between one run's end and the next run's start.
    None where the trace has no such line (a CPU's)."""
    threads = {key for key, name in thread_names(events).items() if name.endswith("XLA Modules")}
    runs = sorted((e["ts"], e["dur"]) for e in events
                  if "dur" in e and (e.get("pid"), e.get("tid")) in threads and str(e.get("name", "")).startswith(program))
    if not threads:
        return None
    others = sorted({str(e.get("name")) for e in events if "dur" in e and (e.get("pid"), e.get("tid")) in threads
                     and not str(e.get("name", "")).startswith(program)})[:20]
    if len(runs) < 2:
        return {"runs": len(runs), "other_programs": others}
    gaps = [(b_ts - (a_ts + a_dur)) * 1e-6 for (a_ts, a_dur), (b_ts, _) in zip(runs, runs[1:])]
    span = (runs[-1][0] + runs[-1][1] - runs[0][0]) * 1e-6
    return {"runs": len(runs), "run_seconds": [d * 1e-6 for _, d in runs], "idle_between_runs_seconds": gaps,
            "busy_share": sum(d for _, d in runs) * 1e-6 / span,
            "other_programs": others}


def lines_summary(events, top: int = 12) -> list[dict]:
    """The trace's busiest lines (process / thread) by summed event time: what the trace holds,
    for a backend whose op names do not match the HLO's."""
    names, busy = thread_names(events), Counter()
    for e in events:
        if "dur" in e:
            busy[names.get((e.get("pid"), e.get("tid")), f"{e.get('pid')}/{e.get('tid')}")] += e["dur"] * 1e-6
    return [{"line": k, "seconds": t} for k, t in busy.most_common(top)]
