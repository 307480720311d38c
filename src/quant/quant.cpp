// FP8 quantization entry points (semantics §6): argument checks, then dispatch on the tensors' device.
#include "core/check.hpp"
#include <epmoe/quant.hpp>

#include <cmath>
#include <memory>
#include <optional>

#include "quant/quant.hpp"

namespace epmoe {

namespace quant_detail {

std::string strides_of(const TensorView& t) {
  return fmt::format("{} with strides {}", describe(t), to_string(t.strides));
}

// A [rows, cols] matrix of `dtype` whose rows may be spaced by any stride >= cols.
void check_matrix(const TensorView& t, std::string_view name, DType dtype, std::int64_t rows, std::int64_t cols) {
  EPMOE_CHECK_ARG(t.defined(), name, fmt::format("{}[{}, {}]", dtype_name(dtype), rows, cols), "None");
  EPMOE_CHECK_ARG(t.dtype == dtype && t.ndim() == 2 && t.size(0) == rows && t.size(1) == cols, name,
                  fmt::format("{}[{}, {}]", dtype_name(dtype), rows, cols), describe(t));
  EPMOE_CHECK_ARG(cols <= 1 || t.stride(1) == 1, name, "unit stride in dimension 1", strides_of(t));
  EPMOE_CHECK_ARG(rows <= 1 || t.stride(0) >= cols, name, fmt::format("a row stride >= {}", cols), strides_of(t));
  EPMOE_CHECK_ARG(t.data != nullptr || rows * cols == 0, name, "a non-null data pointer", "nullptr");
}

// What each layout asks of the strides, for messages.
std::string layout_rule(ScaleLayout layout, std::int64_t rows, std::int64_t cols) {
  return layout == ScaleLayout::row_major
             ? fmt::format("row-major scales (unit stride in dimension 1, a row stride >= {})", cols)
             : fmt::format("column-major scales (unit stride in dimension 0, a column stride >= {})", rows);
}

void require_cpu(const TensorView& t, std::string_view name) {
#if !defined(EPMOE_HAVE_CUDA)
  if (!t.device.is_cpu())
    raise(ErrorCode::unsupported, "argument '{}' is on {} but epmoe was built without CUDA ({})", name,
          to_string(t.device), describe(t));
#endif
}

}  // namespace quant_detail

namespace {

using quant_detail::check_matrix;
using quant_detail::require_cpu;

// Device dispatch: quant/cpu.cpp or quant/cuda.cu (asynchronous on the current stream, same bits).
void run_quantize(const quant_detail::QuantizeProblem& p) {
#if defined(EPMOE_HAVE_CUDA)
  if (p.x.device.is_cuda()) return quant_detail::quantize_fp8_cuda(p, current_stream());
#endif
  quant_detail::quantize_fp8_cpu(p);
}
void run_dequantize(const TensorView& q, const TensorView& scales, const TensorView& out) {
#if defined(EPMOE_HAVE_CUDA)
  if (q.device.is_cuda()) return quant_detail::dequantize_fp8_cuda(q, scales, out, current_stream());
#endif
  quant_detail::dequantize_fp8_cpu(q, scales, out);
}

// Checks x and the options; returns [T, H].
void check_input(const TensorView& x, const Fp8Options& o, std::int64_t& T, std::int64_t& H) {
  EPMOE_CHECK_ARG(x.defined(), "x", "a bfloat16 or float32 tensor [T, H]", "None");
  EPMOE_CHECK_ARG(x.ndim() == 2 && (x.dtype == DType::bf16 || x.dtype == DType::fp32), "x",
                  "a 2-d bfloat16 or float32 tensor [T, H]", describe(x));
  T = x.size(0);
  H = x.size(1);
  EPMOE_CHECK_ARG(H > 0 && H % 16 == 0, "x", "hidden size H a positive multiple of 16 (fp8 rows of 16-byte units)",
                  fmt::format("H = {} ({})", H, describe(x)));
  check_matrix(x, "x", x.dtype, T, H);
  EPMOE_CHECK_ARG(!o.use_ue8m0 || o.round_scale, "options.use_ue8m0",
                  "round_scale = true (UE8M0 stores power-of-two scales only)", "round_scale = false");
  EPMOE_CHECK_ARG(o.scale_layout == ScaleLayout::row_major || o.scale_layout == ScaleLayout::column_major,
                  "options.scale_layout", "row_major or column_major", static_cast<int>(o.scale_layout));
}

DType scale_dtype(const Fp8Options& o) { return o.use_ue8m0 ? DType::int32 : DType::fp32; }
std::int64_t scale_cols(std::int64_t H, const Fp8Options& o) {
  return o.use_ue8m0 ? num_ue8m0_words(H) : num_scale_groups(H);
}

}  // namespace

namespace quant_detail {

void check_scales(const TensorView& t, std::string_view name, DType dtype, std::int64_t rows, std::int64_t cols,
                  std::optional<ScaleLayout> layout) {
  EPMOE_CHECK_ARG(t.defined(), name, fmt::format("{}[{}, {}]", dtype_name(dtype), rows, cols), "None");
  EPMOE_CHECK_ARG(t.dtype == dtype && t.ndim() == 2 && t.size(0) == rows && t.size(1) == cols, name,
                  fmt::format("{}[{}, {}]", dtype_name(dtype), rows, cols), describe(t));
  if (layout)
    EPMOE_CHECK_ARG(scales_have_layout(t, *layout), name, layout_rule(*layout, rows, cols), strides_of(t));
  else
    EPMOE_CHECK_ARG(scales_have_layout(t, ScaleLayout::row_major) || scales_have_layout(t, ScaleLayout::column_major),
                    name,
                    fmt::format("{} or {}", layout_rule(ScaleLayout::row_major, rows, cols),
                                layout_rule(ScaleLayout::column_major, rows, cols)),
                    strides_of(t));
  EPMOE_CHECK_ARG(t.data != nullptr || rows * cols == 0, name, "a non-null data pointer", "nullptr");
}

}  // namespace quant_detail

Fp8Tensor quantize_fp8(const TensorView& x, const Fp8Options& options) {
  std::int64_t T = 0, H = 0;
  check_input(x, options, T, H);
  require_cpu(x, "x");
  Fp8Tensor out;
  out.data = Tensor::empty(DType::fp8_e4m3, {T, H}, x.device);
  out.scales = empty_fp8_scales(scale_dtype(options), {T, scale_cols(H, options)}, options.scale_layout, x.device);
  quant_detail::QuantizeProblem p{x, out.data.view(), out.scales.view(), T, H, options};
  run_quantize(p);
  return out;
}

void quantize_fp8_into(const TensorView& x, const TensorView& q, const TensorView& scales, const Fp8Options& options) {
  std::int64_t T = 0, H = 0;
  check_input(x, options, T, H);
  check_matrix(q, "q", DType::fp8_e4m3, T, H);
  quant_detail::check_scales(scales, "scales", scale_dtype(options), T, scale_cols(H, options), options.scale_layout);
  EPMOE_CHECK_ARG(q.device == x.device, "q", fmt::format("a tensor on x's device {}", to_string(x.device)),
                  to_string(q.device));
  EPMOE_CHECK_ARG(scales.device == x.device, "scales", fmt::format("a tensor on x's device {}", to_string(x.device)),
                  to_string(scales.device));
  require_cpu(x, "x");
  run_quantize({x, q, scales, T, H, options});
}

Tensor dequantize_fp8(const TensorView& q, const TensorView& scales, DType out_dtype) {
  EPMOE_CHECK_ARG(q.defined(), "q", "a float8_e4m3fn tensor [T, H]", "None");
  EPMOE_CHECK_ARG(q.ndim() == 2 && q.dtype == DType::fp8_e4m3, "q", "a 2-d float8_e4m3fn tensor [T, H]", describe(q));
  const std::int64_t T = q.size(0), H = q.size(1);
  EPMOE_CHECK_ARG(H > 0, "q", "H >= 1", describe(q));
  check_matrix(q, "q", DType::fp8_e4m3, T, H);
  EPMOE_CHECK_ARG(scales.defined() && (scales.dtype == DType::fp32 || scales.dtype == DType::int32), "scales",
                  fmt::format("float32[{}, {}] or UE8M0 int32[{}, {}]", T, num_scale_groups(H), T, num_ue8m0_words(H)),
                  describe(scales));
  const bool ue8m0 = scales.dtype == DType::int32;
  quant_detail::check_scales(scales, "scales", scales.dtype, T, ue8m0 ? num_ue8m0_words(H) : num_scale_groups(H), std::nullopt);
  EPMOE_CHECK_ARG(out_dtype == DType::bf16 || out_dtype == DType::fp32, "out_dtype", "bfloat16 or float32",
                  dtype_name(out_dtype));
  EPMOE_CHECK_ARG(scales.device == q.device, "scales", fmt::format("a tensor on q's device {}", to_string(q.device)),
                  to_string(scales.device));
  require_cpu(q, "q");
  Tensor out = Tensor::empty(out_dtype, {T, H}, q.device);
  run_dequantize(q, scales, out.view());
  return out;
}

const char* scale_layout_name(ScaleLayout layout) {
  return layout == ScaleLayout::column_major ? "column_major" : "row_major";
}

bool scales_have_layout(const TensorView& t, ScaleLayout layout) {
  if (t.ndim() != 2) return false;
  const std::int64_t rows = t.size(0), cols = t.size(1);
  if (rows == 0 || cols == 0) return true;
  if (layout == ScaleLayout::row_major) return (cols <= 1 || t.stride(1) == 1) && (rows <= 1 || t.stride(0) >= cols);
  return (rows <= 1 || t.stride(0) == 1) && (cols <= 1 || t.stride(1) >= rows);
}

Tensor empty_fp8_scales(DType dtype, Shape shape, ScaleLayout layout, Device device) {
  EPMOE_CHECK_ARG(dtype == DType::fp32 || dtype == DType::int32, "dtype", "float32 or int32 (UE8M0)", dtype_name(dtype));
  const int n = shape.ndim();
  EPMOE_CHECK_ARG((n == 2 || n == 3) && shape[0] >= 0 && shape[1] >= 0 && (n == 2 || shape[2] >= 0), "shape",
                  "[rows, cols] or [batch, rows, cols]", to_string(shape));
  if (layout == ScaleLayout::row_major) return Tensor::empty(dtype, shape, device);
  const std::int64_t batch = n == 3 ? shape[0] : 1, rows = shape[n - 2], cols = shape[n - 1];
  const std::int64_t padded = tma_aligned_scale_rows(rows);
  auto storage = std::make_shared<Tensor>(Tensor::empty(dtype, {batch * cols * padded}, device));
  const Shape strides = n == 3 ? Shape{cols * padded, 1, padded} : Shape{1, padded};
  return Tensor::wrap(TensorView(storage->data(), dtype, shape, strides, device), storage);
}

float fp8_group_scale(float amax, bool round_scale) {
  EPMOE_CHECK_ARG(amax >= 0.0f, "amax", "a non-negative number (an absolute maximum)", amax);
  return quant_detail::group_scale(amax, round_scale).scale;
}

std::uint8_t ue8m0_from_scale(float pow2_scale) {
  const std::uint32_t b = float_bits(pow2_scale);
  const std::uint32_t exponent = (b >> 23) & 0xffu, mantissa = b & 0x7fffffu;
  if (b == 0x00400000u) return 0;  // 2^-127, the subnormal that byte 0 stands for
  EPMOE_CHECK_ARG((b >> 31) == 0 && mantissa == 0 && exponent >= 1 && exponent <= 254, "pow2_scale",
                  "a power of two in [2^-127, 2^127]", pow2_scale);
  return static_cast<std::uint8_t>(exponent);
}

float ue8m0_to_scale(std::uint8_t byte) {
  if (byte == 0xff) return std::nanf("");  // OCP MX: 0xFF is NaN
  return std::ldexp(1.0f, static_cast<int>(byte) - 127);
}

}  // namespace epmoe
