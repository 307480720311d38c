// The layout stage on CUDA (include/epmoe/layout.hpp, permute.hpp; the CPU twins are in layout/cpu.cpp), and
// the out-of-range id flags of semantics §11.
//
// Dispatch layout (semantics §3), one warp per token: lanes read the token's K ids, count them into a per-block
// shared histogram of experts, and OR the token's ranks into a bit mask (one __reduce_or_sync per 32 ranks),
// which gives is_token_in_rank and counts each token once per rank. Each block then adds its histograms to the
// global counts, zeroed by one memset. Integer counts do not depend on the order of the atomics, so the
// result is identical to the CPU's.
//
// Out-of-range ids (outside [-1, E)) are skipped and the smallest offending (t, k) with its value is kept in a
// device word per device (atomicMin of a packed key, core/id_flag.cuh); cuda::check_invalid_ids() reads it. A
// device word rather than host-mapped memory: system-scope atomics on mapped host memory are not
// available on every platform (hostNativeAtomicSupported), and the check synchronises anyway.
//
// Permute layout (a stable counting sort, three kernels): the M*K entries are cut into at most 64 chunks in
// row-major (m, k) order, one warp per chunk. (1) Each warp counts its chunk per expert. (2) One block
// turns the counts into per-chunk offsets (a scan over chunks per expert) and the padded segment starts
// (a scan over experts). (3) Each warp walks its chunk again 32 entries at a time; __match_any_sync
// finds the lanes with the same expert, and a lane's rank among them plus the warp's running count
// gives its row. Rows therefore keep the (m, k) order within an expert, exactly as on the CPU.
//
// Permute scatters: each block takes a slice of one source row, reads it once (16-byte vectors) and
// writes it to each of the row's destinations; extra blocks zero the padding rows. Unpermute gathers:
// each thread sums one 16-byte vector of an output row over its K expert rows in float32, k ascending,
// each product rounded before the add (__fmul_rn / __fadd_rn, never a fused multiply-add), as the CPU does.
#include <epmoe/permute.hpp>

#include <algorithm>
#include <mutex>
#include <string>

#include "core/bf16_device.cuh"
#include "core/cuda_util.hpp"
#include "core/id_flag.cuh"
#include "layout/layout.hpp"

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
            cuda_util::flag_bad_id(bad_flag, t, k, e);
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
  // + 16 bytes of slack past the counters (see kSharedSlack below).
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

// ---- permute layout -----------------------------------------------------------------------------

