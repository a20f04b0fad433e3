"""Pure pieces of the remote engines: SSE framing, Prometheus parsing, event decoding."""

from __future__ import annotations

import pytest
from remote_helpers import make_request

from asyncrl.engine.base import EngineLoad
from asyncrl.engine.remote.engine import LoadCache
from asyncrl.engine.remote.wire import SSEDecoder, gauge, parse_prometheus
from asyncrl.engine.sglang.engine import decode_event, sampling_body
from asyncrl.engine.vllm.engine import completion_body, decode_chunk
from asyncrl.errors import EngineError


def test_sse_frames_split_anywhere_are_reassembled():
    body = b'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    for cut in range(1, len(body)):
        d = SSEDecoder()
        out = d.feed(body[:cut]) + d.feed(body[cut:])
        assert out == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]


def test_sse_frame_larger_than_aiohttp_line_limit():
    big = b'{"x": "' + b"y" * 300_000 + b'"}'
    d = SSEDecoder()
    out = []
    for i in range(0, len(big), 4096):
        out += d.feed((b"data: " if i == 0 else b"") + big[i:i + 4096])
    out += d.feed(b"\n\n")
    assert out == [big]


METRICS = """# HELP sglang:num_used_tokens x
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{model_name="m",tp_rank="0",dp_rank="0"} 100.0
sglang:num_used_tokens{model_name="m",tp_rank="1",dp_rank="0"} 100.0
sglang:num_used_tokens{model_name="m",tp_rank="0",dp_rank="1"} 50.0
vllm:cache_config_info{block_size="16",engine="0",note="a,b=c"} 1.0
plain_metric 3
"""


def test_prometheus_gauges_sum_data_parallel_ranks_not_tensor_parallel_copies():
    m = parse_prometheus(METRICS)
    assert gauge(m, "sglang:num_used_tokens", per="dp_rank") == 150.0
    assert gauge(m, "missing", "plain_metric") == 3.0
    assert gauge(m, "missing") is None
    labels, _ = m["vllm:cache_config_info"][0]
    assert labels == {"block_size": "16", "engine": "0", "note": "a,b=c"}


def test_load_cache_expires():
    c = LoadCache(ttl_s=1.0)
    assert not c.fresh(0.0)
    c.put(EngineLoad(kv_tokens_used=1, kv_tokens_capacity=2, running=0, waiting=0), 10.0)
    assert c.fresh(10.5) and not c.fresh(11.0)


def _ev(entries, total, finish=None):
    return {"meta_info": {"output_token_logprobs": entries, "completion_tokens": total,
                          "finish_reason": finish}}


def test_sglang_cumulative_and_incremental_streams_decode_to_the_same_tokens():
    e = [[-0.1, 11, None], [-0.2, 12, None], [-0.3, 13, None]]
    cum = {"n": 0}
    got_cum = [decode_event(_ev(e[:k], k), cum, "s") for k in (1, 2, 3)]
    inc = {"n": 0}
    got_inc = [decode_event(_ev(e[k - 1:k], k), inc, "s") for k in (1, 2, 3)]
    assert [d.token_ids for d in got_cum] == [d.token_ids for d in got_inc] == [[11], [12], [13]]
    assert [d.logprobs for d in got_inc] == [[-0.1], [-0.2], [-0.3]]


def test_sglang_incremental_ids_with_cumulative_logprobs_older_servers():
    # Before SGLang PR 21583 incremental mode still sent cumulative logprobs.
    e = [[-0.1, 11, None], [-0.2, 12, None]]
    st = {"n": 0, "incr": True}
    assert decode_event(_ev(e[:1], 1), st, "s").token_ids == [11]
    assert decode_event(_ev(e[:2], 2), st, "s").token_ids == [12]


def test_sglang_stream_that_skips_tokens_is_an_error():
    st = {"n": 0}
    decode_event(_ev([[-0.1, 11, None]], 1), st, "s")
    with pytest.raises(EngineError, match="lost tokens"):
        decode_event(_ev([[-0.1, 13, None]], 3), st, "s")


def test_sglang_finish_reasons():
    st = {"n": 0}
    d = decode_event(_ev([[-0.1, 2, None]], 1, {"type": "stop", "matched": 2}), st, "s")
    assert d.finish_reason == "stop" and d.token_ids == [2]
    d = decode_event(_ev([], 0, {"type": "length", "length": 0}), {"n": 0}, "s")
    assert d.finish_reason == "length"
    with pytest.raises(EngineError, match="server aborted"):
        decode_event(_ev([], 0, {"type": "abort", "message": "too long"}), {"n": 0}, "s")
    d = decode_event(_ev([], 0, {"type": "abort"}), {"n": 0, "aborting": True}, "s")
    assert d.finish_reason == "abort"
    with pytest.raises(EngineError, match="boom"):
        decode_event({"error": {"message": "boom"}}, {"n": 0}, "s")


def test_sglang_request_keeps_stop_text_and_specials():
    body = sampling_body(make_request([1, 2], max_new=5, stop_ids=(7,), stop_strs=("</x>",)))
    sp = body["sampling_params"]
    assert body["input_ids"] == [1, 2] and body["stream"] and body["return_logprob"]
    assert sp["no_stop_trim"] is True and sp["skip_special_tokens"] is False
    assert sp["stop"] == ["</x>"] and sp["stop_token_ids"] == [7] and sp["max_new_tokens"] == 5
    assert "sampling_seed" not in sp


def test_vllm_request_and_chunks():
    body = completion_body(make_request([1, 2], max_new=5, stop_strs=("</x>",), rid="abc"), "m")
    assert body["prompt"] == [1, 2] and body["include_stop_str_in_output"] is True
    assert body["return_token_ids"] and body["logprobs"] == 0 and body["request_id"] == "abc"
    chunk = {"choices": [{"token_ids": [5, 6], "logprobs": {"token_logprobs": [-1.0, -2.0]},
                          "finish_reason": None}]}
    d = decode_chunk(chunk, "v")
    assert d.token_ids == [5, 6] and d.logprobs == [-1.0, -2.0] and d.finish_reason is None
    assert decode_chunk({"choices": []}, "v") is None
    with pytest.raises(EngineError, match="logprobs"):
        decode_chunk({"choices": [{"token_ids": [5], "logprobs": None}]}, "v")
    with pytest.raises(EngineError, match="'error'"):
        decode_chunk({"choices": [{"token_ids": [], "finish_reason": "error"}]}, "v")
