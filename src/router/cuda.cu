// CUDA router (semantics §2): topk_softmax, topk_sigmoid and grouped_topk, bit-identical to router/cpu.cpp.
//
// One warp per token, its row of scores in shared memory. Every float32 operation of the CPU code is
// done in the same order: the softmax sum runs in one lane over e ascending; exp is score_exp (the same
// bits on host and device); the max is exact whatever the order. Selection is K rounds of a warp
// argmax under the CPU TopK's total order (key descending, then id ascending, NaN as -inf), which
// yields exactly the CPU's ordered list. Group scores (a max or a top-2 sum over one group) are
// computed serially by one lane per group, like the CPU's loops.
#include <cfloat>
#include <climits>
#include <string>

#include "core/cuda_util.hpp"
#include "router/router.hpp"
#include "router/score_math.hpp"

namespace epmoe::router_detail {

namespace {

struct Candidate {
  float key;
  int id;
};

__device__ __forceinline__ float select_key(float v) { return v != v ? -INFINITY : v; }
__device__ __forceinline__ bool better(const Candidate& a, const Candidate& b) {
  return a.key > b.key || (a.key == b.key && a.id < b.id);
}
__device__ __forceinline__ Candidate warp_best(Candidate c) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) {
    Candidate o{__shfl_xor_sync(0xffffffffu, c.key, off), __shfl_xor_sync(0xffffffffu, c.id, off)};
    if (better(o, c)) c = o;
  }
  return c;
}

// Per-warp scratch, carved from dynamic shared memory (offsets in bytes, 16-aligned).
struct Scratch {
  int score, biased, chosen, group_score, group_kept, picked, bytes;
};
__host__ __device__ inline int align16(int v) { return (v + 15) / 16 * 16; }
__host__ __device__ inline Scratch scratch_layout(int E, int G, int K, bool bias) {
  Scratch s{};
  int o = 0;
  s.score = o;
  o += align16(4 * E);
  s.biased = o;
  o += bias ? align16(4 * E) : 0;
  s.chosen = o;
  o += align16(E);
  s.group_score = o;
  o += align16(4 * G);
  s.group_kept = o;
  o += align16(G);
  s.picked = o;
  o += align16(4 * K);
  s.bytes = o + 16;  // slack: ptxas may merge a loop's last loads into one wider load past an array's end
  return s;
}

struct Params {
  const void* logits;
  bool bf16;
  std::int64_t T;
  int E, K, G, topk_group;
  bool softmax, renormalize, has_bias;
  float scaling;
  const float* bias;
  float* weights;
  std::int64_t* ids;
  int warps_per_block;
};

