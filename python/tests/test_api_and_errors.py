"""The DeepEP-compatible surface, epmoe.Error, groups and thread ranks."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import time
import traceback

import numpy as np
import pytest

import epmoe
from conftest import BF16, FP8, TIMEOUT_S, nice_bf16, random_topk_idx

# DeepEP V1 (deep_ep/buffer.py at commit 567632d): parameter names in order, with defaults
# (a bare name has none). An engine that calls deep_ep.Buffer positionally or by keyword must work.
DEEPEP_V1 = {
    "__init__": ["group", ("num_nvl_bytes", 0), ("num_rdma_bytes", 0), ("low_latency_mode", False),
                 ("num_qps_per_rank", 24), ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                 ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False), ("comm", None)],
    "get_dispatch_layout": ["topk_idx", "num_experts", ("previous_event", None), ("async_finish", False),
                            ("allocate_on_comm_stream", False)],
    "dispatch": ["x", ("handle", None), ("num_tokens_per_rank", None), ("num_tokens_per_rdma_rank", None),
                 ("is_token_in_rank", None), ("num_tokens_per_expert", None), ("topk_idx", None),
                 ("topk_weights", None), ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None),
                 ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "combine": ["x", "handle", ("topk_weights", None), ("bias", None), ("config", None), ("previous_event", None),
                ("async_finish", False), ("allocate_on_comm_stream", False)],
    "internode_dispatch": ["x", ("handle", None), ("num_tokens_per_rank", None), ("num_tokens_per_rdma_rank", None),
                           ("is_token_in_rank", None), ("num_tokens_per_expert", None), ("topk_idx", None),
                           ("topk_weights", None), ("expert_alignment", 1), ("num_worst_tokens", 0),
                           ("config", None), ("previous_event", None), ("async_finish", False),
                           ("allocate_on_comm_stream", False)],
    "internode_combine": ["x", "handle", ("topk_weights", None), ("bias", None), ("config", None),
                          ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "clean_low_latency_buffer": ["num_max_dispatch_tokens_per_rank", "hidden", "num_experts"],
    "low_latency_dispatch": ["x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts",
                             ("cumulative_local_expert_recv_stats", None), ("dispatch_wait_recv_cost_stats", None),
                             ("use_fp8", True), ("round_scale", False), ("use_ue8m0", False), ("async_finish", False),
                             ("return_recv_hook", False)],
    "low_latency_combine": ["x", "topk_idx", "topk_weights", "handle", ("use_logfmt", False), ("zero_copy", False),
                            ("async_finish", False), ("return_recv_hook", False), ("out", None),
                            ("combine_wait_recv_cost_stats", None)],
    "get_next_low_latency_combine_buffer": ["handle"],
    "get_low_latency_rdma_size_hint": ["num_max_dispatch_tokens_per_rank", "hidden", "num_ranks", "num_experts"],
    "get_dispatch_config": ["num_ranks"],
    "get_combine_config": ["num_ranks"],
    "set_num_sms": ["new_num_sms"],
    "capture": [],
    "destroy": [],
    "is_sm90_compiled": [],
    "get_comm_stream": [],
    "get_local_buffer_tensor": ["dtype", ("size", None), ("offset", 0), ("use_rdma_buffer", False)],
    "low_latency_update_mask_buffer": ["rank_to_mask", ("mask", False)],
    "low_latency_query_mask_buffer": ["mask_status"],
    "low_latency_clean_mask_buffer": [],
}


# epmoe's own additions, and arguments of DeepEP's later branches (sgl-project/DeepEP's nvfp4 low-latency dispatch;
# the overlapped combine of DeepEP PR #483 and fzyzcjy/DeepEP's combine_v2, as SGLang passes them): keyword-only,
# after DeepEP V1's parameters, so no V1 call can reach them.
EPMOE_KEYWORD_ONLY = {"__init__": {"backend": None, "device": None, "num_recv_slots": 0, "debug_validate": False},
                      "low_latency_dispatch": {"use_nvfp4": False, "x_global_scale": None},
                      "low_latency_combine": {"overlap": False, "packed_recv_count": None, "comp_signal": None,
                                              "block_m": None, "threshold": None, "num_sms": None,
                                              "src_signals": None, "src_signal_expect_value": None}}


@pytest.mark.parametrize("method", sorted(DEEPEP_V1))
def test_buffer_signatures_match_deepep_v1(method):
    params = [p for p in inspect.signature(getattr(epmoe.Buffer, method)).parameters.values() if p.name != "self"]
    positional = [p for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    got = [p.name if p.default is inspect.Parameter.empty else (p.name, p.default) for p in positional]
    assert got == DEEPEP_V1[method]
    extras = {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert extras == EPMOE_KEYWORD_ONLY.get(method, {})


def test_config_and_event_overlap_signatures():
    assert list(inspect.signature(epmoe.Config).parameters) == [
        "num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
        "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"]
    assert list(inspect.signature(epmoe.EventOverlap).parameters) == ["event", "extra_tensors"]
    ev = epmoe.EventOverlap(None, (np.zeros(1),))
    ev.current_stream_wait()
    with ev as inner:
        assert inner is ev
    assert isinstance(epmoe.Buffer.num_sms, int)


def test_error_carries_the_cpp_message():
    assert issubclass(epmoe.Error, RuntimeError)
    with pytest.raises(epmoe.Error) as e:
        epmoe.topk_softmax(np.zeros((2, 4), dtype=np.float64), 2)
    msg = str(e.value)
    assert e.value.code == "invalid_argument"
    assert msg.startswith("epmoe: invalid argument 'logits': expected ") and "got float64[2, 4]" in msg
    with pytest.raises(epmoe.Error, match=r"'x'.*got an object of type list"):
        epmoe.quantize_fp8([[1.0] * 16])
    with pytest.raises(epmoe.Error, match=r"'num_topk'|'K'|num_topk"):
        epmoe.topk_softmax(np.zeros((2, 4), dtype=np.float32), 5)
    with pytest.raises(epmoe.Error, match="'x'.*16"):
        epmoe.quantize_fp8(np.ones((2, 24), dtype=np.float32))  # H % 16 != 0
    with pytest.raises(epmoe.Error, match="out_dtype"):
        epmoe.dequantize_fp8(*epmoe.quantize_fp8(np.ones((1, 16), np.float32)), out_dtype="float16")
    with pytest.raises(epmoe.Error, match=r"topk_idx.*9 at \[1, 0\]"):
        epmoe.get_dispatch_layout(np.array([[0], [9]], dtype=np.int64), 8, 2)


def test_checks_of_flagged_cuda_faults_pass_when_nothing_was_flagged():
    # On CPU tensors a bad id raises at once (above), so nothing is ever left flagged for these to raise; they take an
    # optional tensor naming the stream and return None (tests/gpu has the flagged cases).
    if epmoe.built_with_cuda() and epmoe._ext.cuda_device_count() == 0:
        pytest.skip("a CUDA build without a GPU: the checks would ask the driver for a device")
    idx = np.array([[0, 1]], dtype=np.int64)
    epmoe.get_dispatch_layout(idx, 4, 2)
    assert epmoe.check_invalid_ids() is None
    assert epmoe.check_invalid_ids(idx) is None
    assert epmoe.check_moe_faults() is None
    assert epmoe.check_moe_faults(idx) is None


def test_buffer_arguments_are_checked_before_any_exchange(rng):
    R, E, H, K = 2, 4, 128, 2
    x = nice_bf16(rng, (3, H))
    idx = random_topk_idx(rng, 3, K, E)

    def rank_main(group):
        buf = epmoe.Buffer(group)
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, E)
        codes = {}
        cases = {
            "x_float64": lambda: buf.dispatch(x.astype(np.float64), num_tokens_per_rank=ntpr,
                                              is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx),
            "topk_idx_float": lambda: buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                   num_tokens_per_expert=ntpe, topk_idx=idx.astype(np.float32)),
            "no_layout": lambda: buf.dispatch(x, topk_idx=idx),
            "bad_handle": lambda: buf.combine(x, ("not", "a", "handle")),
            "bad_config": lambda: buf.dispatch(x, config="fast"),
            "bias_triple": lambda: buf.combine(x, None, bias=(x, x, x)),
            "local_buffer": lambda: buf.get_local_buffer_tensor(np.int32),
            "destroy": lambda: buf.destroy(),
        }
        assert buf.get_comm_stream() is None  # CPU ranks: a call is complete when it returns
        for name, call in cases.items():
            with pytest.raises(epmoe.Error) as e:
                call()
            codes[name] = (e.value.code, str(e.value))
        return codes

    for codes in epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S):
        assert codes["x_float64"][0] == "invalid_argument" and "'x'" in codes["x_float64"][1]
        assert "float64" in codes["x_float64"][1]
        assert "'topk_idx'" in codes["topk_idx_float"][1] and "float32" in codes["topk_idx_float"][1]
        assert "num_tokens_per_expert" in codes["no_layout"][1]
        assert "'handle'" in codes["bad_handle"][1]
        assert "'config'" in codes["bad_config"][1]
        assert "'handle'" in codes["bias_triple"][1] or "'bias'" in codes["bias_triple"][1]
        assert codes["local_buffer"][0] == "unsupported" and "get_local_buffer_tensor" in codes["local_buffer"][1]
        assert "explicitly_destroy" in codes["destroy"][1]


TOO_BIG = (2**31, 2**40, 2**62)  # Python ints past the C++ int the binding takes
INT32_MOST = "an int of at most 2147483647"


def assert_named(name, value, call, expected=INT32_MOST):
    """call() raises epmoe.Error('invalid_argument') naming `name`, the bound expected and `value`."""
    with pytest.raises(epmoe.Error) as e:
        call()
    message = str(e.value)
    assert e.value.code == "invalid_argument", message
    assert message == f"epmoe: invalid argument '{name}': expected {expected}, got {value!r}", message


def test_integers_that_do_not_fit_are_named_with_the_range_and_the_value(rng):
    """Found by a fresh user: 2**31 or more for num_max_dispatch_tokens_per_rank, num_experts, expert_alignment or
    num_worst_tokens (and in get_low_latency_rdma_size_hint) came back as nanobind's TypeError, naming nothing. Every
    public entry point taking such an integer names the argument, the range and the value, before any exchange,
    and the buffer stays usable."""
    R, E, H, K = 2, 4, 128, 2
    x = nice_bf16(rng, (3, H))
    idx = random_topk_idx(rng, 3, K, E)
    idx[0] = [0, E - 1]  # each rank owns one of token 0's experts, so each receives a row ("still usable" below)
    for v in TOO_BIG:
        assert_named("num_max_dispatch_tokens_per_rank", v,
                     lambda: epmoe.Buffer.get_low_latency_rdma_size_hint(v, H, R, E))
        assert_named("num_ranks", v, lambda: epmoe.Buffer.get_low_latency_rdma_size_hint(8, H, v, E))
        assert_named("num_experts", v, lambda: epmoe.Buffer.get_low_latency_rdma_size_hint(8, H, R, v))
        assert_named("num_topk", v, lambda: epmoe.Buffer.get_normal_nvl_size_hint(8, H, R, v))
        assert_named("num_experts", v, lambda: epmoe.get_dispatch_layout(idx, v, R))
    int64_most = "an int of at most 9223372036854775807"
    assert_named("hidden", 2**64, lambda: epmoe.Buffer.get_low_latency_rdma_size_hint(8, 2**64, R, E), int64_most)
    assert_named("max_tokens_per_rank", 2**64, lambda: epmoe.Buffer.get_normal_nvl_size_hint(2**64, H, R, K),
                 int64_most)
    # Found by a fresh user: the message quoted the C++ type's whole range ("an int in -9223372036854775808..
    # 9223372036854775807"), as if a negative count were taken; it names the bound the value passes, alone.
    assert_named("hidden", -2**64, lambda: epmoe.Buffer.get_low_latency_rdma_size_hint(8, -2**64, R, E),
                 "an int of at least -9223372036854775808")
    assert_named("hidden", "8", lambda: epmoe.Buffer.get_low_latency_rdma_size_hint(8, "8", R, E), "an int")
    assert epmoe.Buffer.get_low_latency_rdma_size_hint(8, H, R, E) > 0  # in range: the C++ answer

    def rank_main(group):
        buf = epmoe.Buffer(group)
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, E)
        layout = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx)
        for v in TOO_BIG:
            assert_named("num_experts", v, lambda: buf.get_dispatch_layout(idx, v))
            assert_named("expert_alignment", v, lambda: buf.dispatch(x, **layout, expert_alignment=v))
            assert_named("num_worst_tokens", v, lambda: buf.dispatch(x, **layout, num_worst_tokens=v))
            assert_named("num_max_dispatch_tokens_per_rank", v, lambda: buf.low_latency_dispatch(x, idx, v, E))
            assert_named("num_experts", v, lambda: buf.low_latency_dispatch(x, idx, 8, v))
            assert_named("num_max_dispatch_tokens_per_rank", v, lambda: buf.clean_low_latency_buffer(v, H, E))
            assert_named("num_experts", v, lambda: buf.clean_low_latency_buffer(8, H, v))
            assert_named("num_max_dispatch_tokens_per_rank", v, lambda: epmoe.make_low_latency_prepare_finalize(buf, v))
        assert_named("num_rdma_bytes", 2**64, lambda: epmoe.Buffer(group, num_rdma_bytes=2**64),
                     "an int of at most 9223372036854775807")
        assert_named("num_rdma_bytes", -1, lambda: epmoe.Buffer(group, num_rdma_bytes=-1), "an int of at least 0")
        assert_named("device", 2**40, lambda: epmoe.Buffer(group, device=2**40),
                     "None or a CUDA device index in 0..2**31-1")
        recv_x, recv_idx, _, counts, _, _ = buf.dispatch(x, **layout)  # still usable
        return recv_x.shape[0], sum(counts)

    for rows, routed in epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S):
        assert rows > 0 and routed > 0


def test_a_dtype_epmoe_cannot_hold_is_named_with_the_dtype_the_argument_takes(rng):
    """Found by a fresh user: float64 topk_weights passed to combine were refused naming every dtype epmoe holds
    ("expected a tensor of dtype bfloat16, float16, ..."), not the float32 that combine takes."""
    R, E, H, K, T = 2, 4, 128, 2, 3
    x = nice_bf16(rng, (T, H))
    idx = random_topk_idx(rng, T, K, E)

    def rank_main(group):
        buf = epmoe.Buffer(group)
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, E)
        layout = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe)
        recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, **layout)
        rows = recv_x.shape[0]
        messages = {}
        for name, call in {
            "combine": lambda: buf.combine(recv_x, handle, topk_weights=np.ones((rows, K), np.float64)),
            "dispatch": lambda: buf.dispatch(x, topk_idx=idx, topk_weights=np.ones((T, K), np.float64), **layout),
            "dispatch_x": lambda: buf.dispatch(x.astype(np.float64), topk_idx=idx, **layout),
            "layout": lambda: buf.get_dispatch_layout(idx.astype(np.uint64), E),
        }.items():
            with pytest.raises(epmoe.Error) as e:
                call()
            messages[name] = (e.value.code, str(e.value))
        return rows, messages

    for rows, messages in epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S):
        assert messages == {
            "combine": ("invalid_argument", "epmoe: invalid argument 'topk_weights': expected dtype float32, got "
                                            f"float64[{rows}, {K}] cpu"),
            "dispatch": ("invalid_argument", "epmoe: invalid argument 'topk_weights': expected dtype float32, got "
                                             f"float64[{T}, {K}] cpu"),
            "dispatch_x": ("invalid_argument", "epmoe: invalid argument 'x': expected dtype bfloat16 or float8_e4m3fn, "
                                               f"got float64[{T}, {H}] cpu"),
            "layout": ("invalid_argument", "epmoe: invalid argument 'topk_idx': expected dtype int64 or int32, got "
                                           f"uint64[{T}, {K}] cpu"),
        }


def test_a_dtype_epmoe_cannot_hold_is_named_with_the_dtype_the_argument_takes_outside_the_buffer(rng):
    """The router, quantization, EPLB and MoE layer calls name the dtype an argument takes for a dtype epmoe holds
    none of (float64, uint64), as the Buffer calls do: they listed every dtype epmoe holds."""
    E, K, T, H = 4, 2, 3, 128
    f64 = np.zeros((T, H), np.float64)
    idx = random_topk_idx(rng, T, K, E)
    w1, w2 = np.zeros((E, 2 * 64, H), BF16), np.zeros((E, H, 64), BF16)
    x, w = nice_bf16(rng, (T, H)), np.full((T, K), 0.5, np.float32)
    log2phy, logcnt = np.arange(E, dtype=np.int64).reshape(1, E, 1), np.ones((1, E), np.int64)
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_reference_experts())
    cases = [
        (lambda: epmoe.topk_softmax(f64[:, :E], K), "logits", "float32 or bfloat16", f"float64[{T}, {E}]"),
        (lambda: epmoe.topk_sigmoid(f64[:, :E], K), "logits", "float32 or bfloat16", f"float64[{T}, {E}]"),
        (lambda: epmoe.grouped_topk(np.zeros((T, E), np.float32), K, 2, 1, e_score_correction_bias=f64[0, :E]),
         "e_score_correction_bias", "float32", f"float64[{E}]"),
        (lambda: epmoe.get_dispatch_layout(idx.astype(np.uint64), E, 2), "topk_idx", "int64 or int32",
         f"uint64[{T}, {K}]"),
        (lambda: epmoe.quantize_fp8(f64), "x", "bfloat16 or float32", f"float64[{T}, {H}]"),
        (lambda: epmoe.dequantize_fp8(f64, np.ones((T, 1), np.float32)), "q", "float8_e4m3fn", f"float64[{T}, {H}]"),
        (lambda: epmoe.dequantize_fp8(np.zeros((T, H), FP8), f64[:, :1]), "scales", "float32 or int32 (UE8M0)",
         f"float64[{T}, 1]"),
        (lambda: epmoe.map_to_physical(idx.astype(np.uint64), log2phy, logcnt, 0), "topk_idx", "int64 or int32",
         f"uint64[{T}, {K}]"),
        (lambda: epmoe.ExpertLoadRecorder(1, E, 2, 2).record(0, f64[0, :E]), "num_tokens_per_expert",
         "int32 or int64", f"float64[{E}]"),
        (lambda: layer.forward(x.view(np.uint16), w1, w2, w, idx), "hidden", "bfloat16", f"uint16[{T}, {H}]"),
        (lambda: layer.forward(x, w1.astype(np.float64), w2, w, idx), "w1",
         "bfloat16 (or float8_e4m3fn with w1_scale)", f"float64[{E}, 128, {H}]"),
        (lambda: layer.forward(x, w1, w2, w.astype(np.float64), idx), "topk_weights", "float32",
         f"float64[{T}, {K}]"),
        (lambda: layer.forward(x, w1, w2, w, idx.astype(np.uint64)), "topk_idx", "int64 or int32",
         f"uint64[{T}, {K}]"),
        (lambda: layer.forward(x, w1, w2, w, idx, expert_map=np.arange(E, dtype=np.uint64)), "expert_map", "int32",
         f"uint64[{E}]"),
        (lambda: layer.forward(x, w1, w2, w, idx, output=f64), "output", "bfloat16", f"float64[{T}, {H}]"),
    ]
    for call, name, takes, got in cases:
        with pytest.raises(epmoe.Error) as e:
            call()
        assert (e.value.code, str(e.value)) == (
            "invalid_argument", f"epmoe: invalid argument '{name}': expected dtype {takes}, got {got} cpu"), name


def test_a_wrong_dtype_reads_alike_whether_epmoe_holds_it_or_not(rng):
    """Found by a fresh user: a dtype epmoe holds none of (float64, uint16) was "expected an int64 or int32 tensor", one
    it holds (int16, float32) "expected dtype int64 or int32". Both now read "expected dtype ..., got DTYPE[shape]
    DEVICE", the words of the calls' own checks."""
    E, K, T, H = 8, 2, 4, 128
    idx = random_topk_idx(rng, T, K, E)
    x = nice_bf16(rng, (T, H))
    cases = [
        (lambda t: epmoe.get_dispatch_layout(t, E, 2), idx, "topk_idx", "int64 or int32", (np.uint16, np.int16)),
        (lambda t: epmoe.topk_softmax(t, K), np.zeros((T, E), np.float32), "logits", "float32 or bfloat16",
         (np.float64, np.int32)),
    ]
    for call, good, name, takes, (not_held, held) in cases:
        for dtype in (not_held, held):
            with pytest.raises(epmoe.Error) as e:
                call(good.astype(dtype))
            got = f"{np.dtype(dtype).name}[{', '.join(str(d) for d in good.shape)}] cpu"
            assert (e.value.code, str(e.value)) == (
                "invalid_argument", f"epmoe: invalid argument '{name}': expected dtype {takes}, got {got}"), dtype

    def rank_main(group):
        buf = epmoe.Buffer(group)
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, E)
        layout = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe)
        messages = []
        for bad in (x.astype(np.float64), x.astype(np.float32)):  # epmoe holds float32, not float64
            with pytest.raises(epmoe.Error) as e:
                buf.dispatch(bad, topk_idx=idx, **layout)
            messages.append(str(e.value))
        return messages

    for messages in epmoe.run_thread_ranks(2, rank_main, timeout_s=TIMEOUT_S):
        assert messages == [f"epmoe: invalid argument 'x': expected dtype bfloat16 or float8_e4m3fn, got {d}[{T}, {H}] "
                            "cpu" for d in ("float64", "float32")]


