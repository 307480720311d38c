// Checks of normal-mode dispatch arguments, shared by every backend (the CPU transports through
// cpu/normal_mode.cpp, and cuda_ipc), so each argument has one rule and one message.
#pragma once

#include <epmoe/buffer.hpp>

#include <array>
#include <cstdint>
#include <string_view>

namespace epmoe {

inline constexpr std::int64_t kNormalMaxLocalExperts = 1024;  // semantics §1: E_local <= 1024

/// How fp8 scales travel: none (bf16 rows), float32 [T, G], or UE8M0 int32 [T, ceil(G/4)].
enum class ScaleFormat : std::int64_t { none = 0, float32 = 1, ue8m0 = 2 };

/// The settings of a dispatch that every rank must pass alike, in the order every backend compares them (the CPU
/// modes in their settings all-gather, cuda_ipc in-band in its notify kernel), named as errors name them. The last
/// one, a hash of a cached dispatch's handle layout, is compared by the CPU modes only (cuda_ipc compares the
/// handles' counts themselves).
inline constexpr std::array<std::string_view, 10> kDispatchSettingNames = {
    "hidden",           "x dtype",         "num_topk (0 = no topk_idx)",     "num_experts",
    "x_scales format",  "expert_alignment", "num_worst_tokens",              "cached dispatch (handle given)",
    "topk_weights given", "handle layout (rank_prefix_matrix hash)"};

/// The shape of one dispatch, read off its checked arguments.
struct DispatchSpec {
  std::int64_t T = 0, H = 0;
  bool fp8 = false;
  ScaleFormat scale_format = ScaleFormat::none;
  std::int64_t scale_cols = 0;  ///< columns of x_scales (0 for bf16)
  bool cached = false, has_topk = false, has_weights = false;
  int K = 0;          ///< 0 when topk_idx is not given (cached or layout-only dispatch)
  int E = 0;          ///< from num_tokens_per_expert, or the handle when cached
  int alignment = 1;  ///< expert_alignment in effect (the handle's when cached)
  int worst = 0;      ///< num_worst_tokens in effect (the handle's when cached)
};

/// A tensor on `device`, contiguous, with data. Errors name `name`.
void check_tensor_on(const TensorView& t, const char* name, Device device);
/// As check_tensor_on, with an exact dtype and shape.
void check_tensor(const TensorView& t, const char* name, DType dtype, const Shape& shape, Device device);

/// Checks everything about a dispatch that needs no peer and no id values (semantics §4, 11): x (bf16, or
/// fp8 with float32 or UE8M0 scales), H alignment, topk_idx/topk_weights, the layout tensors' dtypes
/// and shapes, E a multiple of `num_ranks` with E_local <= 1024, alignment and num_worst_tokens, and
/// for a cached dispatch that the handle is one of buffer `buffer_id` for the same T and that the
/// settings agree with it. Every tensor must be on `device`.
/// Errors: ErrorCode::invalid_argument naming the argument, the expected and the actual value.
DispatchSpec check_dispatch_args(const DispatchArgs& a, int num_ranks, std::uint64_t buffer_id, Device device);

/// A handle made by a dispatch of buffer `buffer_id` with `num_ranks` ranks: defined, of this buffer, and its
/// tensors of the shapes dispatch gives them (guards against a handle edited by hand).
/// Errors: ErrorCode::invalid_argument naming 'handle' or the handle's field.
void check_normal_handle(const NormalHandle* handle, std::uint64_t buffer_id, int num_ranks);

/// The shape of one combine, read off its checked arguments.
struct CombineSpec {
  std::int64_t T = 0, H = 0;  ///< tokens of this rank (the handle's), hidden size of x
  int K = 0;                  ///< columns of topk_weights (0 when not given)
};

/// Checks everything about a combine that needs no peer (semantics §4, 11): the handle (check_normal_handle), x bfloat16
/// [handle.num_recv_rows, H] with H % 8 == 0, topk_weights float32 [rows, K] with K in 1..32, bias_0 / bias_1
/// bfloat16 [T, H]. Every tensor must be on `device`.
/// Errors: ErrorCode::invalid_argument naming the argument, the expected and the actual value.
CombineSpec check_combine_args(const CombineArgs& a, int num_ranks, std::uint64_t buffer_id, Device device);

}  // namespace epmoe
