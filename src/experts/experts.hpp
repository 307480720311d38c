// Module interface of the experts stage (the one header of src/experts/ that other folders include): the CUDA
// experts with their variants fixed (the GPU tests and the benchmark cover each), and the router weight on the
// input as the CUDA experts apply it. Declared in every build; defined in CUDA builds only (EPMOE_HAVE_CUDA).
#pragma once

#include <epmoe/experts.hpp>
#include <epmoe/stream.hpp>
#include <epmoe/tensor.hpp>

#include <cstdint>
#include <memory>

namespace epmoe::experts_cuda {

/// How the Standard format runs its per-expert GEMMs (measured in bench/gpu_experts.cpp).
enum class GemmMode : std::uint8_t {
  loop,     ///< one cublasGemmEx per non-empty expert, in order, on the caller's stream
  streams,  ///< the same GEMMs spread round-robin over 4 forked streams (overlaps small GEMMs' tails)
  grouped,  ///< one cublasGemmGroupedBatchedEx per layer (pointer arrays copied to the device)
  /// grouped when the non-empty experts average at most kGroupedMaxMeanRows rows (decode: small, memory-bound
  /// GEMMs, where one grouped launch keeps the weights streaming), else loop (cuBLAS 13.0's grouped kernels
  /// ran 1.3x slower than the loop at 128 rows per expert and 2.4x slower at 1024 on an H200). The default.
  automatic,
};
/// The crossover of GemmMode::automatic in rows per non-empty expert, measured by bench/gpu_experts.cpp on
/// an H200 at H = 7168, N = 2048, 32 experts: grouped won at 32 (0.81 vs 1.14 ms) and 64 rows (1.02 vs
/// 1.15 ms), the loop at 128 (1.19 vs 1.56 ms) and above.
inline constexpr std::int64_t kGroupedMaxMeanRows = 64;
const char* gemm_mode_name(GemmMode mode);

/// make_cuda_experts with an explicit GEMM mode (tests and benchmark cover every mode).
std::unique_ptr<Experts> make_cuda_experts(const ExpertsConfig& config, GemmMode mode);

/// out[t] = bf16(hidden[t] * topk_weights[t, 0]) for every row t: hidden bfloat16 or float32 [T, H] (H % 8 == 0),
/// topk_weights float32 [T, K], out bfloat16 [T, H], contiguous, on one GPU; asynchronous on `stream`. The
/// rounding of apply_router_weight_on_input in the CUDA experts (and on the CPU: float32 product, one bf16
/// rounding). Arguments are the caller's to check.
void weight_hidden_cuda(const TensorView& hidden, const TensorView& topk_weights, const TensorView& out,
                        Stream stream);

}  // namespace epmoe::experts_cuda

namespace epmoe::experts_cuda_fp8 {

/// make_cuda_experts for ExpertsQuant::fp8_block (make_cuda_experts dispatches here). The per-expert GEMMs of a
/// layer go to 4 forked streams when the experts average <= 256 rows, else to the caller's stream; the
/// environment variable EPMOE_CUDA_EXPERTS_FP8_STREAMS=auto|1..4 overrides.
std::unique_ptr<Experts> make_cuda_experts_fp8(const ExpertsConfig& config);
/// The same with an explicit stream count: 0 = auto, 1 = the caller's stream only, 2..4 forked streams (tests and
/// benchmark cover each).
std::unique_ptr<Experts> make_cuda_experts_fp8(const ExpertsConfig& config, int streams);

}  // namespace epmoe::experts_cuda_fp8
