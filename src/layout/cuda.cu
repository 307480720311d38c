// Dispatch layout on CUDA (SPEC 3), and the out-of-range id flags of SPEC 11.
//
// One warp per token: lanes read the token's K ids, count them into a per-block shared histogram of
// experts, and OR the token's ranks into a bit mask (one __reduce_or_sync per 32 ranks), which gives
// is_token_in_rank and counts each token once per rank. Each block then adds its histograms to the
// global counts, zeroed by one memset. Integer counts do not depend on the order of the atomics, so the
// result is identical to the CPU's.
//
// Out-of-range ids (outside [-1, E)) are skipped and the smallest offending (t, k) with its value is
// kept in a device word per device (atomicMin of a packed key); cuda::check_invalid_ids() reads it. A
// device word rather than host-mapped memory: system-scope atomics on mapped host memory are not
// available on every platform (hostNativeAtomicSupported), and the check synchronises anyway.
#include <epmoe/permute.hpp>

#include <mutex>
#include <string>

#include "layout/cuda.hpp"
#include "core/cuda_util.hpp"
#include "layout/id_flag.cuh"

namespace epmoe {

namespace layout_detail {

namespace {

constexpr int kMaxDevices = 64;

struct FlagTable {
  std::mutex mutex;
  unsigned long long* flags[kMaxDevices] = {};  // kNumIdChecks words per device
  std::int64_t bounds[kMaxDevices][kNumIdChecks] = {};
};
FlagTable& flag_table() {
  static FlagTable table;
  return table;
}

unsigned long long* device_flags(int device, bool allocate) {
  FlagTable& table = flag_table();
  std::lock_guard<std::mutex> lock(table.mutex);
  if (device < 0 || device >= kMaxDevices)
    throw Error(ErrorCode::unsupported, "epmoe: CUDA device index " + std::to_string(device) + " >= 64");
  if (!table.flags[device] && allocate) {
    void* p = nullptr;
    EPMOE_CUDA_CHECK(cudaMalloc(&p, sizeof(unsigned long long) * kNumIdChecks));
    // Synchronous on purpose: once, before any kernel can use the flag.
    EPMOE_CUDA_CHECK(cudaMemset(p, 0xff, sizeof(unsigned long long) * kNumIdChecks));
    table.flags[device] = static_cast<unsigned long long*>(p);
  }
  return table.flags[device];
}

constexpr int kLayoutWarps = 8;                   // warps (tokens in flight) per block
constexpr int kLayoutSharedCounters = 12 * 1024;  // E + R int32 counters kept in shared memory (48 KB)

template <class Id>
__global__ void __launch_bounds__(kLayoutWarps * 32)
    dispatch_layout_kernel(const Id* __restrict__ idx, std::int64_t stride_t, std::int64_t stride_k, std::int64_t T,
                           int K, int E, int R, int experts_per_rank, std::int32_t* __restrict__ per_rank,
                           std::int32_t* __restrict__ per_expert, bool* __restrict__ in_rank,
                           unsigned long long* __restrict__ bad_flag, bool shared_counts) {
  extern __shared__ std::int32_t counters[];  // [E] experts, then [R] ranks (when shared_counts)
  std::int32_t* expert_count = shared_counts ? counters : per_expert;
  std::int32_t* rank_count = shared_counts ? counters + E : per_rank;
  if (shared_counts) {
    for (int i = threadIdx.x; i < E + R; i += blockDim.x) counters[i] = 0;
    __syncthreads();
  }
  const int lane = threadIdx.x & 31;
  const std::int64_t warp = blockIdx.x * static_cast<std::int64_t>(kLayoutWarps) + (threadIdx.x >> 5);
  const std::int64_t num_warps = static_cast<std::int64_t>(gridDim.x) * kLayoutWarps;
  const int rank_words = (R + 31) / 32;
  for (std::int64_t t = warp; t < T; t += num_warps) {
    bool* row = in_rank + t * R;
    for (int w = 0; w < rank_words; ++w) {
      unsigned mask = 0;
      for (int k0 = 0; k0 < K; k0 += 32) {
        const int k = k0 + lane;
        int rank = -1;
        if (k < K) {
          const std::int64_t e = static_cast<std::int64_t>(idx[t * stride_t + k * stride_k]);
          if (e >= 0 && e < E) {
            rank = static_cast<int>(e) / experts_per_rank;
            if (w == 0) atomicAdd(&expert_count[e], 1);  // one count per (token, expert) entry
          } else if (e != -1 && w == 0) {
            flag_bad_id(bad_flag, t, k, e);
          }
        }
        const unsigned bit = (rank >= 0 && (rank >> 5) == w) ? (1u << (rank & 31)) : 0u;
        mask |= __reduce_or_sync(0xffffffffu, bit);
      }
      const int r = w * 32 + lane;
      if (r < R) {
        const bool in = (mask >> lane) & 1u;
        row[r] = in;
        if (in) atomicAdd(&rank_count[r], 1);  // a token counts once per rank
      }
    }
  }
  if (shared_counts) {
    __syncthreads();
    for (int i = threadIdx.x; i < E; i += blockDim.x)
      if (counters[i]) atomicAdd(&per_expert[i], counters[i]);
    for (int i = threadIdx.x; i < R; i += blockDim.x)
      if (counters[E + i]) atomicAdd(&per_rank[i], counters[E + i]);
  }
}

}  // namespace

unsigned long long* bad_id_flag(IdCheck kind, std::int64_t bound) {
  int device = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&device));
  unsigned long long* flags = device_flags(device, true);
  {
    FlagTable& table = flag_table();
    std::lock_guard<std::mutex> lock(table.mutex);
    table.bounds[device][static_cast<int>(kind)] = bound;
  }
  return flags + static_cast<int>(kind);
}