def test_messages_name_the_python_argument_not_the_cxx_one(rng):
    """Found by a fresh user: messages named what a Python caller never typed: 'x_scales' for the scales of dispatch's
    tuple x, the C++ ExpertsQuant for make_cuda_experts' quant. The scales are 'x[1]', the setting 'quant'."""
    E, K, T, H = 4, 2, 3, 128
    x = nice_bf16(rng, (T, H))
    idx = random_topk_idx(rng, T, K, E)
    q, scales = epmoe.quantize_fp8(x)
    took = "expected dtype float32 or int32 (UE8M0)"

    def rank_main(group):
        buf = epmoe.Buffer(group)
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, E)
        layout = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe)
        messages = []
        for bad in ((q, scales.astype(np.float64)), (q, scales.astype(np.int16)), (q, scales[:, :0]), q):
            with pytest.raises(epmoe.Error) as e:
                buf.dispatch(bad, topk_idx=idx, **layout)
            messages.append(str(e.value))
        return messages

    for messages in epmoe.run_thread_ranks(2, rank_main, timeout_s=TIMEOUT_S):
        assert messages[:2] == [f"epmoe: invalid argument 'x[1]': {took}, got {d}[{T}, 1] cpu"
                                for d in ("float64", "int16")]
        assert messages[2] == f"epmoe: invalid argument 'x[1]': expected float32[{T}, 1], got float32[{T}, 0] cpu"
        assert messages[3] == (f"epmoe: invalid argument 'x[1]': expected float32[{T}, 1] or UE8M0 int32[{T}, 1] with "
                               "float8 x, got None")
        assert not any("x_scales" in m for m in messages), messages
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_reference_experts())
    w1, w2 = np.zeros((E, 128, H), BF16), np.zeros((E, H, 64), BF16)
    with pytest.raises(epmoe.Error) as e:
        layer.forward(x, w1, w2, np.full((T, K), 0.5, np.float32), idx, w1_scale=np.ones((E, 1, 1), np.float32))
    assert str(e.value) == ("epmoe: invalid argument 'w1_scale': expected None for the 'reference' experts with "
                            "bfloat16 weights (fp8 block-scaled weights need experts made with quant fp8_block), got "
                            f"float32[{E}, 1, 1] cpu")


