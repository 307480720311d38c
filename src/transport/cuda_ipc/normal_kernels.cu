// Kernels of the cuda-ipc normal mode: count exchange (notify), send positions, dispatch send/receive,
// combine send/reduce. Protocol and layout: cuda_ipc/normal.hpp and docs/cuda_ipc_design.md.
//
// Memory ordering: a block's rows are written with plain stores to the peer's memory; after a
// __syncthreads one thread per destination issues __threadfence_system and a st.release.sys of the op's
// sequence number into the destination's done flag. The receiver polls its own flags with
// ld.acquire.sys, then __syncthreads, then reads the rows with ld.global.cg (L2, never a stale L1 line).
// Every spin has a %globaltimer deadline: on expiry the first failing thread records (code, rank, peer,
// phase) in the host-mapped record and the kernel returns (no trap: that would poison the context).
#include <epmoe/dtype.hpp>

#include "core/bf16_device.cuh"
#include "core/cuda_util.hpp"
#include "transport/cuda_ipc/device.cuh"
#include "transport/cuda_ipc/normal_kernels.hpp"

namespace epmoe::cuda_ipc {

namespace {

using namespace cuda_ipc_device;

constexpr int kThreads = 512;  // 16 warps per data block
constexpr int kWarps = kThreads / 32;
// 16-byte vectors each lane keeps in flight when moving a row: memory passes here are bound by the bytes in
// flight per SM (16 warps x 32 lanes x 8 x 16 B = 64 KiB); 4 left the gather at ~45 GB/s per SM (H200).
constexpr int kVec = 8;

__device__ __forceinline__ Control* control(void* base) { return static_cast<Control*>(base); }
__device__ __forceinline__ char* data_region(void* base) { return static_cast<char*>(base) + kControlBytes; }

/// Records the first error of this rank's buffer in the host-mapped record (later errors are dropped). Not inlined:
/// a cold path, whose copies at every call site made the kernels' code bigger to fetch (cold after an L2 flush).
__device__ __noinline__ void report(const Common& c, int code, int peer, int phase, long long value, long long value2 = 0,
                       int index = 0) {
  report_error(&control(c.peers[c.rank])->claim, c.host, code, c.rank, peer, phase, value, value2,
               static_cast<unsigned long long>(index), c.seq);
}

/// Spins until *p >= seq; false (and an error recorded) after the timeout. `sleep_ns` > 0 backs off between
/// polls: for waits that overlap bulk transfers, where a hot polled line slows the L2 slice the data lands in.
__device__ bool wait_geq(const unsigned long long* p, const Common& c, int peer, int phase, unsigned sleep_ns = 0) {
  if (spin_geq(p, c.seq, c.timeout_ns, sleep_ns)) return true;
  report(c, kErrTimeout, peer, phase, static_cast<long long>(ld_acquire_sys(p)));
  return false;
}

/// Every thread of the block: waits for done[s][b] == seq from every source s and sender block b.
__device__ bool wait_all_done(const Common& c, int sender_blocks, int phase) {
  __shared__ int ok;
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  Control* mine = control(c.peers[c.rank]);
  for (int i = threadIdx.x; i < c.num_ranks * sender_blocks; i += blockDim.x) {
    const int s = i / sender_blocks, b = i % sender_blocks;
    if (!wait_geq(&mine->done[s][b], c, s, phase)) ok = 0;
  }
  __syncthreads();
  return ok != 0;
}

/// After this block's rows: one thread per destination publishes done[me][block] = seq there.
__device__ void signal_done(const Common& c) {
  __syncthreads();
  if (threadIdx.x < c.num_ranks) {
    __threadfence_system();
    st_release_sys(&control(c.peers[threadIdx.x])->done[c.rank][blockIdx.x], c.seq);
  }
}

/// One warp copies a row of `nvec` 16-byte vectors, kVec loads in flight per lane before their stores.
__device__ __forceinline__ void warp_copy_row(const int4* src, int4* dst, int nvec, int lane) {
  warp_copy_vectors<kVec, false>(src, dst, nvec, lane);
}

/// After this block's rows of pipeline stage j (every thread calls it): the last block of the grid to finish the
/// stage publishes chunk_done[me][j] = seq in every peer. One thread fences after the barrier (cumulative, as in
/// signal_done). Counting warps instead (no barrier, one fence per warp) was measured slower: 1536 system fences
/// per op instead of 96.
__device__ void publish_stage_if_last(const Common& c, int j) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence_system();
  const unsigned old = atomicAdd(&control(c.peers[c.rank])->chunk_arrive[j], 1u);
  if (old != gridDim.x - 1) return;
  __threadfence_system();
  for (int p = 0; p < c.num_ranks; ++p)
    if (p != c.rank) st_release_sys(&control(c.peers[p])->chunk_done[c.rank][j], c.seq);
}

/// Trace: block 0's thread 0 records %globaltimer at point `i` in the host-mapped record (a posted store).
__device__ __forceinline__ void stamp(const Common& c, int i) {
  if (c.trace && blockIdx.x == 0 && threadIdx.x == 0) c.host->stamps[i] = now_ns();
}

/// `c_in` with the current op's sequence number (set on the device by the op's notify kernel).
__device__ __forceinline__ Common op_common(const Common& c_in) {
  Common c = c_in;
  c.seq = *reinterpret_cast<volatile unsigned long long*>(&control(c_in.peers[c_in.rank])->op_seq);
  return c;
}

__device__ __forceinline__ bool aborted(const Common& c) {
  return *reinterpret_cast<volatile unsigned long long*>(&control(c.peers[c.rank])->abort_seq) == c.seq;
}

// ---- notify: the count exchange (or a bare handshake) ----

__global__ void begin_op_kernel(const __grid_constant__ Common c) {
  Control* own = control(c.peers[c.rank]);
  own->op_seq = own->op_seq + 1;
}

__global__ void push_gate_kernel(const __grid_constant__ Common c_in) {
  const Common c = op_common(c_in);
  Control* mine = control(c.peers[c.rank]);
  if (*reinterpret_cast<volatile unsigned long long*>(&mine->sm_op_seq) + 1 != c.seq) return;
  const int p = threadIdx.x;
  if (p < c.num_ranks && p != c.rank)
    wait_geq(&mine->slots[c.seq & 1][p].tag, c, p, kPhaseCombineNotify);  // a timeout is recorded: the op fails
}

/// One block (every thread calls it): for destination d, pos[t][d] = offset + (tokens t' < t with in_rank[t'][d]),
/// or -1 where t does not go to d; or, with `list`, list[d][position] = t. A block-wide scan over T.
__device__ void block_positions(const bool* in_rank, std::int64_t T, int R, int d, int offset, std::int32_t* pos_out,
                                std::int32_t* list) {
  const std::int64_t chunk = (T + blockDim.x - 1) / blockDim.x;
  const std::int64_t t0 = static_cast<std::int64_t>(threadIdx.x) * chunk;
  const std::int64_t t1 = t0 + chunk < T ? t0 + chunk : T;
  int count = 0;
  for (std::int64_t t = t0; t < t1; ++t) count += in_rank[t * R + d] ? 1 : 0;
  // Exclusive block scan of `count` (warp shuffles, then the warp totals).
  __shared__ int warp_total[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int incl = count;
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int nw = blockDim.x / 32;
    int v = lane < nw ? warp_total[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += u;
    }
    if (lane < nw) warp_total[lane] = v;  // inclusive over warps
  }
  __syncthreads();
  int pos = incl - count + (warp > 0 ? warp_total[warp - 1] : 0) + offset;
  for (std::int64_t t = t0; t < t1; ++t) {
    const bool in = in_rank[t * R + d];
    if (list) {
      if (in) list[d * T + pos] = static_cast<std::int32_t>(t);
    } else {
      pos_out[t * R + d] = in ? pos : -1;
    }
    pos += in ? 1 : 0;
  }
  __syncthreads();  // warp_total is reused by the next call
}

/// One thread: after the host record's writes (this thread's, or the block's before a barrier), tells the polling host
/// the record is complete.
__device__ __forceinline__ void publish_ticket(const Common& c, unsigned long long ticket) {
  if (ticket == 0) return;
  fence_acq_rel_sys();
  *reinterpret_cast<volatile unsigned long long*>(&c.host->ticket) = ticket;
}

// The notify kernel's steps, each called by every thread of its one block (barriers as noted). __forceinline__: the
// kernel compiles to the code of one function (the same PTX as when the steps were written inline).

/// This rank's counts into registers, loaded before the sequence number's barrier: their latency overlaps its read
/// (cold after an L2 flush, each dependent round trip is ~1 us of the op's fixed cost). One local expert per thread:
/// El <= kMaxLocalExperts = the block's 1024 threads.
__device__ __forceinline__ void load_own_counts(const NotifyArgs& a, int R, int El, std::int32_t& my_rank_count,
                                                std::int32_t (&my_expert_counts)[kMaxRanks]) {
  if (a.per_rank) {
    if (threadIdx.x < R) my_rank_count = a.per_rank[threadIdx.x];
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d)
      my_expert_counts[d] = d < R && static_cast<int>(threadIdx.x) < El ? a.per_expert[d * El + threadIdx.x] : 0;
  }
}

