// NVFP4 quantization entry points (semantics §6, "NVFP4"): argument checks, then dispatch on the tensors' device to
// quant/nvfp4_cpu.cpp or quant/nvfp4_cuda.cu (same bits).
#include "core/check.hpp"
#include <epmoe/nvfp4.hpp>

#include <cmath>
#include <cstring>

#include "quant/quant.hpp"

namespace epmoe {

namespace quant_detail {

void check_global_scale_value(float v, std::string_view name) {
  EPMOE_CHECK_ARG(std::isfinite(v) && v > 0.0f, name,
                  "a finite global scale > 0 (the producers' 448 * 6 / amax of the tensor)", v);
}

GlobalScale check_global_scale(const TensorView& t, std::string_view name, Device device) {
  EPMOE_CHECK_ARG(t.defined(), name, "a float32 scalar tensor (shape [] or [1]): the NVFP4 global scale", "None");
  EPMOE_CHECK_ARG(t.dtype == DType::fp32 && (t.ndim() == 0 || (t.ndim() == 1 && t.size(0) == 1)), name,
                  "a float32 scalar tensor (shape [] or [1])", describe(t));
  EPMOE_CHECK_ARG(t.data != nullptr, name, "a non-null data pointer", "nullptr");
  EPMOE_CHECK_ARG(t.device.is_cpu() || t.device == device, name,
                  fmt::format("a tensor on the CPU or on the data's device {}", to_string(device)), describe(t));
  require_cpu(t, name);
  GlobalScale g;
  if (t.device.is_cpu()) {
    std::memcpy(&g.value, t.data, sizeof(float));
    check_global_scale_value(g.value, name);
  } else {
    g.device = static_cast<const float*>(t.data);
  }
  return g;
}

}  // namespace quant_detail

namespace {

using quant_detail::check_matrix;
using quant_detail::require_cpu;

// The scales' [rows, cols] of a [T, H] tensor in `layout`.
std::int64_t scale_rows(std::int64_t T, Nvfp4ScaleLayout layout) {
  return layout == Nvfp4ScaleLayout::linear ? T : nvfp4_row_tiles(T);
}
std::int64_t scale_cols(std::int64_t H, Nvfp4ScaleLayout layout) {
  return layout == Nvfp4ScaleLayout::linear ? H / kNvfp4BlockSize : nvfp4_col_tiles(H) * kNvfp4TileBytes;
}

// H a positive multiple of 16 (of 64 swizzled: whole tiles of 4 scales), named `name`.
void check_hidden(std::int64_t H, Nvfp4ScaleLayout layout, std::string_view name, const TensorView& t) {
  const int unit = layout == Nvfp4ScaleLayout::linear ? kNvfp4BlockSize : kNvfp4BlockSize * kNvfp4TileCols;
  EPMOE_CHECK_ARG(H > 0 && H % unit == 0, name,
                  fmt::format("hidden size H a positive multiple of {} (NVFP4 blocks of 16 channels{})", unit,
                              layout == Nvfp4ScaleLayout::linear ? "" : ", swizzled scales in tiles of 4 blocks"),
                  fmt::format("H = {} ({})", H, describe(t)));
}

void check_same_device(const TensorView& t, std::string_view name, const TensorView& ref) {
  EPMOE_CHECK_ARG(t.device == ref.device, name, fmt::format("a tensor on {}", to_string(ref.device)),
                  to_string(t.device));
}

// x and the global scale of a quantization: the problem without its outputs.
quant_detail::Nvfp4Problem check_quantize(const TensorView& x, const TensorView& gs, Nvfp4ScaleLayout layout) {
  EPMOE_CHECK_ARG(x.defined(), "x", "a bfloat16 or float32 tensor [T, H]", "None");
  EPMOE_CHECK_ARG(x.ndim() == 2 && (x.dtype == DType::bf16 || x.dtype == DType::fp32), "x",
                  "a 2-d bfloat16 or float32 tensor [T, H]", describe(x));
  quant_detail::Nvfp4Problem p;
  p.num_tokens = x.size(0);
  p.hidden = x.size(1);
  check_hidden(p.hidden, layout, "x", x);
  check_matrix(x, "x", x.dtype, p.num_tokens, p.hidden);
  require_cpu(x, "x");
  p.global_scale = quant_detail::check_global_scale(gs, "global_scale", x.device);
  p.x = x;
  p.layout = layout;
  return p;
}

void run_quantize(const quant_detail::Nvfp4Problem& p) {
#if defined(EPMOE_HAVE_CUDA)
  if (p.x.device.is_cuda()) return quant_detail::quantize_nvfp4_cuda(p, current_stream());
#endif
  quant_detail::quantize_nvfp4_cpu(p);
}

}  // namespace

Nvfp4Tensor quantize_nvfp4(const TensorView& x, const TensorView& global_scale, Nvfp4ScaleLayout layout) {
  quant_detail::Nvfp4Problem p = check_quantize(x, global_scale, layout);
  Nvfp4Tensor out;
  out.data = Tensor::empty(DType::uint8, {p.num_tokens, p.hidden / 2}, x.device);
  out.scales =
      Tensor::empty(DType::fp8_e4m3, {scale_rows(p.num_tokens, layout), scale_cols(p.hidden, layout)}, x.device);
  p.q = out.data.view();
  p.scales = out.scales.view();
  run_quantize(p);
  return out;
}

void quantize_nvfp4_into(const TensorView& x, const TensorView& global_scale, const TensorView& q,
                         const TensorView& scales, Nvfp4ScaleLayout layout) {
  quant_detail::Nvfp4Problem p = check_quantize(x, global_scale, layout);
  check_matrix(q, "q", DType::uint8, p.num_tokens, p.hidden / 2);
  check_matrix(scales, "scales", DType::fp8_e4m3, scale_rows(p.num_tokens, layout), scale_cols(p.hidden, layout));
  check_same_device(q, "q", x);
  check_same_device(scales, "scales", x);
  p.q = q;
  p.scales = scales;
  run_quantize(p);
}

Tensor dequantize_nvfp4(const TensorView& q, const TensorView& scales, const TensorView& global_scale,
                        Nvfp4ScaleLayout layout, DType out_dtype) {
  EPMOE_CHECK_ARG(q.defined() && q.ndim() == 2 && q.dtype == DType::uint8, "q",
                  "a 2-d uint8 tensor [T, H / 2] (two e2m1 codes per byte)", q.defined() ? describe(q) : "None");
  const std::int64_t T = q.size(0), H = 2 * q.size(1);
  check_hidden(H, layout, "q", q);
  check_matrix(q, "q", DType::uint8, T, H / 2);
  check_matrix(scales, "scales", DType::fp8_e4m3, scale_rows(T, layout), scale_cols(H, layout));
  check_same_device(scales, "scales", q);
  EPMOE_CHECK_ARG(out_dtype == DType::bf16 || out_dtype == DType::fp32, "out_dtype", "bfloat16 or float32",
                  dtype_name(out_dtype));
  require_cpu(q, "q");
  const quant_detail::GlobalScale gs = quant_detail::check_global_scale(global_scale, "global_scale", q.device);
  Tensor out = Tensor::empty(out_dtype, {T, H}, q.device);
#if defined(EPMOE_HAVE_CUDA)
  if (q.device.is_cuda()) {
    quant_detail::dequantize_nvfp4_cuda(q, scales, layout, gs, out.view(), current_stream());
    return out;
  }
#endif
  quant_detail::dequantize_nvfp4_cpu(q, scales, layout, gs.value, out.view());
  return out;
}

}  // namespace epmoe