def test_an_int16_topk_idx_is_said_in_one_wording_by_every_call(rng):
    """get_dispatch_layout, dispatch, low_latency_dispatch and MoELayer.forward word a topk_idx of another dtype
    alike, naming the argument, the dtypes it takes and the one it has."""
    E, K, T, H = 8, 2, 4, 128
    x = nice_bf16(rng, (T, H))
    idx = random_topk_idx(rng, T, K, E)
    idx16 = idx.astype(np.int16)

    def rank_main(group):
        normal, low_latency = epmoe.Buffer(group), epmoe.Buffer(group, low_latency_mode=True)
        ntpr, _, ntpe, in_rank, _ = normal.get_dispatch_layout(idx, E)
        messages = {}
        for name, call in {
            "layout": lambda: normal.get_dispatch_layout(idx16, E),
            "dispatch": lambda: normal.dispatch(x, topk_idx=idx16, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                num_tokens_per_expert=ntpe),
            "low_latency_dispatch": lambda: low_latency.low_latency_dispatch(x, idx16, T, E, use_fp8=False),
        }.items():
            with pytest.raises(epmoe.Error) as e:
                call()
            messages[name] = (e.value.code, str(e.value))
        return messages

    want = ("invalid_argument",
            f"epmoe: invalid argument 'topk_idx': expected dtype int64 or int32, got int16[{T}, {K}] cpu")
    for messages in epmoe.run_thread_ranks(2, rank_main, timeout_s=TIMEOUT_S):
        assert messages == {"layout": want, "dispatch": want, "low_latency_dispatch": want}
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_reference_experts())
    w1, w2 = np.zeros((E, 128, H), BF16), np.zeros((E, H, 64), BF16)
    with pytest.raises(epmoe.Error) as e:
        layer.forward(x, w1, w2, np.full((T, K), 0.5, np.float32), idx16)
    assert (e.value.code, str(e.value)) == want


