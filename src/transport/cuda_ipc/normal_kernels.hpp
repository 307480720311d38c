// Kernels of the cuda-ipc normal mode (CUDA builds only): the buffer layout they share with the host
// class, their parameter records and thin launchers. No fmt here (this header is included by the .cu).
// The protocol is described in cuda_ipc/normal.hpp and docs/cuda_ipc_design.md.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "transport/cuda_ipc/error.hpp"

namespace epmoe::cuda_ipc {

inline constexpr int kMaxRanks = 8;            // one NVLink host
inline constexpr int kMaxLocalExperts = 1024;  // semantics §1
inline constexpr int kMaxBlocks = 64;          // data-kernel blocks (BufferOptions::num_sms)
inline constexpr int kDefaultBlocks = 24;  // measured best on 2x H200 at T=4096 (bench/results); DeepEP uses 24
inline constexpr int kMaxSettings = 12;
inline constexpr int kMaxChunks = 16;    // pipeline stages of the copy-engine path (BufferOptions::num_chunks)
inline constexpr int kDefaultChunks = 4;  // settings every rank must agree on, compared in-band by notify

/// The count packet one rank writes into each peer's control region (one slot per source rank and
/// parity). `tag` is written last, with release semantics, and equals the op's sequence number.
struct NotifySlot {
  unsigned long long tag;
  unsigned long long pad;
  long long settings[kMaxSettings];              // the op's settings, compared with the receiver's own
  std::int32_t counts[kMaxRanks];                // tokens the source sends to each rank
  std::int32_t expert_counts[kMaxLocalExperts];  // (token, expert) entries for the receiver's experts
  std::int32_t prestaged;                        // the source staged its rows before this count exchange
  std::int32_t recv_slot;  // the source's receive slot for this dispatch (zero-copy path), or -1: none free
};

/// Control region at the start of every rank's mapped buffer. Peers write slots and done flags; the
/// owner alone uses `claim` and `abort_seq` (device-scope words).
struct Control {
  NotifySlot slots[2][kMaxRanks];                  // [seq & 1][source]
  unsigned long long done[kMaxRanks][kMaxBlocks];  // [source][block] = seq once that block's rows are written
  unsigned long long chunk_done[kMaxRanks][kMaxChunks];  // [source][chunk] = seq once that chunk is in place
  unsigned int chunk_arrive[kMaxChunks];  // owner only: gather blocks done with each chunk (zeroed per op)
  unsigned long long abort_seq;                    // = seq when this rank's notify found an error
  unsigned long long op_seq;  // owner only: the current op's sequence number (advanced by every op's first kernel)
  // owner only: = seq when the count exchange chose the SM-store path after some rank staged before it; the
  // send kernel then meets every peer (sm_go) before storing into their regions, which a staging may still write.
  unsigned long long sm_barrier_seq;
  unsigned long long sm_go[kMaxRanks];  // [source] = seq once that source's staging is finished (SM path)
  // owner only: the last op whose ranks stored rows into the whole regions (SM-store path); see launch_push_gate.
  unsigned long long sm_op_seq;
  // owner only: = seq when the count exchange chose the zero-copy path (every rank offered a receive slot).
  unsigned long long direct_seq;
  unsigned int send_arrive;  // owner only: zero-copy send blocks done this op (the last one waits; reset by it)
  int claim;                                       // first error wins the host record
};
inline constexpr std::size_t kControlBytes = (sizeof(Control) + 4095) / 4096 * 4096;

/// Error codes written into HostRecord::error_code.
enum : int {
  kErrNone = 0,
  kErrTimeout = 1,
  kErrCapacity = 2,
  kErrWorstTokens = 3,
  kErrOverflow = 4,
  kErrSettings = 5  ///< error_index = the setting, error_value = the peer's value, error_value2 = this rank's
};
/// Phases named in HostRecord::error_phase.
enum : int {
  kPhaseDispatchNotify = 0,
  kPhaseDispatchData = 1,
  kPhaseCombineNotify = 2,
  kPhaseCombineData = 3,
  kPhaseCachedNotify = 4
};

/// Host-mapped record (cudaHostAlloc mapped) the kernels report to: the count exchange's result for
/// the host read, and the first error.
struct HostRecord : ErrorRecord {
  std::int32_t pm[kMaxRanks * kMaxRanks];        // rank_prefix_matrix of the last notify
  std::int32_t expert_counts[kMaxLocalExperts];  // aligned receive counts per local expert
  unsigned long long seq;                        // op whose pm / counts these are
  int use_copy_engine;                           // the count exchange's choice of data path (dispatch) ...
  int use_direct;                                // ... or the zero-copy path (every rank offered a slot)
  /// Trace (Common::trace): %globaltimer (ns) when block 0's thread 0 passed each kStamp* point of the op; 0 =
  /// not passed. The host clears them before an op and prints their means after it (EPMOE_CUDA_IPC_TRACE=1).
  long long stamps[16];
  /// NotifyArgs::ticket of the last notify the host waits for, written last (after a system release fence).
  unsigned long long ticket;
};
/// Points of HostRecord::stamps: the notify's phases, then the zero-copy send kernel's.
enum : int {
  kStampNotifyStart = 0,
  kStampNotifySeq,       ///< the op's sequence number read (after the first barrier)
  kStampNotifyReleased,  ///< this rank's slots written and their tags released
  kStampNotifyPositions, ///< local send positions computed (zero-copy attempt)
  kStampNotifyPeers,     ///< every peer's tag seen
  kStampNotifyRead,      ///< settings compared, the peers' counts read
  kStampNotifyEnd,       ///< prefix matrix and host record written
  kStampSendStart,
  kStampSendGo,          ///< the path checked and the destinations known
  kStampSendRows,        ///< block 0's rows stored
  kStampSendLast,        ///< the last block saw every sender's rows (zero-copy)
  kNumStamps
};

/// What every kernel of an op needs.
struct Common {
  void* peers[kMaxRanks];  ///< every rank's buffer base as mapped in this process (own included)
  int rank = 0, num_ranks = 0;
  /// The op's sequence number (equal on all ranks). Not set by the host: every kernel reads it from
  /// Control::op_seq, which the op's first kernel (notify, or begin_op) advances, so a captured CUDA graph
  /// replays correctly.
  unsigned long long seq = 0;
  long long timeout_ns = 0;
  HostRecord* host = nullptr;  ///< device pointer of the host-mapped record
  int trace = 0;               ///< write HostRecord::stamps (EPMOE_CUDA_IPC_TRACE=1)
};

/// Where the fields of a data op live inside the data region (bytes from the data region's start),
/// and how many rows each field holds. Equal on every rank (same bytes, same settings).
struct DataLayout {
  std::size_t x_off = 0, scale_off = 0, idx_off = 0, w_off = 0, src_off = 0;
  std::int64_t capacity = 0;
};

struct NotifyArgs {
  const std::int32_t* per_rank = nullptr;    ///< [R] this rank's send counts; null: handshake only
  const std::int32_t* per_expert = nullptr;  ///< [E]
  int experts_per_rank = 0;
  int alignment = 1;
  std::int64_t recv_capacity = 0;      ///< rows any rank may receive (num_worst_tokens, else the region's)
  bool worst = false;                  ///< recv_capacity is num_worst_tokens (error kErrWorstTokens)
  std::int32_t* pm_out = nullptr;      ///< device [R, R]
  std::int32_t* expert_out = nullptr;  ///< device [E_local]
  int phase = kPhaseDispatchNotify;
  /// >= 0: the copy-engine path is allowed; the count exchange takes it when copy_engine_fits(pm, ...,
  /// ce_capacity, ce_min_rows) (the same choice on every rank: pm is the same matrix everywhere).
  std::int64_t ce_min_rows = -1;
  std::int64_t ce_capacity = 0;
  /// false: begin_op already advanced the op's sequence number (work was enqueued before this exchange).
  bool advance = true;
  /// This rank staged its rows before this exchange (every rank learns whether any did: see sm_barrier_seq).
  bool prestaged = false;
  /// This rank's free receive slot (zero-copy path), or -1. The exchange takes the zero-copy path when every rank
  /// offered one and none staged early (the same choice everywhere); it overrides the copy-engine choice.
  int recv_slot = -1;
  long long settings[kMaxSettings] = {};  ///< compared with every peer's (kErrSettings on a difference)
  int num_settings = 0;
  /// Zero-copy attempt: local_pos[t][d] = tokens t' < t this rank sends to d, or -1 (is_token_in_rank [T, R]),
  /// computed while the peers' counts are in flight; the send kernel adds the prefix matrix's offsets (no
  /// send-position kernel between the exchange and the stores). Null: not computed.
  const bool* in_rank = nullptr;
  std::int32_t* local_pos = nullptr;
  std::int64_t T = 0;
  /// != 0: the host waits for this exchange by polling HostRecord::ticket (written with this value once the record is
  /// complete) rather than an event, so nothing sits between the notify and a send kernel launched as its
  /// programmatic dependent. 0: no host read (num_worst_tokens, CUDA graphs), nothing written.
  unsigned long long ticket = 0;
};

struct SendPosArgs {
  const bool* in_rank = nullptr;  ///< [T, R]
  const std::int32_t* pm = nullptr;  ///< null: local positions (tokens t' < t sent to d), no offset
  std::int64_t T = 0;
  std::int32_t* send_pos = nullptr;  ///< [T, R] out
  std::int32_t* list = nullptr;      ///< [R, T] out instead of send_pos: list[d][position] = t
};

/// The SM-store dispatch: every row stored into its destination's region at its final row send_pos[t][d]
/// (the receiver copies the region out); or, zero-copy (slot_bytes > 0), into the receive slot each destination
/// offered in the count exchange, which is that destination's output: no receive pass. A zero-copy launch is
/// enqueued before the host reads the counts and returns at once, storing and signalling nothing, unless the
/// exchange chose the zero-copy path (Control::direct_seq).
struct DispatchSendArgs {
  const void* x = nullptr;
  std::size_t x_row = 0;  ///< bytes, a multiple of 16
  const void* scales = nullptr;
  std::size_t scale_row = 0;  ///< bytes, a multiple of 4 (the rows sent)
  /// Element strides of x_scales [T, C] as given (row- or column-major; DeepEP's scale_token_stride and
  /// scale_hidden_stride): token t's scale c is scales[t * scale_stride + c * scale_col_stride].
  std::int64_t scale_stride = 0, scale_col_stride = 1;
  const void* topk_idx = nullptr;
  bool idx64 = true;
  int K = 0;
  const float* weights = nullptr;
  std::int64_t T = 0;
  const std::int32_t* send_pos = nullptr;  ///< [T, R] absolute rows in each destination
  int experts_per_rank = 0;
  bool write_src = true;
  DataLayout layout;
  std::size_t slot_base = 0;   ///< zero-copy: bytes from the data region's start to receive slot 0 (4 KiB aligned)
  std::size_t slot_bytes = 0;  ///< zero-copy: bytes of one slot (its fields at `layout`'s offsets); 0: region
  /// Zero-copy, fresh dispatch: send_pos holds the notify's local positions; each row's destination row is that
  /// plus the rows earlier sources send there (the prefix matrix `pm`, device [R, R]), written back into
  /// `final_pos` (the same array: the handle's send_pos). Null: send_pos is final.
  const std::int32_t* pm = nullptr;
  std::int32_t* final_pos = nullptr;
  /// Zero-copy: the last block of the grid waits for every sender's rows (no separate wait kernel) and copies
  /// this rank's received source indices (num_recv rows, from pm) out of its slot into recv_src (null: none).
  std::int32_t* recv_src = nullptr;
};

/// The copy-engine dispatch's send side. Rows for peer d are staged in this rank's region grouped by destination
/// ascending (in token order), in `chunks` pipeline stages: stage j holds rows [stage_begin(n_d, j),
/// stage_begin(n_d, j + 1)) of every peer's run (n_d = rows for d); once every block finished stage j, the last one
/// publishes chunk_done[me][j] = seq in every peer, which pulls that stage with the copy engine while later stages
/// are gathered. This rank's own rows go straight into its outputs (a second launch, once they are allocated).
/// The staging needs only this rank's routing, so it may run before the count exchange (into the op's half of
/// the region, see cuda_ipc/normal.cpp); it stages nothing when its rows exceed `layout.capacity` (the count exchange
/// then never chooses the copy-engine path).
enum GatherPart : int {
  kGatherStages = 1,  ///< the staged rows for the peers only (no outputs needed: runs before the host read)
  kGatherOwn = 2,     ///< this rank's own rows into its outputs only
};
struct GatherArgs {
  int part = kGatherStages;
  /// [R] this rank's send counts (the layout's num_tokens_per_rank), or null: taken from `pm`, which the
  /// own-rows pass always reads (and the staging when per_rank is null).
  const std::int32_t* per_rank = nullptr;
  const void* x = nullptr;
  std::size_t x_row = 0;
  const void* scales = nullptr;
  std::size_t scale_row = 0;
  std::int64_t scale_stride = 0, scale_col_stride = 1;  ///< as DispatchSendArgs'
  const void* topk_idx = nullptr;
  bool idx64 = true;
  int K = 0;
  const float* weights = nullptr;
  int experts_per_rank = 0;
  bool write_src = true;
  std::int64_t T = 0;
  const std::int32_t* list = nullptr;  ///< [R, T]: list[d][i] = the i-th token this rank sends to d
  const std::int32_t* pm = nullptr;    ///< device [R, R]
  int chunks = 1;
  DataLayout layout;
  void* recv_x = nullptr;  ///< this rank's outputs (its own rows)
  void* recv_scales = nullptr;
  std::int64_t* recv_idx = nullptr;
  float* recv_w = nullptr;
  std::int32_t* recv_src = nullptr;
};

/// list[d][send_pos[t][d] - pm[me-1][d]] = t for every token t sent to d.
struct SendListArgs {
  const std::int32_t* send_pos = nullptr;  ///< [T, R]
  const std::int32_t* pm = nullptr;        ///< null: send_pos holds local positions (no offset)
  std::int64_t T = 0;
  std::int32_t* list = nullptr;  ///< [R, T] out
};

/// The copy-engine dispatch's small fields (scales, local ids, weights, source index): each source's run of rows
/// for this rank is read straight from its region once every stage is published (one kernel instead of four
/// copies per source, each paying the copy engine's start-up at the op's tail).
struct PullSmallArgs {
  int chunks = 1;
  std::size_t scale_row = 0;  ///< bytes; 0: no scales
  int K = 0;                  ///< 0: no ids or weights
  DataLayout layout;
  std::int64_t src_first[kMaxRanks] = {};  ///< the run's first row in the source's region
  std::int64_t dst_first[kMaxRanks] = {};  ///< ... and in this rank's outputs
  std::int64_t count[kMaxRanks] = {};      ///< rows (0 for this rank)
  void* recv_scales = nullptr;
  std::int64_t* recv_idx = nullptr;
  float* recv_w = nullptr;
  std::int32_t* recv_src = nullptr;
};

struct DispatchRecvArgs {
  const std::int32_t* pm = nullptr;  ///< device [R, R]
  std::int64_t rows = 0;             ///< output rows (Nrecv or num_worst_tokens)
  std::size_t x_row = 0, scale_row = 0;
  int K = 0;
  void* recv_x = nullptr;
  void* recv_scales = nullptr;
  std::int64_t* recv_idx = nullptr;
  float* recv_w = nullptr;
  std::int32_t* recv_src = nullptr;  ///< null for a cached dispatch
  DataLayout layout;
};

struct CombineSendArgs {
  const void* x = nullptr;  ///< bf16 [rows, H]
  std::size_t x_row = 0;
  const float* weights = nullptr;  ///< [rows, K] or null
  int K = 0;
  const std::int32_t* pm = nullptr;
  DataLayout layout;  ///< x_off / w_off / capacity of the combine rows
};

/// The copy-engine combine's pushes done by SM stores instead (one kernel, no host call per stage): this rank's rows
/// for each peer d, the run x[first[d], first[d] + count[d]), go to rows [slot[d], slot[d] + count[d]) of d's half
/// (layout: x_off, w_off), in `chunks` stages as the copies would (stage_begin); the last block done with a stage
/// publishes chunk_done[me][j] = seq in every peer. Behind the same gate as the copies (launch_push_gate).
struct CombinePushArgs {
  const void* x = nullptr;  ///< bf16 [rows, H]
  std::size_t x_row = 0;
  const float* weights = nullptr;  ///< [rows, K] or null
  int K = 0;
  int chunks = 1;
  DataLayout layout;
  std::int64_t first[kMaxRanks] = {};
  std::int64_t count[kMaxRanks] = {};  ///< 0 for this rank
  std::int64_t slot[kMaxRanks] = {};
};

struct CombineReduceArgs {
  const std::int32_t* send_pos = nullptr;  ///< [T, R]
  const std::int32_t* pm = nullptr;
  std::int64_t T = 0, H = 0;
  int K = 0;
  const void* bias_0 = nullptr;  ///< bf16 [T, H] or null
  const void* bias_1 = nullptr;
  void* out = nullptr;     ///< bf16 [T, H]
  float* out_w = nullptr;  ///< [T, K] or null
  DataLayout layout;
  /// Copy-engine path: this rank's own rows are read from its combine input (row send_pos[t][me]) instead of
  /// its region; null: every row comes from the region.
  const void* local_x = nullptr;
  const float* local_w = nullptr;
  /// > 0 (copy-engine path, pipelined): rows from peer d arrive in `chunks` stages of its run of n_back[d] rows
  /// (chunk_done[d][j]); each warp waits for the stage of the row it reads. 0: wait for every done flag first.
  int chunks = 0;
  std::int32_t n_back[kMaxRanks] = {};
};

/// The first row of stage j when a run of n rows is split into `chunks` pipeline stages (the same on the sender,
/// the receiver and the host): stage j is [stage_begin(n, j), stage_begin(n, j + 1)).
/// Stage sizes rise, then fall (weights min(i + 1, chunks - i): 1, 2, 2, 1 for 4 stages): a small first stage
/// starts the receiver's copies early, a small last one shortens the tail after the last copy lands.
__host__ __device__ inline std::int64_t stage_begin(std::int64_t n, int j, int chunks) {
  int before = 0, total = 0;
  for (int i = 0; i < chunks; ++i) {
    const int w = i + 1 < chunks - i ? i + 1 : chunks - i;
    total += w;
    if (i < j) before += w;
  }
  return n * before / total;
}

/// Whether an op takes the copy-engine path, from the prefix matrix pm [R, R] (the same on every rank, so every
/// rank decides alike): the rows each rank sends its peers fit `capacity` (dispatch: the rows it stages; combine:
/// the rows its peers push back to it, as many), and some rank moves at least `min_rows` (below that the path's
/// extra launches and copies cost more than SM stores save). The dispatch's count exchange decides on the device;
/// a combine or cached dispatch on the host (its counts are in the handle).
__host__ __device__ inline bool copy_engine_fits(const std::int32_t* pm, int R, std::int64_t capacity,
                                                 std::int64_t min_rows) {
  std::int64_t most = 0;
  for (int r = 0; r < R; ++r) {
    std::int64_t rows = 0;
    for (int d = 0; d < R; ++d)
      if (d != r) rows += pm[r * R + d] - (r > 0 ? pm[(r - 1) * R + d] : 0);
    if (rows > capacity) return false;
    most = rows > most ? rows : most;
  }
  return most >= min_rows;
}

/// Advances the op's sequence number (one thread): the first kernel of an op that enqueues work before its
/// notify (which then runs with advance = false).
void launch_begin_op(const Common& c, cudaStream_t s);
/// One block, on the copy-engine combine's push stream: returns at once unless the previous op took the SM-store
/// path, else waits for every peer's handshake tag of this op. A peer that wrote its tag finished the previous op;
/// without that wait the pushes, which land in the peers' half of this op, can start before the handshake: the
/// previous op, on the copy-engine path, used the other half (half_layout), and the one before it finished on
/// every rank (this rank passed the previous op's handshake).
void launch_push_gate(const Common& c, cudaStream_t s);
void launch_notify(const Common& c, const NotifyArgs& a, cudaStream_t s);
void launch_send_pos(const Common& c, const SendPosArgs& a, cudaStream_t s);
/// after_notify: launched right behind the notify on `s` as its programmatic dependent (its launch overlaps the
/// exchange; the kernel waits for the notify to finish before reading anything).
void launch_dispatch_send(const Common& c, const DispatchSendArgs& a, int blocks, cudaStream_t s,
                          bool after_notify = false);
void launch_dispatch_recv(const Common& c, const DispatchRecvArgs& a, int blocks, int sender_blocks, cudaStream_t s);
void launch_combine_send(const Common& c, const CombineSendArgs& a, int blocks, cudaStream_t s);
/// Zeroes the stage counters (chunk_arrive) on `s`, then launches the push kernel there.
void launch_combine_push(const Common& c, const CombinePushArgs& a, int blocks, cudaStream_t s);
void launch_send_list(const Common& c, const SendListArgs& a, cudaStream_t s);
void launch_gather(const Common& c, const GatherArgs& a, int blocks, cudaStream_t s);
void launch_pull_small(const Common& c, const PullSmallArgs& a, int blocks, cudaStream_t s);
/// Publishes chunk_done[me][chunk] = seq in every peer (after the copies before it on the stream).
void launch_signal_chunk(const Common& c, int chunk, cudaStream_t s);
/// Waits (one block) until chunk_done[s][chunk] >= seq for every peer s.
void launch_wait_chunk(const Common& c, int chunk, int phase, cudaStream_t s);
/// One thread per rank publishes done[me][0] = seq in every rank (after the copies before it on the stream).
void launch_signal(const Common& c, cudaStream_t s);
/// Waits (one block) until every rank's done[s][b] >= seq for b < sender_blocks.
void launch_wait(const Common& c, int sender_blocks, int phase, cudaStream_t s);
void launch_combine_reduce(const Common& c, const CombineReduceArgs& a, int blocks, int sender_blocks, cudaStream_t s);

}  // namespace epmoe::cuda_ipc
