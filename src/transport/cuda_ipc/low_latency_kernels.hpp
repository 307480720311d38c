// Kernels of the cuda_ipc low-latency mode (CUDA builds only): the window's control block, the kernels' parameter
// records and thin launchers; the byte protocol's records are the CPU implementation's (low_latency_protocol.hpp).
// No fmt here (this header is included by the .cu). Protocol: cuda_ipc/low_latency.hpp.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "transport/cuda_ipc/error.hpp"
#include "transport/low_latency_protocol.hpp"

namespace epmoe::cuda_ipc_ll {

inline constexpr int kMaxRanks = 8;                  // one NVLink host
// The byte protocol (Header, TokenMeta, kMagic, kinds, dispatch_flags) is the CPU implementation's.
using namespace low_latency_protocol;

/// Control block at the start of every rank's window (the halves follow it). Peers write `data` and `consumed`;
/// the owner alone uses the rest.
struct Control {
  // [half][source]: kCallTag for each call of the half the source's data is in (a dispatch send's blocks add their
  // shares as they finish, no grid barrier; a combine's last block stores the sum)
  unsigned long long data[2][kMaxRanks];
  // [half][reader] = index + 1 once reader read its staging of call index: raised by the reader's first launch after
  // that receive (Common::publish_mask), the kernel boundary being what guarantees the reads are done
  unsigned long long consumed[2][kMaxRanks];
  unsigned long long calls;  // owner: calls since the last clean whose send kernel finished (the next call's index)
  unsigned int send_arrive;  // owner: blocks of the running combine send that finished
  unsigned int index_arrive;  // owner: blocks of the running send kernel that ended their send (each read the index)
  int claim;                 // first error wins the host record
  // owner: an overlapped combine's send gave up on a signal (1), of local expert signal_expert, block signal_block
  // (-1: per expert); the send's last block puts it in the headers and clears it
  int signal_gave_up;
  int signal_expert;
  long long signal_block;
};
inline constexpr std::size_t kControlBytes = 4096;
/// What each call adds to a half's data flag: call `index`'s data is in once data[index % 2][source] >=
/// data_target(index). Call index.. 2^40 would wrap it (years of calls between cleans).
inline constexpr unsigned long long kCallTag = 1ull << 40;
__host__ __device__ constexpr unsigned long long data_target(unsigned long long index) {
  return ((index >> 1) + 1) * kCallTag;
}
static_assert(sizeof(Control) <= kControlBytes);

/// Error codes (HostRecord::error_code).
enum : int {
  kErrNone = 0,
  kErrTimeout = 1,
  kErrOtherCall = 2,    ///< a peer's header is of another call or kind: value = its index, value2 = its kind
  kErrFlags = 3,        ///< use_fp8/round_scale/use_ue8m0/use_nvfp4 differ: value = the peer's flags, value2 = this rank's
  kErrShape = 4,        ///< hidden/num_max_dispatch_tokens_per_rank/E differ: value = the peer's hidden, value2 =
                        ///< its num_max_dispatch_tokens_per_rank << 32 | E
  kErrBadId = 5,        ///< an id outside [-1, E) (skipped): value = the id, value2 = its flat index t * K + k
  kErrDuplicateId = 6,  ///< an id twice in one token (the second skipped): value = the id, value2 = t * K + k
  kErrCount = 7,        ///< combine: the peer sent `value` rows, this rank's topk_idx routes value2 to it
  kErrIdsDiffer = 8,    ///< combine's topk_idx differs from the dispatch's: value = the id, value2 = t * K + k
  kErrGlobalScale = 9,  ///< nvfp4: the device x_global_scale is not finite and > 0: value = its float32 bits
  /// overlapped combine: the send of rank `peer` gave up waiting for the signal of its local expert `value`, block
  /// `value2` (-1: the per-expert form); recorded by that rank's send and by every receive of its header
  kErrSignalTimeout = 10,
  /// a bulk copy (TMA) of this rank's own memory did not complete within the timeout: value = the local expert,
  /// value2 = its row; the kernel traps after a second timeout rather than leave copies landing in freed shared memory
  kErrCopyTimeout = 11
};
/// Phases (HostRecord::error_phase).
enum : int { kPhaseDispatchSend = 0, kPhaseDispatchRecv = 1, kPhaseCombineSend = 2, kPhaseCombineRecv = 3 };

/// Host-mapped record of the first error (error_index: the call).
using HostRecord = cuda_ipc::ErrorRecord;

/// Points of a launch's trace (Common::stamps; EPMOE_CUDA_IPC_TRACE=1, cuda_ipc/low_latency_trace.hpp): thread 0 of
/// every block records when it passed each point it reaches, in the order a block passes them.
enum : int {
  kTraceStart = 0,    ///< the block started
  kTraceIndex,        ///< the call index read (and the consumed flags the launch owes raised)
  kTraceIds,          ///< dispatch send: the first chunk's ids loaded and cleaned (before its scan)
  kTraceWritable,     ///< send: every destination's consumed flag of the half seen
  kTraceSent,         ///< send: the block's rows (and metas) stored
  kTracePublished,    ///< send: the block's share of the data flags released
  kTraceCounted,      ///< combine receive: the rows each source must send back counted (block 0)
  kTraceArrived,      ///< receive: source 0's data flag seen
  kTraceHeaders,      ///< receive: every source's header checked
  kTraceScanned,      ///< dispatch receive: the first TokenMetas matched against the block's expert
  kTraceEnd,          ///< the block's work done
  kNumTracePoints
};

/// What every kernel needs: the layout of one half (LowLatencyMode::Layout; num_ranks is the group's size) and the
/// mapped windows.
struct Common : low_latency_protocol::Layout {
  void* peers[kMaxRanks] = {};  ///< every rank's window base as mapped here (control block first)
  int rank = 0;
  long long timeout_ns = 0;
  HostRecord* host = nullptr;  ///< device pointer of the host-mapped record
  std::int32_t* sent_idx = nullptr;  ///< this rank's device scratch [2][num_max_dispatch_tokens_per_rank * kMaxTopk]:
                                     ///< dispatch ids per half
  /// Receives of earlier launches whose consumed flags this launch raises first, in every peer: bit h set: the call
  /// publish_delta[h] calls before this launch's own (call index - delta, of half h). Relative, so a captured graph
  /// replays with fresh indices. Raising them here rather than at the end of the receive kernel spares that kernel
  /// a grid-wide barrier: a source needs the flag only two calls later, after this rank's next launch.
  int publish_mask = 0;
  long long publish_delta[2] = {0, 0};
  /// EPMOE_CUDA_IPC_TRACE=1: %globaltimer ns, [0, kNumTracePoints) the first block to pass each point, then the
  /// last (atomicMin / atomicMax of thread 0's clock); null otherwise (no cost but a branch).
  long long* stamps = nullptr;
};

struct DispatchSendArgs {
  const void* x = nullptr;  ///< bf16 [T, H] rows of x_stride elements (bf16 dispatch)
  long long x_stride = 0;
  /// fp8 with BufferOptions::low_latency_separate_quant, and nvfp4: quantized rows + scales, record_bytes apart
  /// (device scratch); null: an fp8 dispatch quantizes x in the send kernel (quant/fp8_device.cuh, a warp per
  /// UE8M0 word or two of a row)
  const void* records = nullptr;
  /// nvfp4 with a device x_global_scale: block 0 checks it (finite, > 0) and records kErrGlobalScale otherwise
  const float* global_scale = nullptr;
  const void* topk_idx = nullptr;  ///< [T, K] contiguous
  bool idx64 = true;
  int K = 0;
  long long T = 0;
  std::uint32_t flags = 0;
  int scale_cols = 0;  ///< fp8: float32 groups or UE8M0 words per row; nvfp4: words of 4 block scales (H / 64)
};

struct DispatchRecvArgs {
  long long lag = 0;  ///< calls sent after this one when the receive was enqueued (index = calls - 1 - lag)
  std::uint32_t flags = 0;
  int scale_cols = 0;             ///< float32 groups, UE8M0 words, or (nvfp4) words of 4 block scales
  std::int32_t* stats = nullptr;  ///< cumulative_local_expert_recv_stats or null
  long long stats_stride = 1;
  long long* wait_cost = nullptr;  ///< dispatch_wait_recv_cost_stats int64 [R] (+= ns waited per source) or null
};

/// CombineSendArgs::signal_form.
enum : int { kSignalNone = 0, kSignalBlocks = 1, kSignalExperts = 2 };

struct CombineSendArgs {
  const void* x = nullptr;             ///< bf16 [E_local, R * num_max_dispatch_tokens_per_rank, H]
  long long stride0 = 0, stride1 = 0;  ///< elements
  /// Overlapped combine (LowLatencyCombineArgs::overlap): kSignalBlocks: int32 comp_signal, entry
  /// e * blocks_per_expert + b for rows [b * block_m, (b + 1) * block_m) of expert e; kSignalExperts: uint32
  /// src_signals [E_local]. A block's rows are sent once its entry is >= expect.
  int signal_form = kSignalNone;
  const void* signal = nullptr;
  int block_m = 0;
  long long blocks_per_expert = 0;
  unsigned expect = 0;
  int grid = 0;  ///< send blocks (0: E_local); with overlap, num_sms bounds it
  long long* stamps = nullptr;  ///< LowLatencyCombineArgs::send_stamps: %globaltimer of the first / last row store
  /// Not overlapped: blocks per expert (launch_combine sets it; an expert's rows are spread over its blocks' warps)
  int split = 1;
};

struct CombineRecvArgs {
  long long lag = 0;
  const void* topk_idx = nullptr;  ///< [T, K] contiguous
  bool idx64 = true;
  int K = 0;
  const float* weights = nullptr;  ///< [T, K] contiguous
  long long T = 0;
  void* out = nullptr;  ///< bf16 [T, H], rows out_stride elements apart
  long long out_stride = 0;
  long long* wait_cost = nullptr;  ///< combine_wait_recv_cost_stats int64 [R] (+= ns waited per source) or null
};

/// The phases one launch runs (DeepEP's LOW_LATENCY_SEND_PHASE / LOW_LATENCY_RECV_PHASE): both in one kernel for
/// an op without a recv hook, the send alone at the call and the receive alone at its hook otherwise.
enum : int { kSendPhase = 1, kRecvPhase = 2 };

/// One kernel per op ("dispatch" / "combine" in its name, as profilers and DeepEP's tests look for). With both
/// phases the grid is bounded by the blocks the device holds at once (the receive waits for every send block);
/// the arguments of a phase not run are ignored.
void launch_dispatch(const Common& c, const DispatchSendArgs& sa, const DispatchRecvArgs& ra, int phases,
                     cudaStream_t s);
void launch_combine(const Common& c, const CombineSendArgs& sa, const CombineRecvArgs& ra, int phases,
                    cudaStream_t s);

}  // namespace epmoe::cuda_ipc_ll