def test_low_latency_x_of_a_bad_width_is_named_as_x(rng):
    """Found by a fresh user: a bf16 x of 100 columns (or of another width than the buffer's first low-latency call)
    was named 'hidden', an argument low_latency_dispatch has not."""
    E, K, T = 8, 2, 4
    idx = random_topk_idx(rng, T, K, E)

    def rank_main(group):
        buf = epmoe.Buffer(group, low_latency_mode=True)
        messages = []
        for H in (100, 128, 256):
            try:
                buf.low_latency_dispatch(nice_bf16(rng, (T, H)), idx, T, E, use_fp8=False)
            except epmoe.Error as e:
                messages.append((e.code, str(e)))
        return messages

    for messages in epmoe.run_thread_ranks(2, rank_main, timeout_s=TIMEOUT_S):
        assert messages == [
            ("invalid_argument", "epmoe: invalid argument 'x': expected H a positive multiple of 8 (bf16 rows of "
                                 "16-byte units), got H = 100"),
            ("invalid_argument", "epmoe: invalid argument 'x': expected H = 128 (fixed by the buffer's first "
                                 "low-latency call), got H = 256"),
        ]


def test_non_finite_topk_weights_are_refused_with_debug_validate(rng):
    """Found by a fresh user: NaN topk_weights were taken silently. With debug_validate (semantics §11) a weight that
    is not finite is refused before anything is sent, naming topk_weights, its [t, k] and the value; without it
    (the default) the weights are not read and the call runs."""
    R, E, H, K, T = 2, 4, 128, 2, 3
    x = nice_bf16(rng, (T, H))
    idx = np.array([[0, 1], [2, 3], [1, 2]], np.int64)
    weights = np.full((T, K), 0.5, np.float32)
    weights[2, 1] = np.nan

    def rank_main(group):
        messages = {}
        for validate in (True, False):
            buf = epmoe.Buffer(group, debug_validate=validate)
            ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, E)
            layout = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe)
            try:
                recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=weights, **layout)
                messages[validate] = ("accepted", bool(np.isnan(recv_w).any()))
            except epmoe.Error as e:
                messages[validate] = (e.code, str(e))
        return messages

    ranks = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for messages in ranks:
        assert messages[True] == ("invalid_argument", "epmoe: invalid argument 'topk_weights': expected finite "
                                                      "weights (debug_validate), got nan at [2, 1]")
        assert messages[False][0] == "accepted"
    assert [m[False][1] for m in ranks] == [False, True]  # expert 2, of rank 1, received it


