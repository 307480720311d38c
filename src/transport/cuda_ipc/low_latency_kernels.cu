// Kernels of the cuda_ipc low-latency mode: dispatch send/receive, combine send/receive. Protocol and byte layout:
// cuda_ipc/low_latency.hpp (the CPU implementation's, cpu/low_latency_mode.cpp).
//
// Every kernel learns its call index on the device: Control::calls counts the send kernels launched since the last
// clean, so a send kernel's index is `calls` (the last block to end its send advances it) and a receive kernel's is
// calls - 1 - lag, lag being the calls sent after it when it was enqueued (0 unless a recv hook runs late). A
// captured CUDA graph therefore replays with fresh indices. Memory ordering: rows are plain stores into the peer's
// window; a dispatch send's blocks publish them with one red.release each into the peer's data flag (their
// shares sum to kCallTag), a combine send's last block (an arrive counter between acquire-release fences) with
// st.release; receivers poll with ld.acquire and read staging with ld.global.cg. The scope is sys between ranks and
// gpu for a rank's own flags (its rows to itself: every R has that pair, R = 1 only it). Every spin
// has a %globaltimer deadline: on expiry the first failing thread records (code, rank, peer, phase) in the
// host-mapped record (atomicCAS on Control::claim) and the kernel returns (no trap).
#include <epmoe/dtype.hpp>
#include <epmoe/nvfp4.hpp>

#include <cfloat>

#include "core/bf16_device.cuh"
#include "transport/cuda_ipc/low_latency_kernels.hpp"

#include "core/cuda_check.hpp"
#include "transport/cuda_ipc/device.cuh"
#include "quant/quant.hpp"

namespace epmoe::cuda_ipc_ll {

namespace {

using namespace cuda_ipc_device;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 4;  // 16-byte vectors each lane keeps in flight when moving a row
constexpr int kMaxSendBlocks = 132;  // a dispatch send alone: up to a block per SM of an H100/H200
constexpr int kQuantWords = 2;  // most UE8M0 words (4 groups of 128 channels each) per warp item of a fused fp8 send
constexpr std::size_t kPieceBytes = 32 * kVec * 16;  // a row piece per warp item: one round of kVec loads per lane
// The combine send's items: twice the bytes in flight per warp (the send is bound by load latency, not bandwidth: ~1.4
// TB/s at T = 128); its kernel keeps the same occupancy (registers bound it at 2 blocks per SM either way).
constexpr int kSendVec = 8;
constexpr std::size_t kSendPieceBytes = 32 * kSendVec * 16;
constexpr int kMaxRecvBlocks = 1024;
// The dispatch receive's bulk copies: a piece of a row per item, two buffers per warp (dynamic shared memory of a
// launch with the receive phase; two blocks per SM still fit beside the static arrays).
constexpr std::size_t kRecvPiece = 4096;
constexpr std::size_t kRecvSmemBytes = kWarps * 2 * kRecvPiece;
// The combine receive's items: a token's row in chunks of kCombineVecs 16-byte vectors per thread (the K loads of each
// in flight together), so a receive-only launch (the hook) at T = 128, H = 7168 is 257 blocks, one wave of 2 blocks per
// SM (513 with one vector per thread: the last blocks started 7.4 us after the first); with both phases the grid is
// the co-resident one either way, each block taking half as many items. K = 16 keeps one (its registers would spill).
template <int kK>
inline constexpr int kCombineVecs = kK <= 8 ? 2 : 1;
template <int kK>
inline constexpr int kCombineChunk = kCombineVecs<kK> * kThreads;

__device__ __forceinline__ Control* control(void* base) { return static_cast<Control*>(base); }
__device__ __forceinline__ char* half_base(const Common& c, int r, int half) {
  return static_cast<char*>(c.peers[r]) + kControlBytes + static_cast<std::size_t>(half) * c.half_bytes;
}

/// The rank owning expert `id` (0 <= id < E): a multiply and a shift (low_latency_protocol::expert_rank).
__device__ __forceinline__ int expert_rank(const Common& c, int id) {
  return low_latency_protocol::expert_rank(id, c.expert_rank_multiplier);
}

/// Records the first error of this rank's window in the host-mapped record (later ones are dropped).
__device__ __noinline__ void report(const Common& c, int code, int peer, int phase, unsigned long long index,
                                    long long value, long long value2 = 0) {
  report_error(&control(c.peers[c.rank])->claim, c.host, code, c.rank, peer, phase, value, value2, index, 0);
}

/// Trace (Common::stamps): thread 0 of this block passed `point`. The body is out of line so that the kernels carry
/// only the branch when tracing is off (their code is fetched cold at small T).
__device__ __noinline__ void record_stamp(long long* stamps, int point) {
  const long long t = now_ns();
  atomicMin(stamps + point, t);
  atomicMax(stamps + kNumTracePoints + point, t);
}
__device__ __forceinline__ void stamp(const Common& c, int point) {
  if (c.stamps != nullptr && threadIdx.x == 0) record_stamp(c.stamps, point);
}

/// Spins until *p >= target; false (and a timeout recorded) after the group's timeout.
__device__ bool wait_geq(const unsigned long long* p, unsigned long long target, const Common& c, int peer, int phase,
                         unsigned long long index) {
  if (spin_geq(p, target, c.timeout_ns, 0, peer == c.rank)) return true;
  report(c, kErrTimeout, peer, phase, index, static_cast<long long>(ld_acquire_sys(p)));
  return false;
}

/// Exclusive prefix of `flag` over the block (thread order) and the block's total. Every thread calls it.
__device__ int block_scan(int flag, int* total) {
  __shared__ int warp_sums[kWarps + 1];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const unsigned ballot = __ballot_sync(0xffffffffu, flag != 0);
  const int prefix = __popc(ballot & ((1u << lane) - 1u));
  if (lane == 0) warp_sums[w] = __popc(ballot);
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = 0;
    for (int i = 0; i < kWarps; ++i) {
      const int v = warp_sums[i];
      warp_sums[i] = run;
      run += v;
    }
    warp_sums[kWarps] = run;
  }
  __syncthreads();
  const int r = warp_sums[w] + prefix;
  *total = warp_sums[kWarps];
  __syncthreads();
  return r;
}

/// One warp copies `bytes` (a multiple of 16) from src to dst, kVec 16-byte loads in flight per lane. `fresh`:
/// the source was written by another GPU (read through L2).
template <bool kFresh>
__device__ __forceinline__ void warp_copy(const void* src_v, void* dst_v, std::size_t bytes, int lane) {
  warp_copy_vectors<kVec, kFresh>(static_cast<const int4*>(src_v), static_cast<int4*>(dst_v),
                                  static_cast<int>(bytes / 16), lane);
}

/// Token t's ids as the protocol uses them, cleaned by a group of kK lanes, lane k of the group holding id k: an id
/// outside [-1, E) or one an earlier id of the token already holds becomes -1 (the host raises the recorded error at
/// the next call, semantics §11). Returns the lane's id (-1 past K, or when t < 0: the group has no token). Every
/// lane of the warp calls it, converged; groups are aligned (lanes g * kK .. g * kK + kK - 1). `report_errors`: the
/// lane of the token's first error (k order) records it.
///
/// A group per token, not a thread: on one thread the K x K duplicate test, with the K divisions that follow it, is
/// a chain of ~800 dependent instructions (~2.5 us on the kernels' first path at small T); here it is kK - 1 shuffles.
/// kK: the lanes per token (K <= kK), a template parameter of the kernels (8 covers the common K; 16 = kMaxTopk).
template <int kK>
__device__ int clean_id(const Common& c, const void* idx, bool idx64, int K, long long t, bool report_errors,
                        int phase, unsigned long long index) {
  static_assert(kK == 8 || kK == 16, "a token's ids are a group of 8 or 16 lanes");
  const int lane = threadIdx.x & 31, k = lane % kK;
  long long raw = -1;
  if (t >= 0 && k < K)
    raw = idx64 ? static_cast<const long long*>(idx)[t * K + k]
                : static_cast<long long>(static_cast<const int*>(idx)[t * K + k]);
  const bool bad = raw < -1 || raw >= c.num_experts;
  const int id = bad ? -1 : static_cast<int>(raw);
  // A duplicate: an earlier lane of the group with the same id, by kK - 1 shuffles in flight together (width kK:
  // no lane of another group is read; k >= o: a lane's own value is not compared). A -1 matches no lane.
  const unsigned key = id >= 0 ? static_cast<unsigned>(id) : 0x80000000u | lane;
  bool dup = false;
#pragma unroll
  for (int o = 1; o < kK; ++o) {
    const unsigned other = __shfl_up_sync(0xffffffffu, key, o, kK);
    dup |= k >= o && other == key;
  }
  const unsigned errors = __ballot_sync(0xffffffffu, bad || dup) & (((1u << kK) - 1u) << (lane - k));
  if (report_errors && errors != 0 && lane == __ffs(errors) - 1)
    report(c, bad ? kErrBadId : kErrDuplicateId, c.rank, phase, index, bad ? raw : id, t * K + k);
  return dup ? -1 : id;
}

/// The last block of the grid to get here (every thread calls it, after its stores): true in every thread of that
/// block, after a system-scope fence that orders every block's stores before what it publishes next (each block's
/// release fence before its arrival, the last block's acquire fence after it).
__device__ bool last_block_all(unsigned int* arrive) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();
    last = atomicAdd(arrive, 1u) == gridDim.x - 1;
    if (last) {
      fence_acq_rel_sys();
      *arrive = 0;  // ready for the next kernel (stream order)
    }
  }
  __syncthreads();
  return last != 0;
}

