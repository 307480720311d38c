// The MoE stage's CUDA kernels: the no-EP prepare (see cuda.hpp) with semantics §11's host-mapped fault record, and
// TopKWeightAndReduce (semantics §8, weight_and_reduce.hpp), the twin of cpu.cpp's.
//
// The fault record lives in page-locked host memory mapped into the device's address space, so the host
// reads it at any time without a synchronisation or a copy, and kernels replayed from a CUDA graph write
// it like any other. The exact first offender ([t, k] and value) still goes to the per-device word of
// core/id_flag.cuh (an atomicMin, which host-mapped memory cannot do portably), read by
// cuda::check_invalid_ids() once the record says there is something to read.
#include <mutex>
#include <string>

#include "core/bf16_device.cuh"
#include "core/cuda_util.hpp"
#include "core/id_flag.cuh"
#include "layout/layout.hpp"
#include "moe/cuda.hpp"
#include "moe/weight_and_reduce.hpp"

namespace epmoe::moe_cuda {

namespace {

constexpr int kMaxDevices = 64;
constexpr int kMaxTopk = 512;     // K limit of the no-EP path on CUDA (checked on the host)
constexpr int kCopyThreads = 128;

struct RecordTable {
  std::mutex mutex;
  FaultRecord* host[kMaxDevices] = {};
  FaultRecord* device[kMaxDevices] = {};
};
RecordTable& records() {
  static RecordTable table;
  return table;
}

__device__ __forceinline__ void raise_invalid_id(FaultRecord* r) {
  *reinterpret_cast<volatile std::uint32_t*>(&r->invalid_id) = 1u;
  __threadfence_system();
}

// Histogram in shared memory when E fits (E * 4 bytes), else straight into global memory.
template <class Id>
__global__ void count_ids_kernel(const Id* __restrict__ idx, std::int64_t n, int K, int E, bool shared_hist,
                                 std::int32_t* __restrict__ counts, FaultRecord* record,
                                 unsigned long long* __restrict__ bad_word) {
  extern __shared__ std::int32_t hist[];
  std::int32_t* h = shared_hist ? hist : counts;
  if (shared_hist) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
    __syncthreads();
  }
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t e = static_cast<std::int64_t>(idx[i]);
    if (e >= 0 && e < E) {
      atomicAdd(&h[e], 1);
    } else if (e != -1) {
      cuda_util::flag_bad_id(bad_word, i / K, i % K, e);
      raise_invalid_id(record);
    }
  }
  if (shared_hist) {
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      if (hist[e]) atomicAdd(&counts[e], hist[e]);
  }
}

// Block (m, y): token m, 16-byte vectors [y * kCopyThreads, ...) of its row.
template <class Id>
__global__ void __launch_bounds__(kCopyThreads)
    scatter_kernel(const uint4* __restrict__ x, std::int64_t row_vecs, const Id* __restrict__ idx, int K, int E,
                   const std::int32_t* __restrict__ src2dst, const std::int64_t* __restrict__ seg_indptr,
                   const std::int32_t* __restrict__ reorder, std::int64_t max_tokens, uint4* __restrict__ slabs,
                   std::int32_t* __restrict__ slot_of, FaultRecord* record) {
  __shared__ std::int64_t dst[kMaxTopk];
  const std::int64_t m = blockIdx.x;
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    const std::int64_t i = m * K + k;
    const std::int32_t d = src2dst[i];
    std::int64_t row = -1;
    if (d >= 0) {
      const std::int32_t e = reorder[d];
      const std::int64_t slot = d - seg_indptr[e];
      if (slot < max_tokens) row = e * max_tokens + slot;  // else dropped: the counts kernel flags it
    } else {
      const std::int64_t e = static_cast<std::int64_t>(idx[i]);
      if (e != -1 && (e < 0 || e >= E)) raise_invalid_id(record);
    }
    dst[k] = row;
    if (blockIdx.y == 0) slot_of[i] = static_cast<std::int32_t>(row);
  }
  __syncthreads();
  const std::int64_t v = static_cast<std::int64_t>(blockIdx.y) * kCopyThreads + threadIdx.x;
  if (v >= row_vecs) return;
  const uint4 r = __ldg(x + m * row_vecs + v);
  for (int k = 0; k < K; ++k)
    if (dst[k] >= 0) slabs[dst[k] * row_vecs + v] = r;
}