/// This rank's slot in every peer (settings, prestaged, offered receive slot, counts), then, after a barrier, its
/// tag: a peer that sees the tag sees the whole slot.
__device__ __forceinline__ void publish_own_slots(const Common& c, const NotifyArgs& a, int R, int me, int par, int El,
                                                  std::int32_t my_rank_count,
                                                  const std::int32_t (&my_expert_counts)[kMaxRanks]) {
  for (int d = 0; d < R; ++d) {
    NotifySlot* slot = &control(c.peers[d])->slots[par][me];
    for (int i = threadIdx.x; i < a.num_settings; i += blockDim.x) slot->settings[i] = a.settings[i];
    if (threadIdx.x == 0) {
      slot->prestaged = a.prestaged ? 1 : 0;
      slot->recv_slot = a.recv_slot;
    }
  }
  if (a.per_rank) {
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) {
      if (d >= R) break;
      NotifySlot* slot = &control(c.peers[d])->slots[par][me];
      if (threadIdx.x < R) slot->counts[threadIdx.x] = my_rank_count;
      if (static_cast<int>(threadIdx.x) < El) slot->expert_counts[threadIdx.x] = my_expert_counts[d];
    }
  }
  __syncthreads();
  if (threadIdx.x < R) {
    // A release fence after the barrier orders the whole block's slot writes before the tag (cumulativity), as
    // a full __threadfence_system would, for less.
    fence_acq_rel_sys();
    st_release_sys(&control(c.peers[threadIdx.x])->slots[par][me].tag, c.seq);
  }
}

/// Settings every rank must share (the same comparison on every rank: all of them abandon the op; the lowest
/// (setting, peer) wins so every rank names the same difference, in first_bad), and everything the peers sent, read
/// in one round before one barrier (parallel loads into shared memory; the counts are used only if the settings
/// agree).
__device__ __forceinline__ void read_peer_slots(const NotifyArgs& a, int R, int par, int El, Control* mine,
                                                int& first_bad, std::int32_t* prestaged, std::int32_t* offered,
                                                std::int32_t* counts, std::int32_t* expert_in) {
  for (int i = threadIdx.x; i < a.num_settings * R; i += blockDim.x) {
    const int k = i / R, s = i % R;
    const long long theirs = *reinterpret_cast<volatile long long*>(&mine->slots[par][s].settings[k]);
    if (theirs != a.settings[k]) atomicMin(&first_bad, i);
  }
  if (threadIdx.x < R) {
    prestaged[threadIdx.x] = *reinterpret_cast<volatile std::int32_t*>(&mine->slots[par][threadIdx.x].prestaged);
    offered[threadIdx.x] = *reinterpret_cast<volatile std::int32_t*>(&mine->slots[par][threadIdx.x].recv_slot);
  }
  if (a.per_rank) {
    for (int i = threadIdx.x; i < R * R; i += blockDim.x)
      counts[i] = *reinterpret_cast<volatile std::int32_t*>(&mine->slots[par][i / R].counts[i % R]);
    for (int i = threadIdx.x; i < R * El; i += blockDim.x)
      expert_in[i] = *reinterpret_cast<volatile std::int32_t*>(&mine->slots[par][i / El].expert_counts[i % El]);
  }
  __syncthreads();
}

/// Thread 0: the zero-copy path is taken when every rank offered a receive slot and none staged early (the same
/// choice everywhere); a handshake's ticket is published here (it has no counts to wait for).
__device__ __forceinline__ void choose_zero_copy(const Common& c, const NotifyArgs& a, int R, Control* mine,
                                                 const std::int32_t* prestaged, const std::int32_t* offered,
                                                 bool& any_prestaged, bool& direct) {
  if (threadIdx.x == 0) {
    bool all_slots = true;
    any_prestaged = false;
    for (int s = 0; s < R; ++s) {
      any_prestaged = any_prestaged || prestaged[s] != 0;
      all_slots = all_slots && offered[s] >= 0;
    }
    direct = all_slots && !any_prestaged;
    if (direct) mine->direct_seq = c.seq;
    c.host->use_direct = direct ? 1 : 0;
    if (!a.per_rank) publish_ticket(c, a.ticket);
  }
}

/// Threads d < R: the rank prefix matrix's column d (pm[s][d] = tokens ranks 0..s send to d), and the first error
/// (a column past 2^31 - 1 rows, or one past the receive capacity: the same on every rank, so every rank aborts).
/// A barrier follows.
__device__ __forceinline__ void prefix_matrix(const NotifyArgs& a, int R, const std::int32_t* counts,
                                              std::int32_t* pm, int& bad, int& bad_peer, long long& bad_value) {
  if (threadIdx.x < R) {
    const int d = threadIdx.x;
    long long acc = 0;
    for (int s = 0; s < R; ++s) {
      acc += counts[s * R + d];
      if (acc > 0x7fffffffLL) {
        bad = kErrOverflow;
        bad_peer = d;
        bad_value = acc;
        acc = 0x7fffffffLL;
      }
      pm[s * R + d] = static_cast<std::int32_t>(acc);
    }
    if (acc > a.recv_capacity) {  // the same on every rank: every rank aborts
      bad = a.worst ? kErrWorstTokens : kErrCapacity;
      bad_peer = d;
      bad_value = acc;
    }
  }
  __syncthreads();
}

