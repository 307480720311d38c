// Pieces of MoELayer::forward kept out of layer.cpp (private to src/moe/): the GPU shared experts on a side
// stream (shared_experts.cpp) and the fp8 block-scaled weights' argument checks (layer_fp8.cpp).
#pragma once

#include <epmoe/experts.hpp>
#include <epmoe/moe.hpp>
#include <epmoe/tensor.hpp>

#include <cstdint>
#include <exception>
#include <memory>

namespace epmoe::layer_detail {

/// One forward's shared experts on the layer's side stream.
struct GpuSharedRun {
  bool active = false;          ///< the fork happened: join_gpu_shared_experts must run
  SharedExpertsStream* state = nullptr;
  Stream main;                  ///< the caller's current stream at the fork
  Tensor output;                ///< the shared experts' result (ready on the side stream)
  std::exception_ptr error;     ///< what the shared experts threw, rethrown after the routed forward
};

/// Records an event on the current stream, makes the side stream (made in `state` on hidden's device on first use)
/// wait on it, calls `fn(hidden)` with the side stream current, records the join event on the side stream. The
/// callable's exception is kept in the result (the routed forward must still run). Errors of the setup itself
/// (raised before anything was enqueued): unsupported when the side stream must be made while the current stream
/// is being captured.
GpuSharedRun start_gpu_shared_experts(std::shared_ptr<SharedExpertsStream>& state, const SharedExperts& fn,
                                      const TensorView& hidden);
/// Makes run.main wait on the side stream's join event (no host wait). A no-op when !run.active; never throws
/// (it runs on error paths too).
void join_gpu_shared_experts(GpuSharedRun& run) noexcept;

/// The fp8 block-scaled weights' checks of MoEForwardArgs (w1, w2 dtypes; w1_scale, w2_scale presence, dtype,
/// shape, layout, device), against `experts`' quantization; e_local, H, N as check_forward_args derived them.
/// invalid_argument naming the argument, the expected and the actual value.
void check_weight_scales(const MoEForwardArgs& args, const Experts& experts, std::int64_t e_local, std::int64_t H,
                         std::int64_t N);

}  // namespace epmoe::layer_detail
