// Internal entry point of the CUDA router (CUDA builds only: EPMOE_HAVE_CUDA). router.cpp validates the
// arguments and calls this for logits on a GPU; bit-identical to route_cpu (router/cpu.cpp).
#pragma once

#include <epmoe/stream.hpp>

#include "router/router_impl.hpp"

namespace epmoe::router_detail {

/// Writes float32 [T, K] weights and int64 [T, K] ids (contiguous, device memory of the logits' device),
/// asynchronously on `stream`. Errors: unsupported when a row's scratch (about 9 bytes per expert)
/// exceeds the shared memory of a block (E above about 20000).
void route_cuda(const RoutingProblem& p, float* topk_weights, std::int64_t* topk_idx, Stream stream);

}  // namespace epmoe::router_detail
