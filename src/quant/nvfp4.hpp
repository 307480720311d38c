// NVFP4 part of the quantization stage's interface (included by quant/quant.hpp, the header other folders include):
// nvfp4.cpp checks the public functions' arguments and dispatches on device to nvfp4_cpu.cpp or nvfp4_cuda.cu (CUDA
// builds only), which agree bit for bit. The format and the scalar rules are include/epmoe/nvfp4.hpp's.
#pragma once

#include <epmoe/nvfp4.hpp>
#include <epmoe/stream.hpp>
#include <epmoe/tensor.hpp>

#include <cstdint>
#include <string_view>

namespace epmoe::quant_detail {

/// Byte of scale (t, j) in a scale matrix of `layout` with row stride `stride` (bytes) and `col_tiles` tiles of 4
/// scales per matrix row (swizzled: a matrix row per 128 tokens).
EPMOE_HD std::int64_t nvfp4_scale_at(Nvfp4ScaleLayout layout, std::int64_t t, std::int64_t j, std::int64_t stride,
                                     std::int64_t col_tiles) {
  if (layout == Nvfp4ScaleLayout::linear) return t * stride + j;
  return (t / kNvfp4TileRows) * stride + nvfp4_swizzled_offset(t % kNvfp4TileRows, j, col_tiles);
}

/// A global scale as a kernel takes it: a value known on the host, or a pointer to it in device memory (read by
/// the kernel; `value` then unused).
struct GlobalScale {
  float value = 0.0f;
  const float* device = nullptr;
};

/// Checks a global scale argument `name` for data on `device`: float32 with one element (shape [] or [1]), on the
/// CPU or on `device`; a CPU value finite and > 0 (read here). A value on the GPU is not read (that would
/// synchronise): it is returned as a device pointer. Errors: invalid_argument naming `name`.
GlobalScale check_global_scale(const TensorView& t, std::string_view name, Device device);
/// The finite, > 0 rule for a global scale value (also for one copied from the device). Errors: invalid_argument.
void check_global_scale_value(float v, std::string_view name);

/// A validated NVFP4 quantization: x [T, H] bf16/fp32 (unit inner stride), q uint8 [T, H / 2], scales fp8_e4m3 in
/// `layout`'s shape (each with any row stride >= its width).
struct Nvfp4Problem {
  TensorView x, q, scales;
  std::int64_t num_tokens = 0, hidden = 0;
  Nvfp4ScaleLayout layout = Nvfp4ScaleLayout::swizzled;
  GlobalScale global_scale;
};

void quantize_nvfp4_cpu(const Nvfp4Problem& p);
/// q uint8 [T, H / 2], scales in `layout`; out [T, H] bf16/fp32, contiguous.
void dequantize_nvfp4_cpu(const TensorView& q, const TensorView& scales, Nvfp4ScaleLayout layout, float global_scale,
                          const TensorView& out);

// ---- CUDA (asynchronous on `stream`; bit-identical to the CPU) ------------------------------------------

/// NVFP4 quantization of a validated problem; x's rows must be 16-byte aligned (pointer and row stride in bytes),
/// invalid_argument otherwise. A thread per block of 16 channels.
void quantize_nvfp4_cuda(const Nvfp4Problem& p, Stream stream);
/// q uint8 [T, H / 2], scales in `layout`; out [T, H] bf16/fp32, contiguous.
void dequantize_nvfp4_cuda(const TensorView& q, const TensorView& scales, Nvfp4ScaleLayout layout,
                           const GlobalScale& global_scale, const TensorView& out, Stream stream);
/// Slabs of the low-latency dispatch (its output layout): q uint8 [E, rows, H / 2], scales fp8_e4m3 [E,
/// ceil(rows / 128), (H / 64) * 512] (each slab a swizzled matrix), out bf16/fp32 [E, rows, H], all contiguous;
/// only slab e's first masked_m[e] rows (device int32 [E], clamped to [0, rows]) are written.
void dequantize_nvfp4_masked_cuda(const TensorView& q, const TensorView& scales, const GlobalScale& global_scale,
                                  const TensorView& out, const std::int32_t* masked_m, Stream stream);

}  // namespace epmoe::quant_detail
