// Independent reference of low-latency dispatch and combine (semantics §5), written from docs/semantics.md with
// plain loops over every rank's inputs; it never calls the code under test.
#pragma once

#include <epmoe/tensor.hpp>

#include <cstdint>
#include <vector>

namespace epmoe::test {

/// One rank's inputs: x bf16 [T, H], topk_idx int64 [T, K], topk_weights float32 [T, K].
struct LowLatencyRankInput {
  Tensor x, topk_idx, topk_weights;
};

/// Where one packed row came from.
struct PackedRowSource {
  int rank = 0;   ///< source rank
  int token = 0;  ///< token index in the source rank's x
  int k = 0;      ///< the topk slot that chose this expert
};

/// What rank d receives: per local expert, its rows in order, and the layout ranges.
struct LowLatencyReferenceRank {
  std::vector<std::vector<PackedRowSource>> rows;  ///< [E_local][count]
  std::vector<std::int64_t> layout_range;          ///< [E_local * R]: begin << 32 | count
};

/// The layout every rank receives: expert e of rank d (global id d * E_local + e) gets, for source
/// ranks s ascending, the tokens t of s in ascending order, and for each the slots k (ascending) with
/// topk_idx[s][t, k] == d * E_local + e.
std::vector<LowLatencyReferenceRank> reference_low_latency_dispatch(const std::vector<LowLatencyRankInput>& inputs,
                                                                    int num_experts);

/// Combine: out[r][t] = bf16(sum over k ascending, skipping -1, of w[r][t, k] * y(r, t, k)), the sum in
/// float32 starting from 0.0f with each product rounded to float32 before it is added, where y(r, t, k)
/// is row `row` of expert e in expert_out[d] (bf16 [E_local, R*Tmax, H]) with (d, e, row) the position
/// of (r, t, k) in the reference layout. Returns bf16 [T_r, H] per rank.
std::vector<Tensor> reference_low_latency_combine(const std::vector<LowLatencyRankInput>& inputs,
                                                  const std::vector<LowLatencyReferenceRank>& layout,
                                                  const std::vector<Tensor>& expert_out, int num_experts);

}  // namespace epmoe::test
