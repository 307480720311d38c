// Module interface of the router stage (the one header of src/router/ that other folders include): the
// public functions (router.cpp) validate their arguments once, normalise every variant to one RoutingProblem
// and hand it to a device implementation, cpu.cpp or cuda.cu (CUDA builds only: EPMOE_HAVE_CUDA).
#pragma once

#include <epmoe/router.hpp>
#include <epmoe/stream.hpp>

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

/// CUDA implementation, bit-identical to route_cpu: writes float32 [T, K] weights and int64 [T, K] ids
/// (contiguous, device memory of the logits' device), asynchronously on `stream`. Errors: unsupported when a
/// row's scratch (about 9 bytes per expert) exceeds the shared memory of a block (E above about 20000).
void route_cuda(const RoutingProblem& p, float* topk_weights, std::int64_t* topk_idx, Stream stream);

}  // namespace epmoe::router_detail
