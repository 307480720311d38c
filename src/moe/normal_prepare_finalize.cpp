// Normal-mode prepare/finalize: dispatch one row per (token, rank), reduce each received row's local
// experts with its weights (Contiguous), combine back.
//
// Calls whose hidden states are on a GPU (the buffer a cuda_ipc one on that GPU) stay on the device, enqueued on
// the calling thread's current stream: the router weight on the input (K == 1), get_dispatch_layout, the fp8
// quantization, the dequantization of the received rows and the weight-and-reduce are CUDA kernels; the cuda_ipc
// dispatch and combine wait for the current stream and make it wait for them. The one host synchronisation is the
// dispatch's own (it reads the receive counts to size its outputs). The whole dispatch runs in dispatch_a (on CPU
// ranks too), so the buffer's own argument errors (a tensor on another GPU than the buffer's, K > 32, CPU tensors
// over a cuda_ipc buffer) leave the stage INITIAL.
#include <epmoe/quant.hpp>

#include "core/check.hpp"
#include "core/cuda_util.hpp"
#include "moe/prepare_common.hpp"

#if defined(EPMOE_HAVE_CUDA)
#include "moe/cuda.hpp"
#include "moe/weight_and_reduce.hpp"
#endif

namespace epmoe {
namespace {

class NormalPrepareFinalize final : public PrepareFinalize {
 public:
  NormalPrepareFinalize(std::shared_ptr<Buffer> buffer, PrepareFinalizeOptions o)
      : buffer_(std::move(buffer)), options_(o), workspaces_(std::make_shared<WorkspaceCache>()) {}
  std::string_view name() const override { return "normal"; }
  ActivationFormat activation_format() const override { return ActivationFormat::standard; }
  WeightAndReduce delegate_weight_and_reduce() const override { return WeightAndReduce::contiguous; }
  int num_local_experts(int global_num_experts) const override { return global_num_experts / buffer_->num_ranks(); }
  int ep_rank() const override { return buffer_->rank(); }

 protected:
  void do_dispatch_a(const PrepareInputs& in) override {
    on_gpu_ = in.hidden.device.is_cuda();
    device_ = in.hidden.device;
    output_ = {};
    if (on_gpu_) {
      gpu_dispatch(in);
      return;
    }
    // The dispatch runs here too (a CPU rank's dispatch is one blocking exchange: nothing to overlap with
    // dispatch_b), so the buffer's own argument errors (CPU tensors over a cuda_ipc buffer, say) leave the stage
    // INITIAL and the layer usable.
    side_ = prepare_token_side(in);
    dispatch_side(in.global_num_experts);
  }

  PrepareOutput do_dispatch_b() override {
    const bool fp8 = options_.dispatch_dtype == DispatchDtype::fp8;
    PrepareOutput out;
    out.format = ActivationFormat::standard;
    // GPU: dequantize_fp8 runs on the current stream, which the dispatch made wait for its outputs.
    out.hidden = fp8 ? dequantize_on(device_) : recv_.recv_x;
    out.topk_idx = recv_.recv_topk_idx;
    out.topk_weights = recv_.recv_topk_weights;
    out.expert_num_tokens = recv_.handle.num_recv_tokens_per_expert;
    return out;
  }

  void do_combine_a(const TensorView& fused, WeightAndReduce w) override {
    if (w == WeightAndReduce::delegate) w = delegate_weight_and_reduce();
    if (on_gpu_) {
      result_ = gpu_combine(fused, w);
      return;
    }
    const Tensor reduced = reduce_standard(fused, w, recv_.recv_topk_weights, recv_.recv_topk_idx);
    CombineArgs c;
    c.x = reduced;
    c.handle = &recv_.handle;
    result_ = buffer_->combine(c).combined_x;
  }

  Tensor do_combine_b() override {
    recv_ = {};
    side_ = {};
    output_ = {};
    return std::move(result_);
  }

 private:
  Tensor dequantize_on(const Device& device) {
    if (device.is_cpu()) return dequantize_fp8(recv_.recv_x, recv_.recv_x_scales, DType::bf16);
#if defined(EPMOE_HAVE_CUDA)
    cuda_util::DeviceGuard guard(device);
    return dequantize_fp8(recv_.recv_x, recv_.recv_x_scales, DType::bf16);
#else
    raise(ErrorCode::unsupported, "normal prepare on {}: epmoe was built without CUDA", to_string(device));
#endif
  }

