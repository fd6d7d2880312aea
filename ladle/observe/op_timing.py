"""Measured time per op and local-shape bucket (issue 15, item 1): with `--observe-timing`, every
`--observe-timing-interval`-th step times each op launch; the rest of the steps time nothing.

Sources: on CUDA a pair of CUDA events around the launch ("cuda_events": GPU time, the stream's time between the
two records); on the CPU the host's time.perf_counter ("host_clock", the stand-in the CPU tests use).

Where it hooks (one line per op family; the timing itself lives only here):
  - `@timed_op` on each kernel op's public function (ladle/kernels/*): the launch is labelled with the op's own
    dispatch decision (ladle.observe.dispatch tells the listener set here), so rows are keyed (op, token bucket)
    exactly as /debug/dispatch counts them;
  - `@timed_gemm` on the unquantized GEMM (ladle/layers/linear.py `UnquantizedLinearMethod.apply`): keyed
    (layer name, M bucket, N, K) as ladle.observe.shapes rows are;
  - `note_graph_replay(bucket)` in `CudaGraphRunner.run` (ladle/runner/cuda_graph.py);
  - `ladle.observe.steps` calls `start_step` / `finish_step` around each sampled step.
Only the outermost timed call is timed (an op calling another op counts once, under the outer op).

CUDA graphs: a replay runs no Python, so per-op times come from eager steps only. A sampled step that replays a
graph keeps none of its per-op launches; its whole step time (the step's CUDA events) goes to one row,
"cuda_graph_replay" at the replayed batch bucket. Nothing is timed while a graph is being captured. The snapshot
counts the sampled steps of each kind ("eager", "graph").

No extra synchronisation: CUDA event pairs are read (`elapsed_time`) only once both events have completed
(`query()`), at the next sampled step or when the snapshot is read; by then the step that recorded them has long
ended with its device->host copy of the sampled tokens. Cost: nothing on unsampled steps beyond one attribute
read per op call (measured by benchmarks/observe_cost.py); on a sampled step two event records per launch.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable, Optional

from ladle.observe import dispatch
from ladle.observe.shapes import m_bucket

SOURCE_CUDA = "cuda_events"
SOURCE_HOST = "host_clock"
GRAPH_OP = "cuda_graph_replay"
_POOL_MAX = 4096  # CUDA events kept for reuse

Label = tuple  # (op, bucket, m_bucket or None, n or None, k or None)


class OpTimer:
    """The process-wide per-op timer (`TIMER`). Thread-safe snapshots; the hooks run on the engine thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active = False  # True only during a sampled step
        self._cuda = False
        self.source: Optional[str] = None
        self._depth = 0
        self._frames: list[list] = []  # this step's launches: [label or None, start, stop, default label]
        self._graph_bucket: Optional[str] = None
        self._free: list = []  # reusable CUDA events
        self.names: dict[int, str] = {}  # id(module) -> its name's last part ("qkv_proj", "lm_head")
        self.reset()

    def reset(self) -> None:
        """Clear the measured rows and sampled-step counts (the module names stay)."""
        with self._lock:
            self._rows: dict[Label, list[float]] = {}  # label -> [total_ms, samples]
            self._pending: list[list[list]] = []  # CUDA frames of past steps, not read yet
            self.steps = {"eager": 0, "graph": 0}

    def name_modules(self, model: Any) -> None:
        """Remember each module's name (the last part of its qualified name) to label GEMM rows by it."""
        self.names = {id(mod): name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if name}

    # ---- step bracket (ladle.observe.steps) ---------------------------------------------------------------

    def start_step(self, cuda: bool) -> None:
        """Time the launches of the step that starts now (a sampled step). Launches of an earlier sampled step
        that never finished (it scheduled nothing, or raised) are dropped."""
        self._recycle(self._frames)
        self._frames, self._graph_bucket, self._depth = [], None, 0
        self._cuda = cuda
        self.source = SOURCE_CUDA if cuda else SOURCE_HOST
        if cuda:
            self._resolve()
        dispatch.set_listener(self._label)
        self.active = True

    def abandon(self) -> None:
        """Stop timing without recording the launches (a sampled step that never finished)."""
        self.active = False
        dispatch.set_listener(None)
        self._recycle(self._frames)
        self._frames = []

    def pause(self) -> Optional[tuple[list, Optional[str]]]:
        """The sampled step's launches are all made (--async-scheduling launches the next step before this one's
        results are read): stop timing and hand back (frames, graph bucket) for `finish_step`. None when no step is
        being timed."""
        if not self.active:
            return None
        self.active = False
        dispatch.set_listener(None)
        state, self._frames, self._graph_bucket = (self._frames, self._graph_bucket), [], None
        return state

    def finish_step(self, step_ms: Optional[float], state: Optional[tuple[list, Optional[str]]] = None) -> None:
        """End the sampled step. `step_ms`: the step's time (CUDA events on CUDA, host time on the CPU), charged
        to GRAPH_OP when the step replayed a CUDA graph. `state`: what `pause` returned, when it was called."""
        if state is None:
            self.active = False
            dispatch.set_listener(None)
            state, self._frames = (self._frames, self._graph_bucket), []
        frames, graph_bucket = state
        with self._lock:
            if graph_bucket is not None:
                self.steps["graph"] += 1
                if step_ms is not None:
                    self._add((GRAPH_OP, graph_bucket, None, None, None), step_ms)
                self._recycle(frames)
                return
            self.steps["eager"] += 1
            if self._cuda:
                self._pending.append(frames)
                return
            for label, start, stop, default in frames:
                if stop is not None:
                    self._add(label or default, (stop - start) * 1e3)

    def note_graph_replay(self, bucket: str) -> None:
        """The step replays a CUDA graph of batch bucket `bucket` (called by CudaGraphRunner.run)."""
        if self.active:
            self._graph_bucket = bucket

    # ---- the launch bracket -------------------------------------------------------------------------------

    def call(self, fn: Callable, args: tuple, kwargs: dict, label: Optional[Label]) -> Any:
        """Run fn(*args, **kwargs) timed under `label` (None: the op's dispatch decision labels it)."""
        if self._depth or self._graph_bucket is not None or self._capturing():
            return fn(*args, **kwargs)
        frame = [label, self._now(), None, (getattr(fn, "__name__", "op"), "-", None, None, None)]
        self._frames.append(frame)
        self._depth = 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._depth = 0
            frame[2] = self._now()

    def gemm_label(self, layer: Any, x: Any) -> Label:
        """(layer name, "M<=m", m bucket, N, K) of a GEMM of `x` [..., K] with `layer.weight` [N, K]."""
        n, k = layer.weight.shape[0], layer.weight.shape[-1]
        mb = m_bucket(x.numel() // max(int(x.shape[-1]), 1))
        return (self.names.get(id(layer), type(layer).__name__), f"M<={mb}", mb, int(n), int(k))

    def _label(self, op: str, bucket: str) -> None:
        """dispatch listener: the first decision inside the outermost timed call names it."""
        if self._depth and self._frames[-1][0] is None:
            self._frames[-1][0] = (op, bucket, None, None, None)

    def _now(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        import torch

        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _capturing(self) -> bool:
        if not self._cuda:
            return False
        import torch

        return torch.cuda.is_current_stream_capturing()

    # ---- reading --------------------------------------------------------------------------------------------

    def _add(self, label: Label, ms: float) -> None:
        row = self._rows.setdefault(label, [0.0, 0])
        row[0] += ms
        row[1] += 1

    def _recycle(self, frames: list[list]) -> None:
        if self._cuda:
            for f in frames:
                self._free.extend(e for e in f[1:3] if e is not None and len(self._free) < _POOL_MAX)

    def _resolve(self) -> None:
        """Read the event pairs of past sampled steps whose events have completed (no synchronisation)."""
        with self._lock:
            keep = []
            for frames in self._pending:
                if all(f[2] is not None and f[2].query() for f in frames):
                    for label, start, stop, default in frames:
                        self._add(label or default, start.elapsed_time(stop))
                    self._recycle(frames)
                else:
                    keep.append(frames)
            self._pending = keep

    def snapshot(self) -> dict:
        """{"source": "cuda_events" | "host_clock" | None, "sampled_steps": {"eager", "graph"}, "unread_steps",
        "ops": [{"op", "bucket", "m_bucket", "n", "k", "total_ms", "samples", "mean_us"}]} with the rows sorted
        by total_ms, largest first. GEMM rows carry m_bucket, N, K; kernel-op rows None there."""
        if self._cuda:
            self._resolve()
        with self._lock:
            rows = [{"op": op, "bucket": b, "m_bucket": mb, "n": n, "k": k, "total_ms": ms, "samples": int(c),
                     "mean_us": 1e3 * ms / c} for (op, b, mb, n, k), (ms, c) in self._rows.items()]
            steps, unread = dict(self.steps), len(self._pending)
        rows.sort(key=lambda r: -r["total_ms"])
        return {"source": self.source, "sampled_steps": steps, "unread_steps": unread, "ops": rows}


TIMER = OpTimer()
note_graph_replay = TIMER.note_graph_replay


def timed_op(fn: Callable) -> Callable:
    """Decorator for a kernel op's public function: on a sampled step its launch is timed under its dispatch
    decision (op, bucket); otherwise the call goes straight through."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not TIMER.active:
            return fn(*args, **kwargs)
        return TIMER.call(fn, args, kwargs, None)

    return wrapper


def timed_gemm(fn: Callable) -> Callable:
    """Decorator for a linear method's `apply(self, layer, x, ...)`: on a sampled step the GEMM is timed under
    (layer name, M bucket, N, K)."""

    @functools.wraps(fn)
    def wrapper(method: Any, layer: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        if not TIMER.active:
            return fn(method, layer, x, *args, **kwargs)
        return TIMER.call(fn, (method, layer, x) + args, kwargs, TIMER.gemm_label(layer, x))

    return wrapper
