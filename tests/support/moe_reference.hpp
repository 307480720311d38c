// An independent float64 reference of a whole MoE layer (semantics §7/8), written from docs/semantics.md:
// out[t] = sum_k w[t,k] * w2[e] @ act(w1[e] @ x[t]), e = topk_idx[t,k] (global), -1 skipped.
#pragma once

#include <epmoe/tensor.hpp>

#include <string>
#include <vector>

namespace epmoe::test {

/// x bf16 [T, H] (the values the experts see), w1 bf16 [E, 2N|N, H], w2 bf16 [E, H, N], topk int64
/// [T, K], weights f32 [T, K]; activation by vLLM name. Returns [T * H] doubles.
std::vector<double> moe_layer_reference(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& topk_idx,
                                        const Tensor& topk_weights, const std::string& activation,
                                        bool weight_on_input = false);

/// ||got - want|| / ||want|| over all elements (got bf16 [T, H]).
double relative_l2(const Tensor& got, const std::vector<double>& want);

}  // namespace epmoe::test