def test_an_array_where_an_integer_goes_is_named_there(rng):
    """Found by a fresh user: topk_weights passed positionally where DeepEP's low_latency_dispatch takes
    num_max_dispatch_tokens_per_rank came back as NumPy's bare TypeError, or as an error about a later argument the
    shift moved (dispatch_wait_recv_cost_stats). The integer's own name and the array's shape come first."""
    E, H, K, T = 8, 128, 2, 4
    x = nice_bf16(rng, (T, H))
    idx = random_topk_idx(rng, T, K, E)
    weights = rng.random((T, K), dtype=np.float32)
    expected = f"an array of shape {(T, K)} (float32)"

    def rank_main(group):
        buf = epmoe.Buffer(group, low_latency_mode=True)
        for call in (lambda: buf.low_latency_dispatch(x, idx, weights, E),
                     lambda: buf.low_latency_dispatch(x, idx, weights, E, None, np.zeros(16, np.int32))):
            with pytest.raises(epmoe.Error) as e:
                call()
            assert e.value.code == "invalid_argument"
            assert str(e.value) == (f"epmoe: invalid argument 'num_max_dispatch_tokens_per_rank': expected an int, "
                                    f"got {expected}"), str(e.value)
        # a 0-d integer array is an integer
        recv_x, count, _, _, _ = buf.low_latency_dispatch(x, idx, np.array(T), E)
        return int(np.asarray(count).sum())

    got = epmoe.run_thread_ranks(1, rank_main, timeout_s=TIMEOUT_S)
    assert got == [int((idx >= 0).sum())]


def test_num_worst_tokens_past_this_machines_memory_is_named_before_allocating(rng):
    """Found by a fresh user: a num_worst_tokens in range whose padded outputs cannot be allocated failed (or was
    killed) in the allocation, naming no argument. It is named with the bytes needed, before any exchange, and the
    buffer stays usable."""
    R, E, H, K = 2, 4, 4096, 2  # 2**31 - 1 rows of 8 KiB: about 17.6 TB, more than any machine here
    x = nice_bf16(rng, (3, H))
    idx = random_topk_idx(rng, 3, K, E)

    def rank_main(group):
        buf = epmoe.Buffer(group)
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, E)
        layout = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx)
        with pytest.raises(epmoe.Error) as e:
            buf.dispatch(x, **layout, num_worst_tokens=2**31 - 1)
        recv_x = buf.dispatch(x, **layout, num_worst_tokens=2 * 3 * R)[0]  # still usable
        return e.value.code, str(e.value), recv_x.shape

    for code, message, shape in epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S):
        assert code == "out_of_memory", message
        assert "'num_worst_tokens' = 2147483647" in message and "bytes of memory" in message, message
        assert shape == (2 * 3 * R, H)


