"""The messages between the API server and the engine-core process (ARCHITECTURE.md "Processes"): msgspec
structs, msgpack-encoded, over ZeroMQ. Plain data only (token ids, SamplingParams, EngineOutputs, stats dicts).

    API server --(input socket, PUSH->PULL)--> core:  AddRequest | AddRequests | AbortRequests | FinishProcessed |
                                                      Utility | Stop
    core --(output socket, PUSH->PULL)--> API server: Ready | AddAck | StepOutputs | UtilityResult | CoreDead

Every core->server message after Ready carries the scheduler's stats snapshot (`stats`: SchedulerStats fields,
and `step_host_s`: the per-phase host-time totals of EngineCore.step), so /metrics reads the state of the last
message without asking.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

from ladle.core.outputs import EngineOutput
from ladle.core.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add"):
    """One prompt: its `n` child ids (from the server's OutputProcessor), token ids and params."""

    parent_id: str
    child_ids: list[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


class AddRequests(msgspec.Struct, tag="adds"):
    """The prompts of one offline `LLM.generate` call, added together: all or none (one AddAck per prompt, each
    with the error when any prompt is refused), and no step runs between them, so the first step's batch is the
    same as with the core in-process."""

    requests: list[AddRequest]


class AbortRequests(msgspec.Struct, tag="abort"):
    child_ids: list[str]


class FinishProcessed(msgspec.Struct, tag="finish"):
    """What the server's output processing ended: (child id, stop string) hits and failed child ids."""

    stop_hits: list[tuple[str, str]]
    failed_ids: list[str]


class Utility(msgspec.Struct, tag="call"):
    """A request for an observe record (ladle/engine/observe_snapshots.py), answered by UtilityResult."""

    call_id: int
    name: str
    kwargs: dict[str, Any]


class Stop(msgspec.Struct, tag="stop"):
    pass


class Ready(msgspec.Struct, tag="ready"):
    """The core is built: what the server needs (its tokenizer, pickled, for chat templates, detokenization and
    stop strings; the config for /version and /v1/models)."""

    model_name: str
    tokenizer: bytes
    engine_config: bytes  # the resolved EngineConfig, pickled (frozen dataclasses, read once at startup)
    max_model_len: int
    stats: dict[str, Any] = {}  # the first stats snapshot (KV blocks) for /metrics before any request


class AddAck(msgspec.Struct, tag="ack"):
    """`error` None: queued. Otherwise `rejected` tells RequestRejected (a 400) from any other failure."""

    parent_id: str
    error: Optional[str] = None
    rejected: bool = False
    stats: dict[str, Any] = {}


class StepOutputs(msgspec.Struct, tag="out"):
    outputs: list[EngineOutput]
    stats: dict[str, Any]


class UtilityResult(msgspec.Struct, tag="result"):
    call_id: int
    result: Any = None
    error: Optional[str] = None


class CoreDead(msgspec.Struct, tag="dead"):
    message: str


ToCore = Union[AddRequest, AddRequests, AbortRequests, FinishProcessed, Utility, Stop]
FromCore = Union[Ready, AddAck, StepOutputs, UtilityResult, CoreDead]

encoder = msgspec.msgpack.Encoder()
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_decoder = msgspec.msgpack.Decoder(FromCore)
