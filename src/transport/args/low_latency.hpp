// Checks of low-latency arguments (semantics §5, 11), shared by the CPU implementation (cpu/low_latency_mode.cpp) and the
// cuda_ipc GPU implementation (cuda_ipc/low_latency.cpp), so each argument has one rule and one message.
// `tmax` is num_max_dispatch_tokens_per_rank, its one short name below the API (docs/semantics.md, "Letters").
#pragma once

#include <epmoe/buffer.hpp>

#include "transport/low_latency_protocol.hpp"
#include "quant/quant.hpp"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace epmoe::low_latency_args {

/// "<describe(t)> with strides [...]", for messages about strides.
std::string strides_of(const TensorView& t);
/// `t` lives on `device` (CPU: the threads/mpi backends; CUDA: this rank's device of the cuda_ipc backend).
void check_on(const TensorView& t, std::string_view name, Device device);
/// Tmax >= 1 with R * Tmax < 2^31, H a positive multiple of 8, R >= 1, E a positive multiple of R, E / R <= 1024.
void check_settings(int tmax, std::int64_t hidden, int R, int E);
/// A host topk_idx [T, K] int64/int32, K in 1..16, ids in [-1, E) and distinct per token (a token has at most one
/// row per expert). Returns it as int32, row-major. Errors: invalid_argument naming 'topk_idx'.
std::vector<std::int32_t> read_topk_idx(const TensorView& t, std::int64_t T, int E);
/// A host topk_weights float32 [T, K], row-major copy.
std::vector<float> read_topk_weights(const TensorView& t, std::int64_t T, std::int64_t K);
/// A low-latency buffer's settings, fixed by its first call (`set`) until it is destroyed.
struct Config {
  bool set = false;
  int tmax = 0;
  std::int64_t hidden = 0;
  int num_experts = 0;
};

/// Tmax/H/E against the buffer's first call (set), or else num_rdma_bytes (> 0) against `needed` bytes. A different H
/// is named `hidden_name`: "x" where H is x's width (a dispatch), "hidden" where it is an argument.
void check_against_config(bool set, int cfg_tmax, std::int64_t cfg_hidden, int cfg_e, int tmax, std::int64_t hidden,
                          int num_experts, int R, std::int64_t num_rdma_bytes, std::int64_t needed,
                          std::string_view hidden_name);

/// Combine's first checks, before the buffer's state: a handle that is not empty, of this buffer (`buffer_id`).
/// Returns it. Errors: invalid_argument naming 'handle'.
const LowLatencyHandle& combine_handle(const LowLatencyCombineArgs& a, std::uint64_t buffer_id);
/// Combine's x: bfloat16 [E_local, rows, H] on `device` with unit stride in dimension 2 (on CUDA also 16-byte aligned
/// rows). Errors: invalid_argument naming 'x'.
void check_combine_x(const TensorView& x, int local_experts, std::int64_t rows, std::int64_t hidden, Device device);
/// What a combine sends: with zero_copy the buffer's combine slab of the call's half (`slab`; x, when given, must
/// still pass check_combine_x, as DeepEP's x keeps its shape), else x (checked). Errors: those of check_combine_x.
TensorView combine_input(const LowLatencyCombineArgs& a, const TensorView& slab, int local_experts, std::int64_t rows,
                         std::int64_t hidden, Device device);
/// The combine slab of a half (Layout::combine_slab at `half`) as bfloat16 [E_local, R * tmax, H] on `device`.
TensorView combine_slab_view(const low_latency_protocol::Layout& L, void* half, Device device);
/// A wait-cost statistic (dispatch_wait_recv_cost_stats / combine_wait_recv_cost_stats): undefined, or a contiguous
/// int64 [R] on `device`. Errors: invalid_argument naming `name`.
void check_wait_cost_stats(const TensorView& stats, std::string_view name, int R, Device device);
/// Combine's optional out: bfloat16 [T, H] on `device` with unit stride in dimension 1 (on CUDA also 16-byte aligned
/// rows). Errors: invalid_argument naming 'out'.
void check_combine_out(const TensorView& out, std::int64_t T, std::int64_t hidden, Device device);

