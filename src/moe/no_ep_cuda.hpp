// The no-EP prepare/finalize on CUDA tensors (no_ep_cuda.cpp): the GPU half of NoEpPrepareFinalize
// (prepare_finalize.cpp), which hands it every call whose hidden states live on a GPU.
#pragma once

#include <epmoe/moe.hpp>

namespace epmoe::moe_cuda {

/// Prepare and finalize of one no-EP call on one GPU, asynchronous on the current stream. Buffers come from
/// a WorkspaceCache; nothing synchronises with the host.
class NoEpCuda {
 public:
  NoEpCuda(const PrepareFinalizeOptions& options, const NoEpOptions& no_ep);
  /// Checks `in` (every tensor on the same GPU) and prepares the experts' input in the configured format.
  PrepareOutput dispatch(const PrepareInputs& in);
  /// Applies `w` (delegate already resolved) to the experts' output into PrepareInputs::output, or a new
  /// tensor when none was given (refused while the stream is being captured).
  Tensor combine(const TensorView& fused, WeightAndReduce w);

 private:
  TensorView ws(std::string_view name, DType dtype, Shape shape);

  PrepareFinalizeOptions options_;
  NoEpOptions no_ep_;
  Device device_;
  std::int64_t T_ = 0, H_ = 0, K_ = 0, max_tokens_ = 0;
  int E_ = 0;
  TensorView topk_idx_, topk_weights_, slot_of_, output_;
};

}  // namespace epmoe::moe_cuda
