// The stage machine of PrepareFinalize and the no-EP implementations.
#include <climits>
#include <cstring>
#include <vector>

#include "core/check.hpp"
#include "moe/no_ep_cuda.hpp"
#include "moe/prepare_common.hpp"
#include "moe/weight_and_reduce.hpp"

namespace epmoe {

std::string_view stage_name(Stage s) {
  switch (s) {
    case Stage::initial: return "INITIAL";
    case Stage::after_dispatch_a: return "AFTER_DISPATCH_A";
    case Stage::after_dispatch_b: return "AFTER_DISPATCH_B";
    case Stage::after_combine_a: return "AFTER_COMBINE_A";
  }
  return "?";
}

void PrepareFinalize::expect(Stage s, std::string_view call) const {
  if (stage_ != s)
    raise(ErrorCode::stale_handle, "{}() called in stage {}; it needs stage {} (order: dispatch_a, dispatch_b, "
          "combine_a, combine_b)", call, stage_name(stage_), stage_name(s));
}

void PrepareFinalize::dispatch_a(const PrepareInputs& in) {
  expect(Stage::initial, "dispatch_a");
  if (before_dispatch) before_dispatch();
  do_dispatch_a(in);
  stage_ = Stage::after_dispatch_a;
}

PrepareOutput PrepareFinalize::dispatch_b() {
  expect(Stage::after_dispatch_a, "dispatch_b");
  PrepareOutput out = do_dispatch_b();
  stage_ = Stage::after_dispatch_b;
  if (after_dispatch) after_dispatch();
  return out;
}

void PrepareFinalize::combine_a(const TensorView& fused_expert_output, WeightAndReduce weight_and_reduce) {
  expect(Stage::after_dispatch_b, "combine_a");
  if (before_combine) before_combine();
  do_combine_a(fused_expert_output, weight_and_reduce);
  stage_ = Stage::after_combine_a;
}

Tensor PrepareFinalize::combine_b() {
  expect(Stage::after_combine_a, "combine_b");
  Tensor out = do_combine_b();
  stage_ = Stage::initial;
  if (after_combine) after_combine();
  return out;
}

namespace {

/// One rank: the tokens go to the experts where they are (standard), or into per-expert slabs
/// (batched_experts). Calls whose hidden states are on a GPU go to moe_cuda::NoEpCuda.
class NoEpPrepareFinalize final : public PrepareFinalize {
 public:
  NoEpPrepareFinalize(PrepareFinalizeOptions o, NoEpOptions no_ep) : options_(o), no_ep_(no_ep), gpu_(o, no_ep) {}
  std::string_view name() const override { return "no_ep"; }
  ActivationFormat activation_format() const override { return no_ep_.format; }
  WeightAndReduce delegate_weight_and_reduce() const override {
    return no_ep_.format == ActivationFormat::batched_experts ? WeightAndReduce::naive_batched
                                                              : WeightAndReduce::contiguous;
  }
  int num_local_experts(int global_num_experts) const override { return global_num_experts; }

 protected:
  void do_dispatch_a(const PrepareInputs& in) override {
    on_gpu_ = in.hidden.device.is_cuda();
    if (on_gpu_) {
      out_ = gpu_.dispatch(in);
      return;
    }
    const TokenSide side = prepare_token_side(in);
    out_ = {};
    out_.format = ActivationFormat::standard;
    out_.hidden = options_.dispatch_dtype == DispatchDtype::fp8 ? fp8_round_trip(side.hidden, options_) : clone(side.hidden);
    out_.topk_idx = clone(in.topk_idx);
    out_.topk_weights = clone(side.topk_weights);
    out_.expert_num_tokens = Tensor::zeros(DType::int32, {in.global_num_experts});
    for (std::int64_t i = 0; i < in.topk_idx.numel(); ++i) {
      const std::int64_t e = in.topk_idx.dtype == DType::int64 ? in.topk_idx.ptr<std::int64_t>()[i]
                                                               : in.topk_idx.ptr<std::int32_t>()[i];
      const std::int64_t K = in.topk_idx.size(1);
      EPMOE_CHECK_ARG(e >= -1 && e < in.global_num_experts, "topk_idx",
                      fmt::format("ids in [-1, {})", in.global_num_experts),
                      fmt::format("{} at [{}, {}]", e, i / K, i % K));
      if (e >= 0) ++out_.expert_num_tokens.ptr<std::int32_t>()[e];
    }
    if (no_ep_.format == ActivationFormat::batched_experts) to_slabs();
  }
  PrepareOutput do_dispatch_b() override { return out_; }
  void do_combine_a(const TensorView& fused, WeightAndReduce w) override {
    if (w == WeightAndReduce::delegate) w = delegate_weight_and_reduce();
    if (on_gpu_) {
      result_ = gpu_.combine(fused, w);
      return;
    }
    if (no_ep_.format == ActivationFormat::standard) {
      result_ = reduce_standard(fused, w, out_.topk_weights, out_.topk_idx);
      return;
    }
    EPMOE_CHECK_ARG(w == WeightAndReduce::naive_batched, "weight_and_reduce",
                    "naive_batched for the batched_experts format", weight_and_reduce_name(w));
    result_ = Tensor::empty(DType::bf16, {out_.topk_idx.size(0), fused.size(2)});
    weight_and_reduce_naive_batched(fused, out_.topk_weights, out_.topk_idx, 0, result_);
  }
  Tensor do_combine_b() override {
    out_ = {};
    return std::move(result_);
  }

