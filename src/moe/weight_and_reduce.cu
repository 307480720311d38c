// TopKWeightAndReduce on CUDA (SPEC 8): the twin of weight_and_reduce.cpp.
//
// Block (m, y): output row m, 16-byte vectors [y * kThreads, ...); each thread sums its 8 bf16 channels over
// the K choices in k order, each product rounded before the add (__fmul_rn / __fadd_rn: never a fused
// multiply-add, which the CPU loop does not use either), and rounds once to bf16.
#include "core/bf16_device.cuh"
#include "core/cuda_util.hpp"
#include "moe/weight_and_reduce.hpp"

namespace epmoe {

namespace {

constexpr int kThreads = 128;
constexpr int kMaxTopk = 512;

// kSlots: rows[m*K + k] gives the fused row of choice (m, k) (NaiveBatched); else the row is m*K + k when
// topk_idx[m, k] >= 0 (Contiguous).
template <bool kSlots, class Id>
__global__ void __launch_bounds__(kThreads)
    reduce_kernel(const uint4* __restrict__ fused, std::int64_t row_vecs, const std::int32_t* __restrict__ rows,
                  const Id* __restrict__ idx, const float* __restrict__ w, int K, uint4* __restrict__ out) {
  __shared__ std::int64_t src[kMaxTopk];
  __shared__ float weight[kMaxTopk];
  const std::int64_t m = blockIdx.x;
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    const std::int64_t i = m * K + k;
    if constexpr (kSlots)
      src[k] = rows[i];
    else
      src[k] = idx[i] >= 0 ? i : -1;
    weight[k] = w[i];
  }
  __syncthreads();
  const std::int64_t v = static_cast<std::int64_t>(blockIdx.y) * kThreads + threadIdx.x;
  if (v >= row_vecs) return;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int k = 0; k < K; ++k) {
    if (src[k] < 0) continue;
    const uint4 r = __ldg(fused + src[k] * row_vecs + v);
    const std::uint32_t words[4] = {r.x, r.y, r.z, r.w};
    const float wk = weight[k];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      acc[2 * j] = __fadd_rn(acc[2 * j], __fmul_rn(wk, __uint_as_float(words[j] << 16)));
      acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __fmul_rn(wk, __uint_as_float(words[j] & 0xffff0000u)));
    }
  }
  std::uint32_t packed[4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
    packed[j] = pack_bf16x2(acc[2 * j], acc[2 * j + 1]);
  out[m * row_vecs + v] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

template <bool kSlots, class Id>
void launch(const TensorView& fused, const std::int32_t* rows, const Id* idx, const TensorView& topk_weights,
            const TensorView& out, Stream stream) {
  const std::int64_t M = out.size(0), H = out.size(1);
  const int K = static_cast<int>(topk_weights.size(1));
  if (M == 0) return;
  if (K > kMaxTopk) throw_invalid_argument("topk_weights", "K <= 512 on CUDA", std::to_string(K));
  const std::int64_t row_vecs = H * static_cast<std::int64_t>(sizeof(bf16_t)) / 16;
  const dim3 grid(static_cast<unsigned>(M), static_cast<unsigned>(cuda_util::ceil_div(row_vecs, kThreads)));
  reduce_kernel<kSlots, Id><<<grid, kThreads, 0, cuda_util::to_cuda(stream)>>>(
      static_cast<const uint4*>(fused.data), row_vecs, rows, idx, static_cast<const float*>(topk_weights.data), K,
      static_cast<uint4*>(out.data));
  EPMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void weight_and_reduce_contiguous_cuda(const TensorView& fused, const TensorView& topk_weights,
                                       const TensorView& topk_idx, const TensorView& out, Stream stream) {
  if (topk_idx.dtype == DType::int64)
    launch<false>(fused, nullptr, static_cast<const std::int64_t*>(topk_idx.data), topk_weights, out, stream);
  else
    launch<false>(fused, nullptr, static_cast<const std::int32_t*>(topk_idx.data), topk_weights, out, stream);
}

void weight_and_reduce_naive_batched_cuda(const TensorView& fused, const TensorView& topk_weights,
                                          const TensorView& slot_of, const TensorView& out, Stream stream) {
  launch<true>(fused, static_cast<const std::int32_t*>(slot_of.data), static_cast<const std::int32_t*>(nullptr),
               topk_weights, out, stream);
}

}  // namespace epmoe