def test_buffer_groups_and_destroy():
    with pytest.raises(epmoe.Error, match="'group'"):
        epmoe.Buffer(None)
    with pytest.raises(epmoe.Error, match="'group'"):
        epmoe.Buffer(object())

    def rank_main(group):
        out = {}
        for name, call in {"shrink": lambda: epmoe.Buffer(group, enable_shrink=True),
                           "negative": lambda: epmoe.Buffer(group, num_rdma_bytes=-1),
                           "slots_65": lambda: epmoe.Buffer(group, num_recv_slots=65),
                           "slots_str": lambda: epmoe.Buffer(group, num_recv_slots="2")}.items():
            with pytest.raises(epmoe.Error) as e:
                call()
            out[name] = (e.value.code, str(e.value))
        buf = epmoe.Buffer(group, explicitly_destroy=True)
        buf.destroy()
        with pytest.raises(epmoe.Error) as e:
            buf.get_dispatch_layout(np.zeros((1, 1), np.int64), 2)
        out["after_destroy"] = e.value.code
        return out

    for out in epmoe.run_thread_ranks(2, rank_main, timeout_s=TIMEOUT_S):
        assert out["shrink"][0] == "unsupported"
        assert out["negative"][0] == "invalid_argument" and "num_rdma_bytes" in out["negative"][1]
        for name, got in (("slots_65", "65"), ("slots_str", "'2'")):
            code, message = out[name]
            assert code == "invalid_argument" and "num_recv_slots" in message and "0..64" in message, message
            assert got in message, message
        assert out["after_destroy"] == "unusable"


@pytest.mark.skipif(epmoe._ext.built_with_cuda() and epmoe._ext.cuda_device_count() > 0,
                    reason="GPUs are visible: backend='cuda_ipc' is accepted")
def test_cuda_ipc_asked_for_without_gpus_names_the_choice_and_the_reason():
    # Found by a fresh user: thread ranks with backend='cuda_ipc' were told "Buffer over a 'threads' group needs
    # the cuda_ipc backend", as if the group, not the argument, had asked for it.
    def rank_main(group):
        with pytest.raises(epmoe.Error) as e:
            epmoe.Buffer(group, backend="cuda_ipc")
        return e.value.code, str(e.value)

    for code, message in epmoe.run_thread_ranks(2, rank_main, timeout_s=TIMEOUT_S):
        assert code == "unsupported", message
        assert "Buffer(backend='cuda_ipc') needs CUDA GPUs" in message, message
        assert ("this build has no CUDA" in message) != ("this machine has no visible GPU" in message), message
        assert "group needs" not in message, message


def test_run_thread_ranks_refuses_bad_arguments_naming_them():
    # Found by a fresh user: timeout_s="5" raised nanobind's TypeError, naming no argument.
    cases = [((0, lambda g: None), {}, "'num_ranks': expected an int of at least 1, got 0"),
             ((2**31, lambda g: None), {}, "'num_ranks': expected an int of at most 2147483647, got 2147483648"),
             (("2", lambda g: None), {}, "'num_ranks': expected an int, got '2'"),
             ((2, 3), {}, "'fn': expected a callable fn(group) run once per rank, got an object of type int"),
             ((2, lambda g: None), {"timeout_s": "5"}, "'timeout_s': expected None or a number of seconds > 0, "
                                                         "got '5'"),
             ((2, lambda g: None), {"timeout_s": True}, "'timeout_s': expected None or a number of seconds > 0, "
                                                          "got True"),
             ((2, lambda g: None), {"timeout_s": 0}, "'timeout_s': expected > 0 or None, got 0")]
    for args, kwargs, want in cases:
        with pytest.raises(epmoe.Error) as e:
            epmoe.run_thread_ranks(*args, **kwargs)
        assert e.value.code == "invalid_argument" and want in str(e.value), (args, kwargs, str(e.value))
    assert epmoe.run_thread_ranks(2, lambda g: g.rank(), timeout_s=np.float32(5.0)) == [0, 1]


def test_run_thread_ranks_returns_results_and_reraises():
    def rank_main(group):
        group.barrier()
        gathered = group.all_gather_bytes(bytes([group.rank()]) * (group.rank() + 1))
        return group.rank(), group.size(), group.backend, gathered

    out = epmoe.run_thread_ranks(3, rank_main, timeout_s=TIMEOUT_S)
    for r, (rank, size, backend, gathered) in enumerate(out):
        assert (rank, size, backend) == (r, 3, "threads")
        assert gathered == [b"\x00", b"\x01\x01", b"\x02\x02\x02"]

    def failing(group):
        if group.rank() == 1:
            raise ValueError("rank one fails")
        return group.rank()

    with pytest.raises(ValueError, match="rank one fails"):
        epmoe.run_thread_ranks(2, failing, timeout_s=TIMEOUT_S)

    def returning_early(group):
        if group.rank() == 1:
            return 1
        group.barrier()  # rank 1 never comes: the others are released at once, not after the 60 s timeout

    for _ in range(10):  # which waiting rank sees it first varies; the message names rank 1 every time
        start = time.monotonic()
        with pytest.raises(epmoe.Error, match=r"rank\(s\) 1 returned from their function") as e:
            epmoe.run_thread_ranks(4, returning_early, timeout_s=60.0)
        assert e.value.code == "unusable"
        assert time.monotonic() - start < 30.0

    def late(group):
        if group.rank() == 1:
            time.sleep(0.4)
        group.barrier("late phase")

    with pytest.raises(epmoe.Error, match="peer 1 in phase 'late phase'") as e:  # a timeout, not 'unusable'
        epmoe.run_thread_ranks(3, late, timeout_s=0.1)
    assert e.value.code == "timeout"

    def late_under_no_timeout(group):
        assert group.timeout_s == 1e9  # infinity: the longest timeout the clocks hold
        if group.rank() == 1:
            time.sleep(0.05)
        group.barrier()

    epmoe.run_thread_ranks(2, late_under_no_timeout, timeout_s=float("inf"))
    for bad in (0, 10**12, 2.0, True, "2"):
        with pytest.raises(epmoe.Error, match="num_ranks") as e:
            epmoe.run_thread_ranks(bad, failing)
        assert e.value.code == "invalid_argument" and repr(bad) in str(e.value)


def test_ranks_in_different_collectives_raise_rank_mismatch():
    def apart(group):
        if group.rank() == 0:
            group.barrier("A")
        else:
            group.all_gather_bytes(b"x", "B")

    # The same words whichever rank arrives last (rank 0's collective first).
    for _ in range(20):
        with pytest.raises(epmoe.Error, match="ranks met in different collectives: rank 0 in barrier 'A', "
                                              "rank 1 in all_gather of 8 bytes per rank 'B'") as e:
            epmoe.run_thread_ranks(2, apart, timeout_s=30.0)
        assert e.value.code == "rank_mismatch"


