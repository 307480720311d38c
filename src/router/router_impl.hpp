// Internal interface of the router stage: the public functions (router.cpp) validate their arguments
// once, normalise every variant to one RoutingProblem, and hand it to a device implementation
// (cpu.cpp here; a CUDA twin implements the same entry point).
#pragma once

#include <epmoe/router.hpp>

namespace epmoe::router_detail {

/// One fully validated routing problem. topk_softmax / topk_sigmoid are the special case
/// num_expert_group == topk_group == 1, no bias, routed_scaling_factor 1.
struct RoutingProblem {
  TensorView logits;  ///< float32 or bfloat16 [T, E], contiguous
  std::int64_t num_tokens = 0;  ///< T
  std::int64_t num_experts = 0;  ///< E
  int num_topk = 1;  ///< K, 1..(topk_group * E / num_expert_group)
  ScoringFunc scoring = ScoringFunc::softmax;
  bool renormalize = false;
  float routed_scaling_factor = 1.0f;
  int num_expert_group = 1;  ///< E % num_expert_group == 0
  int topk_group = 1;  ///< 1..num_expert_group
  const float* bias = nullptr;  ///< float32 [E] on the logits' device, or null
};

/// CPU implementation: writes float32 [T, K] weights and int64 [T, K] ids (contiguous, host memory).
void route_cpu(const RoutingProblem& p, float* topk_weights, std::int64_t* topk_idx);

}  // namespace epmoe::router_detail