/// One warp quantizes UE8M0 words [word_begin, word_end) of bf16 row `x_row` (H channels, H % 16 == 0; word w
/// covers groups 4w..4w+3 of 128 channels) to fp8 e4m3 with one scale per group, exactly as quant/cuda.cu's
/// quantize_kernel does (one word's four groups per step, 8 lanes per group, 16 channels per lane; the helpers of
/// quant/fp8_device.cuh), and stores that part of the record (fp8 row, then float32 scales or UE8M0 words) at each
/// of `num_dst` destinations. Rows are split among warps: one warp per row is bound by its own instruction latency
/// (~15 us for H = 7168).
__device__ void quantize_row_to(const std::uint32_t* x_row, int H, bool round_scale, bool ue8m0, char* const* dst,
                                int num_dst, int lane, int word_begin, int word_end) {
  using namespace quant_detail;
  const int G = (H + 127) / 128;
  // The loads of kAhead steps are issued before any is used (one load's latency per step otherwise).
  constexpr int kAhead = kQuantWords;  // a call covers at most kQuantWords words: more only adds code
  for (int w0 = word_begin; w0 < word_end; w0 += kAhead) {
    uint4 raw[kAhead][2];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int g = (w0 + u) * 4 + (lane >> 3), c = g * 8 + (lane & 7);
      if (w0 + u < word_end && g < G && c * 16 < H) {
        const uint4* src = reinterpret_cast<const uint4*>(x_row) + 2 * c;
        raw[u][0] = __ldg(src);
        raw[u][1] = __ldg(src + 1);
      }
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int word = w0 + u;
      if (word >= word_end) break;  // warp-uniform
      const int g = word * 4 + (lane >> 3);
      const int c = g * 8 + (lane & 7);  // 16-channel chunk of the row
      const bool active = g < G && c * 16 < H;
      float v[16];
      if (active) unpack16<2>(raw[u], v);
      uint4 out;
      const DeviceGroupScale sc = quantize_lane16<true>(v, active, round_scale, &out);
      if (active)
        for (int d = 0; d < num_dst; ++d) *reinterpret_cast<uint4*>(dst[d] + static_cast<std::size_t>(c) * 16) = out;
      if (!ue8m0) {
        if ((lane & 7) == 0 && g < G)
          for (int d = 0; d < num_dst; ++d) reinterpret_cast<float*>(dst[d] + H)[g] = sc.scale;
      } else {
        const std::int32_t packed = ue8m0_word(sc.exponent, g < G);  // bytes past the last group are 0
        if (lane == 0)
          for (int d = 0; d < num_dst; ++d) reinterpret_cast<std::int32_t*>(dst[d] + H)[word] = packed;
      }
    }
  }
}

/// Block 0's threads d < R raise, in peer d, the consumed flags of the earlier receives Common::publish_mask names
/// (relative to this launch's call `index`). Before any wait, so two ranks never wait for each other's flags.
__device__ void publish_consumed(const Common& c, unsigned long long index) {
  if (blockIdx.x != 0 || threadIdx.x >= c.num_ranks) return;
  for (int h = 0; h < 2; ++h) {
    if (((c.publish_mask >> h) & 1) == 0) continue;
    const unsigned long long call = index - static_cast<unsigned long long>(c.publish_delta[h]);
    st_release(&control(c.peers[threadIdx.x])->consumed[call & 1][c.rank], call + 1,
               static_cast<int>(threadIdx.x) == c.rank);
  }
}

/// A send kernel's start (every thread calls it): its call index (Control::calls, advanced by end_send), after
/// raising the consumed flags the launch owes (publish_consumed).
__device__ unsigned long long begin_send(const Common& c) {
  Control* own = control(c.peers[c.rank]);
  __shared__ unsigned long long s_index;
  if (threadIdx.x == 0) s_index = read_volatile(&own->calls);
  __syncthreads();
  const unsigned long long index = s_index;
  publish_consumed(c, index);
  return index;
}

/// A send phase's end (every thread calls it, whatever the send's outcome): the block that arrives last advances
/// Control::calls to index + 1; every block read `calls` in begin_send before arriving. The block's last thread
/// arrives, not one that publishes or polls a data flag. At the start, the atomic's round trip came before the
/// block's first barrier (~0.3-0.5 us on every send).
__device__ void end_send(const Common& c, unsigned long long index) {
  Control* own = control(c.peers[c.rank]);
  if (threadIdx.x == kThreads - 1 && atomicAdd(&own->index_arrive, 1u) == gridDim.x - 1) {
    own->index_arrive = 0;
    own->calls = index + 1;
  }
}

/// Whether a send of call `index` may write into the destinations (every thread calls it; the same answer in all):
/// a half is written again only once every destination has read it (call index - 2); false after a timeout
/// (recorded).
/// One thread's part of it: whether destination `d` has read this rank's call index - 2 in the half call `index`
/// writes (waits for it; false after a timeout, recorded).
__device__ bool destination_read(const Common& c, int d, int phase, unsigned long long index) {
  const int half = static_cast<int>(index & 1);
  return index < 2 || wait_geq(&control(c.peers[c.rank])->consumed[half][d], index - 1, c, d, phase, index);
}
__device__ bool writable(const Common& c, int phase, unsigned long long index) {
  __shared__ int s_ok;
  if (threadIdx.x == 0) s_ok = 1;
  __syncthreads();
  if (threadIdx.x < c.num_ranks && !destination_read(c, threadIdx.x, phase, index)) s_ok = 0;
  __syncthreads();
  return s_ok != 0;
}

// ---- dispatch ----

