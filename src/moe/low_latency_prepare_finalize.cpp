// Low-latency prepare/finalize: batched per-expert slabs; the send and receive halves of both the
// dispatch and the combine are split with receive hooks, so dispatch_a/combine_a only send.
//
// Calls whose hidden states are on a GPU run on the buffer's GPU low-latency mode (a cuda_ipc buffer,
// cuda_ipc/low_latency.hpp) and stay on the device, asynchronous on the current stream: the router weight
// on the input (K == 1) and the fp8 / nvfp4 wire's dequantization run as CUDA kernels, the received slabs and counts
// are views of the buffer's receive half, and the combine writes into MoEForwardArgs::output when given.
#include <epmoe/nvfp4.hpp>
#include <epmoe/quant.hpp>

#include <cmath>
#include <cstring>
#include <utility>

#include "core/check.hpp"
#include "moe/prepare_common.hpp"

#if defined(EPMOE_HAVE_CUDA)
#include "core/cuda_util.hpp"
#include "quant/quant.hpp"
#endif

namespace epmoe {
namespace {

class LowLatencyPrepareFinalize final : public PrepareFinalize {
 public:
  LowLatencyPrepareFinalize(std::shared_ptr<Buffer> buffer, int tmax, PrepareFinalizeOptions o)
      : buffer_(std::move(buffer)), tmax_(tmax), options_(o), workspaces_(std::make_shared<WorkspaceCache>()) {
    global_scale_ = Tensor::empty(DType::fp32, Shape{});  // the nvfp4 x_global_scale: a CPU scalar, read when sent
    *global_scale_.ptr<float>() = o.nvfp4_global_scale;
  }
  std::string_view name() const override { return "low_latency"; }
  ActivationFormat activation_format() const override { return ActivationFormat::batched_experts; }
  // The low-latency combine applies the router weights itself.
  WeightAndReduce delegate_weight_and_reduce() const override { return WeightAndReduce::delegate; }
  int num_local_experts(int global_num_experts) const override { return global_num_experts / buffer_->num_ranks(); }
  int ep_rank() const override { return buffer_->rank(); }
  void set_next_combine_overlap(const LowLatencyCombineArgs& o) override { overlap_ = o; }

 protected:
  void do_dispatch_a(const PrepareInputs& in) override {
    on_gpu_ = in.hidden.device.is_cuda();
    output_ = {};
    if (on_gpu_) {
      check_cuda_prepare_inputs(in);
      side_ = cuda_token_side(in, *workspaces_, "low_latency");
      output_ = in.output;
    } else {
      side_ = prepare_token_side(in);
    }
    LowLatencyDispatchArgs a;
    a.x = side_.hidden;
    a.topk_idx = in.topk_idx;
    a.topk_weights = side_.topk_weights;
    a.num_max_dispatch_tokens_per_rank = tmax_;
    a.num_experts = in.global_num_experts;
    a.use_fp8 = options_.dispatch_dtype == DispatchDtype::fp8;
    a.use_nvfp4 = options_.dispatch_dtype == DispatchDtype::nvfp4;
    if (a.use_nvfp4) a.x_global_scale = global_scale_;
    a.round_scale = options_.round_scale;
    a.use_ue8m0 = options_.use_ue8m0;
    a.return_recv_hook = true;
    recv_ = buffer_->low_latency_dispatch(a);
  }

  PrepareOutput do_dispatch_b() override {
    recv_.hook();
    const bool nvfp4 = recv_.packed_recv_x.dtype == DType::uint8;
    const std::int64_t E_local = recv_.packed_recv_x.size(0), rows = recv_.packed_recv_x.size(1),
                       H = recv_.packed_recv_x.size(2) * (nvfp4 ? 2 : 1);
    PrepareOutput out;
    out.format = ActivationFormat::batched_experts;
    if (on_gpu_) return gpu_prepare_output(E_local, rows, H);
    out.expert_num_tokens = clone(recv_.packed_recv_count);
    if (recv_.packed_recv_x.dtype == DType::bf16) {
      // The received slabs already are the experts' BatchedExperts input: a view of the buffer's low-latency half,
      // valid until that half's next dispatch (after this micro-batch's combine). No copy, no zero fill: the
      // experts read rows below each count only.
      out.hidden = Tensor::wrap(recv_.packed_recv_x, nullptr);
      return out;
    }
    // fp8 / nvfp4: dequantize the valid rows of each slab; rows past the count are never read. An nvfp4 slab's
    // scales are one swizzled matrix whose first ceil(n / 128) rows of tiles hold its first n rows.
    out.hidden = Tensor::empty(DType::bf16, {E_local, rows, H});
    for (std::int64_t e = 0; e < E_local; ++e) {
      const std::int64_t n = out.expert_num_tokens.ptr<std::int32_t>()[e];
      if (n == 0) continue;
      const TensorView q = recv_.packed_recv_x.row(e).slice_rows(0, n), sc = recv_.packed_recv_x_scales.row(e);
      const Tensor d = nvfp4 ? dequantize_nvfp4(q, sc.slice_rows(0, nvfp4_row_tiles(n)), global_scale_,
                                                Nvfp4ScaleLayout::swizzled, DType::bf16)
                             : dequantize_fp8(q, sc.slice_rows(0, n), DType::bf16);
      std::memcpy(out.hidden.ptr<bf16_t>() + e * rows * H, d.data(), d.nbytes());
    }
    return out;
  }