/// The results, to the device outputs and the host record: the prefix matrix, the data path, the aligned expert
/// counts, then (after a barrier) the ticket the host polls.
__device__ __forceinline__ void publish_counts(const Common& c, const NotifyArgs& a, int R, int El, Control* mine,
                                               const std::int32_t* pm, const std::int32_t* expert_in,
                                               const bool& direct, const bool& any_prestaged) {
  volatile HostRecord* h = c.host;
  for (int i = threadIdx.x; i < R * R; i += blockDim.x) {
    a.pm_out[i] = pm[i];
    h->pm[i] = pm[i];
  }
  if (threadIdx.x == 0) {  // the data path (the same on every rank: pm is)
    const bool ce = !direct && a.ce_min_rows >= 0 && copy_engine_fits(pm, R, a.ce_capacity, a.ce_min_rows);
    if (!ce && !direct && any_prestaged) mine->sm_barrier_seq = c.seq;
    h->use_copy_engine = ce ? 1 : 0;
  }
  for (int e = threadIdx.x; e < El; e += blockDim.x) {
    long long n = 0;
    for (int s = 0; s < R; ++s) n += expert_in[s * El + e];
    n = (n + a.alignment - 1) / a.alignment * a.alignment;
    const std::int32_t v = static_cast<std::int32_t>(n > 0x7fffffffLL ? 0x7fffffffLL : n);
    a.expert_out[e] = v;
    h->expert_counts[e] = v;
  }
  if (threadIdx.x == 0) h->seq = c.seq;  // names the op the record belongs to (diagnosis)
  if (a.ticket) {
    __syncthreads();  // every thread's record writes before the ticket
    if (threadIdx.x == 0) publish_ticket(c, a.ticket);
  }
}

__global__ void __launch_bounds__(1024)
    notify_kernel(const __grid_constant__ Common c_in, const __grid_constant__ NotifyArgs a) {
  // The op's sequence number lives on the device (Control::op_seq, advanced by the first kernel of every op:
  // here, or begin_op): a captured CUDA graph replays with the next number, where a kernel parameter would
  // repeat the old one.
  stamp(c_in, kStampNotifyStart);
  // The zero-copy send kernel is launched behind this one as a programmatic dependent: its blocks may start now and
  // wait (griddepcontrol.wait) for this grid to finish, so its launch latency overlaps the exchange.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  __shared__ unsigned long long op;
  const int R = c_in.num_ranks, me = c_in.rank;
  const int El = a.experts_per_rank;
  std::int32_t my_rank_count = 0, my_expert_counts[kMaxRanks];
  load_own_counts(a, R, El, my_rank_count, my_expert_counts);
  if (threadIdx.x == 0) {
    Control* own = control(c_in.peers[c_in.rank]);
    op = *reinterpret_cast<volatile unsigned long long*>(&own->op_seq) + (a.advance ? 1 : 0);
    own->op_seq = op;
  }
  __syncthreads();
  Common c = c_in;
  c.seq = op;
  const int par = static_cast<int>(c.seq & 1);
  stamp(c, kStampNotifySeq);
  __shared__ int ok, bad, bad_peer, first_bad;
  __shared__ long long bad_value;
  if (threadIdx.x == 0) {
    ok = 1;
    bad = kErrNone;
    first_bad = 0x7fffffff;
  }
  publish_own_slots(c, a, R, me, par, El, my_rank_count, my_expert_counts);
  stamp(c, kStampNotifyReleased);
  // While the peers' counts are in flight: this rank's local send positions (zero-copy attempt).
  if (a.local_pos) {
    for (int d = 0; d < R; ++d) block_positions(a.in_rank, a.T, R, d, 0, a.local_pos, nullptr);
    stamp(c, kStampNotifyPositions);
  }
  if (threadIdx.x < R && !wait_geq(&control(c.peers[me])->slots[par][threadIdx.x].tag, c, threadIdx.x, a.phase))
    ok = 0;
  __syncthreads();
  stamp(c, kStampNotifyPeers);
  Control* mine = control(c.peers[me]);
  if (!ok) {
    if (threadIdx.x == 0) mine->abort_seq = c.seq;
    return;
  }
  __shared__ std::int32_t prestaged[kMaxRanks], offered[kMaxRanks], counts[kMaxRanks * kMaxRanks];
  __shared__ std::int32_t expert_in[kMaxRanks * kMaxLocalExperts];
  read_peer_slots(a, R, par, El, mine, first_bad, prestaged, offered, counts, expert_in);
  if (first_bad != 0x7fffffff) {
    if (threadIdx.x == 0) {
      const int k = first_bad / R, s = first_bad % R;
      report(c, kErrSettings, s, a.phase, *reinterpret_cast<volatile long long*>(&mine->slots[par][s].settings[k]),
             a.settings[k], k);
      mine->abort_seq = c.seq;
    }
    return;
  }
  stamp(c, kStampNotifyRead);
  __shared__ bool any_prestaged, direct;
  choose_zero_copy(c, a, R, mine, prestaged, offered, any_prestaged, direct);
  if (!a.per_rank) return;  // a handshake (cached dispatch, combine): the counts are known

  __shared__ std::int32_t pm[kMaxRanks * kMaxRanks];
  prefix_matrix(a, R, counts, pm, bad, bad_peer, bad_value);
  if (bad != kErrNone) {
    if (threadIdx.x == 0) {
      report(c, bad, bad_peer, a.phase, bad_value);
      mine->abort_seq = c.seq;
    }
    return;
  }
  publish_counts(c, a, R, El, mine, pm, expert_in, direct, any_prestaged);
  stamp(c, kStampNotifyEnd);
}

// ---- send positions: send_pos[t, d] = before(me, d) + (tokens t' < t sent to d), or -1; or the send lists ----

__global__ void __launch_bounds__(1024)
    send_pos_kernel(const __grid_constant__ Common c_in, const __grid_constant__ SendPosArgs a) {
  const Common c = op_common(c_in);
  const int R = c.num_ranks, d = blockIdx.x, me = c.rank;
  if (aborted(c)) return;
  block_positions(a.in_rank, a.T, R, d, me > 0 && a.pm ? a.pm[(me - 1) * R + d] : 0, a.send_pos, a.list);
}

// ---- dispatch: each source writes its rows straight into each destination's region ----

