// The MoE stage's steps on CUDA tensors, host side, shared by the prepare/finalize implementations
// (prepare_common.hpp): the argument check of a GPU call and the router weight on the input. The CPU twins are
// in cpu.cpp, the kernels in cuda.cu.
#include "core/check.hpp"
#include "core/cuda_util.hpp"
#include "moe/prepare_common.hpp"

#if defined(EPMOE_HAVE_CUDA)
#include "experts/experts.hpp"
#include "moe/cuda.hpp"
#endif

namespace epmoe {

void check_cuda_prepare_inputs(const PrepareInputs& in) {
  const TensorView& x = in.hidden;
  const Device d = x.device;
  EPMOE_CHECK_ARG(x.dtype == DType::bf16 && x.ndim() == 2 && x.is_contiguous() && x.size(1) % 8 == 0 &&
                      (x.numel() == 0 || cuda_util::aligned16(x.data)),
                  "hidden", "contiguous bfloat16 [T, H] with H % 8 == 0 and 16-byte-aligned data on CUDA",
                  describe(x));
  const std::int64_t T = x.size(0);
  check_topk_idx_dtype(in.topk_idx);
  EPMOE_CHECK_ARG(in.topk_idx.ndim() == 2 && in.topk_idx.size(0) == T && in.topk_idx.is_contiguous() &&
                      in.topk_idx.device == d,
                  "topk_idx", fmt::format("contiguous [{}, K] on {} (hidden's device)", T, to_string(d)),
                  describe(in.topk_idx));
  EPMOE_CHECK_ARG(in.topk_weights.dtype == DType::fp32 && in.topk_weights.shape == in.topk_idx.shape &&
                      in.topk_weights.is_contiguous() && in.topk_weights.device == d,
                  "topk_weights",
                  fmt::format("contiguous float32 {} on {} (hidden's device)", to_string(in.topk_idx.shape),
                              to_string(d)),
                  describe(in.topk_weights));
  EPMOE_CHECK_ARG(in.global_num_experts > 0, "global_num_experts", "> 0", in.global_num_experts);
  EPMOE_CHECK_ARG(!in.apply_router_weight_on_input || in.topk_idx.size(1) == 1, "apply_router_weight_on_input",
                  "only with K == 1", fmt::format("K = {}", in.topk_idx.size(1)));
  if (in.output.defined())
    EPMOE_CHECK_ARG(in.output.dtype == DType::bf16 && in.output.shape == (Shape{T, x.size(1)}) &&
                        in.output.is_contiguous() && in.output.device == d,
                    "output", fmt::format("contiguous bfloat16 [{}, {}] on {} (hidden's device)", T, x.size(1),
                                          to_string(d)),
                    describe(in.output));
}

#if defined(EPMOE_HAVE_CUDA)
void weight_on_input_cuda(const TensorView& hidden, const TensorView& topk_weights, const TensorView& scaled,
                          const TensorView& ones, Stream stream) {
  const std::int64_t T = hidden.size(0);
  if (T == 0) return;
  experts_cuda::weight_hidden_cuda(hidden, topk_weights, scaled, stream);
  moe_cuda::fill(static_cast<float*>(ones.data), T, 1.0f, stream);
}
#endif

TokenSide cuda_token_side(const PrepareInputs& in, WorkspaceCache& workspaces, std::string_view prefix) {
  const Tensor topk_idx = Tensor::wrap(in.topk_idx, nullptr);
  if (!in.apply_router_weight_on_input)
    return {Tensor::wrap(in.hidden, nullptr), topk_idx, Tensor::wrap(in.topk_weights, nullptr)};
#if defined(EPMOE_HAVE_CUDA)
  const Device d = in.hidden.device;
  const std::int64_t T = in.hidden.size(0), H = in.hidden.size(1);
  cuda_util::DeviceGuard guard(d);
  const Stream s = current_stream();
  const TensorView scaled = workspaces.get(0, fmt::format("{}.scaled", prefix), DType::bf16, {T, H}, d);
  const TensorView ones = workspaces.get(0, fmt::format("{}.ones", prefix), DType::fp32, {T, 1}, d);
  weight_on_input_cuda(in.hidden, in.topk_weights, scaled, ones, s);
  return {Tensor::wrap(scaled, nullptr), topk_idx, Tensor::wrap(ones, nullptr)};
#else
  (void)workspaces;
  (void)prefix;
  raise(ErrorCode::unsupported, "argument 'hidden' is on {} but epmoe was built without CUDA",
        to_string(in.hidden.device));
#endif
}

}  // namespace epmoe