@pytest.mark.parametrize("value, expected, warned", [("inf", 1e9, False), ("7.5", 7.5, False), ("abc", 100.0, True),
                                                     ("0", 100.0, True), ("nan", 100.0, True), ("5s", 100.0, True)])
def test_timeout_environment_variable(value, expected, warned):
    env = dict(os.environ, EPMOE_TIMEOUT_S=value)
    out = subprocess.run([sys.executable, "-c", "import epmoe; print(repr(epmoe.default_timeout_s()))"], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    assert float(out.stdout) == expected, out
    assert ("EPMOE_TIMEOUT_S='%s' is not a positive number of seconds; using 100" % value in out.stderr) == warned, out


def test_a_required_argument_given_as_none_is_named(rng):
    """None where an array or a callable is required: epmoe.Error naming the argument (not the binding's
    TypeError, which names none), raised before any exchange, the buffer still usable after."""
    def named(name, call):
        with pytest.raises(epmoe.Error) as e:
            call()
        assert e.value.code == "invalid_argument" and f"'{name}'" in str(e.value), str(e.value)

    named("fn", lambda: epmoe.run_thread_ranks(1, None))
    named("logits", lambda: epmoe.topk_softmax(None, 2))
    named("logits", lambda: epmoe.topk_sigmoid(None, 2))
    named("logits", lambda: epmoe.grouped_topk(None, 2, 2, 1))
    named("topk_idx", lambda: epmoe.get_dispatch_layout(None, 4, 2))
    named("x", lambda: epmoe.quantize_fp8(None))
    q, s = epmoe.quantize_fp8(nice_bf16(rng, (2, 128)))
    named("q", lambda: epmoe.dequantize_fp8(None, s))
    named("scales", lambda: epmoe.dequantize_fp8(q, None))
    named("prepare_finalize", lambda: epmoe.MoELayer(None, epmoe.make_reference_experts()))
    named("experts", lambda: epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), None))
    named("micro_batch", lambda: epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_reference_experts(),
                                                micro_batch=-1))
    named("chunk_size", lambda: epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_reference_experts(),
                                               chunk_size=-1))
    named("shared_experts", lambda: epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(),
                                                   epmoe.make_reference_experts(), shared_experts=5))
    E, H, K, T = 4, 128, 2, 3
    x = nice_bf16(rng, (T, H))
    idx = random_topk_idx(rng, T, K, E)

    def rank_main(group):
        buf = epmoe.Buffer(group)
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, E)
        layout = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx)
        named("x", lambda: buf.dispatch(None, **layout))
        named("x", lambda: buf.dispatch((x, x, x), **layout))
        named("topk_idx", lambda: buf.get_dispatch_layout(None, E))
        recv_x, _, _, _, handle, _ = buf.dispatch(x, **layout)  # still usable
        named("x", lambda: buf.combine(None, handle))
        combined, _, _ = buf.combine(recv_x, handle)
        # Low-latency calls: None, and read-only outputs (DLPack would hand their memory over for writing).
        ll = epmoe.Buffer(group, low_latency_mode=True)
        w = np.full((T, K), 0.5, np.float32)
        named("x", lambda: ll.low_latency_dispatch(None, idx, T, E))
        named("topk_idx", lambda: ll.low_latency_dispatch(x, None, T, E))
        frozen = np.zeros(2, np.int64)
        frozen.setflags(write=False)
        named("dispatch_wait_recv_cost_stats",
              lambda: ll.low_latency_dispatch(x, idx, T, E, dispatch_wait_recv_cost_stats=frozen))
        frozen_counts = np.zeros(E // 2, np.int32)
        frozen_counts.setflags(write=False)
        named("cumulative_local_expert_recv_stats",
              lambda: ll.low_latency_dispatch(x, idx, T, E, cumulative_local_expert_recv_stats=frozen_counts))
        recv, _, ll_handle, _, _ = ll.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        named("topk_weights", lambda: ll.low_latency_combine(recv, idx, None, ll_handle))
        named("topk_idx", lambda: ll.low_latency_combine(recv, None, w, ll_handle))
        named("x", lambda: ll.low_latency_combine(None, idx, w, ll_handle))
        frozen_out = np.zeros((T, H), BF16)
        frozen_out.setflags(write=False)
        named("out", lambda: ll.low_latency_combine(recv, idx, w, ll_handle, out=frozen_out))
        named("combine_wait_recv_cost_stats",
              lambda: ll.low_latency_combine(recv, idx, w, ll_handle, combine_wait_recv_cost_stats=frozen))
        ll.low_latency_combine(recv, idx, w, ll_handle)  # still usable
        assert not frozen.any() and not frozen_counts.any() and not frozen_out.view(np.uint16).any()
        return combined

    for combined in epmoe.run_thread_ranks(2, rank_main, timeout_s=TIMEOUT_S):
        # Each token reaches a rank once per rank its experts live on; combine sums those copies.
        per_rank = np.zeros((T, 2), dtype=bool)
        for t in range(T):
            for k in range(K):
                if idx[t, k] >= 0:
                    per_rank[t, idx[t, k] // (E // 2)] = True
        want = x.astype(np.float64) * per_rank.sum(axis=1, keepdims=True)
        np.testing.assert_array_equal(combined.astype(np.float64), want)

@pytest.mark.parametrize("failing", [0, 1])
def test_a_rank_that_raises_releases_the_other_at_once_and_its_own_exception_comes_back(failing):
    # The waiting rank sees only 'unusable' (the other failed); that must not hide the failing rank's ValueError,
    # whichever rank it is.
    seen = {}

    def rank_main(group):
        if group.rank() == failing:
            raise ValueError(f"boom from rank {failing}")
        group.timeout_s = 600.0  # released by the failure, not by this timeout
        try:
            group.barrier("waiting for the other rank")
        except epmoe.Error as e:
            seen["code"], seen["message"] = e.code, str(e)
            raise

    start = time.monotonic()
    with pytest.raises(ValueError) as e:
        epmoe.run_thread_ranks(2, rank_main, timeout_s=TIMEOUT_S)
    assert type(e.value) is ValueError and str(e.value) == f"rank {failing}: boom from rank {failing}"
    assert seen["code"] == "unusable" and f"rank {failing}" in seen["message"], seen
    assert time.monotonic() - start < 60.0


def test_a_higher_rank_raising_invalid_argument_while_others_dispatch_reraises_it(rng):
    R, E, H, K = 3, 6, 128, 2
    x = nice_bf16(rng, (4, H))
    idx = random_topk_idx(rng, 4, K, E)
    seen = {}

    def rank_main(group):
        buf = epmoe.Buffer(group)
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, E)
        mine = x.astype(np.float64) if group.rank() == R - 1 else x  # the last rank's x is invalid
        try:
            return buf.dispatch(mine, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                num_tokens_per_expert=ntpe, topk_idx=idx)
        except epmoe.Error as e:
            seen[group.rank()] = (e.code, str(e))
            raise

    with pytest.raises(epmoe.Error) as e:
        epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    assert e.value.code == "invalid_argument", str(e.value)
    assert "'x'" in str(e.value) and "float64" in str(e.value)
    # The failing rank's own error, its message naming that rank.
    code, message = seen[R - 1]
    assert message.startswith("epmoe: invalid argument 'x'"), message
    assert (e.value.code, str(e.value)) == (code, f"epmoe: rank {R - 1}: " + message[len("epmoe: "):])
    for r in range(R - 1):  # the others saw only its consequence
        assert seen[r][0] in ("unusable", "timeout"), seen


def test_an_epmoe_error_raised_by_one_rank_comes_back_naming_the_rank():
    # The same object as raised (type, code and traceback kept), its message naming the rank; one that already names
    # a rank first (a timeout's) is left as it is, and so is an exception of another type.
    raised = {}

    def rank_main(group):
        if group.rank() == 1:
            try:
                epmoe.Buffer(group).get_dispatch_layout(np.zeros((2, 2), np.int64), 0)
            except epmoe.Error as e:
                raised["error"], raised["message"] = e, str(e)
                raise
        group.barrier("waiting for rank 1")

    with pytest.raises(epmoe.Error) as e:
        epmoe.run_thread_ranks(2, rank_main, timeout_s=TIMEOUT_S)
    assert e.value is raised["error"] and e.value.code == "invalid_argument"
    assert raised["message"].startswith("epmoe: invalid argument 'num_experts'"), raised["message"]
    assert str(e.value) == "epmoe: rank 1: " + raised["message"][len("epmoe: "):]

    def named(group):
        if group.rank() == 0:
            raise epmoe.Error("epmoe: rank 0: already named")
        group.barrier("waiting for rank 0")

    with pytest.raises(epmoe.Error, match="^epmoe: rank 0: already named$"):
        epmoe.run_thread_ranks(2, named, timeout_s=TIMEOUT_S)


def test_a_lower_rank_raising_while_a_higher_waits_reraises_its_own_exception():
    class RankZeroError(Exception):
        pass

    def rank_main(group):
        if group.rank() == 0:
            raise RankZeroError("rank zero's own failure")
        group.barrier("waiting for rank zero")

    with pytest.raises(RankZeroError, match="^rank 0: rank zero's own failure$"):
        epmoe.run_thread_ranks(3, rank_main, timeout_s=TIMEOUT_S)


def test_an_exception_of_another_type_raised_by_one_rank_comes_back_naming_the_rank():
    """Found by a fresh user: a ValueError (any exception that is not an epmoe error) raised by one rank came back
    without the rank. It comes back as the same object (type, attributes and traceback as raised), its message naming
    the rank where the message is its one string argument; else (KeyError's argument is the key) with a note naming the
    rank, on Python 3.11+."""
    raised = {}

    def raising(make):
        def rank_main(group):
            if group.rank() == 1:
                raised["error"] = make()
                raise raised["error"]
            group.barrier("waiting for rank 1")
        return rank_main

    with pytest.raises(ValueError) as e:
        epmoe.run_thread_ranks(2, raising(lambda: ValueError("bad value")), timeout_s=TIMEOUT_S)
    assert e.value is raised["error"] and type(e.value) is ValueError
    assert str(e.value) == "rank 1: bad value" and e.value.args == ("rank 1: bad value",)
    assert "rank_main" in [frame.name for frame in traceback.extract_tb(e.value.__traceback__)]

    class WithFields(Exception):
        def __init__(self, path: str) -> None:
            super().__init__(f"cannot read {path}")
            self.path = path

    with pytest.raises(WithFields) as e:
        epmoe.run_thread_ranks(2, raising(lambda: WithFields("/x")), timeout_s=TIMEOUT_S)
    assert (str(e.value), e.value.path) == ("rank 1: cannot read /x", "/x")

    with pytest.raises(ValueError, match="^rank 0: said by rank 0$"):  # a message naming a rank first is kept
        epmoe.run_thread_ranks(2, raising(lambda: ValueError("rank 0: said by rank 0")), timeout_s=TIMEOUT_S)

    for make, args in ((lambda: KeyError("expert 7"), ("expert 7",)), (lambda: OSError(2, "No such file"),
                                                                          (2, "No such file")),
                       (lambda: RuntimeError(), ()), (lambda: ValueError("a", 1), ("a", 1))):
        with pytest.raises(Exception) as e:
            epmoe.run_thread_ranks(2, raising(make), timeout_s=TIMEOUT_S)
        assert e.value is raised["error"] and e.value.args == args  # its arguments are data: left as they are
        if sys.version_info >= (3, 11):
            assert e.value.__notes__ == ["raised by rank 1 of run_thread_ranks"], e.value


def test_a_rank_that_never_arrives_times_out_instead_of_hanging():
    def rank_main(group):
        if group.rank() == 0:
            time.sleep(2.0)  # late, not gone: a rank that returns releases its peers at once instead
            return "skipped"
        group.timeout_s = 0.5
        with pytest.raises(epmoe.Error) as e:
            group.barrier("lonely")
        return e.value.code, str(e.value)

    out = epmoe.run_thread_ranks(2, rank_main, timeout_s=TIMEOUT_S)
    code, msg = out[1]
    assert code == "timeout" and "lonely" in msg and "0" in msg


def test_package_facts():
    assert isinstance(epmoe.__version__, str) and epmoe.__version__.count(".") == 2
    assert epmoe.default_timeout_s() > 0
    assert epmoe.BFLOAT16 == np.dtype(BF16)
    assert str(epmoe.topk_idx_t).replace("torch.", "") == "int64"  # torch.int64 where torch imports