__global__ void __launch_bounds__(kThreads)
    dispatch_send_kernel(const __grid_constant__ Common c_in, const __grid_constant__ DispatchSendArgs a) {
  stamp(c_in, kStampSendStart);
  // Launched as a programmatic dependent of the notify (zero-copy path): everything below reads what it wrote. A
  // no-op when launched normally.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const Common c = op_common(c_in);
  const int R = c.num_ranks, lane = threadIdx.x & 31;
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const std::int64_t num_warps = static_cast<std::int64_t>(gridDim.x) * kWarps;
  const DataLayout& L = a.layout;
  const int nvec = static_cast<int>(a.x_row / 16);
  const int nscale = static_cast<int>(a.scale_row / 4);
  // Where destination d's fields start: d's region (row send_pos[t][d], its final row).
  __shared__ char* dst_x[kMaxRanks];
  __shared__ char* dst_scale[kMaxRanks];
  __shared__ long long* dst_idx[kMaxRanks];
  __shared__ float* dst_w[kMaxRanks];
  __shared__ std::int32_t* dst_src[kMaxRanks];
  Control* mine = control(c.peers[c.rank]);
  __shared__ int go;
  if (threadIdx.x == 0) {
    // Zero-copy: only when the exchange chose it (else this early launch stores and signals nothing).
    go = a.slot_bytes == 0 || *reinterpret_cast<volatile unsigned long long*>(&mine->direct_seq) == c.seq;
    for (int d = 0; d < R && go; ++d) {
      char* region = data_region(c.peers[d]);
      if (a.slot_bytes) {  // the slot destination d offered (it wrote its index into this rank's slot array)
        const int slot = *reinterpret_cast<volatile std::int32_t*>(&mine->slots[c.seq & 1][d].recv_slot);
        region += a.slot_base + static_cast<std::size_t>(slot) * a.slot_bytes;
      }
      dst_x[d] = region + L.x_off;
      dst_scale[d] = region + L.scale_off;
      dst_idx[d] = reinterpret_cast<long long*>(region + L.idx_off);
      dst_w[d] = reinterpret_cast<float*>(region + L.w_off);
      dst_src[d] = reinterpret_cast<std::int32_t*>(region + L.src_off);
    }
  }
  __syncthreads();
  if (!go) return;
  stamp(c, kStampSendGo);
  // A rank that staged before the count exchange may still be writing its region until its own send kernel starts
  // (its stream waits for the staging first): when the exchange chose this path after such a staging, meet every
  // peer before storing into its region. (Never on the zero-copy path: chosen only when no rank staged early.)
  if (blockIdx.x == 0 && threadIdx.x == 0 && a.slot_bytes == 0) mine->sm_op_seq = c.seq;
  if (*reinterpret_cast<volatile unsigned long long*>(&mine->sm_barrier_seq) == c.seq) {
    if (blockIdx.x == 0 && threadIdx.x < R) st_release_sys(&control(c.peers[threadIdx.x])->sm_go[c.rank], c.seq);
    if (threadIdx.x < R && !wait_geq(&mine->sm_go[threadIdx.x], c, threadIdx.x, kPhaseDispatchData)) go = 0;
    __syncthreads();
  }
  if (go && !aborted(c)) {
    for (std::int64_t t = warp; t < a.T; t += num_warps) {
      int my_pos = lane < R ? a.send_pos[t * R + lane] : -1;
      if (a.pm && lane < R && my_pos >= 0) {  // local position + the rows earlier sources send to `lane`
        my_pos += c.rank > 0 ? a.pm[(c.rank - 1) * R + lane] : 0;
        a.final_pos[t * R + lane] = my_pos;
      }
      std::int64_t pos[kMaxRanks];
#pragma unroll
      for (int d = 0; d < kMaxRanks; ++d) {
        const int p = __shfl_sync(0xffffffffu, my_pos, d);
        pos[d] = (d < R && p >= 0) ? p : -1;
        if (pos[d] >= L.capacity) {  // only a cached dispatch with another row size can get here
          if (lane == 0) report(c, kErrCapacity, d, kPhaseDispatchData, pos[d]);
          pos[d] = -1;
        }
      }
      // x: 16-byte vectors, four in flight per lane, each stored to every destination.
      const int4* src = reinterpret_cast<const int4*>(static_cast<const char*>(a.x) + t * a.x_row);
      for (int i0 = lane; i0 < nvec; i0 += 32 * kVec) {
        int4 v[kVec];
#pragma unroll
        for (int u = 0; u < kVec; ++u)
          if (i0 + u * 32 < nvec) v[u] = __ldg(src + i0 + u * 32);
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
          if (pos[d] < 0) continue;
          int4* dst = reinterpret_cast<int4*>(dst_x[d] + pos[d] * a.x_row);
#pragma unroll
          for (int u = 0; u < kVec; ++u)
            if (i0 + u * 32 < nvec) dst[i0 + u * 32] = v[u];
        }
      }
      if (a.scales) {
        const std::int32_t* ss = static_cast<const std::int32_t*>(a.scales) + t * a.scale_stride;
        for (int i = lane; i < nscale; i += 32) {
          const std::int32_t v = ss[i * a.scale_col_stride];
          for (int d = 0; d < R; ++d)
            if (pos[d] >= 0)
              reinterpret_cast<std::int32_t*>(dst_scale[d] + pos[d] * a.scale_row)[i] = v;
        }
      }
      if (a.topk_idx && lane < a.K) {
        const long long id = a.idx64 ? static_cast<const long long*>(a.topk_idx)[t * a.K + lane]
                                     : static_cast<const std::int32_t*>(a.topk_idx)[t * a.K + lane];
        const float w = a.weights ? a.weights[t * a.K + lane] : 0.0f;
        for (int d = 0; d < R; ++d) {
          if (pos[d] < 0) continue;
          const long long local = id - static_cast<long long>(d) * a.experts_per_rank;
          const bool mine = local >= 0 && local < a.experts_per_rank;
          if (dst_idx[d]) dst_idx[d][pos[d] * a.K + lane] = mine ? local : -1;
          if (a.weights && dst_w[d]) dst_w[d][pos[d] * a.K + lane] = mine ? w : 0.0f;
        }
      }
      if (a.write_src && lane < R && pos[lane] >= 0 && dst_src[lane])
        dst_src[lane][pos[lane]] = static_cast<std::int32_t>(t);
    }
  }
  stamp(c, kStampSendRows);
  signal_done(c);
  if (a.slot_bytes == 0) return;
  // Zero-copy: the last block waits for every sender's rows (every sender runs as many blocks), then copies this
  // rank's received source indices out of its slot (the handle keeps them; the slot is freed with the outputs).
  __shared__ int last;
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(&mine->send_arrive, 1u) == gridDim.x - 1;
    if (last) mine->send_arrive = 0;  // ready for the next op (stream order)
  }
  __syncthreads();
  if (!last || !wait_all_done(c, gridDim.x, kPhaseDispatchData)) return;
  if (c.trace && threadIdx.x == 0) c.host->stamps[kStampSendLast] = now_ns();
  if (!a.recv_src || aborted(c)) return;
  std::int64_t rows = a.pm[(R - 1) * R + c.rank];
  rows = rows < 0 ? 0 : (rows > L.capacity ? L.capacity : rows);
  const std::int32_t* src = dst_src[c.rank];
  for (std::int64_t i = threadIdx.x; i < rows; i += blockDim.x) a.recv_src[i] = __ldcg(src + i);
}

