"""Parsing SGLang's ``/generate`` responses (no server): the fields, versions and malformed bodies."""

from __future__ import annotations

import pytest

from miles_agent.engine import FinishReason, SamplingParams
from miles_agent.engines.sglang.wire import GenerateResponseError, generate_payload, parse_generate_response


def body(**meta):
    m = {"id": "r1", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3, "completion_tokens": 2,
         "weight_version": "7", "output_token_logprobs": [[-0.5, 11, "a"], [-1.25, 2, None]]}
    m.update(meta)
    return {"text": "a", "output_ids": [11, 2], "meta_info": m}


def test_request_payload_is_sglangs_generate_req_input():
    p = generate_payload([1, 2], SamplingParams(max_new_tokens=3, temperature=0.5, seed=4), return_routed_experts=True)
    assert p == {"input_ids": [1, 2], "return_logprob": True, "return_routed_experts": True,
                 "sampling_params": {"max_new_tokens": 3, "temperature": 0.5, "top_p": 1.0, "top_k": -1,
                                     "sampling_seed": 4}}


def test_fields_map_to_the_completion():
    c = parse_generate_response(body(), prompt_len=3, want_routed=False)
    assert (c.output_ids, c.output_logprobs, c.finish_reason) == ([11, 2], [-0.5, -1.25], FinishReason.STOP)
    assert c.weight_version == 7 and c.meta["weight_versions"] == [(7, 0)] and c.meta["matched_stop"] == 2
    spans = [{"version": "6", "start": 0, "end": 1}, {"version": "7", "start": 1, "end": 2}]
    assert parse_generate_response(body(weight_versions=spans), prompt_len=3,
                                   want_routed=False).meta["weight_versions"] == [(6, 0), (7, 1)]
    length = parse_generate_response(body(finish_reason={"type": "length", "length": 2}), prompt_len=3,
                                     want_routed=False)
    assert length.finish_reason is FinishReason.LENGTH
    abort = parse_generate_response(body(finish_reason={"type": "abort", "message": "Abort in waiting queue"}),
                                    prompt_len=3, want_routed=True)
    assert abort.finish_reason is FinishReason.ABORT and abort.meta["abort_message"] == "Abort in waiting queue"
    assert abort.routed_experts is None and abort.meta["routed_experts_missing"]


def test_a_server_without_our_versions_keeps_the_clients():
    c = parse_generate_response(body(weight_version="default"), prompt_len=3, want_routed=False, current_version=4)
    assert c.weight_version == 4 and c.meta["weight_versions"] == [(4, 0)]


@pytest.mark.parametrize(("meta", "match"), [
    ({"output_token_logprobs": [[-0.5, 11, "a"]]}, "1 entries for 2 output tokens"),
    ({"output_token_logprobs": [[-0.5, 11, "a"], [-1.0, 3, None]]}, "is for token 3"),
    ({"finish_reason": None}, "finish_reason must be a dict"),
    ({"finish_reason": {"type": "exploded"}}, "unknown finish_reason type"),
])
def test_malformed_responses_are_named(meta, match):
    with pytest.raises(GenerateResponseError, match=match):
        parse_generate_response(body(**meta), prompt_len=3, want_routed=False)