__global__ void route_kernel(Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const Scratch L = scratch_layout(p.E, p.G, p.K, p.has_bias);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * p.warps_per_block + warp;
  if (t >= p.T) return;
  unsigned char* base = smem + static_cast<std::size_t>(warp) * L.bytes;
  float* s = reinterpret_cast<float*>(base + L.score);
  float* sel = p.has_bias ? reinterpret_cast<float*>(base + L.biased) : s;
  unsigned char* chosen = base + L.chosen;
  float* group_score = reinterpret_cast<float*>(base + L.group_score);
  unsigned char* group_kept = base + L.group_kept;
  int* picked = reinterpret_cast<int*>(base + L.picked);
  const int E = p.E;

  // Scores.
  for (int e = lane; e < E; e += 32) {
    s[e] = p.bf16 ? bf16_to_float(bf16_t{static_cast<const std::uint16_t*>(p.logits)[t * E + e]})
                  : static_cast<const float*>(p.logits)[t * E + e];
    chosen[e] = 0;
  }
  __syncwarp();
  if (p.softmax) {
    // CPU: m = s[0], then m = s[e] > m ? s[e] : m: the largest non-NaN value, or NaN when s[0] is NaN.
    float m = -INFINITY;
    for (int e = lane; e < E; e += 32) m = s[e] > m ? s[e] : m;
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) {
      const float o = __shfl_xor_sync(0xffffffffu, m, off);
      m = o > m ? o : m;
    }
    if (s[0] != s[0]) m = s[0];
    for (int e = lane; e < E; e += 32) s[e] = score_exp(s[e] - m);
    __syncwarp();
    float sum = 0.0f;
    if (lane == 0)
      for (int e = 0; e < E; ++e) sum += s[e];  // ascending e, as the CPU sums
    sum = __shfl_sync(0xffffffffu, sum, 0);
    for (int e = lane; e < E; e += 32) s[e] = s[e] / sum;
  } else {
    for (int e = lane; e < E; e += 32) s[e] = score_sigmoid(s[e]);
  }
  if (p.has_bias)
    for (int e = lane; e < E; e += 32) sel[e] = s[e] + p.bias[e];
  __syncwarp();

  // Groups.
  const int G = p.G, group_size = E / G;
  const bool grouped = p.topk_group < G;
  if (grouped) {
    for (int g = lane; g < G; g += 32) {
      const float* v = sel + g * group_size;
      if (p.has_bias) {
        Candidate b1{-INFINITY, INT_MAX}, b2{-INFINITY, INT_MAX};
        for (int i = 0; i < group_size; ++i) {
          const Candidate c{select_key(v[i]), i};
          if (better(c, b1)) {
            b2 = b1;
            b1 = c;
          } else if (better(c, b2)) {
            b2 = c;
          }
        }
        group_score[g] = v[b1.id] + v[b2.id];
      } else {
        float m = v[0];
        for (int i = 1; i < group_size; ++i) m = v[i] > m ? v[i] : m;
        group_score[g] = m;
      }
      group_kept[g] = 0;
    }
    __syncwarp();
    for (int round = 0; round < p.topk_group; ++round) {
      Candidate c{-INFINITY, INT_MAX};
      for (int g = lane; g < G; g += 32) {
        const Candidate o{select_key(group_score[g]), g};
        if (!group_kept[g] && better(o, c)) c = o;
      }
      c = warp_best(c);
      if (lane == 0) group_kept[c.id] = 1;
      __syncwarp();
    }
  }

  // Experts: K rounds of argmax.
  for (int k = 0; k < p.K; ++k) {
    Candidate c{-INFINITY, INT_MAX};
    for (int e = lane; e < E; e += 32) {
      if (chosen[e] || (grouped && !group_kept[e / group_size])) continue;
      const Candidate o{select_key(sel[e]), e};
      if (better(o, c)) c = o;
    }
    c = warp_best(c);
    if (lane == 0) {
      chosen[c.id] = 1;
      picked[k] = c.id;
    }
    __syncwarp();
  }

  // Weights: the unbiased scores, summed in k order, then renormalised and scaled as on the CPU.
  float sum = 0.0f;
  if (lane == 0)
    for (int k = 0; k < p.K; ++k) sum += s[picked[k]];
  sum = __shfl_sync(0xffffffffu, sum, 0);
  for (int k = lane; k < p.K; k += 32) {
    float w = s[picked[k]];
    if (p.renormalize) w = w / sum;
    if (p.scaling != 1.0f) w *= p.scaling;
    p.weights[t * p.K + k] = w;
    p.ids[t * p.K + k] = picked[k];
  }
}

}  // namespace

void route_cuda(const RoutingProblem& rp, float* topk_weights, std::int64_t* topk_idx, Stream stream) {
  if (rp.num_tokens == 0) return;
  cuda_util::DeviceGuard guard(rp.logits.device);
  const int E = static_cast<int>(rp.num_experts);
  const Scratch L = scratch_layout(E, rp.num_expert_group, rp.num_topk, rp.bias != nullptr);
  int device = 0, max_optin = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&device));
  EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (L.bytes > max_optin)
    throw Error(ErrorCode::unsupported,
                "epmoe: the CUDA router keeps a row of scores in shared memory: E = " + std::to_string(E) + " needs " +
                    std::to_string(L.bytes) + " bytes per token, more than the " + std::to_string(max_optin) +
                    " bytes of a block on this GPU (argument 'logits', " + describe(rp.logits) + ")");
  int warps = static_cast<int>(std::min<std::int64_t>(4, (48 * 1024) / L.bytes));
  warps = warps < 1 ? 1 : warps;
  const std::size_t smem = static_cast<std::size_t>(warps) * static_cast<std::size_t>(L.bytes);
  if (smem > 48 * 1024)
    EPMOE_CUDA_CHECK(
        cudaFuncSetAttribute(route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  Params p{};
  p.logits = rp.logits.data;
  p.bf16 = rp.logits.dtype == DType::bf16;
  p.T = rp.num_tokens;
  p.E = E;
  p.K = rp.num_topk;
  p.G = rp.num_expert_group;
  p.topk_group = rp.topk_group;
  p.softmax = rp.scoring == ScoringFunc::softmax;
  p.renormalize = rp.renormalize;
  p.has_bias = rp.bias != nullptr;
  p.scaling = rp.routed_scaling_factor;
  p.bias = rp.bias;
  p.weights = topk_weights;
  p.ids = topk_idx;
  p.warps_per_block = warps;
  const auto blocks = static_cast<unsigned>(cuda_util::ceil_div(rp.num_tokens, warps));
  route_kernel<<<blocks, warps * 32, smem, cuda_util::to_cuda(stream)>>>(p);
  EPMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace epmoe::router_detail