__global__ void __launch_bounds__(kThreads)
    dispatch_recv_kernel(const __grid_constant__ Common c_in, const __grid_constant__ DispatchRecvArgs a,
                         int sender_blocks) {
  const Common c = op_common(c_in);
  if (!wait_all_done(c, sender_blocks, kPhaseDispatchData) || aborted(c)) return;
  const int R = c.num_ranks, lane = threadIdx.x & 31;
  std::int64_t n = a.pm[(R - 1) * R + c.rank];
  if (n > a.layout.capacity) {  // only a cached dispatch with larger rows than its handle's can get here
    if (blockIdx.x == 0 && threadIdx.x == 0) report(c, kErrCapacity, c.rank, kPhaseDispatchData, n);
    n = a.layout.capacity;
  }
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const std::int64_t num_warps = static_cast<std::int64_t>(gridDim.x) * kWarps;
  const char* base = data_region(c.peers[c.rank]);
  const DataLayout& L = a.layout;
  const int nvec = static_cast<int>(a.x_row / 16), nscale = static_cast<int>(a.scale_row / 4);
  for (std::int64_t r = warp; r < a.rows; r += num_warps) {
    const bool valid = r < n;
    int4* dx = reinterpret_cast<int4*>(static_cast<char*>(a.recv_x) + r * a.x_row);
    const int4* sx = reinterpret_cast<const int4*>(base + L.x_off + r * a.x_row);
    for (int i0 = lane; i0 < nvec; i0 += 32 * kVec) {
      int4 v[kVec];
#pragma unroll
      for (int u = 0; u < kVec; ++u)
        if (i0 + u * 32 < nvec) v[u] = valid ? __ldcg(sx + i0 + u * 32) : make_int4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < kVec; ++u)
        if (i0 + u * 32 < nvec) dx[i0 + u * 32] = v[u];
    }
    if (a.recv_scales) {
      const std::int32_t* ss = reinterpret_cast<const std::int32_t*>(base + L.scale_off + r * a.scale_row);
      std::int32_t* ds = reinterpret_cast<std::int32_t*>(static_cast<char*>(a.recv_scales) + r * a.scale_row);
      for (int i = lane; i < nscale; i += 32) ds[i] = valid ? __ldcg(ss + i) : 0;
    }
    if (lane < a.K) {
      if (a.recv_idx)
        a.recv_idx[r * a.K + lane] =
            valid ? __ldcg(reinterpret_cast<const long long*>(base + L.idx_off) + r * a.K + lane) : -1;
      if (a.recv_w)
        a.recv_w[r * a.K + lane] =
            valid ? __ldcg(reinterpret_cast<const float*>(base + L.w_off) + r * a.K + lane) : 0.0f;
    }
    if (a.recv_src && lane == 0)
      a.recv_src[r] = valid ? __ldcg(reinterpret_cast<const std::int32_t*>(base + L.src_off) + r) : -1;
  }
}

// ---- combine: expert ranks write rows back into the token rank's slots; the token rank reduces ----

