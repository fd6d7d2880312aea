"""A fake runner and a driver loop for scheduler simulations (no model, no torch).

`FakeRunner` mirrors what the real runner must do with a SchedulerOutput and checks it independently:
it keeps a simulated KV cache (slot -> token id written there, slot = block_id * block_size + offset),
asserts that every position a chunk attends to holds the right token (so a wrong prefix hit, a shared
block overwritten by another request or a lost block after preemption fails loudly), and picks the next
token from what it *read back from the cache* by a fixed rule, so a corrupted cache also changes outputs.
"""

from __future__ import annotations

from typing import Callable, Optional

from ladle.config import SchedulerConfig
from ladle.core.outputs import EngineOutput, RunnerOutput, SchedulerOutput
from ladle.core.request import Request
from ladle.core.sampling_params import SamplingParams
from ladle.core.scheduler import Scheduler


def hash_rule(context: list[int], vocab: int = 1000) -> int:
    """Next token = a deterministic function of the whole context."""
    acc = 17
    for t in context:
        acc = (acc * 1_000_003 + t) % 2_147_483_647
    return acc % vocab


class FakeRunner:
    def __init__(self, block_size: int, rule: Callable[[list[int]], int] = hash_rule) -> None:
        self.block_size = block_size
        self.rule = rule
        self.kv: dict[int, int] = {}  # slot -> token id
        self.tokens: dict[str, list[int]] = {}  # runner-side state per request: known token ids
        self.params: dict[str, SamplingParams] = {}
        self.steps = 0

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self.steps += 1
        for rid in so.finished_request_ids + so.preempted_request_ids:
            del self.tokens[rid]  # the scheduler only names requests the runner holds
            del self.params[rid]
        for new in so.new_requests:
            assert new.request_id not in self.tokens
            self.tokens[new.request_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.params[new.request_id] = new.sampling_params
        out = RunnerOutput()
        seen = set()
        for chunk in so.chunks:
            rid = chunk.request_id
            assert rid not in seen
            seen.add(rid)
            tokens = self.tokens[rid]
            start, n = chunk.start_position, len(chunk.token_ids)
            end = start + n
            assert n >= 1 and chunk.token_ids == tokens[start:end]
            assert 0 not in chunk.block_ids and len(set(chunk.block_ids)) == len(chunk.block_ids)
            assert len(chunk.block_ids) * self.block_size >= end
            context = [self.kv.get(self._slot(chunk.block_ids, p)) for p in range(start)]
            assert context == tokens[:start], f"{rid}: KV cache does not hold its prefix"
            for p in range(start, end):
                self.kv[self._slot(chunk.block_ids, p)] = tokens[p]
            assert chunk.sample == (end == len(tokens) and self.params[rid].max_tokens > 0)
            if chunk.sample:
                token = self.rule(context + chunk.token_ids)
                tokens.append(token)
                out.sampled_token_ids[rid] = token
                out.logprobs[rid] = [(token, -0.5, 1)]
            if chunk.prompt_logprob_positions:
                out.prompt_logprobs[rid] = [
                    [(tokens[p + 1], -float(p + 1), 1)]
                    for p in range(start, start + chunk.prompt_logprob_positions)
                ]
        return out


def make_scheduler(
    *,
    block_size: int = 4,
    num_blocks: int = 64,
    max_model_len: int = 256,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
    )


def make_request(
    rid: str, prompt: list[int], max_tokens: int = 4, eos: tuple[int, ...] = (), **params
) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=eos)


def check_pool(scheduler: Scheduler) -> None:
    """Reference counts equal the number of live requests' block tables holding each block."""
    kv = scheduler.kv_cache_manager
    pool = kv.pool
    expected = [0] * pool.num_blocks
    for rid in scheduler.requests:
        for block_id in kv.get_block_ids(rid):
            expected[block_id] += 1
    for block in pool.blocks[1:]:
        assert block.ref_cnt == expected[block.block_id], block
    assert pool.num_free_blocks == sum(1 for c in expected[1:] if c == 0)


def run(
    scheduler: Scheduler,
    runner: FakeRunner,
    max_steps: int = 10_000,
    on_step: Optional[Callable[[SchedulerOutput], None]] = None,
) -> dict[str, list[EngineOutput]]:
    """Step until no request is unfinished; returns each request's EngineOutputs in order."""
    outputs: dict[str, list[EngineOutput]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        so = scheduler.schedule()
        assert not so.is_empty, "unfinished requests but nothing scheduled (livelock)"
        assert so.num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        assert len(so.chunks) <= scheduler.config.max_num_seqs
        if on_step:
            on_step(so)
        for out in scheduler.update(so, runner.execute(so)):
            outputs.setdefault(out.request_id, []).append(out)
        check_pool(scheduler)
    raise AssertionError("did not finish")


def tokens_of(outputs: list[EngineOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]
