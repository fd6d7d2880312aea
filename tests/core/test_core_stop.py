"""Stop checks in update(): EOS, stop_token_ids, min_tokens, ignore_eos, max_tokens, max_model_len."""

import pytest
from core_sim import FakeRunner, make_request, make_scheduler, run, tokens_of

from ladle.core.outputs import FINISH_LENGTH, FINISH_STOP
from ladle.core.sampling_params import SamplingParams
from ladle.core.request import Request

PROMPT = [11, 12, 13]
EOS = 2
SCRIPT = [5, 2, 7, 9, 2, 3, 4, 6, 8, 10]  # the tokens the fake model emits, in order


def _generate(eos=(EOS,), max_model_len=256, **params):
    sched = make_scheduler(max_model_len=max_model_len)
    runner = FakeRunner(4, rule=lambda ctx: SCRIPT[len(ctx) - len(PROMPT)])
    sched.add_request(make_request("a", PROMPT, eos=eos, **params))
    outs = run(sched, runner)["a"]
    assert all(o.finish_reason is None for o in outs[:-1])
    return tokens_of(outs), outs[-1].finish_reason, outs[-1].stop_reason


@pytest.mark.parametrize(
    "params, want",
    [
        (dict(max_tokens=8), ([5, 2], FINISH_STOP, None)),  # EOS, stop_reason None
        (dict(max_tokens=8, ignore_eos=True), (SCRIPT[:8], FINISH_LENGTH, None)),
        (dict(max_tokens=8, min_tokens=2), ([5, 2], FINISH_STOP, None)),  # output 2 is EOS: 2 >= min_tokens
        (dict(max_tokens=8, min_tokens=3), ([5, 2, 7, 9, 2], FINISH_STOP, None)),  # EOS at output 2 too early
        (dict(max_tokens=8, min_tokens=5), ([5, 2, 7, 9, 2], FINISH_STOP, None)),  # output 5 is EOS: counts
        (dict(max_tokens=8, stop_token_ids=(7,), ignore_eos=True), ([5, 2, 7], FINISH_STOP, 7)),
        (dict(max_tokens=8, stop_token_ids=(9,), min_tokens=4), ([5, 2, 7, 9], FINISH_STOP, 9)),
        (dict(max_tokens=8, stop_token_ids=(9,), min_tokens=5), ([5, 2, 7, 9, 2], FINISH_STOP, None)),
        (dict(max_tokens=8, stop_token_ids=(9,), min_tokens=3, ignore_eos=True), ([5, 2, 7, 9], FINISH_STOP, 9)),
        (dict(max_tokens=1), ([5], FINISH_LENGTH, None)),
        (dict(max_tokens=2), ([5, 2], FINISH_STOP, None)),  # EOS is checked before length
    ],
)
def test_stop_rules(params, want):
    assert _generate(**params) == want


def test_no_eos_configured_runs_to_max_tokens():
    assert _generate(eos=(), max_tokens=6) == (SCRIPT[:6], FINISH_LENGTH, None)


def test_max_model_len_stops_with_length():
    """Admission keeps prompt + max_tokens <= max_model_len, so check the rule on the Request directly."""
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=100, ignore_eos=True))
    req.append_output_token(4)
    assert not req.check_stop(max_model_len=5)
    req.append_output_token(5)
    assert req.check_stop(max_model_len=5) and req.finish_reason == FINISH_LENGTH


def test_eos_ignored_before_min_tokens_but_stop_id_wins_after():
    req = Request("a", [1], SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[3]), eos_token_ids=(3,))
    req.append_output_token(3)
    assert not req.check_stop(100)
    req.append_output_token(3)
    assert req.check_stop(100) and (req.finish_reason, req.stop_reason) == (FINISH_STOP, None)