/// off[s] = rows rank s receives back from ranks before `me`; before[s] = pm[s-1][me]. (Shared arrays.)
__device__ void combine_offsets(const Common& c, const std::int32_t* pm, int me_as_dst, std::int32_t* off) {
  const int R = c.num_ranks;
  if (threadIdx.x < R) {
    const int s = threadIdx.x;
    std::int32_t o = 0;
    for (int d = 0; d < me_as_dst; ++d) o += pm[s * R + d] - (s > 0 ? pm[(s - 1) * R + d] : 0);
    off[s] = o;
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads)
    combine_send_kernel(const __grid_constant__ Common c_in, const __grid_constant__ CombineSendArgs a) {
  const Common c = op_common(c_in);
  const int R = c.num_ranks, me = c.rank, lane = threadIdx.x & 31;
  __shared__ std::int32_t off[kMaxRanks];
  combine_offsets(c, a.pm, me, off);
  const DataLayout& L = a.layout;
  if (blockIdx.x == 0 && threadIdx.x == 0) control(c.peers[me])->sm_op_seq = c.seq;
  if (!aborted(c)) {
    const std::int64_t n = a.pm[(R - 1) * R + me];
    const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
    const std::int64_t num_warps = static_cast<std::int64_t>(gridDim.x) * kWarps;
    const int nvec = static_cast<int>(a.x_row / 16);
    for (std::int64_t r = warp; r < n; r += num_warps) {
      int s = 0;
      while (r >= a.pm[s * R + me]) ++s;
      const std::int64_t j = r - (s > 0 ? a.pm[(s - 1) * R + me] : 0);
      const std::int64_t row = off[s] + j;
      if (row >= L.capacity) {
        if (lane == 0) report(c, kErrCapacity, s, kPhaseCombineData, row);
        continue;
      }
      char* base = data_region(c.peers[s]);
      const int4* sx = reinterpret_cast<const int4*>(static_cast<const char*>(a.x) + r * a.x_row);
      int4* dx = reinterpret_cast<int4*>(base + L.x_off + row * a.x_row);
      warp_copy_row(sx, dx, nvec, lane);
      if (a.weights && lane < a.K)
        reinterpret_cast<float*>(base + L.w_off)[row * a.K + lane] = a.weights[r * a.K + lane];
    }
  }
  signal_done(c);
}

__global__ void __launch_bounds__(kThreads)
    combine_push_kernel(const __grid_constant__ Common c_in, const __grid_constant__ CombinePushArgs a) {
  const Common c = op_common(c_in);
  const int R = c.num_ranks, lane = threadIdx.x & 31;
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const std::int64_t num_warps = static_cast<std::int64_t>(gridDim.x) * kWarps;
  const int nvec = static_cast<int>(a.x_row / 16);
  for (int j = 0; j < a.chunks; ++j) {
    std::int64_t lo[kMaxRanks], total = 0;
    for (int d = 0; d < R; ++d) {
      lo[d] = stage_begin(a.count[d], j, a.chunks);
      total += stage_begin(a.count[d], j + 1, a.chunks) - lo[d];
    }
    for (std::int64_t w = warp; w < total; w += num_warps) {
      std::int64_t k = w;
      int d = 0;
      for (; d < R; ++d) {
        const std::int64_t len = stage_begin(a.count[d], j + 1, a.chunks) - lo[d];
        if (k < len) break;
        k -= len;
      }
      const std::int64_t i = lo[d] + k, src_row = a.first[d] + i, dst_row = a.slot[d] + i;
      char* region = data_region(c.peers[d]);
      const int4* src = reinterpret_cast<const int4*>(static_cast<const char*>(a.x) + src_row * a.x_row);
      int4* dst = reinterpret_cast<int4*>(region + a.layout.x_off + dst_row * a.x_row);
      warp_copy_row(src, dst, nvec, lane);
      if (a.weights && lane < a.K)
        reinterpret_cast<float*>(region + a.layout.w_off)[dst_row * a.K + lane] = a.weights[src_row * a.K + lane];
    }
    publish_stage_if_last(c, j);
  }
}

/// NR: ranks rounded up to 2, 4 or 8 (registers: kU x NR 16-byte vectors in flight per lane, 16 in all).
template <int NR>
__global__ void __launch_bounds__(kThreads)
    combine_reduce_kernel(const __grid_constant__ Common c_in, const __grid_constant__ CombineReduceArgs a,
                          int sender_blocks) {
  const Common c = op_common(c_in);
  constexpr int kU = 16 / NR;
  if (a.chunks == 0 && !wait_all_done(c, sender_blocks, kPhaseCombineData)) return;
  if (aborted(c)) return;
  const int R = c.num_ranks, me = c.rank, lane = threadIdx.x & 31;
  // off[d] = rows returned by ranks before d (this rank's send counts, ascending d; the copy-engine path leaves
  // out this rank's own rows, read from local_x); before[d] = pm[me-1][d].
  __shared__ std::int32_t off[kMaxRanks], before[kMaxRanks];
  // Pipelined: the last stage of each peer this block has seen published, and the one this round needs.
  // all_ready: every peer's last stage seen (or nothing to wait for): the rounds skip the waiting and its barriers.
  __shared__ int ready[kMaxRanks], need[kMaxRanks], failed, all_ready;
  if (threadIdx.x == 0) {
    std::int32_t o = 0;
    all_ready = 1;
    for (int d = 0; d < R; ++d) {
      const std::int32_t b = me > 0 ? a.pm[(me - 1) * R + d] : 0;
      off[d] = o;
      before[d] = b;
      if (!(a.local_x && d == me)) o += a.pm[me * R + d] - b;
      ready[d] = -1;
      need[d] = -1;
      if (a.chunks > 0 && d != me && a.n_back[d] > 0) all_ready = 0;
    }
    failed = 0;
  }
  __syncthreads();
  const char* base = data_region(c.peers[me]);
  const DataLayout& L = a.layout;
  const std::size_t x_row = static_cast<std::size_t>(a.H) * 2;
  const int nvec = static_cast<int>(x_row / 16);
  Control* mine = control(c.peers[me]);
  // Rounds of one token per warp; in each round one thread per peer waits for the stages the round reads (with
  // a back-off), instead of every warp polling: hundreds of pollers on one line slowed the incoming copies.
  for (std::int64_t t0 = static_cast<std::int64_t>(blockIdx.x) * kWarps; t0 < a.T;
       t0 += static_cast<std::int64_t>(gridDim.x) * kWarps) {
    const std::int64_t t = t0 + (threadIdx.x >> 5);
    const bool have = t < a.T;
    const int my_pos = (have && lane < R) ? a.send_pos[t * R + lane] : -1;
    if (a.chunks > 0 && !all_ready) {  // uniform: all_ready changes only between the barriers below
      if (lane < R && lane != me && my_pos >= 0) {
        const std::int64_t i = my_pos - before[lane], n = a.n_back[lane];
        int j = static_cast<int>(i * a.chunks / (n > 0 ? n : 1));
        while (j + 1 < a.chunks && stage_begin(n, j + 1, a.chunks) <= i) ++j;
        while (j > 0 && stage_begin(n, j, a.chunks) > i) --j;
        atomicMax(&need[lane], j);
      }
      __syncthreads();
      if (threadIdx.x < R) {
        const int d = threadIdx.x;
        // Stages land out of order (two side streams): wait for every one up to the needed one.
        for (int j = ready[d] + 1; j <= need[d]; ++j)
          if (!wait_geq(&mine->chunk_done[d][j], c, d, kPhaseCombineData, 128)) failed = 1;
        if (need[d] > ready[d]) ready[d] = need[d];
      }
      __syncthreads();
      if (failed) return;
      if (threadIdx.x == 0) {
        int all = 1;
        for (int d = 0; d < R; ++d)
          if (d != me && a.n_back[d] > 0 && ready[d] < a.chunks - 1) all = 0;
        all_ready = all;
      }
      __syncthreads();
    }
    if (!have) continue;
    std::int64_t row[NR];
    const char* src_x[NR];
    const float* src_w[NR];
#pragma unroll
    for (int d = 0; d < NR; ++d) {
      const int p = __shfl_sync(0xffffffffu, my_pos, d);
      const bool local = a.local_x != nullptr && d == me;
      row[d] = (d < R && p >= 0) ? (local ? p : static_cast<std::int64_t>(off[d]) + (p - before[d])) : -1;
      src_x[d] = local ? static_cast<const char*>(a.local_x) : base + L.x_off;
      src_w[d] = local ? a.local_w : reinterpret_cast<const float*>(base + L.w_off);
    }
    // kU 16-byte vectors per lane per source, all loads issued before the sums: more bytes in flight per SM.
    for (int i0 = lane; i0 < nvec; i0 += 32 * kU) {
      int4 v[kU][NR];
#pragma unroll
      for (int u = 0; u < kU; ++u)
#pragma unroll
        for (int d = 0; d < NR; ++d)
          if (row[d] >= 0 && i0 + 32 * u < nvec)
            v[u][d] = __ldcg(reinterpret_cast<const int4*>(src_x[d] + row[d] * x_row) + i0 + 32 * u);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int i = i0 + 32 * u;
        if (i >= nvec) continue;
        float acc[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
#pragma unroll
        for (int d = 0; d < NR; ++d) {
          if (row[d] < 0) continue;
          const unsigned w[4] = {static_cast<unsigned>(v[u][d].x), static_cast<unsigned>(v[u][d].y),
                                 static_cast<unsigned>(v[u][d].z), static_cast<unsigned>(v[u][d].w)};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            acc[2 * j] = __fadd_rn(acc[2 * j], bf16_to_float(bf16_t{static_cast<std::uint16_t>(w[j] & 0xffffu)}));
            acc[2 * j + 1] =
                __fadd_rn(acc[2 * j + 1], bf16_to_float(bf16_t{static_cast<std::uint16_t>(w[j] >> 16)}));
          }
        }
        const void* biases[2] = {a.bias_0, a.bias_1};
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          if (!biases[b]) continue;
          const int4 bv = __ldg(reinterpret_cast<const int4*>(static_cast<const char*>(biases[b]) + t * x_row) + i);
          const unsigned w[4] = {static_cast<unsigned>(bv.x), static_cast<unsigned>(bv.y), static_cast<unsigned>(bv.z),
                                 static_cast<unsigned>(bv.w)};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            acc[2 * j] = __fadd_rn(acc[2 * j], bf16_to_float(bf16_t{static_cast<std::uint16_t>(w[j] & 0xffffu)}));
            acc[2 * j + 1] =
                __fadd_rn(acc[2 * j + 1], bf16_to_float(bf16_t{static_cast<std::uint16_t>(w[j] >> 16)}));
          }
        }
        unsigned packed[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
          packed[j] = pack_bf16x2(acc[2 * j], acc[2 * j + 1]);
        reinterpret_cast<int4*>(static_cast<char*>(a.out) + t * x_row)[i] =
            make_int4(static_cast<int>(packed[0]), static_cast<int>(packed[1]), static_cast<int>(packed[2]),
                      static_cast<int>(packed[3]));
      }
    }
    if (a.out_w && lane < a.K) {
      float s = 0.0f;
      for (int d = 0; d < R; ++d)
        if (row[d] >= 0) s = __fadd_rn(s, __ldcg(src_w[d] + row[d] * a.K + lane));
      a.out_w[t * a.K + lane] = s;
    }
  }
}

