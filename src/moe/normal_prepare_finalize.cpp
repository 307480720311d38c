// Normal-mode prepare/finalize: dispatch one row per (token, rank), reduce each received row's local
// experts with its weights (Contiguous), combine back.
#include <epmoe/quant.hpp>

#include "core/check.hpp"
#include "moe/prepare_common.hpp"

namespace epmoe {
namespace {

class NormalPrepareFinalize final : public PrepareFinalize {
 public:
  NormalPrepareFinalize(std::shared_ptr<Buffer> buffer, PrepareFinalizeOptions o)
      : buffer_(std::move(buffer)), options_(o) {}
  std::string_view name() const override { return "normal"; }
  ActivationFormat activation_format() const override { return ActivationFormat::standard; }
  WeightAndReduce delegate_weight_and_reduce() const override { return WeightAndReduce::contiguous; }
  int num_local_experts(int global_num_experts) const override { return global_num_experts / buffer_->num_ranks(); }

 protected:
  void do_dispatch_a(const PrepareInputs& in) override {
    side_ = prepare_token_side(in);
    layout_ = buffer_->get_dispatch_layout(in.topk_idx, in.global_num_experts);
    if (options_.dispatch_dtype == DispatchDtype::fp8) q_ = quantize_fp8(side_.hidden, {options_.round_scale, options_.use_ue8m0});
  }

  PrepareOutput do_dispatch_b() override {
    const bool fp8 = options_.dispatch_dtype == DispatchDtype::fp8;
    DispatchArgs a =
        make_dispatch_args(layout_, fp8 ? q_.data.view() : side_.hidden.view(), side_.topk_idx, side_.topk_weights);
    if (fp8) a.x_scales = q_.scales;
    recv_ = buffer_->dispatch(a);
    PrepareOutput out;
    out.format = ActivationFormat::standard;
    out.hidden = fp8 ? dequantize_fp8(recv_.recv_x, recv_.recv_x_scales, DType::bf16) : recv_.recv_x;
    out.topk_idx = recv_.recv_topk_idx;
    out.topk_weights = recv_.recv_topk_weights;
    out.expert_num_tokens = recv_.handle.num_recv_tokens_per_expert;
    q_ = {};
    return out;
  }

  void do_combine_a(const TensorView& fused, WeightAndReduce w) override {
    if (w == WeightAndReduce::delegate) w = delegate_weight_and_reduce();
    const Tensor reduced = reduce_standard(fused, w, recv_.recv_topk_weights, recv_.recv_topk_idx);
    CombineArgs c;
    c.x = reduced;
    c.handle = &recv_.handle;
    result_ = buffer_->combine(c).combined_x;
  }

  Tensor do_combine_b() override {
    recv_ = {};
    side_ = {};
    return std::move(result_);
  }

 private:
  std::shared_ptr<Buffer> buffer_;
  PrepareFinalizeOptions options_;
  TokenSide side_;
  DispatchLayout layout_;
  Fp8Tensor q_;
  DispatchResult recv_;
  Tensor result_;
};

}  // namespace

std::shared_ptr<PrepareFinalize> make_normal_prepare_finalize(std::shared_ptr<Buffer> buffer,
                                                              const PrepareFinalizeOptions& options) {
  EPMOE_CHECK_ARG(buffer != nullptr, "buffer", "a Buffer", "null");
  return std::make_shared<NormalPrepareFinalize>(std::move(buffer), options);
}

}  // namespace epmoe