 private:
  // CPU batched_experts: slot i of slab e holds the i-th choice of expert e in (token, k) order.
  void to_slabs() {
    const std::int64_t T = out_.hidden.size(0), H = out_.hidden.size(1), K = out_.topk_idx.size(1);
    const std::int64_t E = out_.expert_num_tokens.numel();
    const std::int64_t max_tokens = no_ep_.max_tokens_per_expert > 0 ? no_ep_.max_tokens_per_expert : T;
    for (std::int64_t e = 0; e < E; ++e) {
      const std::int32_t c = out_.expert_num_tokens.ptr<std::int32_t>()[e];
      if (c > max_tokens)
        raise(ErrorCode::out_of_memory, "no_ep batched_experts prepare: expert {} received {} choices but "
              "max_tokens_per_expert is {}: make it >= {}", e, c, max_tokens, c);
    }
    // E * max_tokens * H bf16 values: checked, so a huge max_tokens_per_expert is named rather than wrapping.
    std::int64_t elems = 0;
    if (__builtin_mul_overflow(E, max_tokens, &elems) || __builtin_mul_overflow(elems, H, &elems) ||
        elems > INT64_MAX / 2)
      throw_invalid_argument("max_tokens_per_expert",
                             fmt::format("slabs [E = {}, max_tokens_per_expert, H = {}] of bfloat16 that fit in 2^63 "
                                         "bytes", E, H), std::to_string(max_tokens));
    Tensor slabs = Tensor::zeros(DType::bf16, {E, max_tokens, H});
    std::vector<std::int64_t> next(static_cast<std::size_t>(E), 0);
    for (std::int64_t i = 0; i < T * K; ++i) {
      const std::int64_t e = out_.topk_idx.dtype() == DType::int64 ? out_.topk_idx.ptr<std::int64_t>()[i]
                                                                   : out_.topk_idx.ptr<std::int32_t>()[i];
      if (e < 0) continue;
      const std::int64_t slot = next[static_cast<std::size_t>(e)]++;
      std::memcpy(slabs.ptr<bf16_t>() + (e * max_tokens + slot) * H, out_.hidden.ptr<bf16_t>() + (i / K) * H,
                  static_cast<std::size_t>(H) * sizeof(bf16_t));
    }
    out_.format = ActivationFormat::batched_experts;
    out_.hidden = slabs;
  }

  PrepareFinalizeOptions options_;
  NoEpOptions no_ep_;
  moe_cuda::NoEpCuda gpu_;
  bool on_gpu_ = false;
  PrepareOutput out_;
  Tensor result_;
};

}  // namespace

std::shared_ptr<PrepareFinalize> make_no_ep_prepare_finalize(const PrepareFinalizeOptions& options) {
  refuse_nvfp4(options, "no_ep");
  return std::make_shared<NoEpPrepareFinalize>(options, NoEpOptions{});
}

std::shared_ptr<PrepareFinalize> make_no_ep_prepare_finalize(const PrepareFinalizeOptions& options,
                                                              const NoEpOptions& no_ep) {
  refuse_nvfp4(options, "no_ep");
  // Slots are int32-counted (expert_num_tokens), as on GPUs.
  EPMOE_CHECK_ARG(no_ep.max_tokens_per_expert >= 0 && no_ep.max_tokens_per_expert <= INT32_MAX, "max_tokens_per_expert",
                  "0..2^31 - 1", no_ep.max_tokens_per_expert);
  EPMOE_CHECK_ARG(no_ep.format == ActivationFormat::batched_experts || no_ep.max_tokens_per_expert == 0,
                  "max_tokens_per_expert", "0 (unused) with the standard format", no_ep.max_tokens_per_expert);
  return std::make_shared<NoEpPrepareFinalize>(options, no_ep);
}

}  // namespace epmoe