/// The send phase of dispatch call `index`: rows and metas into every destination's half, then the headers and data
/// flags. It waits for the destinations' consumed flags (writable's condition, on lanes of the last warp) beside the
/// first chunk's ids, before its first store into them. False when the send may not write (a timeout, recorded).
template <int kK>
__device__ bool dispatch_send(const Common& c, const DispatchSendArgs& a, unsigned long long index) {
  Control* own = control(c.peers[c.rank]);
  const int half = static_cast<int>(index & 1), R = c.num_ranks, me = c.rank, El = c.local_experts, K = a.K;

  const bool fp8 = (a.flags & 1u) != 0, nvfp4 = (a.flags & kFlagNvfp4) != 0;
  if (a.global_scale != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    const float g = *a.global_scale;  // nvfp4: reported here, raised by the host's next call (semantics §11)
    if (!(g > 0.0f && g <= FLT_MAX))
      report(c, kErrGlobalScale, c.rank, kPhaseDispatchSend, index, static_cast<long long>(__float_as_uint(g)));
  }
  __shared__ int carry[kMaxRanks];
  // The chunk's tokens (slot j = token base + j): each destination's slot (the scan's), the mask of destinations
  // (0: the token goes nowhere) and each id as (local expert | destination << 16), -1 for none.
  __shared__ int tok_pos[kThreads][kMaxRanks];
  __shared__ unsigned tok_mask[kThreads];
  __shared__ int tok_ent[kThreads][kK];
  const bool fused = fp8 && a.records == nullptr;  // quantized here, once per token, stored at every destination
  if (threadIdx.x < kMaxRanks) carry[threadIdx.x] = 0;
  const std::size_t slot_off =
      c.staging + static_cast<std::size_t>(R) * kHeaderBytes + static_cast<std::size_t>(me) * c.dispatch_slot_bytes;
  const std::size_t records_off = slot_off + static_cast<std::size_t>(c.tmax) * c.meta_bytes;
  // fp8 / nvfp4: the row and its scales only (the record's stride fits a bf16 row)
  const std::size_t quant_row = nvfp4 ? nvfp4_row_bytes(c.hidden) : static_cast<std::size_t>(c.hidden);
  const std::size_t payload = fp8 || nvfp4 ? (quant_row + 4u * a.scale_cols + 15) / 16 * 16
                                           : static_cast<std::size_t>(2 * c.hidden);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // The destinations' consumed flags (writable's wait): the last warp's lanes d < R wait on destination d while the
  // other warps load and clean the ids, so the wait's round trip overlaps the ids' loads instead of following the
  // scan. The scan's barriers publish the answers before the first store.
  __shared__ int dest_ok[kMaxRanks];
  const int waiter = static_cast<int>(threadIdx.x) - (kThreads - 32);
  const auto wait_writable = [&] {
    if (waiter >= 0 && waiter < R) dest_ok[waiter] = destination_read(c, waiter, kPhaseDispatchSend, index);
  };
  const auto all_writable = [&] {
    bool ok = true;
    for (int d = 0; d < R; ++d) ok = ok && dest_ok[d] != 0;
    return ok;
  };
  bool checked = false;  // the answers were read (after a barrier)
  __syncthreads();

  // A token's ids are a group of kK lanes (clean_id); kGroups tokens per warp at a time.
  constexpr int kGroups = 32 / kK;
  const int k_lane = lane % kK;
  const unsigned group_lanes = ((1u << kK) - 1u) << (lane - k_lane);
  for (long long base = 0; base < a.T; base += kThreads) {
    const int chunk = static_cast<int>(a.T - base < kThreads ? a.T - base : kThreads);
    if (base == 0) wait_writable();
    // The chunk's ids: each destination's (local expert | destination << 16) in tok_ent, the destinations in
    // tok_mask. The first chunk leaves the last warp to its wait. Errors are recorded once, by block 0; every block
    // skips the same ids.
    const int clean_warps = base == 0 ? kWarps - 1 : kWarps;
    for (int jw = warp * kGroups; warp < clean_warps && jw < chunk; jw += clean_warps * kGroups) {
      const int j = jw + lane / kK;
      const long long t = j < chunk ? base + j : -1;
      const int id = clean_id<kK>(c, a.topk_idx, a.idx64, K, t, blockIdx.x == 0, kPhaseDispatchSend, index);
      const int d = id >= 0 ? expert_rank(c, id) : 0;
      unsigned bits = id >= 0 ? 1u << d : 0u;
#pragma unroll
      for (int o = kK / 2; o > 0; o >>= 1) bits |= __shfl_xor_sync(0xffffffffu, bits, o);
      if (t >= 0) {
        tok_ent[j][k_lane] = id >= 0 ? d << 16 | (id - d * El) : -1;
        if (k_lane == 0) tok_mask[j] = bits;
        if (blockIdx.x == 0 && k_lane < K)
          c.sent_idx[static_cast<std::size_t>(half) * c.tmax * kMaxTopk + t * K + k_lane] = id;
      }
    }
    if (base == 0) stamp(c, kTraceIds);
    __syncthreads();
    const unsigned mask = static_cast<int>(threadIdx.x) < chunk ? tok_mask[threadIdx.x] : 0u;
    for (int d = 0; d < R; ++d) {
      const int before = carry[d];  // read by every thread before block_scan's first barrier
      int total = 0;
      tok_pos[threadIdx.x][d] = before + block_scan((mask >> d) & 1u, &total);
      if (threadIdx.x == 0) carry[d] = before + total;
    }
    __syncthreads();
    if (!checked) {
      if (!all_writable()) return false;
      checked = true;
      stamp(c, kTraceWritable);
    }
    // The chunk's metas: token j's by a group of block j mod the grid (that block's release publishes them), one
    // entry per lane (k ascending), one meta per destination.
    const int metas = chunk > static_cast<int>(blockIdx.x) ? (chunk - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    for (int mw = warp * kGroups; mw < metas; mw += kWarps * kGroups) {
      const int m = mw + lane / kK, j = static_cast<int>(blockIdx.x + m * gridDim.x);
      const int ent = m < metas ? tok_ent[j][k_lane] : -1;
      const unsigned dests = m < metas ? tok_mask[j] : 0u;
      for (int d = 0; d < R; ++d) {
        const bool hit = ent >= 0 && (ent >> 16) == d;
        const unsigned hits = __ballot_sync(0xffffffffu, hit) & group_lanes;
        if (((dests >> d) & 1u) == 0) continue;
        auto* meta = reinterpret_cast<TokenMeta*>(half_base(c, d, half) + slot_off +
                                                  static_cast<std::size_t>(tok_pos[j][d]) * c.meta_bytes);
        if (hit) meta->entries[__popc(hits & ((1u << lane) - 1u))] = static_cast<std::uint32_t>(k_lane) << 16 | (ent & 0xffff);
        if (k_lane == 0) {
          meta->token = static_cast<std::int32_t>(base + j);
          meta->num_entries = __popc(hits);
        }
      }
    }
    // The chunk's rows as items over every warp of the grid (every block's scan knows every token's slots; a block
    // per token left the others idle at small T and kept a row's pieces on one SM). The order is the same in every
    // block, so each item is taken once.
    const long long grid_warp = static_cast<long long>(blockIdx.x) * kWarps + warp;
    const long long grid_warps = static_cast<long long>(gridDim.x) * kWarps;
    // Fused fp8: items (token, 1 or kQuantWords words of its row): one word where the grid has a warp per word, so
    // a row's quantization is spread widest at small T.
    const int words = (static_cast<int>((c.hidden + 127) / 128) + 3) / 4;
    const int item_words = static_cast<long long>(chunk) * words <= grid_warps ? 1 : kQuantWords;
    const int pieces = (words + item_words - 1) / item_words;
    for (long long i = grid_warp; fused && i < static_cast<long long>(chunk) * pieces; i += grid_warps) {
      const int j = static_cast<int>(i / pieces), piece = static_cast<int>(i % pieces);
      const long long tt = base + j;
      const unsigned m_d = tok_mask[j];
      if (m_d == 0) continue;
      char* dst[kMaxRanks];
      int nd = 0;
      for (int d = 0; d < R; ++d)
        if ((m_d >> d) & 1u)
          dst[nd++] = half_base(c, d, half) + records_off + static_cast<std::size_t>(tok_pos[j][d]) * c.record_bytes;
      quantize_row_to(reinterpret_cast<const std::uint32_t*>(static_cast<const char*>(a.x) +
                                                             static_cast<std::size_t>(tt) * a.x_stride * 2),
                      static_cast<int>(c.hidden), (a.flags & 2u) != 0, (a.flags & 4u) != 0, dst, nd, lane,
                      piece * item_words, min(words, (piece + 1) * item_words));
    }
    // Rows by SM stores: items (token, destination, kPieceBytes of its payload).
    const int row_pieces = static_cast<int>((payload + kPieceBytes - 1) / kPieceBytes);
    for (long long i = grid_warp; !fused && i < static_cast<long long>(chunk) * R * row_pieces; i += grid_warps) {
      const int j = static_cast<int>(i / (static_cast<long long>(R) * row_pieces));
      const int d = static_cast<int>(i / row_pieces % R), piece = static_cast<int>(i % row_pieces);
      if (((tok_mask[j] >> d) & 1u) == 0) continue;
      const long long tt = base + j;
      const std::size_t slot = static_cast<std::size_t>(tok_pos[j][d]);
      char* dst_half = half_base(c, d, half);
      const char* src = a.records != nullptr
                            ? static_cast<const char*>(a.records) + static_cast<std::size_t>(tt) * c.record_bytes
                            : static_cast<const char*>(a.x) + static_cast<std::size_t>(tt) * a.x_stride * 2;
      const std::size_t at = static_cast<std::size_t>(piece) * kPieceBytes;
      warp_copy<false>(src + at, dst_half + records_off + slot * c.record_bytes + at,
                       payload - at < kPieceBytes ? payload - at : kPieceBytes, lane);
    }
    __syncthreads();
  }

  if (!checked) {  // T = 0: no scan ran
    wait_writable();
    __syncthreads();
    if (!all_writable()) return false;
    stamp(c, kTraceWritable);
  }
  // No grid barrier: each block publishes its own rows (and block 0 the headers: every block's scan knows each
  // destination's count) with one release-add per destination; the shares sum to kCallTag once every block is in.
  __syncthreads();
  stamp(c, kTraceSent);
  if (threadIdx.x != 0) return true;
  if (blockIdx.x == 0)
    for (int d = 0; d < R; ++d) {
      Header* h =
          reinterpret_cast<Header*>(half_base(c, d, half) + c.staging + static_cast<std::size_t>(me) * kHeaderBytes);
      h->magic = kMagic;
      h->kind = kKindDispatch;
      h->index = index;
      h->count = carry[d];
      h->hidden = c.hidden;
      h->flags = a.flags;
      h->tmax = c.tmax;
      h->num_experts = c.num_experts;
    }
  const unsigned long long share = blockIdx.x == 0 ? kCallTag - (gridDim.x - 1) : 1ull;
  for (int d = 0; d < R; ++d) red_release_add(&control(c.peers[d])->data[half][me], share, d == me);
  stamp(c, kTracePublished);
  return true;
}

/// Threads s < R wait for source s's data flag of call `index`; then every thread runs `prefetch` (loads of the
/// sources' data issued in the same round trip as the headers': after the flags, before anything is checked; what
/// they read is used only when this returns true) while threads s < R check source s's header. False on every
/// thread when some source failed (recorded). `counts` receives each source's count.
template <class Prefetch>
__device__ bool receive_headers(const Common& c, int half, unsigned long long index, std::uint32_t kind,
                                std::uint32_t flags, const long long* expected, long long* counts, int phase,
                                long long* wait_cost, Prefetch&& prefetch) {
  // `arrived` is written before the barrier that every thread reads it after; `ok` after it, read after the last one
  // (one flag for both would let a header check's write race with another warp's read of the arrivals).
  __shared__ int arrived_all, ok;
  if (threadIdx.x == 0) {
    arrived_all = 1;
    ok = 1;
  }
  __syncthreads();
  const int s = threadIdx.x;
  if (s < c.num_ranks) {
    Control* own = control(c.peers[c.rank]);
    const long long start = wait_cost != nullptr ? now_ns() : 0;
    const bool arrived = wait_geq(&own->data[half][s], data_target(index), c, s, phase, index);
    stamp(c, kTraceArrived);
    // Every block waits; block 0 alone adds, so the statistic counts each source's wait once per call.
    if (wait_cost != nullptr && blockIdx.x == 0)
      atomicAdd(reinterpret_cast<unsigned long long*>(wait_cost + s), static_cast<unsigned long long>(now_ns() - start));
    if (!arrived) arrived_all = 0;
  }
  // The barrier orders every thread's loads after the waiters' acquires (and so after the sources' releases).
  __syncthreads();
  if (arrived_all == 0) return false;
  prefetch();
  if (s < c.num_ranks) {
    const Header* hp = reinterpret_cast<const Header*>(half_base(c, c.rank, half) + c.staging +
                                                       static_cast<std::size_t>(s) * kHeaderBytes);
    const std::uint32_t magic = __ldcg(&hp->magic), hkind = __ldcg(&hp->kind), hflags = __ldcg(&hp->flags);
    const unsigned long long hindex = __ldcg(reinterpret_cast<const unsigned long long*>(&hp->index));
    const long long count = __ldcg(reinterpret_cast<const long long*>(&hp->count));
    const long long hidden = __ldcg(reinterpret_cast<const long long*>(&hp->hidden));
    const int num_max_dispatch_tokens_per_rank = __ldcg(&hp->tmax), E = __ldcg(&hp->num_experts);
    if (magic != kMagic || hkind != kind || hindex != index) {
      report(c, kErrOtherCall, s, phase, index, static_cast<long long>(hindex), magic != kMagic ? 0 : hkind);
      ok = 0;
    } else if (hidden != c.hidden || num_max_dispatch_tokens_per_rank != c.tmax || E != c.num_experts) {
      report(c, kErrShape, s, phase, index, hidden,
             static_cast<long long>(num_max_dispatch_tokens_per_rank) << 32 | E);
      ok = 0;
    } else if (kind == kKindCombine && (hflags & kFlagSignalTimeout) != 0) {
      // the source's overlapped send gave up on a signal: its rows are incomplete
      report(c, kErrSignalTimeout, s, phase, index, __ldcg(&hp->reserved[0]), __ldcg(&hp->reserved[1]));
      ok = 0;
    } else if (kind == kKindDispatch && hflags != flags) {
      report(c, kErrFlags, s, phase, index, hflags, flags);
      ok = 0;
    } else if (count < 0 || (kind == kKindDispatch && count > c.tmax) ||
               (expected != nullptr && count != expected[s])) {
      report(c, kErrCount, s, phase, index, count, expected != nullptr ? expected[s] : c.tmax);
      ok = 0;
    } else {
      counts[s] = count;
    }
  }
  __syncthreads();
  stamp(c, kTraceHeaders);
  return ok != 0;
}

struct RecvItem {
  int j, k, token;
};

/// A TokenMeta as loaded, its 18 words: the first 12 (token, num_entries, up to 10 entries: any K <= 8) in one
/// round of 16-byte loads, the rest only for a token with more entries on this rank (a load per entry waited K
/// latencies; loading all 72 bytes for every token cost the receive's scan ~40% more traffic on one hot region).
struct MetaWords {
  int w[18];
};
static_assert(sizeof(TokenMeta) == 72, "TokenMeta: 18 words");
__device__ __forceinline__ MetaWords load_meta(const char* at) {
  const int4* mv = reinterpret_cast<const int4*>(at);
  MetaWords m;
  int4 q[3];
#pragma unroll
  for (int i = 0; i < 3; ++i) q[i] = __ldcg(mv + i);
#pragma unroll
  for (int i = 0; i < 3; ++i) {
    m.w[4 * i] = q[i].x;
    m.w[4 * i + 1] = q[i].y;
    m.w[4 * i + 2] = q[i].z;
    m.w[4 * i + 3] = q[i].w;
  }
  int4 q3 = make_int4(0, 0, 0, 0);
  int2 q4 = make_int2(0, 0);
  if (m.w[1] > 10) {
    q3 = __ldcg(mv + 3);
    q4 = __ldcg(reinterpret_cast<const int2*>(mv + 4));
  }
  m.w[12] = q3.x;
  m.w[13] = q3.y;
  m.w[14] = q3.z;
  m.w[15] = q3.w;
  m.w[16] = q4.x;
  m.w[17] = q4.y;
  return m;
}

/// One warp's bulk copies (TMA) of pieces from global to global through its two shared-memory buffers of kRecvPiece
/// bytes, driven by its lane 0 alone: two pieces load while the warp's other work runs, and a buffer refills as soon
/// as its store has read it. `piece_of(q, &src, &dst)` gives piece q's addresses and returns its bytes (16-byte
/// aligned, a multiple of 16, at most kRecvPiece).
struct BulkPipe {
  unsigned char* buffers;
  unsigned long long* bars;  // an mbarrier per buffer
  unsigned parity = 0;       // bit b: the phase buffer b's mbarrier completes next

  __device__ void init() {
    mbar_init(&bars[0]);
    mbar_init(&bars[1]);
    fence_proxy_async_global();  // what this thread's acquires made visible, to its bulk loads
  }
  template <class PieceOf>
  __device__ void load(int q, PieceOf& piece_of) {
    const char* src;
    char* dst;
    const unsigned bytes = piece_of(q, &src, &dst);
    bulk_load(buffers + (q & 1) * kRecvPiece, src, bytes, &bars[q & 1]);
  }
  /// Issues the first two pieces' loads (before the warp's other work on the same items).
  template <class PieceOf>
  __device__ void start(int n, PieceOf& piece_of) {
    for (int q = 0; q < n && q < 2; ++q) load(q, piece_of);
  }
  /// Copies pieces 0..n-1 (the first two loading since start). A load is of this rank's own memory: one that does
  /// not land within the timeout is recorded (kErrCopyTimeout) and waited for once more, then the kernel traps, as
  /// a block must not end while copies may still land in its shared memory.
  template <class PieceOf>
  __device__ void finish(int n, PieceOf& piece_of, const Common& c, int phase, unsigned long long index, int expert,
                         long long first_row) {
    for (int q = 0; q < n; ++q) {
      const int b = q & 1;
      if (!mbar_wait(&bars[b], (parity >> b) & 1u, c.timeout_ns)) {
        report(c, kErrCopyTimeout, c.rank, phase, index, expert, first_row);
        if (!mbar_wait(&bars[b], (parity >> b) & 1u, c.timeout_ns)) __trap();
      }
      parity ^= 1u << b;
      const char* src;
      char* dst;
      const unsigned bytes = piece_of(q, &src, &dst);
      bulk_store(dst, buffers + b * kRecvPiece, bytes);
      if (q + 2 < n) {
        bulk_wait_read();  // this store has read buffer b
        load(q + 2, piece_of);
      }
    }
    bulk_wait_read();  // both buffers free for the next items
  }
};

/// The receive phase of dispatch call `index`: every source's rows into the packed per-expert layout (the consumed
/// flags are raised by this rank's next launch: Common::publish_mask).
__device__ void dispatch_recv(const Common& c, const DispatchRecvArgs& a, unsigned long long index) {
  const int half = static_cast<int>(index & 1), R = c.num_ranks, El = c.local_experts;
  __shared__ long long n[kMaxRanks];
  const char* staging = half_base(c, c.rank, half) + c.staging;
  const auto metas_of = [&](int s) {
    return staging + static_cast<std::size_t>(R) * kHeaderBytes + static_cast<std::size_t>(s) * c.dispatch_slot_bytes;
  };
  // No TokenMeta is loaded with the headers: the count is not known yet, and every expert's block loading up to
  // tmax metas of the same source (one hot region of the L2) slowed the receive by ~1 us at T = 1.
  if (!receive_headers(c, half, index, kKindDispatch, a.flags, nullptr, n, kPhaseDispatchRecv, a.wait_cost, [] {}))
    return;

  const bool fp8 = (a.flags & 1u) != 0, nvfp4 = (a.flags & kFlagNvfp4) != 0;
  const long long H = c.hidden, rows = static_cast<long long>(R) * c.tmax;
  const std::size_t x_row = nvfp4 ? nvfp4_row_bytes(H) : fp8 ? static_cast<std::size_t>(H) : static_cast<std::size_t>(2 * H);
  const int sc_cols = fp8 || nvfp4 ? a.scale_cols : 0;
  const std::size_t slab_scales = nvfp4_slab_scale_bytes(rows, H);  // nvfp4: an expert's swizzled scale matrix
  char* base = half_base(c, c.rank, half);
  char* packed_x = base + c.packed_x;
  auto* scales = reinterpret_cast<int*>(base + c.scales);
  auto* count = reinterpret_cast<std::int32_t*>(base + c.count);
  auto* src_info = reinterpret_cast<std::int32_t*>(base + c.src_info);
  auto* range = reinterpret_cast<long long*>(base + c.layout_range);
  auto* packed_k = reinterpret_cast<std::uint8_t*>(base + c.packed_k);
  auto* self_row = reinterpret_cast<std::int32_t*>(base + c.self_row);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ RecvItem items[kThreads];
  // Each warp's two bulk buffers (the launch's dynamic shared memory, kRecvSmemBytes) and their mbarriers.
  extern __shared__ __align__(128) unsigned char recv_smem[];
  __shared__ unsigned long long bars[kWarps][2];
  BulkPipe pipe{recv_smem + static_cast<std::size_t>(warp) * 2 * kRecvPiece, bars[warp]};
  unsigned smem_bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_bytes));
  if (smem_bytes < kRecvSmemBytes) __trap();  // a launch without the buffers (launch_phases gives them): a bug here
  if (lane == 0) pipe.init();

  for (int e = blockIdx.x; e < El; e += gridDim.x) {
    int fill = 0;  // uniform over the block
    for (int s = 0; s < R; ++s) {
      const int begin = fill;
      const char* metas = metas_of(s);
      const char* records = metas + static_cast<std::size_t>(c.tmax) * c.meta_bytes;
      for (long long j0 = 0; j0 < n[s]; j0 += kThreads) {
        const long long j = j0 + threadIdx.x;
        int match = 0, k = 0, token = 0;
        if (j < n[s]) {
          const MetaWords m = load_meta(metas + static_cast<std::size_t>(j) * c.meta_bytes);
          token = m.w[0];
          const int ne = m.w[1];
#pragma unroll
          for (int q = 0; q < kMaxTopk; ++q) {
            const auto ent = static_cast<std::uint32_t>(m.w[2 + q]);
            if (!match && q < ne && static_cast<int>(ent & 0xffffu) == e) {
              match = 1;
              k = static_cast<int>(ent >> 16);
            }
          }
        }
        int total = 0;
        const int at = block_scan(match, &total);
        if (match) items[at] = RecvItem{static_cast<int>(j), k, token};
        __syncthreads();
        if (s == 0 && j0 == 0) stamp(c, kTraceScanned);
        // The rows' bodies as items (row, kRecvPiece bytes of it) over the block's warps, by bulk copies that lane 0
        // of each warp drives through its two buffers (BulkPipe): two 4 KiB pieces in flight per warp, 64 KiB per
        // block, holding no registers. A warp's copy of 4 vectors per lane kept 16 KiB in flight per block, and the
        // busiest expert's block took a round of loads per 2 KiB piece (T = 128: ~11 rows, 6 rounds).
        const int pieces = static_cast<int>((x_row + kRecvPiece - 1) / kRecvPiece);
        const int my_items = total * pieces > warp ? (total * pieces - warp + kWarps - 1) / kWarps : 0;
        const auto piece_of = [&](int q, const char** src, char** dst) {
          const int w0 = warp + q * kWarps, i = w0 / pieces;
          const std::size_t at = static_cast<std::size_t>(w0 % pieces) * kRecvPiece;
          *src = records + static_cast<std::size_t>(items[i].j) * c.record_bytes + at;
          *dst = packed_x + static_cast<std::size_t>(static_cast<long long>(e) * rows + fill + i) * x_row + at;
          return static_cast<unsigned>(x_row - at < kRecvPiece ? x_row - at : kRecvPiece);
        };
        if (lane == 0) pipe.start(my_items, piece_of);
        // Each row's scales and source info, by the lanes of one warp while the first pieces load.
        for (int i = warp; i < total; i += kWarps) {
          const RecvItem it = items[i];
          const long long row = static_cast<long long>(e) * rows + fill + i;
          const char* rec = records + static_cast<std::size_t>(it.j) * c.record_bytes;
          if (nvfp4) {
            // Word w holds scales 4w..4w+3 of the row: one 4-byte run of tile column w in the swizzled matrix.
            char* slab = reinterpret_cast<char*>(scales) + static_cast<std::size_t>(e) * slab_scales;
            const long long j_e = fill + i;
            for (int w = lane; w < sc_cols; w += 32)
              *reinterpret_cast<int*>(slab + nvfp4_swizzled_offset(j_e, 4 * w, sc_cols)) =
                  __ldcg(reinterpret_cast<const int*>(rec + x_row) + w);
          } else {
            // Column-major per expert, as DeepEP's (Layout::scale_rows): lane w's word lies a column away.
            const std::size_t first = (static_cast<std::size_t>(e) * sc_cols) * c.scale_rows + fill + i;
            for (int w = lane; w < sc_cols; w += 32)
              scales[first + static_cast<std::size_t>(w) * c.scale_rows] =
                  __ldcg(reinterpret_cast<const int*>(rec + H) + w);
          }
          if (lane == 0) {
            src_info[row] = it.token;
            packed_k[row] = static_cast<std::uint8_t>(it.k);
            if (s == c.rank) self_row[it.token * kMaxTopk + it.k] = static_cast<std::int32_t>(row);
          }
        }
        if (lane == 0) pipe.finish(my_items, piece_of, c, kPhaseDispatchRecv, index, e, fill);
        fill += total;
        __syncthreads();
      }
      if (threadIdx.x == 0)
        range[static_cast<std::size_t>(e) * R + s] =
            static_cast<long long>(begin) << 32 | static_cast<long long>(fill - begin);
    }
    if (threadIdx.x == 0) {
      count[e] = fill;
      if (a.stats) a.stats[e * a.stats_stride] += fill;
    }
  }
}