/// Combine's checks of its handle (of this buffer, which is configured as `tmax`, `hidden`, `num_experts`) on rank
/// `rank`: the handle's settings (invalid_argument naming 'handle'), then that it was made after the last clean
/// (`base`: the buffer's call count then; `generation`: its calls so far, for the message) and that the dispatch's
/// routing is still held by the buffer (`routing_kept`: no later dispatch reused the half holding it; semantics §5,
/// the alternation rule) (stale_handle), and that its receive is done (`receive_pending` false: its recv hook was
/// called; invalid_argument naming 'handle').
void check_combine_handle(const LowLatencyHandle& handle, int rank, int tmax, std::int64_t hidden, int num_experts,
                          std::uint64_t base, std::uint64_t generation, bool routing_kept, bool receive_pending);
/// Combine's topk_idx has the dispatch's shape [T, K]. Errors: invalid_argument naming 'topk_idx'.
void check_combine_idx_shape(const TensorView& topk_idx, std::int64_t T, std::int64_t K);

/// What an overlapped combine waits on (LowLatencyCombineArgs::overlap), once checked.
struct OverlapSpec {
  enum class Form { none, blocks, experts };
  Form form = Form::none;  ///< none: overlap false (the signal fields were ignored)
  /// blocks: comp_signal's int32 entries; experts: src_signals' uint32 entries (both on the backend's device).
  void* signal = nullptr;
  const std::int32_t* packed_recv_count = nullptr;  ///< blocks: the caller's counts (on the backend's device)
  int block_m = 0;                   ///< blocks: rows per block
  std::int64_t blocks_per_expert = 0;  ///< blocks: ceil(R * Tmax / block_m), the stride of comp_signal per expert
  std::uint32_t expect = 0;          ///< the value a block (threshold) or an expert (src_signal_expect_value) waits for
  int num_sms = 0;                   ///< the send's SM bound (0 = a block per local expert)
  std::int64_t* send_stamps = nullptr;  ///< LowLatencyCombineArgs::send_stamps (first, last row store), or null
  bool active() const { return form != Form::none; }
};

/// The overlap fields of a combine (LowLatencyCombineArgs, docs/semantics.md "Overlapped low-latency combine"),
/// for `local_experts` experts of `rows` = R * Tmax packed rows, the signal tensors on `device` (x's). overlap
/// false: nothing is checked (Form::none). Errors (invalid_argument naming the argument, the expected and the
/// actual value): num_sms outside 0..1024; neither form or both forms (a field of the other form set); block_m
/// or threshold < 1; comp_signal not int32 1-d with unit stride and >= E_local * ceil(rows / block_m) entries;
/// packed_recv_count not int32 [E_local]; src_signals not uint32 [E_local] with unit stride;
/// src_signal_expect_value outside 1..2^32-1; send_stamps not int64 [2] with unit stride; a tensor on another device.
OverlapSpec check_combine_overlap(const LowLatencyCombineArgs& a, int local_experts, std::int64_t rows,
                                  Device device);

/// What a checked dispatch looks like.
struct DispatchSpec {
  std::int64_t T = 0, H = 0, K = 0;
  int tmax = 0, E = 0, El = 0;
  std::vector<std::int32_t> idx;  ///< topk_idx as int32 [T * K] when `device` is the CPU (values checked); else empty
  quant_detail::GlobalScale global_scale;  ///< use_nvfp4: x_global_scale's value (CPU) or device pointer
};

/// Every check of a low-latency dispatch that needs no peer: x bfloat16 [T, H] on `device` (unit stride in dimension
/// 1; on CUDA also contiguous rows, 16-byte aligned), the settings (check_settings), T <= Tmax (the message names
/// both), fp8 H % 16 == 0, round_scale / use_ue8m0 rules, use_nvfp4 (not with use_fp8, H % 64 == 0, x_global_scale
/// float32 with one element on the CPU or `device`, a CPU value finite and > 0), hook and async_finish exclusive, topk_idx (shape, K in
/// 1..16; on the CPU also the values), topk_weights float32 [T, K], cumulative_local_expert_recv_stats int32
/// [E_local]. Errors: invalid_argument naming the argument, the expected and the actual value.
DispatchSpec check_dispatch(const LowLatencyDispatchArgs& a, int R, Device device);

/// The dispatch's packed_recv_x_scales over the scales area at `area` (of layout L, on `device`): float32
/// [E_local, R*Tmax, G], or with `ue8m0` int32 [E_local, R*Tmax, ceil(G/4)], column-major per expert with strides
/// {C * L.scale_rows, 1, L.scale_rows}: DeepEP's layout (a transposed [E_local, C, R*Tmax] allocation), each
/// expert's columns padded to DeepGEMM's TMA alignment (semantics §5, 6).
TensorView recv_scales_view(const low_latency_protocol::Layout& L, void* area, bool ue8m0, Device device);

}  // namespace epmoe::low_latency_args