__global__ void clamp_counts_kernel(const std::int32_t* __restrict__ per_expert, int E, std::int64_t max_tokens,
                                    std::int32_t* __restrict__ counts, FaultRecord* record) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  const std::int32_t c = per_expert[e];
  if (c > max_tokens) {
    volatile FaultRecord* r = record;
    r->overflow_expert = e;
    r->overflow_count = c;
    r->overflow_limit = static_cast<std::int32_t>(max_tokens);
    __threadfence_system();
    r->overflow = 1u;
    __threadfence_system();
  }
  counts[e] = c < max_tokens ? c : static_cast<std::int32_t>(max_tokens);
}

__global__ void fill_kernel(float* __restrict__ p, std::int64_t n, float value) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    p[i] = value;
}

__global__ void fill_int32_kernel(std::int32_t* __restrict__ p, std::int64_t n, std::int32_t value) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    p[i] = value;
}

}  // namespace

FaultRecord* fault_record_for_kernels() {
  int device = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices)
    throw Error(ErrorCode::unsupported, "epmoe: CUDA device index " + std::to_string(device) + " >= 64");
  RecordTable& t = records();
  std::lock_guard<std::mutex> lock(t.mutex);
  if (t.device[device] == nullptr) {
    void* host = nullptr;
    EPMOE_CUDA_CHECK(cudaHostAlloc(&host, sizeof(FaultRecord), cudaHostAllocMapped | cudaHostAllocPortable));
    *static_cast<FaultRecord*>(host) = FaultRecord{0u, 0u, -1, 0, 0};
    void* dev = nullptr;
    EPMOE_CUDA_CHECK(cudaHostGetDevicePointer(&dev, host, 0));
    t.host[device] = static_cast<FaultRecord*>(host);
    t.device[device] = static_cast<FaultRecord*>(dev);
  }
  return t.device[device];
}

volatile FaultRecord* fault_record_host(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  RecordTable& t = records();
  std::lock_guard<std::mutex> lock(t.mutex);
  return t.host[device];
}

void count_ids(const TensorView& topk_idx, int num_experts, std::int32_t* counts, Stream stream) {
  const cudaStream_t s = cuda_util::to_cuda(stream);
  EPMOE_CUDA_CHECK(cudaMemsetAsync(counts, 0, sizeof(std::int32_t) * static_cast<std::size_t>(num_experts), s));
  const std::int64_t n = topk_idx.numel();
  if (n == 0) return;
  FaultRecord* record = fault_record_for_kernels();
  unsigned long long* word = layout_detail::bad_id_flag(layout_detail::IdCheck::permute, num_experts);
  const int K = static_cast<int>(topk_idx.size(1));
  const bool shared_hist = num_experts <= 12 * 1024;
  const std::size_t smem = shared_hist ? sizeof(std::int32_t) * static_cast<std::size_t>(num_experts) : 0;
  constexpr int kThreads = 256;
  const int blocks = static_cast<int>(
      std::min<std::int64_t>(cuda_util::ceil_div(n, kThreads), static_cast<std::int64_t>(cuda_util::num_sms()) * 2));
  auto launch = [&](auto kernel, const auto* idx) {
    if (smem > 48 * 1024)
      EPMOE_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    kernel<<<blocks, kThreads, smem, s>>>(idx, n, K, num_experts, shared_hist, counts, record, word);
  };
  if (topk_idx.dtype == DType::int64)
    launch(count_ids_kernel<std::int64_t>, static_cast<const std::int64_t*>(topk_idx.data));
  else
    launch(count_ids_kernel<std::int32_t>, static_cast<const std::int32_t*>(topk_idx.data));
  EPMOE_CUDA_CHECK_LAUNCH();
}

void scatter_to_slabs(const TensorView& x, const TensorView& topk_idx, const std::int32_t* src2dst,
                      const std::int64_t* seg_indptr, const std::int32_t* reorder, const std::int32_t* per_expert,
                      int num_experts, std::int64_t max_tokens, void* slabs, std::int32_t* slot_of,
                      std::int32_t* counts, Stream stream) {
  const cudaStream_t s = cuda_util::to_cuda(stream);
  FaultRecord* record = fault_record_for_kernels();
  constexpr int kCountThreads = 256;
  clamp_counts_kernel<<<static_cast<unsigned>(cuda_util::ceil_div(num_experts, kCountThreads)), kCountThreads, 0, s>>>(
      per_expert, num_experts, max_tokens, counts, record);
  EPMOE_CUDA_CHECK_LAUNCH();
  const std::int64_t M = x.size(0), H = x.size(1);
  const int K = static_cast<int>(topk_idx.size(1));
  if (M == 0 || K == 0) return;
  const std::int64_t row_vecs = H * static_cast<std::int64_t>(sizeof(bf16_t)) / 16;
  const dim3 grid(static_cast<unsigned>(M), static_cast<unsigned>(cuda_util::ceil_div(row_vecs, kCopyThreads)));
  auto launch = [&](auto kernel, const auto* idx) {
    kernel<<<grid, kCopyThreads, 0, s>>>(static_cast<const uint4*>(x.data), row_vecs, idx, K, num_experts, src2dst,
                                         seg_indptr, reorder, max_tokens, static_cast<uint4*>(slabs), slot_of, record);
  };
  if (topk_idx.dtype == DType::int64)
    launch(scatter_kernel<std::int64_t>, static_cast<const std::int64_t*>(topk_idx.data));
  else
    launch(scatter_kernel<std::int32_t>, static_cast<const std::int32_t*>(topk_idx.data));
  EPMOE_CUDA_CHECK_LAUNCH();
}

