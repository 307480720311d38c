// Independent reference for the dispatch layout and normal-mode dispatch/combine (semantics §3, 4).
//
// Computed for all ranks at once from every rank's full inputs with plain loops over ranks and tokens
// (no Transport, no code of src/). The ordering rules are those of include/epmoe/buffer.hpp:
// rows grouped by source rank ascending, source token order within; combine sums the destination
// ranks' rows in ascending rank order in float32 starting from +0.0f, then bias_0, then bias_1, and
// rounds to bfloat16 once (float32 is the order the spec fixes, so the reference uses float32 too).
#pragma once

#include <epmoe/tensor.hpp>

#include <cstdint>
#include <vector>

namespace epmoe::test {

/// Layout of one rank's topk_idx (int64 or int32 [T, K]) for E experts on R ranks.
struct RefLayout {
  std::vector<std::int32_t> num_tokens_per_rank;    ///< [R]
  std::vector<std::int32_t> num_tokens_per_expert;  ///< [E]
  std::vector<std::uint8_t> is_token_in_rank;       ///< [T * R], 0/1
};
RefLayout reference_layout(const TensorView& topk_idx, int num_experts, int num_ranks);

/// One rank's dispatch inputs. x_scales, topk_idx and topk_weights may be undefined.
struct RefDispatchInput {
  Tensor x;             ///< bf16 or fp8 [T, H]
  Tensor x_scales;      ///< fp32 [T, G] or int32 [T, ceil(G/4)] (moved verbatim)
  Tensor topk_idx;      ///< int64 or int32 [T, K]
  Tensor topk_weights;  ///< fp32 [T, K]
};

/// What one rank should receive.
struct RefDispatchOutput {
  std::int64_t num_recv_tokens = 0;
  std::int64_t rows = 0;                       ///< num_worst_tokens or num_recv_tokens
  std::vector<std::uint8_t> recv_x;            ///< rows * H * elem bytes (padding zero)
  std::vector<std::uint8_t> recv_x_scales;     ///< rows * scale row bytes (padding zero)
  std::vector<std::int64_t> recv_topk_idx;     ///< rows * K (padding -1)
  std::vector<float> recv_topk_weights;        ///< rows * K (padding 0)
  std::vector<std::int32_t> recv_src_idx;      ///< num_recv_tokens
  std::vector<std::int32_t> src_rank;          ///< num_recv_tokens: the source rank of each row
  std::vector<std::int32_t> num_recv_tokens_per_expert;  ///< E_local, aligned
  std::vector<std::int32_t> rank_prefix_matrix;          ///< R * R (same on every rank)
  std::vector<std::int32_t> send_pos;                    ///< T * R (this rank as the sender)
};

/// Expected dispatch for every rank. topk_idx is required in `in` (the routing); the topk fields of
/// the output are filled only when in[r].topk_idx (weights) is given.
std::vector<RefDispatchOutput> reference_dispatch(const std::vector<RefDispatchInput>& in, int num_experts,
                                                  int expert_alignment, int num_worst_tokens);

/// Expected combine for every rank: rank s's token t sums, over destination ranks d ascending that
/// hold it, row (row of t in d's recv_x) of y[d], in float32 from +0.0f, then bias_0[s][t], bias_1[s][t],
/// rounded to bf16 once. y[d]: bf16 [rows_d, H]. weights[d] (optional, fp32 [rows_d, K]) likewise
/// summed into combined_topk_weights. bias vectors may be empty or hold undefined tensors.
struct RefCombineOutput {
  std::vector<std::uint16_t> combined_x;      ///< T * H bf16 bits
  std::vector<float> combined_topk_weights;   ///< T * K
};
std::vector<RefCombineOutput> reference_combine(const std::vector<Tensor>& topk_idx, int num_experts,
                                                const std::vector<Tensor>& y, const std::vector<Tensor>& weights,
                                                const std::vector<Tensor>& bias_0, const std::vector<Tensor>& bias_1);

}  // namespace epmoe::test
