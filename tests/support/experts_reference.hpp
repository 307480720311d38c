// An independent, deliberately naive float64 model of the expert MLPs (semantics §7), for tests.
//
// Written from docs/semantics.md, separately from src/experts: it reads tensors element by element, computes the
// whole first-layer vector h1 = w1[e] @ x before splitting it into gate/up, and spells the activations
// differently (sigmoid through tanh, GELU through erfc), so a shared slip is unlikely. No rounding.
#pragma once

#include <epmoe/experts.hpp>
#include <epmoe/tensor.hpp>

#include <vector>

namespace epmoe::test {

/// semantics §7's activation of one intermediate channel: gated ones use gate and up, *_no_mul only gate.
double naive_activation(Activation act, double gate, double up);

/// Standard format. x bf16/fp32 [M, H]; w1 bf16 [E_local, 2N or N, H]; w2 bf16 [E_local, H, N];
/// topk_weights fp32 [M, K]; topk_idx int64/int32 [M, K] (global ids when expert_map, an int32 [E]
/// tensor, is given, else local ids; -1 = none). Returns [M, H] (reduce: weighted sum over k, or with
/// weight_on_input the input scaled by the K == 1 weight and a plain sum) or [M, K, H] (unweighted,
/// zeros for -1 slots), row-major.
std::vector<double> naive_experts_standard(const TensorView& x, const TensorView& w1, const TensorView& w2,
                                           const TensorView& topk_weights, const TensorView& topk_idx,
                                           Activation act, const TensorView& expert_map, bool weight_on_input,
                                           bool reduce);

/// Batched format. x [E_local, T, H]; counts int32 [E_local]. Returns [E_local, T, H] with rows past each
/// count zero.
std::vector<double> naive_experts_batched(const TensorView& x, const TensorView& w1, const TensorView& w2,
                                          const TensorView& counts, Activation act);

/// ||out - ref||_2 / ||ref||_2, `out` a bf16 tensor holding ref.size() elements (semantics §13's measure).
double relative_l2(const std::vector<double>& ref, const TensorView& out);
/// The same between two double vectors.
double relative_l2(const std::vector<double>& ref, const std::vector<double>& got);

}  // namespace epmoe::test
