// Internal entry points of the CUDA fp8 quantization kernels (CUDA builds only: EPMOE_HAVE_CUDA).
// quant.cpp checks the arguments on the host, then calls these for tensors on a GPU. Asynchronous on
// `stream`; bit-identical to quant/cpu.cpp.
#pragma once

#include <epmoe/stream.hpp>

#include "quant/quant_impl.hpp"

namespace epmoe::quant_detail {

/// Per-token-group fp8 quantization of a validated problem. On CUDA the rows of x and q must be
/// 16-byte aligned (pointer and row stride in bytes); invalid_argument otherwise.
/// `hardware_convert` selects the cvt.rn.satfinite.e4m3x2 instruction (default) or the software
/// conversion of dtype.hpp; both give the same bits (tests/gpu checks it). `tasks_per_warp` 1 or 4
/// forces that many rows' scale words per warp (0: chosen by size; the benchmark compares them).
void quantize_fp8_cuda(const QuantizeProblem& p, Stream stream, bool hardware_convert = true, int tasks_per_warp = 0);

/// q [T, H] fp8, scales float32 [T, G] or int32 [T, W]; out [T, H] bf16/fp32, contiguous.
void dequantize_fp8_cuda(const TensorView& q, const TensorView& scales, const TensorView& out, Stream stream);

/// Slabs (the low-latency layout): q [E, rows, H] fp8, scales [E, rows, G or W], out [E, rows, H], contiguous;
/// only slab e's first masked_m[e] rows (device int32 [E], clamped to [0, rows]) are written: the others are
/// never read by a masked (batched) consumer. Rows that are not 16-byte vectors fall back to every row.
void dequantize_fp8_masked_cuda(const TensorView& q, const TensorView& scales, const TensorView& out,
                                const std::int32_t* masked_m, Stream stream);

}  // namespace epmoe::quant_detail