// ---- combine ----

__device__ __forceinline__ unsigned ld_acquire_gpu_u32(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

/// Overlapped combine: thread 0 polls the signal entry of expert `e`, block `blk` (acquire: the producer's rows are
/// visible after it) until it reaches a.expect, for at most half the timeout (the peers wait the whole timeout for
/// this rank's header, so they read the mark first). Every thread of the block returns after it. On expiry the
/// timeout is recorded (kErrSignalTimeout) and marked for the headers; `gave_up` (shared) skips the block's later
/// waits, whose rows are then sent as they are.
__device__ void wait_combine_signal(const Common& c, const CombineSendArgs& a, int e, long long blk,
                                    unsigned long long index, int* gave_up) {
  if (threadIdx.x == 0 && *gave_up == 0) {
    const long long entry = a.signal_form == kSignalBlocks ? e * a.blocks_per_expert + blk : e;
    const unsigned* p = static_cast<const unsigned*>(a.signal) + entry;
    // int32 entries compare signed (a negative entry is not done), uint32 ones unsigned
    const auto done = [&] {
      const unsigned v = ld_acquire_gpu_u32(p);
      return a.signal_form == kSignalBlocks ? static_cast<int>(v) >= static_cast<int>(a.expect) : v >= a.expect;
    };
    if (!done()) {
      const long long deadline = now_ns() + c.timeout_ns / 2;
      while (!done()) {
        if (now_ns() > deadline) {
          *gave_up = 1;
          const long long b = a.signal_form == kSignalBlocks ? blk : -1;
          report(c, kErrSignalTimeout, c.rank, kPhaseCombineSend, index, e, b);
          Control* own = control(c.peers[c.rank]);
          if (atomicExch(&own->signal_gave_up, 1) == 0) {
            own->signal_expert = e;
            own->signal_block = b;
          }
          break;
        }
        __nanosleep(64);
      }
    }
  }
  __syncthreads();
}

/// Rows of expert `e` of the dispatch sent block by block after each block's signal: each
/// row to the source its layout range names (ranges ascend with the rows).
__device__ void combine_send_overlapped(const Common& c, const CombineSendArgs& a, int e, int half,
                                        unsigned long long index, const char* dbase, int* gave_up) {
  const int R = c.num_ranks;
  const long long H = c.hidden, rows = static_cast<long long>(R) * c.tmax;
  const auto* src_info = reinterpret_cast<const std::int32_t*>(dbase + c.src_info);
  const auto* range = reinterpret_cast<const long long*>(dbase + c.layout_range);
  const auto* packed_k = reinterpret_cast<const std::uint8_t*>(dbase + c.packed_k);
  // The expert's rows: the last source's range ends there (the count area is not among the routing a combine
  // brings into this half, so it is not read).
  const long long last_range = range[static_cast<std::size_t>(e) * R + R - 1];
  const long long n = (last_range >> 32) + (last_range & 0xffffffffll);
  const std::size_t body = c.staging + static_cast<std::size_t>(R) * kHeaderBytes;
  const std::size_t row_bytes = static_cast<std::size_t>(2 * H);
  const int pieces = static_cast<int>((row_bytes + kPieceBytes - 1) / kPieceBytes);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long bm = a.signal_form == kSignalBlocks ? a.block_m : (n > 0 ? n : 1);
  for (long long blk = 0; blk * bm < n; ++blk) {
    if (a.signal_form == kSignalBlocks || blk == 0) wait_combine_signal(c, a, e, blk, index, gave_up);
    const long long first = blk * bm, last = first + bm < n ? first + bm : n;
    if (a.stamps != nullptr && threadIdx.x == 0) atomicMin(a.stamps, now_ns());
    for (long long w0 = warp; w0 < (last - first) * pieces; w0 += kWarps) {
      const long long r = first + w0 / pieces;
      int s = 0;
      while (s + 1 < R) {
        const long long rg = range[static_cast<std::size_t>(e) * R + s];
        if (r < (rg >> 32) + (rg & 0xffffffffll)) break;
        ++s;
      }
      const std::size_t at = static_cast<std::size_t>(w0 % pieces) * kPieceBytes;
      const long long row = static_cast<long long>(e) * rows + r;
      const std::size_t dst = static_cast<std::size_t>(src_info[row]) * kMaxTopk + packed_k[row];
      const char* src = static_cast<const char*>(a.x) + (e * a.stride0 + r * a.stride1) * 2;
      // through L2 (ld.global.cg): x is written by the GEMM while this kernel runs, not read-only data
      warp_copy<true>(src + at, half_base(c, s, half) + body + dst * row_bytes + at,
                       row_bytes - at < kPieceBytes ? row_bytes - at : kPieceBytes, lane);
    }
    if (a.stamps != nullptr) {
      __syncthreads();  // the block's stores of these rows are issued
      if (threadIdx.x == 0) atomicMax(a.stamps + 1, now_ns());
    }
  }
}

/// A combine's header at source `s`: `rows_back` rows of call `index`; `marked`: an overlapped send gave up on the
/// signal of local expert `expert`, block `block` (kFlagSignalTimeout, the rows incomplete).
__device__ void write_combine_header(const Common& c, int s, int half, unsigned long long index, long long rows_back,
                                     bool marked, int expert, std::int32_t block) {
  Header* h =
      reinterpret_cast<Header*>(half_base(c, s, half) + c.staging + static_cast<std::size_t>(c.rank) * kHeaderBytes);
  h->magic = kMagic;
  h->kind = kKindCombine;
  h->index = index;
  h->count = rows_back;
  h->hidden = c.hidden;
  h->flags = marked ? kFlagSignalTimeout : 0u;
  h->reserved[0] = marked ? expert : 0;
  h->reserved[1] = marked ? block : 0;
  h->tmax = c.tmax;
  h->num_experts = c.num_experts;
}

/// Rows of expert `e` back to their sources: items (row, kSendPieceBytes of it) from `first` by `stride` over the
/// warps that share the expert, each row to the source its layout range names (this rank's own rows only prefetched
/// into the L2 with `skip_own`: the receive of the same launch reads them in place, from memory at T = 1 ~1 us later
/// than the copy's rows from the L2).
__device__ void send_expert_rows(const Common& c, const CombineSendArgs& a, int e, int half, const char* dbase,
                                 long long first, long long stride, bool skip_own) {
  const int R = c.num_ranks;
  const long long rows = static_cast<long long>(R) * c.tmax;
  const auto* src_info = reinterpret_cast<const std::int32_t*>(dbase + c.src_info);
  const auto* range = reinterpret_cast<const long long*>(dbase + c.layout_range);
  const auto* packed_k = reinterpret_cast<const std::uint8_t*>(dbase + c.packed_k);
  const std::size_t body = c.staging + static_cast<std::size_t>(R) * kHeaderBytes;
  const std::size_t row_bytes = static_cast<std::size_t>(2 * c.hidden);
  const int pieces = static_cast<int>((row_bytes + kSendPieceBytes - 1) / kSendPieceBytes);
  const int lane = threadIdx.x & 31;
  for (int s = 0; s < R; ++s) {
    const long long rg = range[static_cast<std::size_t>(e) * R + s];
    const long long b = rg >> 32, cnt = rg & 0xffffffffll;
    if (skip_own && s == c.rank) {
      for (long long i = first; lane == 0 && i < cnt; i += stride)
        bulk_prefetch_l2(static_cast<const char*>(a.x) + (e * a.stride0 + (b + i) * a.stride1) * 2,
                         static_cast<unsigned>(row_bytes));
      continue;
    }
    char* dst_body = half_base(c, s, half) + body;
    for (long long w0 = first; w0 < cnt * pieces; w0 += stride) {
      const long long r = b + w0 / pieces;
      const std::size_t at = static_cast<std::size_t>(w0 % pieces) * kSendPieceBytes;
      const long long row = static_cast<long long>(e) * rows + r;
      const std::size_t dst = static_cast<std::size_t>(src_info[row]) * kMaxTopk + packed_k[row];
      const char* src = static_cast<const char*>(a.x) + (e * a.stride0 + r * a.stride1) * 2;
      const std::size_t bytes = row_bytes - at < kSendPieceBytes ? row_bytes - at : kSendPieceBytes;
      warp_copy_vectors<kSendVec, false>(reinterpret_cast<const int4*>(src + at),
                                         reinterpret_cast<int4*>(dst_body + dst * row_bytes + at),
                                         static_cast<int>(bytes / 16), lane);
    }
  }
}

/// The send phase of combine call `index` (writable passed): each expert's rows back to their sources (over
/// CombineSendArgs::split blocks; block by block after the signals when overlapped), then the headers and data flags.
/// `skip_own`: the rows of this rank's own tokens stay where they are (combine_recv reads them in x).
__device__ void combine_send(const Common& c, const CombineSendArgs& a, unsigned long long index, bool skip_own) {
  Control* own = control(c.peers[c.rank]);
  const int half = static_cast<int>(index & 1), dh = half ^ 1, R = c.num_ranks, me = c.rank, El = c.local_experts;

  const char* dbase = half_base(c, me, dh);  // the dispatch's half (the call just before)
  const auto* range = reinterpret_cast<const long long*>(dbase + c.layout_range);
  const int warp = threadIdx.x >> 5;
  __shared__ int gave_up;
  if (threadIdx.x == 0) gave_up = 0;
  __syncthreads();
  for (int e = blockIdx.x; e < El && a.signal_form != kSignalNone; e += gridDim.x)
    combine_send_overlapped(c, a, e, half, index, dbase, &gave_up);
  const int split = a.split > 0 ? a.split : 1;
  for (int u = blockIdx.x; u < El * split && a.signal_form == kSignalNone; u += gridDim.x) {
    const int e = u % El, part = u / El;
    send_expert_rows(c, a, e, half, dbase, part * kWarps + warp, split * kWarps, skip_own);
  }

  // Rows sent back to each source, summed by a whole block (not El x R dependent loads by one thread), in registers
  // and per warp: one shared atomic per (warp, source). (One per (expert, source) on R counters serialised block 0,
  // whose headers every receive waits for: El = 256 atomics on one address at R = 1.) A count fits 32 bits (T x K).
  __shared__ unsigned back[kMaxRanks];
  const auto sum_rows_back = [&] {
    if (threadIdx.x < kMaxRanks) back[threadIdx.x] = 0;
    unsigned mine[kMaxRanks] = {};
    for (int i = threadIdx.x; i < El * R; i += blockDim.x) {
      const auto rows = static_cast<unsigned>(range[i] & 0xffffffffll);
#pragma unroll
      for (int s = 0; s < kMaxRanks; ++s) mine[s] += s == i % R ? rows : 0u;
    }
    __syncthreads();
    for (int s = 0; s < R; ++s) {
      const unsigned sum = __reduce_add_sync(0xffffffffu, mine[s]);
      if ((threadIdx.x & 31) == 0 && sum != 0) atomicAdd(&back[s], sum);
    }
    __syncthreads();
  };
  if (a.signal_form == kSignalNone) {
    // No grid barrier: block 0 sums the rows (the dispatch's ranges, which no block writes) and writes the headers;
    // each block publishes its rows with one release-add share per source, the shares summing to kCallTag.
    if (blockIdx.x == 0) sum_rows_back();
    __syncthreads();
    stamp(c, kTraceSent);
    if (threadIdx.x != 0) return;
    if (blockIdx.x == 0)
      for (int s = 0; s < R; ++s) write_combine_header(c, s, half, index, static_cast<long long>(back[s]), false, 0, 0);
    const unsigned long long share = blockIdx.x == 0 ? kCallTag - (gridDim.x - 1) : 1ull;
    for (int s = 0; s < R; ++s) red_release_add(&control(c.peers[s])->data[half][me], share, s == me);
    stamp(c, kTracePublished);
    return;
  }
  // Overlapped: the last block also learns whether any block gave up on a signal, and marks the headers so.
  if (!last_block_all(&own->send_arrive)) return;
  sum_rows_back();
  if (threadIdx.x != 0) return;
  const bool marked = own->signal_gave_up != 0;  // after last_block_all's acquire: every block's mark is seen
  for (int s = 0; s < R; ++s)
    write_combine_header(c, s, half, index, static_cast<long long>(back[s]), marked, own->signal_expert,
                         static_cast<std::int32_t>(own->signal_block));
  own->signal_gave_up = 0;
  for (int s = 0; s < R; ++s) st_release(&control(c.peers[s])->data[half][me], data_target(index), s == me);
  stamp(c, kTracePublished);
}

/// The receive phase of combine call `index`: the weighted sum of every token's rows into out (the consumed flags
/// are raised by this rank's next launch). `own`: the send phase of the same launch (not overlapped), which left
/// the rows of this rank's own experts in its x: they are read there (the dispatch's self_row gives each one's row),
/// the others in the staging area. kInPlace: `own` is given (a compile-time choice, so the staged receive keeps its
/// plain loads: reading each slot's address from shared memory cost the hook receive ~3 us).
template <int kK, bool kInPlace>
__device__ void combine_recv(const Common& c, const CombineRecvArgs& a, unsigned long long index,
                             const CombineSendArgs* own) {
  const int half = static_cast<int>(index & 1), dh = half ^ 1, R = c.num_ranks, El = c.local_experts, K = a.K;
  // Rows each rank must send back: this rank's (token, k) pairs routed to it (checked by block 0, which also
  // reports id errors and a topk_idx that differs from the dispatch's).
  __shared__ long long expected[kMaxRanks];
  __shared__ long long n[kMaxRanks];
  if (threadIdx.x < kMaxRanks) expected[threadIdx.x] = 0;
  __syncthreads();
  const std::int32_t* sent = c.sent_idx + static_cast<std::size_t>(dh) * c.tmax * kMaxTopk;
  if (blockIdx.x == 0) {
    // A token per group of kK lanes (clean_id), counted in registers and summed per warp: one shared atomic per
    // (warp, rank). (An atomic per (token, k) on the same few counters serialised this block: ~0.4 us per token at
    // T = 128, the whole kernel waiting on it.) The dispatch's id is loaded beside the token's own.
    constexpr int kGroups = 32 / kK;
    const int lane = threadIdx.x & 31, k = lane % kK;
    int mine[kMaxRanks] = {};
    for (long long tw = static_cast<long long>(threadIdx.x >> 5) * kGroups; tw < a.T; tw += kWarps * kGroups) {
      const long long t = tw + lane / kK < a.T ? tw + lane / kK : -1;
      const int was = t >= 0 && k < K ? sent[t * K + k] : -1;
      const int id = clean_id<kK>(c, a.topk_idx, a.idx64, K, t, true, kPhaseCombineRecv, index);
      if (id != was) report(c, kErrIdsDiffer, c.rank, kPhaseCombineRecv, index, id, t * K + k);
      const int d = id >= 0 ? expert_rank(c, id) : -1;
#pragma unroll
      for (int r = 0; r < kMaxRanks; ++r) mine[r] += d == r ? 1 : 0;
    }
    for (int d = 0; d < R; ++d) {
      const int sum = __reduce_add_sync(0xffffffffu, mine[d]);
      if (lane == 0 && sum != 0) atomicAdd(reinterpret_cast<unsigned long long*>(&expected[d]),
                                           static_cast<unsigned long long>(sum));
    }
  }
  __syncthreads();
  if (blockIdx.x == 0) stamp(c, kTraceCounted);

  // out[t] = sum over k ascending of w[t, k] * row(t, k): float32 from +0.0f, each product rounded before it is
  // added (no fused multiply-add, as the CPU), one rounding to bf16. Items (token, chunk of kCombineChunk 16-byte
  // vectors of its row): kCombineVecs vectors per thread, all their K loads in flight before the sums, so a token's row
  // is one round of loads whatever H (a block per token took H / 8 / kThreads rounds: ~4 us at T = 1, H = 7168). When
  // the grid has more than one block, block 0 only counts (above) and the others take the items, so the count is off
  // their path.
  const long long H = c.hidden;
  const int nvec = static_cast<int>(H / 8);
  const long long chunks = (nvec + kCombineChunk<kK> - 1) / kCombineChunk<kK>, items = a.T * chunks;
  const long long first = gridDim.x > 1 ? static_cast<long long>(blockIdx.x) - 1 : 0;
  const long long stride = gridDim.x > 1 ? gridDim.x - 1 : 1;
  const auto* body = reinterpret_cast<const int4*>(half_base(c, c.rank, half) + c.staging +
                                                   static_cast<std::size_t>(R) * kHeaderBytes);
  // The item's ids and weights, the same for the whole block (an item is one token's): in shared memory, read where
  // used, so the registers hold the rows' loads.
  __shared__ int ids[kK];
  __shared__ float w[kK];
  __shared__ const int4* row_of[kK];  // where slot k's row is read: the staging area, or x for an own expert's
  __shared__ bool in_x[kK];           // row_of[k] lies in x (no source's data: loadable before the flags)
  const auto* self_row = reinterpret_cast<const std::int32_t*>(half_base(c, c.rank, dh) + c.self_row);
  const long long rows = static_cast<long long>(R) * c.tmax;
  int4 raw[kCombineVecs<kK>][kK];
  long long t = 0;
  int v = 0;  // the thread's first vector; the others kThreads apart
  const auto prepare = [&](long long item) {  // inputs, not data of the sources; a barrier follows before any use
    t = item / chunks;
    v = static_cast<int>(item % chunks) * kCombineChunk<kK> + static_cast<int>(threadIdx.x);
    if (threadIdx.x < 32) {  // slot k by lane k of warp 0 (its first group; the others have no token)
      const int k = static_cast<int>(threadIdx.x);
      const int id = clean_id<kK>(c, a.topk_idx, a.idx64, K, k < kK ? t : -1, false, kPhaseCombineRecv, index);
      if (k < kK) {
        ids[k] = id;
        w[k] = k < K ? a.weights[t * K + k] : 0.0f;
        if constexpr (kInPlace) {
          const int4* at = body + (static_cast<std::size_t>(t) * kMaxTopk + k) * nvec;
          bool x_row = false;
          if (id >= 0 && expert_rank(c, id) == c.rank) {
            // The dispatch's row of (t, k); ids other than the dispatch's are reported by block 0, and their row is
            // kept inside the expert's rows.
            const long long row = self_row[t * kMaxTopk + k];
            const long long e = id % El, r = row - e * rows;
            if (r >= 0 && r < rows) {
              at = reinterpret_cast<const int4*>(static_cast<const char*>(own->x) +
                                                 (e * own->stride0 + r * own->stride1) * 2);
              x_row = true;
            }
          }
          row_of[k] = at;
          in_x[k] = x_row;
        }
      }
    }
  };
  // Loads the item's rows: kRowsInX those in x, kRowsStaged those in the staging area, or both.
  enum : int { kRowsInX = 1, kRowsStaged = 2, kRowsAll = 3 };
  const auto load = [&](int which) {
#pragma unroll
    for (int u = 0; u < kCombineVecs<kK>; ++u) {
      const int vu = v + u * kThreads;
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        if constexpr (kInPlace) {
          if (vu < nvec && k < K && ids[k] >= 0 && (which & (in_x[k] ? kRowsInX : kRowsStaged)) != 0)
            raw[u][k] = __ldcg(row_of[k] + vu);
        } else if (vu < nvec && k < K && ids[k] >= 0) {
          raw[u][k] = __ldcg(body + (static_cast<std::size_t>(t) * kMaxTopk + k) * nvec + vu);
        }
      }
    }
  };
  const bool has_first = first >= 0 && first < items;
  // A block without items leaves (block 0 stays: it checks the counts): pollers of the one data flag slow the
  // blocks still sending.
  if (!has_first && blockIdx.x != 0) return;
  if (has_first) prepare(first);
  // The first item's rows in x are loaded at once (they wait on no source: at T = 1 their latency from memory
  // followed the flags), the others with the headers (after receive_headers' first barrier).
  if constexpr (kInPlace) {
    __syncthreads();
    if (has_first) load(kRowsInX);
  }
  if (!receive_headers(c, half, index, kKindCombine, 0, blockIdx.x == 0 ? expected : nullptr, n, kPhaseCombineRecv,
                       a.wait_cost, [&] {
                         if (has_first) load(kInPlace ? kRowsStaged : kRowsAll);
                       }))
    return;
  for (long long item = first; item >= 0 && item < items; item += stride) {
    if (item != first) {
      __syncthreads();  // the block's reads of the last item's ids are done
      prepare(item);
      __syncthreads();
      load(kRowsAll);
    }
#pragma unroll
    for (int u = 0; u < kCombineVecs<kK>; ++u) {
      const int vu = v + u * kThreads;
      if (vu >= nvec) continue;
      float acc[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        if (k >= K || ids[k] < 0) continue;
        const std::uint32_t words[4] = {static_cast<std::uint32_t>(raw[u][k].x), static_cast<std::uint32_t>(raw[u][k].y),
                                        static_cast<std::uint32_t>(raw[u][k].z), static_cast<std::uint32_t>(raw[u][k].w)};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          acc[2 * j] = __fadd_rn(acc[2 * j], __fmul_rn(w[k], __uint_as_float(words[j] << 16)));
          acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __fmul_rn(w[k], __uint_as_float(words[j] & 0xffff0000u)));
        }
      }
      std::uint32_t packed[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) packed[j] = pack_bf16x2(acc[2 * j], acc[2 * j + 1]);
      int4* out = reinterpret_cast<int4*>(static_cast<char*>(a.out) + t * a.out_stride * 2);
      out[vu] = make_int4(static_cast<int>(packed[0]), static_cast<int>(packed[1]), static_cast<int>(packed[2]),
                          static_cast<int>(packed[3]));
    }
  }
}

