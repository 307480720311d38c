// Low-latency prepare/finalize: batched per-expert slabs; the send and receive halves of both the
// dispatch and the combine are split with receive hooks, so dispatch_a/combine_a only send.
#include <epmoe/quant.hpp>

#include <cstring>

#include "core/check.hpp"
#include "moe/prepare_common.hpp"

namespace epmoe {
namespace {

class LowLatencyPrepareFinalize final : public PrepareFinalize {
 public:
  LowLatencyPrepareFinalize(std::shared_ptr<Buffer> buffer, int tmax, PrepareFinalizeOptions o)
      : buffer_(std::move(buffer)), tmax_(tmax), options_(o) {}
  std::string_view name() const override { return "low_latency"; }
  ActivationFormat activation_format() const override { return ActivationFormat::batched_experts; }
  // The low-latency combine applies the router weights itself.
  WeightAndReduce delegate_weight_and_reduce() const override { return WeightAndReduce::delegate; }
  int num_local_experts(int global_num_experts) const override { return global_num_experts / buffer_->num_ranks(); }

 protected:
  void do_dispatch_a(const PrepareInputs& in) override {
    side_ = prepare_token_side(in);
    LowLatencyDispatchArgs a;
    a.x = side_.hidden;
    a.topk_idx = in.topk_idx;
    a.topk_weights = side_.topk_weights;
    a.num_max_dispatch_tokens_per_rank = tmax_;
    a.num_experts = in.global_num_experts;
    a.use_fp8 = options_.dispatch_dtype == DispatchDtype::fp8;
    a.round_scale = options_.round_scale;
    a.use_ue8m0 = options_.use_ue8m0;
    a.return_recv_hook = true;
    recv_ = buffer_->low_latency_dispatch(a);
  }

  PrepareOutput do_dispatch_b() override {
    recv_.hook();
    const std::int64_t E_local = recv_.packed_recv_x.size(0), rows = recv_.packed_recv_x.size(1),
                       H = recv_.packed_recv_x.size(2);
    PrepareOutput out;
    out.format = ActivationFormat::batched_experts;
    out.expert_num_tokens = clone(recv_.packed_recv_count);
    if (recv_.packed_recv_x.dtype == DType::bf16) {
      // The received slabs already are the experts' BatchedExperts input: a view of the buffer's low-latency half,
      // valid until that half's next dispatch (after this micro-batch's combine). No copy, no zero fill: the
      // experts read rows below each count only.
      out.hidden = Tensor::wrap(recv_.packed_recv_x, nullptr);
      return out;
    }
    // fp8: dequantize the valid rows of each slab; rows past the count are never read.
    out.hidden = Tensor::empty(DType::bf16, {E_local, rows, H});
    for (std::int64_t e = 0; e < E_local; ++e) {
      const std::int64_t n = out.expert_num_tokens.ptr<std::int32_t>()[e];
      if (n == 0) continue;
      const Tensor d = dequantize_fp8(recv_.packed_recv_x.row(e).slice_rows(0, n),
                                      recv_.packed_recv_x_scales.row(e).slice_rows(0, n), DType::bf16);
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
    combined_ = buffer_->low_latency_combine(c);
  }

  Tensor do_combine_b() override {
    combined_.hook();
    Tensor out = std::move(combined_.combined_x);
    combined_ = {};
    recv_ = {};
    side_ = {};
    return out;
  }

 private:
  std::shared_ptr<Buffer> buffer_;
  int tmax_;
  PrepareFinalizeOptions options_;
  TokenSide side_;
  LowLatencyDispatchResult recv_;
  LowLatencyCombineResult combined_;
};

}  // namespace

std::shared_ptr<PrepareFinalize> make_low_latency_prepare_finalize(std::shared_ptr<Buffer> buffer,
                                                                   int num_max_dispatch_tokens_per_rank,
                                                                   const PrepareFinalizeOptions& options) {
  EPMOE_CHECK_ARG(buffer != nullptr, "buffer", "a Buffer", "null");
  EPMOE_CHECK_ARG(num_max_dispatch_tokens_per_rank > 0, "num_max_dispatch_tokens_per_rank", "> 0",
                  num_max_dispatch_tokens_per_rank);
  return std::make_shared<LowLatencyPrepareFinalize>(std::move(buffer), num_max_dispatch_tokens_per_rank, options);
}

}  // namespace epmoe
