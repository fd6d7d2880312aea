"""One step launched by the ModelRunner, from its sampled tensors on the device to its RunnerOutput on the host.

`ModelRunner.launch` ends with `LaunchedStep.start(...)`: the sampled ids and, when asked, the logprob floats
(packed behind them in one float32 buffer; ids are exact in float32 below 2^24) start their one device->host copy
without waiting. On CUDA that is a non-blocking copy into pinned host memory followed by a CUDA event; elsewhere the
values are already on the host. `ModelRunner.wait(step)` = `step.finish()`: wait for the event (the "wait" phase of
EngineCore.step_host_s), turn the buffer into lists, append the sampled tokens to the requests' RequestStates and
return the RunnerOutput. Between the two the host may schedule and launch the next step, whose placeholder tokens
are filled on the device from `sampled` (asynchronous scheduling, ladle/engine/engine_core.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ladle.core.outputs import RunnerOutput
from ladle.runner.request_state import RequestState
from ladle.runner.sampler import unpack_logprobs


@dataclass
class LaunchedStep:
    """A step whose device work is queued and whose results are on their way to the host.

    sample_ids / states: request id and RequestState of each sampled row, in row order (states are held by
        reference: one dropped meanwhile, its request finished or preempted, is appended harmlessly).
    sampled: [S] int64 on the device, the sampled ids (None when the step sampled nothing); the next step's
        placeholders are gathered from it.
    num_top: logprob alternatives per sampled row when some row asked for logprobs, else None.
    prompt_specs: (request_id, positions, num_top) per chunk with prompt logprobs, in buffer order.
    host: the buffer on the host, [S] int64 alone, or float32 [S + packed logprob floats]; event: the CUDA event
        recorded after its copy (None: already complete).
    begin_event / done_event: CUDA timing events recorded before the step's first device work and after its last
        (None off CUDA and unless the runner records them, ModelRunner record_step_events): the engine reads the
        device's idle time between consecutive steps from them (EngineCore.step_host_s "device_idle").
    """

    sample_ids: list[str] = field(default_factory=list)
    states: list[RequestState] = field(default_factory=list)
    sampled: Optional[torch.Tensor] = None
    num_top: Optional[int] = None
    prompt_specs: list[tuple[str, int, int]] = field(default_factory=list)
    host: Optional[torch.Tensor] = None
    event: Any = None
    begin_event: Any = None
    done_event: Any = None
    _rows: Optional[dict[str, int]] = None

    @classmethod
    def start(cls, sample_ids: list[str], states: list[RequestState], sampled: Optional[torch.Tensor],
              packs: list[torch.Tensor], num_top: Optional[int],
              prompt_specs: list[tuple[str, int, int]]) -> "LaunchedStep":
        """Start the step's one device->host copy: `sampled` [S] int64 and the flattened float32 `packs` after it."""
        step = cls(sample_ids, states, sampled, num_top, prompt_specs)
        if sampled is None and not packs:
            return step
        if packs:
            ids_f = sampled.to(torch.float32) if sampled is not None else packs[0].new_zeros(0)
            device_buf = torch.cat([ids_f] + packs)
        else:
            device_buf = sampled
        if device_buf.device.type == "cuda":
            step.host = torch.empty(device_buf.shape, dtype=device_buf.dtype, pin_memory=True)
            step.host.copy_(device_buf, non_blocking=True)
            step.event = torch.cuda.Event()
            step.event.record()
        else:
            step.host = device_buf
        for state in states:
            state.num_pending_outputs += 1
        return step

    def row_of(self, request_id: str) -> int:
        """The row of `sampled` that holds this request's token (KeyError when it sampled nothing here)."""
        if self._rows is None:
            self._rows = {rid: j for j, rid in enumerate(self.sample_ids)}
        return self._rows[request_id]

    def finish(self) -> RunnerOutput:
        """Wait for the copy, append the tokens to the states, return the step's RunnerOutput."""
        out = RunnerOutput()
        if self.host is None:
            return out
        if self.event is not None:
            self.event.synchronize()
        values = self.host.tolist()
        n = len(self.sample_ids)
        if self.host.dtype == torch.int64:
            ids, rest = values, []
        else:
            ids, rest = [int(x) for x in values[:n]], values[n:]
        pos = 0
        if self.num_top is not None:
            width = 3 + 2 * self.num_top
            for j, (rid, state) in enumerate(zip(self.sample_ids, self.states)):
                if state.sampling_params.logprobs is not None:
                    out.logprobs[rid] = unpack_logprobs(rest[j * width:(j + 1) * width], state.sampling_params.logprobs)
            pos = width * n
        for rid, count, k in self.prompt_specs:
            width = 3 + 2 * k
            out.prompt_logprobs[rid] = [unpack_logprobs(rest[pos + r * width:pos + (r + 1) * width], k)
                                        for r in range(count)]
            pos += width * count
        out.sampled_token_ids = dict(zip(self.sample_ids, ids))
        for state, token in zip(self.states, ids):
            state.output_token_ids.append(token)
            state.num_pending_outputs -= 1
        self.host = self.event = None  # finished once
        return out
