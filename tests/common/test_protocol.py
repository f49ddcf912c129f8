import pytest
from pydantic import ValidationError

from common.protocol import (
    GenerateRequest,
    KVTransferParams,
    PrefillRequest,
    PrefillResponse,
    SamplingOptions,
    StreamEvent,
)


def test_prefill_roundtrip_through_json():
    req = PrefillRequest(request_id="r1", prompt_token_ids=[1, 2, 3],
                         sampling=SamplingOptions(temperature=0.0, max_tokens=8), lease_seconds=5)
    again = PrefillRequest.model_validate_json(req.model_dump_json())
    assert again == req
    resp = PrefillResponse(
        request_id="r1", first_token_id=7, num_cached_tokens=0,
        kv_transfer_params=KVTransferParams(do_remote_prefill=True, remote_block_ids=[3, 4],
                                            remote_engine_id="p0", block_hashes=[1, 2]),
    )
    assert PrefillResponse.model_validate_json(resp.model_dump_json()) == resp


def test_kv_transfer_params_pass_unknown_fields_through():
    # The router forwards these opaquely, so fields from other connectors must survive.
    p = KVTransferParams.model_validate({"do_remote_decode": True, "tp_size": 1})
    assert p.do_remote_decode and p.model_dump()["tp_size"] == 1


@pytest.mark.parametrize(
    "bad",
    [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"max_tokens": 0}, {"top_k": 0},
     {"presence_penalty": 3}, {"logprobs": 21}, {"stop": [""]}, {"bogus": 1}],
)
def test_sampling_options_reject_bad_values(bad):
    with pytest.raises(ValidationError):
        SamplingOptions(**bad)


def test_requests_reject_empty_prompts_and_ids():
    with pytest.raises(ValidationError):
        GenerateRequest(request_id="r", prompt_token_ids=[])
    with pytest.raises(ValidationError):
        PrefillRequest(request_id="", prompt_token_ids=[1])


def test_stream_event_defaults():
    ev = StreamEvent(request_id="r", token_ids=[1])
    assert ev.finish_reason is None and ev.timing is None