  void do_combine_a(const TensorView& fused, WeightAndReduce w) override {
    EPMOE_CHECK_ARG(w == WeightAndReduce::delegate || w == WeightAndReduce::none, "weight_and_reduce",
                    "delegate (the low-latency combine applies the router weights)", weight_and_reduce_name(w));
    LowLatencyCombineArgs c;
    c.x = fused;
    c.topk_idx = side_.topk_idx;
    c.topk_weights = side_.topk_weights;
    c.handle = &recv_.handle;
    c.return_recv_hook = true;
    c.out = output_;  // GPU: the caller's output (the CPU layer copies into it after the combine)
    const LowLatencyCombineArgs o = std::exchange(overlap_, LowLatencyCombineArgs{});  // for this call only
    c.overlap = o.overlap;
    c.packed_recv_count = o.packed_recv_count;
    c.comp_signal = o.comp_signal;
    c.block_m = o.block_m;
    c.threshold = o.threshold;
    c.src_signals = o.src_signals;
    c.src_signal_expect_value = o.src_signal_expect_value;
    c.num_sms = o.num_sms;
    c.send_stamps = o.send_stamps;
    combined_ = buffer_->low_latency_combine(c);
  }

  Tensor do_combine_b() override {
    combined_.hook();
    Tensor out = std::move(combined_.combined_x);
    combined_ = {};
    recv_ = {};
    side_ = {};
    output_ = {};
    return out;
  }

 private:
  // GPU expert side: the counts and (bf16) the slabs are views of the buffer's receive half, valid until that
  // half's next dispatch (after this micro-batch's combine). fp8: the slabs dequantized on the device, each slab's
  // counted rows only (the counts stay on the device: the kernel reads them; the other rows are never read).
  PrepareOutput gpu_prepare_output(std::int64_t E_local, std::int64_t rows, std::int64_t H) {
    PrepareOutput out;
    out.format = ActivationFormat::batched_experts;
    out.expert_num_tokens = Tensor::wrap(recv_.packed_recv_count, nullptr);
    if (recv_.packed_recv_x.dtype == DType::bf16) {
      out.hidden = Tensor::wrap(recv_.packed_recv_x, nullptr);
      return out;
    }
#if defined(EPMOE_HAVE_CUDA)
    const TensorView& q = recv_.packed_recv_x;
    const TensorView& sc = recv_.packed_recv_x_scales;
    EPMOE_ASSERT(q.is_contiguous());  // sc: column-major per expert (semantics §5), read by its strides
    const Device d = q.device;
    const TensorView deq = workspaces_->get(0, "low_latency.dequantized", DType::bf16, {E_local, rows, H}, d);
    if (E_local * rows > 0) {
      cuda_util::DeviceGuard guard(d);
      EPMOE_ASSERT(recv_.packed_recv_count.dtype == DType::int32);
      const auto* counts = static_cast<const std::int32_t*>(recv_.packed_recv_count.data);
      if (q.dtype == DType::uint8)
        quant_detail::dequantize_nvfp4_masked_cuda(q, sc, {options_.nvfp4_global_scale, nullptr}, deq, counts,
                                                   current_stream());
      else
        quant_detail::dequantize_fp8_masked_cuda(q, sc, deq, counts, current_stream());
    }
    out.hidden = Tensor::wrap(deq, nullptr);
    return out;
#else
    raise(ErrorCode::unsupported, "low-latency prepare on CUDA: epmoe was built without CUDA");
#endif
  }

  std::shared_ptr<Buffer> buffer_;
  int tmax_;
  PrepareFinalizeOptions options_;
  std::shared_ptr<WorkspaceCache> workspaces_;  // GPU: the scaled tokens, the dequantized slabs
  Tensor global_scale_;                         // float32 scalar on the CPU: nvfp4_global_scale
  bool on_gpu_ = false;
  TensorView output_;
  TokenSide side_;
  LowLatencyDispatchResult recv_;
  LowLatencyCombineResult combined_;
  LowLatencyCombineArgs overlap_;  // set_next_combine_overlap's fields for the next combine_a
};

}  // namespace

std::shared_ptr<PrepareFinalize> make_low_latency_prepare_finalize(std::shared_ptr<Buffer> buffer,
                                                                   int num_max_dispatch_tokens_per_rank,
                                                                   const PrepareFinalizeOptions& options) {
  EPMOE_CHECK_ARG(buffer != nullptr, "buffer", "a Buffer", "null");
  EPMOE_CHECK_ARG(num_max_dispatch_tokens_per_rank > 0, "num_max_dispatch_tokens_per_rank", "> 0",
                  num_max_dispatch_tokens_per_rank);
  if (options.dispatch_dtype == DispatchDtype::nvfp4)
    EPMOE_CHECK_ARG(std::isfinite(options.nvfp4_global_scale) && options.nvfp4_global_scale > 0.0f,
                    "nvfp4_global_scale", "a finite global scale > 0 with dispatch_dtype nvfp4",
                    options.nvfp4_global_scale);
  return std::make_shared<LowLatencyPrepareFinalize>(std::move(buffer), num_max_dispatch_tokens_per_rank, options);
}

}  // namespace epmoe