/// The most bytes of a combine's rows (T x K x H bf16, own or not) below which its own rows still go through the
/// staging area. One H100, R = 1, H = 7168, K = 8: at T = 128 (14 MiB) reading in place made the combine ~8 us
/// faster (the copy moves every byte twice); at T = 1 (115 KiB) the staged receive is the faster (12.6 us per
/// combine against 14.0 with this bound at 0, each against the same base in one call; docs/cuda_ipc_design.md,
/// "Own rows in place"). The crossover is not measured.
constexpr long long kOwnInPlaceBytes = 1ll << 20;

/// The index of a kernel's call: a send phase reads it (begin_send); a receive-only launch is the call sent `lag`
/// calls before the last (Control::calls counts the send kernels launched). Either raises the consumed flags the
/// launch owes first.
__device__ __forceinline__ unsigned long long call_index(const Common& c, int phases, long long lag) {
  if ((phases & kSendPhase) != 0) return begin_send(c);
  const unsigned long long index =
      read_volatile(&control(c.peers[c.rank])->calls) - 1 - static_cast<unsigned long long>(lag);
  publish_consumed(c, index);
  return index;
}

// One kernel per op, its phases a runtime argument (DeepEP's LOW_LATENCY_SEND_PHASE / _RECV_PHASE): both phases in
// one launch unless a recv hook splits them. With both, blocks that finish sending wait in the receive for the
// data flags the send's blocks raise, so the grid must be co-resident (launch_phases bounds it). A hook's two
// launches stay one instantiation: DeepEP's bench_kineto asserts one profiler row per op name.
template <int kK>
__global__ void __launch_bounds__(kThreads)
    dispatch_kernel(const __grid_constant__ Common c, const __grid_constant__ DispatchSendArgs sa,
                    const __grid_constant__ DispatchRecvArgs ra, int phases) {
  stamp(c, kTraceStart);
  const unsigned long long index = call_index(c, phases, ra.lag);
  stamp(c, kTraceIndex);
  if ((phases & kSendPhase) != 0) {
    const bool sent = dispatch_send<kK>(c, sa, index);
    end_send(c, index);
    if (!sent) return;
  }
  if ((phases & kRecvPhase) != 0) dispatch_recv(c, ra, index);
  stamp(c, kTraceEnd);
}

