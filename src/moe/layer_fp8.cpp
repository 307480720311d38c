// MoELayer's checks of fp8 block-scaled weights (MoEForwardArgs::w1_scale, w2_scale; semantics §8), run with the
// other argument checks before any communication.
#include "core/check.hpp"
#include "core/cuda_util.hpp"
#include "moe/layer_extensions.hpp"

namespace epmoe::layer_detail {

void check_weight_scales(const MoEForwardArgs& args, const Experts& experts, std::int64_t e_local, std::int64_t H,
                         std::int64_t N) {
  const bool fp8 = experts.config().quant == ExpertsQuant::fp8_block;
  const auto who = [&] {
    return fmt::format("the '{}' experts with {} weights", experts.name(), fp8 ? "fp8_block" : "bfloat16");
  };
  if (!fp8) {
    // `quant` is the name of the setting in C++ (ExpertsConfig::quant) and in Python (make_cuda_experts(quant=...)).
    const char* hint = " (fp8 block-scaled weights need experts made with quant fp8_block)";
    EPMOE_CHECK_ARG(!args.w1_scale.defined(), "w1_scale", fmt::format("None for {}{}", who(), hint),
                    describe(args.w1_scale));
    EPMOE_CHECK_ARG(!args.w2_scale.defined(), "w2_scale", fmt::format("None for {}{}", who(), hint),
                    describe(args.w2_scale));
    return;
  }
  EPMOE_CHECK_ARG(args.w1.dtype == DType::fp8_e4m3, "w1", fmt::format("float8_e4m3fn weights for {}", who()),
                  describe(args.w1));
  EPMOE_CHECK_ARG(args.w2.dtype == DType::fp8_e4m3, "w2", fmt::format("float8_e4m3fn weights for {}", who()),
                  describe(args.w2));
  // The experts refuse these too, but only after the dispatch (semantics §1's fp8 rows).
  EPMOE_CHECK_ARG(H % 16 == 0 && N % 16 == 0, "w2",
                  fmt::format("H % 16 == 0 and N % 16 == 0 for fp8 weights (H = {} from hidden, N = {} from w1)", H, N),
                  describe(args.w2));
  const std::int64_t rows = args.w1.size(1);
  const auto blocks = [](std::int64_t n) { return cuda_util::ceil_div(n, 128); };
  const auto check = [&](const TensorView& s, std::string_view name, const Shape& want, std::string_view layout) {
    const auto expected = [&] {
      return fmt::format("contiguous float32 {} ({}: one scale per 128x128 block) on {} (the weights' device)",
                         to_string(want), layout, to_string(args.w1.device));
    };
    EPMOE_CHECK_ARG(s.defined(), name, expected(), fmt::format("None (fp8 weights need their block scales)"));
    EPMOE_CHECK_ARG(s.dtype == DType::fp32 && s.shape == want && s.is_contiguous() && s.device == args.w1.device,
                    name, expected(), describe(s));
  };
  check(args.w1_scale, "w1_scale", Shape{e_local, blocks(rows), blocks(H)},
        rows == 2 * N ? "[E_local, ceil(2N/128), ceil(H/128)]" : "[E_local, ceil(N/128), ceil(H/128)]");
  check(args.w2_scale, "w2_scale", Shape{e_local, blocks(H), blocks(N)}, "[E_local, ceil(H/128), ceil(N/128)]");
}

}  // namespace epmoe::layer_detail
