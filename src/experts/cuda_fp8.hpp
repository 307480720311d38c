// The launchers of the fp8 block-scaled CUDA experts' kernels (ExpertsQuant::fp8_block; cuda_fp8.cu, CUDA builds
// only), private to src/experts/. The host side (cuda_fp8.cpp) checks arguments and runs cuBLASLt's block-scaled
// fp8 GEMMs; these quantize, reorder scales and copy rows. No fmt here: nvcc compiles cuda_fp8.cu.
//
// Scale layouts cuBLASLt reads on Hopper (CUBLASLT_MATMUL_MATRIX_SCALE_*, cuBLAS >= 12.9), for the row-major
// GEMM C[rows, out] = X[rows, inner] @ W[out, inner]^T issued as the column-major "TN" GEMM (A = W, B = X):
//   A (weights), BLK128x128_32F: [ceil(out/128)][ld], ld = ceil(inner/128) rounded up to a multiple of 4.
//   B (activations), VEC128_32F: [ceil(inner/128)][rows] -- token-major ("outer-dim-major", as PyTorch's
//     _scaled_mm asks for 1x128 scales); every GEMM here has a row count that is a multiple of 4, so each
//     column of scales starts 16-byte aligned.
// Per expert, the activation scales of its `n` rows starting at permuted row r0 sit at offset r0 * groups.
#pragma once

#include <epmoe/experts.hpp>

#include <cstdint>

#include <cuda_runtime.h>

namespace epmoe::experts_cuda_fp8 {

/// Where the GEMMs' rows lie: Standard format: the permuted segments seg[e]..seg[e+1] (int64 [E+1], on the
/// device); batched: slab e holds rows [e * slab, (e + 1) * slab) of which the first counts[e] (clamped to
/// [0, valid]) are live.
struct Segments {
  const std::int64_t* seg = nullptr;  ///< standard
  int e_local = 0;
  std::int64_t slab = 0;                  ///< batched: rows per slab (a multiple of 4)
  std::int64_t valid = 0;                 ///< batched: max_tokens
  const std::int32_t* counts = nullptr;   ///< batched
};

/// semantics §6 quantization of `rows` rows of x (bf16, or fp32 when x_fp32; h channels, h % 16 == 0), each
/// multiplied first by weights[r * weight_stride] when weights != nullptr (float32 product). Input row r goes
/// to output row o = (r / in_slab) * out_slab + r % in_slab; its fp8 values to q[o * h ...]. Scales: with
/// seg.seg == nullptr and transposed, to the per-slab token-major layout of `seg` (slab seg.slab); otherwise
/// row-major [o][groups]. With seg.counts, rows past the count of their slab are skipped.
void quantize_rows(const void* x, bool x_fp32, std::int64_t rows, std::int64_t h, const float* weights,
                   std::int64_t weight_stride, std::int64_t in_slab, std::int64_t out_slab, std::uint8_t* q,
                   float* scales, bool transposed, const Segments& seg, cudaStream_t stream);

/// Row-major scales src [row][groups] -> the token-major per-segment layout of `seg`, for every GEMM row
/// (rows_total rows: seg[E] for standard, E * slab for batched; batched source rows are e * valid + t, and
/// t >= valid gets 0).
void transpose_scales(const float* src, std::int64_t rows_total, std::int64_t groups, const Segments& seg, float* dst,
                      cudaStream_t stream);

/// g float32 [rows_total, 2n or n] -> a = act(g) quantized per 1x128 group: fp8 rows of a_stride bytes (n used)
/// and token-major scales per segment. Rows past seg[E] (standard) or past their slab's count (batched) are skipped.
void activation_quant(Activation act, const float* g, std::int64_t rows_total, std::int64_t n, const Segments& seg,
                      std::uint8_t* a, std::int64_t a_stride, float* scales, cudaStream_t stream);

/// Weight block scales [E * nb][kb] -> [E * nb][kb4] (kb4 = kb rounded up to 4, zero-filled).
void pad_weight_scales(const float* src, std::int64_t rows, std::int64_t kb, std::int64_t kb4, float* dst,
                       cudaStream_t stream);

/// Copies rows between slabs: for e < e_local, t < (counts ? clamp(counts[e], 0, rows) : rows), row
/// e * src_slab + t of src to row e * dst_slab + t of dst (row_bytes % 16 == 0).
void copy_slab_rows(const void* src, std::int64_t src_slab, void* dst, std::int64_t dst_slab, int e_local,
                    std::int64_t rows, std::int64_t row_bytes, const std::int32_t* counts, cudaStream_t stream);

}  // namespace epmoe::experts_cuda_fp8