namespace {

constexpr int kMaxChunks = 64;
constexpr int kLayoutWarpsPerBlock = 4;
constexpr int kScanThreads = 1024;  // >= kMaxLocalExperts
// Extra bytes at the end of dynamic shared memory: compute-sanitizer once caught a 12-byte shared load
// starting at the last 4-byte element of an array (the tail of an unrolled loop, merged by ptxas).
constexpr std::size_t kSharedSlack = 16;

// Entries per chunk (a multiple of 32) so that there are at most kMaxChunks chunks.
std::int64_t chunk_size(std::int64_t n) {
  const std::int64_t c = std::max<std::int64_t>(256, cuda_util::ceil_div(cuda_util::ceil_div(n, kMaxChunks), 32) * 32);
  return c;
}

template <class Id>
__device__ __forceinline__ std::int64_t load_id(const Id* idx, std::int64_t i, int K, std::int64_t s0,
                                                std::int64_t s1) {
  const std::int64_t m = i / K, k = i - m * K;
  return static_cast<std::int64_t>(idx[m * s0 + k * s1]);
}

template <class Id>
__global__ void __launch_bounds__(kLayoutWarpsPerBlock * 32)
    count_chunks_kernel(const Id* __restrict__ idx, std::int64_t s0, std::int64_t s1, int K, std::int64_t n,
                        std::int64_t chunk, int num_chunks, int E, std::int32_t* __restrict__ counts) {
  extern __shared__ std::int32_t hist_all[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c = blockIdx.x * kLayoutWarpsPerBlock + warp;
  if (c >= num_chunks) return;
  std::int32_t* hist = hist_all + warp * E;
  for (int e = lane; e < E; e += 32) hist[e] = 0;
  __syncwarp();
  const std::int64_t begin = c * chunk, end = begin + chunk < n ? begin + chunk : n;
  for (std::int64_t i = begin + lane; i < end; i += 32) {
    const std::int64_t e = load_id(idx, i, K, s0, s1);
    if (e >= 0 && e < E) atomicAdd(&hist[e], 1);
  }
  __syncwarp();
  for (int e = lane; e < E; e += 32) counts[static_cast<std::int64_t>(c) * E + e] = hist[e];
}

// One block, thread e = expert e: exclusive scan of the expert's counts over the chunks (loads batched
// so they are in flight together; counts and offsets are separate arrays), the totals, then the padded
// segment starts (a scan over experts).
__global__ void __launch_bounds__(kScanThreads)
    scan_counts_kernel(const std::int32_t* __restrict__ counts, std::int32_t* __restrict__ offsets, int num_chunks,
                       int E, int alignment, std::int32_t* __restrict__ per_expert,
                       std::int64_t* __restrict__ seg_indptr) {
  constexpr int kBatch = 16;
  __shared__ std::int64_t padded_of[kScanThreads];
  __shared__ std::int64_t warp_sums[kScanThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x < E) {
    const int ex = threadIdx.x;
    std::int32_t run = 0;
    int c = 0;
    for (; c + kBatch <= num_chunks; c += kBatch) {
      std::int32_t v[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) v[j] = counts[static_cast<std::int64_t>(c + j) * E + ex];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        offsets[static_cast<std::int64_t>(c + j) * E + ex] = run;
        run += v[j];
      }
    }
    for (; c < num_chunks; ++c) {
      const std::int32_t v = counts[static_cast<std::int64_t>(c) * E + ex];
      offsets[static_cast<std::int64_t>(c) * E + ex] = run;
      run += v;
    }
    per_expert[ex] = run;
    padded_of[ex] = (static_cast<std::int64_t>(run) + alignment - 1) / alignment * alignment;
  }
  __syncthreads();
  // Exclusive scan of the padded sizes over the experts (thread e).
  const int e = threadIdx.x;
  const std::int64_t padded = e < E ? padded_of[e] : 0;
  std::int64_t incl = padded;
  for (int d = 1; d < 32; d <<= 1) {
    const std::int64_t v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    std::int64_t w = warp_sums[lane];
    for (int d = 1; d < 32; d <<= 1) {
      const std::int64_t v = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += v;
    }
    warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const std::int64_t before = (warp > 0 ? warp_sums[warp - 1] : 0) + incl - padded;
  if (e < E) seg_indptr[e] = before;
  if (e == E - 1) seg_indptr[E] = before + padded;
}

template <class Id>
__global__ void __launch_bounds__(kLayoutWarpsPerBlock * 32)
    assign_rows_kernel(const Id* __restrict__ idx, std::int64_t s0, std::int64_t s1, int K, std::int64_t n,
                       std::int64_t chunk, int num_chunks, int E, const std::int32_t* __restrict__ chunk_offsets,
                       const std::int64_t* __restrict__ seg_indptr, std::int32_t* __restrict__ src2dst,
                       std::int32_t* __restrict__ dst2src, std::int32_t* __restrict__ reorder,
                       unsigned long long* __restrict__ bad_flag) {
  extern __shared__ std::int64_t next_all[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c = blockIdx.x * kLayoutWarpsPerBlock + warp;
  if (c >= num_chunks) return;
  std::int64_t* next = next_all + warp * E;
  for (int e = lane; e < E; e += 32) next[e] = seg_indptr[e] + chunk_offsets[static_cast<std::int64_t>(c) * E + e];
  __syncwarp();
  const unsigned lower = (1u << lane) - 1u;
  const std::int64_t begin = c * chunk, end = begin + chunk < n ? begin + chunk : n;
  for (std::int64_t base = begin; base < end; base += 32) {
    const std::int64_t i = base + lane;
    int key = -2;  // past the end
    if (i < end) {
      const std::int64_t e = load_id(idx, i, K, s0, s1);
      if (e >= 0 && e < E) {
        key = static_cast<int>(e);
      } else {
        key = -1;
        if (e != -1) cuda_util::flag_bad_id(bad_flag, i / K, i % K, e);
      }
    }
    const unsigned peers = __match_any_sync(0xffffffffu, key);
    std::int64_t pos = -1;
    if (key >= 0) pos = next[key] + __popc(peers & lower);
    __syncwarp();
    if (key >= 0 && (peers & lower) == 0) next[key] += __popc(peers);  // the group's lowest lane advances it
    __syncwarp();
    if (i < end) {
      src2dst[i] = static_cast<std::int32_t>(pos);
      if (key >= 0) {
        dst2src[pos] = static_cast<std::int32_t>(i / K);
        reorder[pos] = key;
      }
    }
  }
}

template <class Id>
void launch_layout(const TensorView& topk_idx, int E, int alignment, const PermuteLayoutBuffers& out, cudaStream_t s) {
  const std::int64_t M = topk_idx.size(0);
  const int K = static_cast<int>(topk_idx.size(1));
  const std::int64_t n = M * K;
  const std::int64_t chunk = chunk_size(n);
  const int num_chunks = static_cast<int>(cuda_util::ceil_div(n, chunk));
  const int blocks = static_cast<int>(cuda_util::ceil_div(num_chunks, kLayoutWarpsPerBlock));
  const Id* idx = static_cast<const Id*>(topk_idx.data);
  auto* counts = static_cast<std::int32_t*>(out.workspace);
  std::int32_t* offsets = counts + static_cast<std::int64_t>(num_chunks) * E;
  // + kSharedSlack: ptxas may merge the last iterations' loads into one wider load past the end.
  const std::size_t count_smem =
      sizeof(std::int32_t) * kLayoutWarpsPerBlock * static_cast<std::size_t>(E) + kSharedSlack;
  count_chunks_kernel<Id><<<blocks, kLayoutWarpsPerBlock * 32, count_smem, s>>>(
      idx, topk_idx.stride(0), topk_idx.stride(1), K, n, chunk, num_chunks, E, counts);
  EPMOE_CUDA_CHECK_LAUNCH();
  scan_counts_kernel<<<1, kScanThreads, 0, s>>>(counts, offsets, num_chunks, E, alignment, out.num_tokens_per_expert,
                                                out.seg_indptr);
  EPMOE_CUDA_CHECK_LAUNCH();
  const std::size_t next_smem =
      sizeof(std::int64_t) * kLayoutWarpsPerBlock * static_cast<std::size_t>(E) + kSharedSlack;
  auto kernel = assign_rows_kernel<Id>;
  if (next_smem > 48 * 1024)
    EPMOE_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(next_smem)));
  kernel<<<blocks, kLayoutWarpsPerBlock * 32, next_smem, s>>>(
      idx, topk_idx.stride(0), topk_idx.stride(1), K, n, chunk, num_chunks, E, offsets, out.seg_indptr, out.src2dst,
      out.dst2src, out.reorder_topk_ids, bad_id_flag(IdCheck::permute, E));
  EPMOE_CUDA_CHECK_LAUNCH();
}

// ---- permute ------------------------------------------------------------------------------------

constexpr int kMaxTopk = 512;  // make_permute_layout's limit on K; sizes the static shared arrays below
constexpr int kCopyThreads = 128;

// Block (b, y): source row b (or, for b >= M, the padding rows of expert b - M), vectors
// [y * kCopyThreads * kUnroll, ...) of the row. Each thread loads kUnroll vectors, then stores them to
// every destination of the row.
template <int kUnroll>
__global__ void __launch_bounds__(kCopyThreads)
    permute_kernel(const char* __restrict__ x, std::int64_t x_stride, char* __restrict__ out, std::int64_t out_stride,
                   std::int64_t row_vecs, const std::int32_t* __restrict__ src2dst, int K, std::int64_t M,
                   const std::uint32_t* __restrict__ xs, std::int64_t xs_stride, std::uint32_t* __restrict__ os,
                   std::int64_t os_stride, int S, const std::int64_t* __restrict__ seg_indptr,
                   const std::int32_t* __restrict__ per_expert) {
  __shared__ std::int32_t dst[kMaxTopk];
  const std::int64_t b = blockIdx.x;
  const std::int64_t slice = static_cast<std::int64_t>(blockIdx.y) * kCopyThreads * kUnroll;
  if (b >= M) {
    // Padding rows of expert b - M: zero data and scales.
    const std::int64_t e = b - M;
    const std::int64_t first = seg_indptr[e] + per_expert[e], last = seg_indptr[e + 1];
    for (std::int64_t p = first; p < last; ++p) {
      uint4* row = reinterpret_cast<uint4*>(out + p * out_stride);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const std::int64_t v = slice + u * kCopyThreads + threadIdx.x;
        if (v < row_vecs) row[v] = make_uint4(0, 0, 0, 0);
      }
      if (blockIdx.y == 0)
        for (int j = threadIdx.x; j < S; j += kCopyThreads) os[p * os_stride + j] = 0;
    }
    return;
  }
  for (int k = threadIdx.x; k < K; k += kCopyThreads) dst[k] = src2dst[b * K + k];
  __syncthreads();
  const uint4* src = reinterpret_cast<const uint4*>(x + b * x_stride);
  uint4 r[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const std::int64_t v = slice + u * kCopyThreads + threadIdx.x;
    if (v < row_vecs) r[u] = __ldg(src + v);
  }
  for (int k = 0; k < K; ++k) {
    const std::int32_t d = dst[k];
    if (d < 0) continue;
    uint4* o = reinterpret_cast<uint4*>(out + static_cast<std::int64_t>(d) * out_stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::int64_t v = slice + u * kCopyThreads + threadIdx.x;
      if (v < row_vecs) o[v] = r[u];
    }
  }
  if (blockIdx.y == 0)
    for (int j = threadIdx.x; j < S; j += kCopyThreads) {
      const std::uint32_t val = xs[b * xs_stride + j];
      for (int k = 0; k < K; ++k)
        if (dst[k] >= 0) os[static_cast<std::int64_t>(dst[k]) * os_stride + j] = val;
    }
}