void fill(float* p, std::int64_t n, float value, Stream stream) {
  if (n == 0) return;
  constexpr int kThreads = 256;
  const int blocks = static_cast<int>(std::min<std::int64_t>(cuda_util::ceil_div(n, kThreads), 1024));
  fill_kernel<<<blocks, kThreads, 0, cuda_util::to_cuda(stream)>>>(p, n, value);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void fill_int32(std::int32_t* p, std::int64_t n, std::int32_t value, Stream stream) {
  if (n == 0) return;
  constexpr int kThreads = 256;
  const int blocks = static_cast<int>(std::min<std::int64_t>(cuda_util::ceil_div(n, kThreads), 1024));
  fill_int32_kernel<<<blocks, kThreads, 0, cuda_util::to_cuda(stream)>>>(p, n, value);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void copy(void* dst, const void* src, std::size_t bytes, Stream stream) {
  if (bytes == 0) return;
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cuda_util::to_cuda(stream)));
}

}  // namespace epmoe::moe_cuda

// ---- TopKWeightAndReduce ------------------------------------------------------------------------
//
// Block (m, y): output row m, 16-byte vectors [y * kReduceThreads, ...); each thread sums its 8 bf16 channels over
// the K choices in k order, each product rounded before the add (__fmul_rn / __fadd_rn: never a fused
// multiply-add, which the CPU loop does not use either), and rounds once to bf16.
namespace epmoe {

namespace {

constexpr int kReduceThreads = 128;
constexpr int kMaxTopk = 512;  // K limit of the CUDA TopKWeightAndReduce (the shared arrays below)

// kSlots: rows[m*K + k] gives the fused row of choice (m, k) (NaiveBatched); else the row is m*K + k when
// topk_idx[m, k] >= 0 (Contiguous).
template <bool kSlots, class Id>
__global__ void __launch_bounds__(kReduceThreads)
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
  const std::int64_t v = static_cast<std::int64_t>(blockIdx.y) * kReduceThreads + threadIdx.x;
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
void launch_reduce(const TensorView& fused, const std::int32_t* rows, const Id* idx, const TensorView& topk_weights,
            const TensorView& out, Stream stream) {
  const std::int64_t M = out.size(0), H = out.size(1);
  const int K = static_cast<int>(topk_weights.size(1));
  if (M == 0) return;
  if (K > kMaxTopk) throw_invalid_argument("topk_weights", "K <= 512 on CUDA", std::to_string(K));
  const std::int64_t row_vecs = H * static_cast<std::int64_t>(sizeof(bf16_t)) / 16;
  const dim3 grid(static_cast<unsigned>(M), static_cast<unsigned>(cuda_util::ceil_div(row_vecs, kReduceThreads)));
  reduce_kernel<kSlots, Id><<<grid, kReduceThreads, 0, cuda_util::to_cuda(stream)>>>(
      static_cast<const uint4*>(fused.data), row_vecs, rows, idx, static_cast<const float*>(topk_weights.data), K,
      static_cast<uint4*>(out.data));
  EPMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void weight_and_reduce_contiguous_cuda(const TensorView& fused, const TensorView& topk_weights,
                                       const TensorView& topk_idx, const TensorView& out, Stream stream) {
  if (topk_idx.dtype == DType::int64)
    launch_reduce<false>(fused, nullptr, static_cast<const std::int64_t*>(topk_idx.data), topk_weights, out, stream);
  else
    launch_reduce<false>(fused, nullptr, static_cast<const std::int32_t*>(topk_idx.data), topk_weights, out, stream);
}

void weight_and_reduce_naive_batched_cuda(const TensorView& fused, const TensorView& topk_weights,
                                          const TensorView& slot_of, const TensorView& out, Stream stream) {
  launch_reduce<true>(fused, static_cast<const std::int32_t*>(slot_of.data), static_cast<const std::int32_t*>(nullptr),
               topk_weights, out, stream);
}

}  // namespace epmoe
