// Router entry points (semantics §2): argument checks, then dispatch on the logits' device.
#include "core/check.hpp"
#include <epmoe/router.hpp>

#include <cmath>

#include "router/router.hpp"

namespace epmoe {

namespace {

using router_detail::RoutingProblem;

// Checks the logits and fills the shape fields of the problem.
void check_logits(const TensorView& logits, RoutingProblem& p) {
  EPMOE_CHECK_ARG(logits.defined(), "logits", "a float32 or bfloat16 tensor [T, E]", "None");
  EPMOE_CHECK_ARG(logits.ndim() == 2, "logits", "a 2-d tensor [T, E]", describe(logits));
  if (logits.dtype != DType::fp32 && logits.dtype != DType::bf16)
    throw_wrong_dtype("logits", "float32 or bfloat16", describe(logits));
  EPMOE_CHECK_ARG(logits.size(0) >= 0 && logits.size(1) >= 1, "logits", "shape [T, E] with T >= 0 and E >= 1",
                  describe(logits));
  EPMOE_CHECK_ARG(logits.is_contiguous(), "logits", "a contiguous (row-major) tensor",
                  fmt::format("{} with strides {}", describe(logits), to_string(logits.strides)));
  EPMOE_CHECK_ARG(logits.data != nullptr || logits.numel() == 0, "logits", "a non-null data pointer", "nullptr");
  p.logits = logits;
  p.num_tokens = logits.size(0);
  p.num_experts = logits.size(1);
}

void check_num_topk(std::string_view name, int k, std::int64_t max_k) {
  EPMOE_CHECK_ARG(k >= 1 && k <= max_k, name, fmt::format("in [1, {}]", max_k), k);
}

TopkResult run(const RoutingProblem& p) {
  const Device device = p.logits.device;
#if !defined(EPMOE_HAVE_CUDA)
  if (!device.is_cpu())
    raise(ErrorCode::unsupported, "logits are on {} but epmoe was built without CUDA (argument 'logits', {})",
          to_string(device), describe(p.logits));
#endif
  TopkResult r;
  r.topk_weights = Tensor::empty(DType::fp32, {p.num_tokens, p.num_topk}, device);
  r.topk_idx = Tensor::empty(DType::int64, {p.num_tokens, p.num_topk}, device);
#if defined(EPMOE_HAVE_CUDA)
  if (device.is_cuda()) {  // router/cuda.cu, asynchronous on the current stream (stream.hpp)
    router_detail::route_cuda(p, r.topk_weights.ptr<float>(), r.topk_idx.ptr<std::int64_t>(), current_stream());
    return r;
  }
#endif
  if (p.num_tokens > 0) router_detail::route_cpu(p, r.topk_weights.ptr<float>(), r.topk_idx.ptr<std::int64_t>());
  return r;
}

TopkResult plain_topk(const TensorView& logits, int num_topk, bool renormalize, ScoringFunc scoring) {
  RoutingProblem p;
  check_logits(logits, p);
  check_num_topk("num_topk", num_topk, p.num_experts);
  p.num_topk = num_topk;
  p.renormalize = renormalize;
  p.scoring = scoring;
  return run(p);
}

}  // namespace

TopkResult topk_softmax(const TensorView& logits, int num_topk, bool renormalize) {
  return plain_topk(logits, num_topk, renormalize, ScoringFunc::softmax);
}

TopkResult topk_sigmoid(const TensorView& logits, int num_topk, bool renormalize) {
  return plain_topk(logits, num_topk, renormalize, ScoringFunc::sigmoid);
}

TopkResult grouped_topk(const TensorView& logits, const GroupedTopkOptions& o) {
  RoutingProblem p;
  check_logits(logits, p);
  const std::int64_t E = p.num_experts;
  const int G = o.num_expert_group;
  EPMOE_CHECK_ARG(G >= 1 && E % G == 0, "options.num_expert_group", fmt::format("a divisor of E = {}", E), G);
  EPMOE_CHECK_ARG(o.topk_group >= 1 && o.topk_group <= G, "options.topk_group",
                  fmt::format("in [1, num_expert_group = {}]", G), o.topk_group);
  check_num_topk("options.num_topk", o.num_topk, static_cast<std::int64_t>(o.topk_group) * (E / G));
  EPMOE_CHECK_ARG(o.scoring == ScoringFunc::softmax || o.scoring == ScoringFunc::sigmoid, "options.scoring",
                  "softmax or sigmoid", static_cast<int>(o.scoring));
  EPMOE_CHECK_ARG(std::isfinite(o.routed_scaling_factor), "options.routed_scaling_factor", "a finite number",
                  o.routed_scaling_factor);
  const TensorView& b = o.e_score_correction_bias;
  if (b.defined()) {
    EPMOE_CHECK_ARG(b.dtype == DType::fp32 && b.ndim() == 1 && b.size(0) == E, "options.e_score_correction_bias",
                    fmt::format("float32[{}] (one per expert)", E), describe(b));
    EPMOE_CHECK_ARG(b.stride(0) == 1, "options.e_score_correction_bias", "stride 1", b.stride(0));
    EPMOE_CHECK_ARG(b.data != nullptr, "options.e_score_correction_bias", "a non-null data pointer", "nullptr");
    EPMOE_CHECK_ARG(b.device == logits.device, "options.e_score_correction_bias",
                    fmt::format("a tensor on the logits' device {}", to_string(logits.device)), to_string(b.device));
    // With a bias the group score is the sum of the group's two best experts (DeepSeek-V3).
    EPMOE_CHECK_ARG(E / G >= 2, "options.num_expert_group",
                    fmt::format("at most E / 2 = {} groups when e_score_correction_bias is given "
                                "(a group's score sums its top-2 experts)",
                                E / 2),
                    G);
    p.bias = static_cast<const float*>(b.data);
  }
  p.num_topk = o.num_topk;
  p.scoring = o.scoring;
  p.renormalize = o.renormalize;
  p.routed_scaling_factor = o.routed_scaling_factor;
  p.num_expert_group = G;
  p.topk_group = o.topk_group;
  return run(p);
}

}  // namespace epmoe