// ---- copy-engine dispatch: send lists and the staged gather ----

__global__ void send_list_kernel(const __grid_constant__ Common c_in, const __grid_constant__ SendListArgs a) {
  const Common c = op_common(c_in);
  const int R = c.num_ranks, me = c.rank;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= a.T || aborted(c)) return;
  for (int d = 0; d < R; ++d) {
    const int p = a.send_pos[t * R + d];
    if (p >= 0) a.list[d * a.T + (p - (me > 0 && a.pm ? a.pm[(me - 1) * R + d] : 0))] = static_cast<std::int32_t>(t);
  }
}

/// One warp moves token t's row into `row` of the destination fields, with top-k ids made local to rank d.
__device__ __forceinline__ void gather_row(const GatherArgs& a, std::int64_t t, int d, char* x, char* scales,
                                           long long* idx, float* w, std::int32_t* src, std::int64_t row, int lane) {
  const int nvec = static_cast<int>(a.x_row / 16);
  const int4* sx = reinterpret_cast<const int4*>(static_cast<const char*>(a.x) + t * a.x_row);
  int4* dx = reinterpret_cast<int4*>(x + row * a.x_row);
  warp_copy_row(sx, dx, nvec, lane);
  if (a.scales) {
    const int nscale = static_cast<int>(a.scale_row / 4);
    const std::int32_t* ss = static_cast<const std::int32_t*>(a.scales) + t * a.scale_stride;
    std::int32_t* ds = reinterpret_cast<std::int32_t*>(scales + row * a.scale_row);
    for (int i = lane; i < nscale; i += 32) ds[i] = ss[i * a.scale_col_stride];
  }
  if (a.topk_idx && lane < a.K) {
    const long long id = a.idx64 ? static_cast<const long long*>(a.topk_idx)[t * a.K + lane]
                                 : static_cast<const std::int32_t*>(a.topk_idx)[t * a.K + lane];
    const long long local = id - static_cast<long long>(d) * a.experts_per_rank;
    const bool mine = local >= 0 && local < a.experts_per_rank;
    if (idx) idx[row * a.K + lane] = mine ? local : -1;
    if (a.weights && w) w[row * a.K + lane] = mine ? a.weights[t * a.K + lane] : 0.0f;
  }
  if (a.write_src && src && lane == 0) src[row] = static_cast<std::int32_t>(t);
}

__global__ void __launch_bounds__(kThreads)
    gather_kernel(const __grid_constant__ Common c_in, const __grid_constant__ GatherArgs a) {
  const Common c = op_common(c_in);
  const int R = c.num_ranks, me = c.rank, lane = threadIdx.x & 31;
  if (aborted(c)) return;
  const bool own = a.part == kGatherOwn;
  __shared__ std::int64_t n[kMaxRanks], staged[kMaxRanks];
  __shared__ std::int64_t own_first, grouped;
  if (threadIdx.x == 0) {
    grouped = 0;
    for (int d = 0; d < R; ++d) {
      const std::int64_t before = me > 0 && (own || !a.per_rank) ? a.pm[(me - 1) * R + d] : 0;
      n[d] = a.per_rank ? a.per_rank[d] : a.pm[me * R + d] - before;
      staged[d] = grouped;
      if (d != me) grouped += n[d];
      if (d == me) own_first = before;
    }
  }
  __syncthreads();
  if (!own && grouped > a.layout.capacity) return;  // does not fit: the count exchange chooses the SM path
  const DataLayout& L = a.layout;
  char* region = data_region(c.peers[me]);
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const std::int64_t num_warps = static_cast<std::int64_t>(gridDim.x) * kWarps;
  const int first = own ? a.chunks : 0, last = own ? a.chunks : a.chunks - 1;
  for (int j = first; j <= last; ++j) {
    std::int64_t lo[kMaxRanks], total = 0;
    for (int d = 0; d < R; ++d) {
      const bool take = own ? d == me : d != me;
      lo[d] = take ? (own ? 0 : stage_begin(n[d], j, a.chunks)) : 0;
      const std::int64_t hi = take ? (own ? n[d] : stage_begin(n[d], j + 1, a.chunks)) : 0;
      total += hi - lo[d];
    }
    for (std::int64_t w = warp; w < total; w += num_warps) {
      std::int64_t k = w;
      int d = 0;
      for (; d < R; ++d) {
        const bool take = own ? d == me : d != me;
        if (!take) continue;
        const std::int64_t len = (own ? n[d] : stage_begin(n[d], j + 1, a.chunks)) - lo[d];
        if (k < len) break;
        k -= len;
      }
      const std::int64_t i = lo[d] + k;
      const std::int64_t t = a.list[d * a.T + i];
      if (own)
        gather_row(a, t, d, static_cast<char*>(a.recv_x), static_cast<char*>(a.recv_scales),
                   reinterpret_cast<long long*>(a.recv_idx), a.recv_w, a.recv_src, own_first + i, lane);
      else
        gather_row(a, t, d, region + L.x_off, region + L.scale_off, reinterpret_cast<long long*>(region + L.idx_off),
                   reinterpret_cast<float*>(region + L.w_off), reinterpret_cast<std::int32_t*>(region + L.src_off),
                   staged[d] + i, lane);
    }
    if (own) break;
    publish_stage_if_last(c, j);
  }
}