template <int kK>
__global__ void __launch_bounds__(kThreads)
    combine_kernel(const __grid_constant__ Common c, const __grid_constant__ CombineSendArgs sa,
                   const __grid_constant__ CombineRecvArgs ra, int phases) {
  stamp(c, kTraceStart);
  const unsigned long long index = call_index(c, phases, ra.lag);
  stamp(c, kTraceIndex);
  // Both phases, not overlapped, and rows enough: the rows of this rank's own experts are not copied to its staging
  // area but read in x by the receive (x is the launch's input: a recv hook's later launch could find it overwritten).
  const bool own = phases == (kSendPhase | kRecvPhase) && sa.signal_form == kSignalNone &&
                   ra.T * ra.K * c.hidden * 2 >= kOwnInPlaceBytes;
  if ((phases & kSendPhase) != 0) {
    const bool ok = writable(c, kPhaseCombineSend, index);
    if (ok) {
      stamp(c, kTraceWritable);
      combine_send(c, sa, index, own);
    }
    end_send(c, index);
    if (!ok) return;
  }
  if ((phases & kRecvPhase) != 0) {
    if (own)
      combine_recv<kK, true>(c, ra, index, &sa);
    else
      combine_recv<kK, false>(c, ra, index, nullptr);
  }
  stamp(c, kTraceEnd);
}