  // The token side's layout, its optional fp8 quantization (CPU or GPU, where side_ lives) and the dispatch.
  void dispatch_side(int num_experts) {
    const DispatchLayout layout = buffer_->get_dispatch_layout(side_.topk_idx, num_experts);
    const bool fp8 = options_.dispatch_dtype == DispatchDtype::fp8;
    Fp8Tensor q;
    if (fp8) q = quantize_fp8(side_.hidden, {options_.round_scale, options_.use_ue8m0});
    DispatchArgs a =
        make_dispatch_args(layout, fp8 ? q.data.view() : side_.hidden.view(), side_.topk_idx, side_.topk_weights);
    if (fp8) a.x_scales = q.scales;
    recv_ = buffer_->dispatch(a);
  }

  // GPU prepare: token side, layout, optional fp8 quantization and the cuda_ipc dispatch, on the current stream.
  // Temporaries (layout, fp8 rows) are dropped on that stream after the dispatch returned: it made the stream wait
  // for its own reads of them.
  void gpu_dispatch(const PrepareInputs& in) {
    check_cuda_prepare_inputs(in);
#if defined(EPMOE_HAVE_CUDA)
    cuda_util::DeviceGuard guard(device_);
    side_ = cuda_token_side(in, *workspaces_, "normal");
    dispatch_side(in.global_num_experts);
    output_ = in.output;
#else
    raise(ErrorCode::unsupported, "argument 'hidden' is on {} but epmoe was built without CUDA",
          to_string(in.hidden.device));
#endif
  }

  // GPU finalize: the weight-and-reduce of each received row (none: the experts' [M, H] as it is; contiguous: the
  // CUDA TopKWeightAndReduce over [M, K, H], bit for bit the CPU's), the cuda_ipc combine, and a copy into the
  // caller's output when one was given.
  Tensor gpu_combine(const TensorView& fused, WeightAndReduce w) {
    const std::int64_t M = recv_.recv_x.size(0), H = recv_.recv_x.size(1), K = recv_.recv_topk_idx.size(1);
    EPMOE_CHECK_ARG(fused.dtype == DType::bf16 && fused.device == device_ && fused.is_contiguous() &&
                        (fused.numel() == 0 || cuda_util::aligned16(fused.data)),
                    "fused_expert_output",
                    fmt::format("contiguous bfloat16 on {} (hidden's device), 16-byte aligned", to_string(device_)),
                    describe(fused));
    EPMOE_CHECK_ARG(w == WeightAndReduce::none || w == WeightAndReduce::contiguous, "weight_and_reduce",
                    "none or contiguous for the standard format", weight_and_reduce_name(w));
    const Shape want = w == WeightAndReduce::none ? Shape{M, H} : Shape{M, K, H};
    EPMOE_CHECK_ARG(fused.shape == want, "fused_expert_output",
                    fmt::format("bfloat16 {} (weight_and_reduce {})", to_string(want), weight_and_reduce_name(w)),
                    describe(fused));
#if defined(EPMOE_HAVE_CUDA)
    cuda_util::DeviceGuard guard(device_);
    const Stream s = current_stream();
    Tensor reduced;
    CombineArgs c;
    c.handle = &recv_.handle;
    c.x = fused;
    if (w == WeightAndReduce::contiguous) {
      reduced = Tensor::empty(DType::bf16, {M, H}, device_);
      weight_and_reduce_contiguous_cuda(fused, recv_.recv_topk_weights, recv_.recv_topk_idx, reduced, s);
      c.x = reduced;
    }
    Tensor combined = buffer_->combine(c).combined_x;
    if (!output_.defined()) return combined;
    moe_cuda::copy(output_.data, combined.data(), combined.nbytes(), s);
    return Tensor::wrap(output_, nullptr);
#else
    raise(ErrorCode::unsupported, "normal combine on {}: epmoe was built without CUDA", to_string(device_));
#endif
  }

  std::shared_ptr<Buffer> buffer_;
  PrepareFinalizeOptions options_;
  std::shared_ptr<WorkspaceCache> workspaces_;  // GPU: the scaled tokens (router weight on the input)
  bool on_gpu_ = false;
  Device device_;      // hidden's device
  TensorView output_;  // GPU calls: the caller's output, if any
  TokenSide side_;
  DispatchResult recv_;
  Tensor result_;
};

}  // namespace

std::shared_ptr<PrepareFinalize> make_normal_prepare_finalize(std::shared_ptr<Buffer> buffer,
                                                              const PrepareFinalizeOptions& options) {
  EPMOE_CHECK_ARG(buffer != nullptr, "buffer", "a Buffer", "null");
  refuse_nvfp4(options, "normal");
  return std::make_shared<NormalPrepareFinalize>(std::move(buffer), options);
}

}  // namespace epmoe