void dispatch_layout_cuda(const TensorView& topk_idx, int num_experts, int num_ranks, std::int32_t* per_rank,
                          std::int32_t* per_expert, bool* in_rank, Stream stream) {
  cuda_util::DeviceGuard guard(topk_idx.device);
  const cudaStream_t s = cuda_util::to_cuda(stream);
  const std::int64_t T = topk_idx.size(0);
  const int K = static_cast<int>(topk_idx.size(1));
  EPMOE_CUDA_CHECK(cudaMemsetAsync(per_rank, 0, sizeof(std::int32_t) * static_cast<std::size_t>(num_ranks), s));
  EPMOE_CUDA_CHECK(cudaMemsetAsync(per_expert, 0, sizeof(std::int32_t) * static_cast<std::size_t>(num_experts), s));
  if (T == 0 || K == 0) return;  // counts are zero, is_token_in_rank is empty
  unsigned long long* flag = bad_id_flag(IdCheck::dispatch_layout, num_experts);
  const bool shared_counts = num_experts + num_ranks <= kLayoutSharedCounters;
  // + 16 bytes of slack past the counters (see kSharedSlack in permute.cu).
  const std::size_t smem =
      shared_counts ? sizeof(std::int32_t) * static_cast<std::size_t>(num_experts + num_ranks) + 16 : 0;
  // Enough blocks to fill the GPU, few enough that each block's histogram flush is amortised over
  // several tokens per warp.
  const std::int64_t max_blocks = static_cast<std::int64_t>(cuda_util::num_sms()) * 8;
  const int blocks = static_cast<int>(std::min<std::int64_t>(cuda_util::ceil_div(T, kLayoutWarps), max_blocks));
  const int epr = num_experts / num_ranks;
  if (topk_idx.dtype == DType::int64) {
    if (smem > 48 * 1024)
      EPMOE_CUDA_CHECK(cudaFuncSetAttribute(dispatch_layout_kernel<std::int64_t>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    dispatch_layout_kernel<std::int64_t><<<blocks, kLayoutWarps * 32, smem, s>>>(
        static_cast<const std::int64_t*>(topk_idx.data), topk_idx.stride(0), topk_idx.stride(1), T, K, num_experts,
        num_ranks, epr, per_rank, per_expert, in_rank, flag, shared_counts);
  } else {
    if (smem > 48 * 1024)
      EPMOE_CUDA_CHECK(cudaFuncSetAttribute(dispatch_layout_kernel<std::int32_t>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    dispatch_layout_kernel<std::int32_t><<<blocks, kLayoutWarps * 32, smem, s>>>(
        static_cast<const std::int32_t*>(topk_idx.data), topk_idx.stride(0), topk_idx.stride(1), T, K, num_experts,
        num_ranks, epr, per_rank, per_expert, in_rank, flag, shared_counts);
  }
  EPMOE_CUDA_CHECK_LAUNCH();
}

DispatchLayout get_dispatch_layout_cuda(const TensorView& topk_idx, int num_experts, int num_ranks) {
  const Device device = topk_idx.device;
  const std::int64_t T = topk_idx.size(0);
  // One allocation for both count vectors.
  Tensor counts = Tensor::empty(DType::int32, {static_cast<std::int64_t>(num_ranks) + num_experts}, device);
  DispatchLayout out;
  auto* base = counts.ptr<std::int32_t>();
  auto keep = std::shared_ptr<void>(counts.data(), [counts](void*) {});
  out.num_tokens_per_rank = Tensor::wrap(TensorView(base, DType::int32, {num_ranks}, device), keep);
  out.num_tokens_per_expert = Tensor::wrap(TensorView(base + num_ranks, DType::int32, {num_experts}, device), keep);
  out.is_token_in_rank = Tensor::empty(DType::boolean, {T, num_ranks}, device);
  dispatch_layout_cuda(topk_idx, num_experts, num_ranks, base, base + num_ranks, out.is_token_in_rank.ptr<bool>(),
                       current_stream());
  return out;
}

}  // namespace layout_detail

namespace cuda {

void check_invalid_ids(Stream stream) {
  int device = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&device));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(cuda_util::to_cuda(stream)));
  unsigned long long* flags = layout_detail::device_flags(device, false);
  if (!flags) return;  // no kernel that checks ids ever ran on this device
  unsigned long long keys[layout_detail::kNumIdChecks];
  EPMOE_CUDA_CHECK(cudaMemcpy(keys, flags, sizeof keys, cudaMemcpyDeviceToHost));
  EPMOE_CUDA_CHECK(cudaMemset(flags, 0xff, sizeof keys));
  for (int kind = 0; kind < layout_detail::kNumIdChecks; ++kind) {
    if (keys[kind] == ~0ull) continue;
    std::int64_t bound = 0;
    {
      auto& table = layout_detail::flag_table();
      std::lock_guard<std::mutex> lock(table.mutex);
      bound = table.bounds[device][kind];
    }
    const layout_detail::BadId bad = layout_detail::decode_bad_id(keys[kind]);
    throw_invalid_argument("topk_idx", "expert ids in [-1, " + std::to_string(bound) + ")",
                           bad.value_text() + " at [" + std::to_string(bad.t) + ", " + std::to_string(bad.k) + "]");
  }
}

}  // namespace cuda

}  // namespace epmoe