// ---- unpermute ----------------------------------------------------------------------------------

constexpr int kReduceThreads = 128;
constexpr int kReduceBatch = 8;  // expert rows loaded before they are added

struct Bf16x8 {
  static constexpr int kElems = 8;
  __device__ static void unpack(const uint4& v, float* f) { unpack_bf16x8(v, f); }
  __device__ static uint4 pack(const float* f) {
    std::uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = static_cast<std::uint32_t>(float_to_bf16(f[2 * i]).bits) |
             (static_cast<std::uint32_t>(float_to_bf16(f[2 * i + 1]).bits) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};
struct F32x4 {
  static constexpr int kElems = 4;
  __device__ static void unpack(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
  __device__ static uint4 pack(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
};

// Block (m, y): output row m, vectors [y * kReduceThreads, ...); one vector per thread, its K expert
// rows loaded kReduceBatch at a time before they are added in k order.
template <class V>
__global__ void __launch_bounds__(kReduceThreads)
    unpermute_kernel(const char* __restrict__ y, std::int64_t y_stride, char* __restrict__ out, std::int64_t out_stride,
                     std::int64_t row_vecs, const std::int32_t* __restrict__ src2dst, const float* __restrict__ w,
                     std::int64_t w_stride, int K) {
  __shared__ std::int32_t dst[kMaxTopk];
  __shared__ float weight[kMaxTopk];
  const std::int64_t m = blockIdx.x;
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    dst[k] = src2dst[m * K + k];
    weight[k] = w[m * w_stride + k];
  }
  __syncthreads();
  const std::int64_t v = static_cast<std::int64_t>(blockIdx.y) * kReduceThreads + threadIdx.x;
  if (v >= row_vecs) return;
  float acc[V::kElems];
#pragma unroll
  for (int i = 0; i < V::kElems; ++i) acc[i] = 0.0f;
  for (int k0 = 0; k0 < K; k0 += kReduceBatch) {
    uint4 r[kReduceBatch];
#pragma unroll
    for (int j = 0; j < kReduceBatch; ++j) {
      const int k = k0 + j;
      if (k < K && dst[k] >= 0)
        r[j] = __ldg(reinterpret_cast<const uint4*>(y + static_cast<std::int64_t>(dst[k]) * y_stride) + v);
    }
#pragma unroll
    for (int j = 0; j < kReduceBatch; ++j) {
      const int k = k0 + j;
      if (k < K && dst[k] >= 0) {
        float f[V::kElems];
        V::unpack(r[j], f);
        const float wk = weight[k];
#pragma unroll
        for (int i = 0; i < V::kElems; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(wk, f[i]));
      }
    }
  }
  reinterpret_cast<uint4*>(out + m * out_stride)[v] = V::pack(acc);
}

}  // namespace

std::size_t permute_layout_workspace_bytes(std::int64_t num_entries, int num_local_experts) {
  if (num_entries == 0) return 0;
  const std::int64_t chunks = cuda_util::ceil_div(num_entries, chunk_size(num_entries));
  // Per-chunk counts, then per-chunk offsets.
  return 2 * sizeof(std::int32_t) * static_cast<std::size_t>(chunks) * static_cast<std::size_t>(num_local_experts);
}

void make_permute_layout_cuda(const TensorView& topk_idx, int num_local_experts, int expert_alignment,
                              std::int64_t capacity, const PermuteLayoutBuffers& out, Stream stream) {
  cuda_util::DeviceGuard guard(topk_idx.device);
  const cudaStream_t s = cuda_util::to_cuda(stream);
  const std::int64_t n = topk_idx.size(0) * topk_idx.size(1);
  if (capacity > 0) {
    // -1 everywhere first: padding and unused rows stay -1, the assign kernel fills the rest.
    EPMOE_CUDA_CHECK(cudaMemsetAsync(out.dst2src, 0xff, sizeof(std::int32_t) * static_cast<std::size_t>(capacity), s));
    EPMOE_CUDA_CHECK(
        cudaMemsetAsync(out.reorder_topk_ids, 0xff, sizeof(std::int32_t) * static_cast<std::size_t>(capacity), s));
  }
  if (n == 0) {
    EPMOE_CUDA_CHECK(
        cudaMemsetAsync(out.seg_indptr, 0, sizeof(std::int64_t) * static_cast<std::size_t>(num_local_experts + 1), s));
    EPMOE_CUDA_CHECK(cudaMemsetAsync(out.num_tokens_per_expert, 0,
                                     sizeof(std::int32_t) * static_cast<std::size_t>(num_local_experts), s));
    return;
  }
  if (topk_idx.dtype == DType::int64)
    launch_layout<std::int64_t>(topk_idx, num_local_experts, expert_alignment, out, s);
  else
    launch_layout<std::int32_t>(topk_idx, num_local_experts, expert_alignment, out, s);
}

void permute_cuda(const TensorView& x, const TensorView& x_scales, const PermuteLayout& layout, const TensorView& out,
                  const TensorView& out_scales, Stream stream) {
  cuda_util::DeviceGuard guard(x.device);
  const std::int64_t M = layout.num_tokens;
  const bool padding = layout.expert_alignment > 1;
  const std::int64_t rows = M + (padding ? layout.num_local_experts : 0);
  if (rows == 0 || layout.num_topk == 0) return;
  const auto elem = static_cast<std::int64_t>(dtype_size(x.dtype));
  const std::int64_t row_vecs = x.size(1) * elem / 16;
  const int S = x_scales.defined() ? static_cast<int>(x_scales.size(1)) : 0;
  const int K = layout.num_topk;
  const cudaStream_t s = cuda_util::to_cuda(stream);
  auto launch = [&](auto kernel, int unroll) {
    const dim3 grid(static_cast<unsigned>(rows),
                    static_cast<unsigned>(cuda_util::ceil_div(row_vecs, kCopyThreads * unroll)));
    kernel<<<grid, kCopyThreads, 0, s>>>(
        static_cast<const char*>(x.data), x.stride(0) * elem, static_cast<char*>(out.data), out.stride(0) * elem,
        row_vecs, layout.src2dst.ptr<std::int32_t>(), K, M,
        S ? static_cast<const std::uint32_t*>(x_scales.data) : nullptr, S ? x_scales.stride(0) : 0,
        S ? static_cast<std::uint32_t*>(out_scales.data) : nullptr, S ? out_scales.stride(0) : 0, S,
        layout.seg_indptr.ptr<std::int64_t>(), layout.num_tokens_per_expert.ptr<std::int32_t>());
  };
  // Many rows: several vectors per thread in flight. Few rows (decode): one per thread, more blocks.
  if (M >= 1024)
    launch(permute_kernel<4>, 4);
  else
    launch(permute_kernel<1>, 1);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void unpermute_cuda(const TensorView& y, const PermuteLayout& layout, const TensorView& topk_weights,
                    const TensorView& out, Stream stream) {
  cuda_util::DeviceGuard guard(y.device);
  const std::int64_t M = layout.num_tokens;
  if (M == 0) return;
  const auto elem = static_cast<std::int64_t>(dtype_size(y.dtype));
  const std::int64_t row_vecs = y.size(1) * elem / 16;
  const int K = layout.num_topk;
  const cudaStream_t s = cuda_util::to_cuda(stream);
  const dim3 grid(static_cast<unsigned>(M), static_cast<unsigned>(cuda_util::ceil_div(row_vecs, kReduceThreads)));
  auto launch = [&](auto kernel) {
    kernel<<<grid, kReduceThreads, 0, s>>>(static_cast<const char*>(y.data), y.stride(0) * elem,
                                           static_cast<char*>(out.data), out.stride(0) * elem, row_vecs,
                                           layout.src2dst.ptr<std::int32_t>(),
                                           static_cast<const float*>(topk_weights.data), topk_weights.stride(0), K);
  };
  if (y.dtype == DType::bf16)
    launch(unpermute_kernel<Bf16x8>);
  else
    launch(unpermute_kernel<F32x4>);
  EPMOE_CUDA_CHECK_LAUNCH();
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
    const cuda_util::BadId bad = cuda_util::decode_bad_id(keys[kind]);
    throw_invalid_argument("topk_idx", "expert ids in [-1, " + std::to_string(bound) + ")",
                           bad.value_text() + " at [" + std::to_string(bad.t) + ", " + std::to_string(bad.k) + "]");
  }
}

}  // namespace cuda

}  // namespace epmoe