/// Copies `bytes` from src to dst with the whole grid (16-byte vectors when both are aligned, else 4-byte words;
/// `bytes` a multiple of 4), several loads in flight per thread: the source is a peer's memory.
__device__ void grid_copy(char* dst, const char* src, std::size_t bytes) {
  const std::size_t tid = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t nthreads = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  constexpr int kIn = 4;
  if (((reinterpret_cast<std::uintptr_t>(dst) | reinterpret_cast<std::uintptr_t>(src) | bytes) & 15) == 0) {
    const std::size_t n = bytes / 16;
    for (std::size_t i0 = tid; i0 < n; i0 += nthreads * kIn) {
      int4 v[kIn];
#pragma unroll
      for (int u = 0; u < kIn; ++u)
        if (i0 + u * nthreads < n) v[u] = __ldcg(reinterpret_cast<const int4*>(src) + i0 + u * nthreads);
#pragma unroll
      for (int u = 0; u < kIn; ++u)
        if (i0 + u * nthreads < n) reinterpret_cast<int4*>(dst)[i0 + u * nthreads] = v[u];
    }
  } else {
    const std::size_t n = bytes / 4;
    for (std::size_t i0 = tid; i0 < n; i0 += nthreads * kIn) {
      int v[kIn];
#pragma unroll
      for (int u = 0; u < kIn; ++u)
        if (i0 + u * nthreads < n) v[u] = __ldcg(reinterpret_cast<const int*>(src) + i0 + u * nthreads);
#pragma unroll
      for (int u = 0; u < kIn; ++u)
        if (i0 + u * nthreads < n) reinterpret_cast<int*>(dst)[i0 + u * nthreads] = v[u];
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    pull_small_kernel(const __grid_constant__ Common c_in, const __grid_constant__ PullSmallArgs a) {
  const Common c = op_common(c_in);
  const int R = c.num_ranks, me = c.rank;
  __shared__ int ok;
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  if (threadIdx.x < R && threadIdx.x != me && a.count[threadIdx.x] > 0)
    for (int j = 0; j < a.chunks; ++j)
      if (!wait_geq(&control(c.peers[me])->chunk_done[threadIdx.x][j], c, threadIdx.x, kPhaseDispatchData, 128))
        ok = 0;
  __syncthreads();
  if (!ok || aborted(c)) return;
  const DataLayout& L = a.layout;
  for (int src = 0; src < R; ++src) {
    const std::int64_t n = a.count[src];
    if (src == me || n == 0) continue;
    const char* region = data_region(c.peers[src]);
    const auto field = [&](void* out, std::size_t off, std::size_t row) {
      if (out)
        grid_copy(static_cast<char*>(out) + a.dst_first[src] * row, region + off + a.src_first[src] * row, n * row);
    };
    if (a.scale_row) field(a.recv_scales, L.scale_off, a.scale_row);
    field(a.recv_idx, L.idx_off, 8 * static_cast<std::size_t>(a.K));
    field(a.recv_w, L.w_off, 4 * static_cast<std::size_t>(a.K));
    field(a.recv_src, L.src_off, 4);
  }
}

__global__ void signal_chunk_kernel(const __grid_constant__ Common c_in, int chunk) {
  const Common c = op_common(c_in);
  if (threadIdx.x < c.num_ranks && threadIdx.x != c.rank) {
    __threadfence_system();
    st_release_sys(&control(c.peers[threadIdx.x])->chunk_done[c.rank][chunk], c.seq);
  }
}

__global__ void wait_chunk_kernel(const __grid_constant__ Common c_in, int chunk, int phase) {
  const Common c = op_common(c_in);
  if (threadIdx.x < c.num_ranks && threadIdx.x != c.rank)
    wait_geq(&control(c.peers[c.rank])->chunk_done[threadIdx.x][chunk], c, threadIdx.x, phase);
}

__global__ void signal_kernel(const __grid_constant__ Common c_in) {
  const Common c = op_common(c_in);
  if (threadIdx.x < c.num_ranks) {
    __threadfence_system();
    st_release_sys(&control(c.peers[threadIdx.x])->done[c.rank][0], c.seq);
  }
}

__global__ void wait_kernel(const __grid_constant__ Common c_in, int sender_blocks, int phase) {
  const Common c = op_common(c_in);
  wait_all_done(c, sender_blocks, phase);
}

}  // namespace

void launch_send_list(const Common& c, const SendListArgs& a, cudaStream_t s) {
  if (a.T == 0) return;
  send_list_kernel<<<static_cast<unsigned>((a.T + 255) / 256), 256, 0, s>>>(c, a);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_gather(const Common& c, const GatherArgs& a, int blocks, cudaStream_t s) {
  gather_kernel<<<blocks, kThreads, 0, s>>>(c, a);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_pull_small(const Common& c, const PullSmallArgs& a, int blocks, cudaStream_t s) {
  pull_small_kernel<<<blocks, kThreads, 0, s>>>(c, a);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_signal_chunk(const Common& c, int chunk, cudaStream_t s) {
  signal_chunk_kernel<<<1, 32, 0, s>>>(c, chunk);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_wait_chunk(const Common& c, int chunk, int phase, cudaStream_t s) {
  wait_chunk_kernel<<<1, 32, 0, s>>>(c, chunk, phase);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_signal(const Common& c, cudaStream_t s) {
  signal_kernel<<<1, 32, 0, s>>>(c);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_wait(const Common& c, int sender_blocks, int phase, cudaStream_t s) {
  wait_kernel<<<1, 256, 0, s>>>(c, sender_blocks, phase);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_begin_op(const Common& c, cudaStream_t s) {
  begin_op_kernel<<<1, 1, 0, s>>>(c);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_push_gate(const Common& c, cudaStream_t s) {
  push_gate_kernel<<<1, 32 * ((kMaxRanks + 31) / 32), 0, s>>>(c);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_notify(const Common& c, const NotifyArgs& a, cudaStream_t s) {
  static_assert(kMaxLocalExperts <= 1024, "notify_kernel gives each local expert a thread");
  notify_kernel<<<1, 1024, 0, s>>>(c, a);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_send_pos(const Common& c, const SendPosArgs& a, cudaStream_t s) {
  if (a.T == 0) return;
  send_pos_kernel<<<c.num_ranks, 1024, 0, s>>>(c, a);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_dispatch_send(const Common& c, const DispatchSendArgs& a, int blocks, cudaStream_t s, bool after_notify) {
  if (!after_notify) {
    dispatch_send_kernel<<<blocks, kThreads, 0, s>>>(c, a);
    EPMOE_CUDA_CHECK_LAUNCH();
    return;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(kThreads);
  config.stream = s;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  EPMOE_CUDA_CHECK(cudaLaunchKernelEx(&config, dispatch_send_kernel, c, a));
}

void launch_dispatch_recv(const Common& c, const DispatchRecvArgs& a, int blocks, int sender_blocks, cudaStream_t s) {
  dispatch_recv_kernel<<<blocks, kThreads, 0, s>>>(c, a, sender_blocks);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_combine_send(const Common& c, const CombineSendArgs& a, int blocks, cudaStream_t s) {
  combine_send_kernel<<<blocks, kThreads, 0, s>>>(c, a);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_combine_push(const Common& c, const CombinePushArgs& a, int blocks, cudaStream_t s) {
  auto* own = static_cast<Control*>(c.peers[c.rank]);
  EPMOE_CUDA_CHECK(cudaMemsetAsync(own->chunk_arrive, 0, sizeof(own->chunk_arrive), s));
  combine_push_kernel<<<blocks, kThreads, 0, s>>>(c, a);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_combine_reduce(const Common& c, const CombineReduceArgs& a, int blocks, int sender_blocks, cudaStream_t s) {
  if (c.num_ranks <= 2)
    combine_reduce_kernel<2><<<blocks, kThreads, 0, s>>>(c, a, sender_blocks);
  else if (c.num_ranks <= 4)
    combine_reduce_kernel<4><<<blocks, kThreads, 0, s>>>(c, a, sender_blocks);
  else
    combine_reduce_kernel<8><<<blocks, kThreads, 0, s>>>(c, a, sender_blocks);
  EPMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace epmoe::cuda_ipc