/// Lets kKernel launch with `smem` bytes of dynamic shared memory past the default 48 KiB (once per thread and
/// device: the limit is the device's).
template <auto kKernel>
void allow_dynamic_smem(std::size_t smem) {
  static thread_local std::uint64_t allowed = 0;  // bit d: set on device d (devices past 63 set it every time)
  if (smem <= 48 * 1024) return;
  int device = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 64 && ((allowed >> device) & 1u) != 0) return;
  EPMOE_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  if (device < 64) allowed |= std::uint64_t{1} << device;
}

/// The most blocks of kKernel the device holds at once (kThreads each, `smem` bytes of dynamic shared memory), cached
/// per thread for the last (device, smem).
template <auto kKernel>
int co_resident_blocks(std::size_t smem) {
  static thread_local int cached_device = -1, cached = 0;
  static thread_local std::size_t cached_smem = 0;
  int device = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&device));
  if (device != cached_device || smem != cached_smem) {
    int per_sm = 0, sms = 0;
    EPMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kThreads, smem));
    EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    cached = per_sm * sms > 0 ? per_sm * sms : 1;
    cached_device = device;
    cached_smem = smem;
  }
  return cached;
}

/// Launches kKernel on one grid: the send phase's or the receive phase's block count, or the larger when both
/// run (every phase loops over its work by gridDim), then bounded by co-residency (the receive waits on the send).
/// A launch of one phase is not bounded: a second wave's blocks start as the first's leave, which balances uneven
/// blocks (the combine send's experts) better than a loop fixed at launch (DeepEP's test, E = 288: 17.6 -> 23.2 us).
/// `recv_smem`: the dynamic shared memory of a launch with the receive phase.
template <auto kKernel, typename SendArgs, typename RecvArgs>
void launch_phases(const Common& c, const SendArgs& sa, const RecvArgs& ra, int phases, long long send_blocks,
                   long long recv_blocks, std::size_t recv_smem, cudaStream_t s) {
  long long g = phases == kSendPhase   ? send_blocks
                : phases == kRecvPhase ? recv_blocks
                                       : (send_blocks > recv_blocks ? send_blocks : recv_blocks);
  const std::size_t smem = (phases & kRecvPhase) != 0 ? recv_smem : 0;
  allow_dynamic_smem<kKernel>(smem);
  if (phases == (kSendPhase | kRecvPhase)) {
    const long long most = co_resident_blocks<kKernel>(smem);
    g = g < most ? g : most;
  }
  kKernel<<<static_cast<unsigned>(g < 1 ? 1 : g), kThreads, smem, s>>>(c, sa, ra, phases);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_dispatch(const Common& c, const DispatchSendArgs& sa, const DispatchRecvArgs& ra, int phases,
                     cudaStream_t s) {
  // Every block of a launch with both phases sends (scans the tokens and publishes a share of the data flags):
  // blocks that skipped the send to poll the flags early slowed the senders (all poll one flag), by ~4 us at T = 1.
  // A send alone: a warp per item (a word of a row to quantize, or a row piece per destination), at most one block
  // per SM.
  const bool fused = (sa.flags & 1u) != 0 && sa.records == nullptr;
  const long long words = ((c.hidden + 127) / 128 + 3) / 4;
  const long long row_pieces =
      static_cast<long long>(((sa.records != nullptr ? c.record_bytes : static_cast<std::size_t>(2 * c.hidden)) +
                              kPieceBytes - 1) / kPieceBytes);
  // (a row piece per destination: up to min(K, R) destinations per token)
  const long long dests = sa.K < c.num_ranks ? sa.K : c.num_ranks;
  const long long items = sa.T * (fused ? words : row_pieces * (dests > 0 ? dests : 1));
  long long send_blocks = (items + kWarps - 1) / kWarps;
  send_blocks = send_blocks < 1 ? 1 : (send_blocks > kMaxSendBlocks ? kMaxSendBlocks : send_blocks);
  const long long recv_blocks = c.local_experts;  // a block per local expert
  // K <= 8 (the common case) takes the instantiation with 8 register slots per token: half the code to fetch.
  if (sa.K <= 8)
    launch_phases<dispatch_kernel<8>>(c, sa, ra, phases, send_blocks, recv_blocks, kRecvSmemBytes, s);
  else
    launch_phases<dispatch_kernel<kMaxTopk>>(c, sa, ra, phases, send_blocks, recv_blocks, kRecvSmemBytes, s);
}

void launch_combine(const Common& c, const CombineSendArgs& sa_in, const CombineRecvArgs& ra, int phases,
                    cudaStream_t s) {
  // Not overlapped: `split` blocks per expert where the experts average two rows or more (R * T * K / E from this
  // rank's T, the peers' being alike in decode): an expert's rows were one block's, and the busiest expert's block
  // (~11 rows where the mean is 4 at T = 128, K = 8, E = 256) set the send's time. Below that, the second block of an
  // expert would find no rows, and its extra look at the layout delayed its block's share of the data flag.
  CombineSendArgs sa = sa_in;
  const long long mean_rows = c.num_experts > 0 ? c.num_ranks * ra.T * ra.K / c.num_experts : 0;
  sa.split = sa.signal_form == kSignalNone && mean_rows >= 2 ? 2 : 1;
  const long long send_blocks = sa.signal_form == kSignalNone ? c.local_experts * static_cast<long long>(sa.split)
                                : (sa.grid > 0 && sa.grid < c.local_experts ? sa.grid : c.local_experts);
  // a block per (token, chunk of kCombineChunk vectors of its row), loops beyond kMaxRecvBlocks; plus block 0, which
  // counts
  const long long chunk = ra.K <= 8 ? kCombineChunk<8> : kCombineChunk<kMaxTopk>;  // the kernel's instantiation
  const long long chunks = (c.hidden / 8 + chunk - 1) / chunk, items = ra.T * chunks;
  long long recv_blocks = (items < kMaxRecvBlocks ? items : kMaxRecvBlocks) + 1;
  // Overlapped: the send shares the GPU with the down GEMM, so the launch keeps to the send's blocks (num_sms).
  if (sa.signal_form != kSignalNone && (phases & kSendPhase) != 0) recv_blocks = send_blocks;
  // With both phases, no more blocks than the senders (or a block per token): a block beyond them would only poll the
  // data flag while they send (and its share of the flag would come first); the items loop instead.
  // Never fewer than a block per token (plus the counting block), so a small E_local (many ranks) keeps the
  // receive's parallelism.
  if (phases == (kSendPhase | kRecvPhase)) {
    const long long per_token = (ra.T < kMaxRecvBlocks ? ra.T : kMaxRecvBlocks) + 1;
    const long long bound = send_blocks > per_token ? send_blocks : per_token;
    if (recv_blocks > bound) recv_blocks = bound;
  }
  if (ra.K <= 8)
    launch_phases<combine_kernel<8>>(c, sa, ra, phases, send_blocks, recv_blocks, 0, s);
  else
    launch_phases<combine_kernel<kMaxTopk>>(c, sa, ra, phases, send_blocks, recv_blocks, 0, s);
}

}  // namespace epmoe::cuda_ipc_ll
