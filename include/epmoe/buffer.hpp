// Buffer: expert-parallel dispatch and combine, normal and low-latency modes (semantics §4, 5).
//
// A Buffer belongs to one rank of a Group and moves tokens to the ranks that own their experts
// (dispatch) and the expert outputs back (combine). The API mirrors DeepEP's V1 Buffer; the ordering
// rules below are epmoe's and are what every backend is tested against, bit for bit, with the
// threads backend as the reference.
//
// Ordering rules (normal mode):
//  - recv rows are grouped by source rank in ascending order; within one source, source token order.
//  - a token is sent once per destination rank (not per expert).
//  - recv_topk_idx holds local expert ids (global - rank * E_local) or -1 for experts elsewhere;
//    recv_topk_weights is 0 where the id is -1.
//  - combine sums, per token, the rows sent back by each destination rank in ascending rank order,
//    in float32, then adds bias 0 and bias 1, then rounds to bfloat16 once. The sum starts from +0.0f
//    (so a token sent nowhere gives the biases or +0, and a lone -0.0 comes back as +0.0).
//  - combined_topk_weights[t, k] = sum over destination ranks (ascending) of their recv weights.
// Ordering rules (low-latency mode):
//  - packed_recv_x[e] holds the tokens of local expert e: blocks in ascending source rank, each
//    block in source token order, compacted from row 0; packed_recv_count[e] rows are valid.
//  - layout_range[e][s] = begin << 32 | count of source s's block in expert e.
//  - src_info[e][j] = the source token index (in its rank's x) of row j.
//  - combine: out[t] = sum over k ascending of topk_weights[t,k] * expert_out(t, k), in float32,
//    skipping -1 ids, rounded to bfloat16 once.
//  - two halves alternate, one per low-latency call (dispatch or combine), as DeepEP's buffers do; a
//    dispatch's handle can be combined (any number of times) until a later dispatch reuses its half,
//    then it is rejected (ErrorCode::stale_handle); semantics §5 says which outputs stay valid.
//  - cuda_ipc buffers: low-latency calls on CUDA tensors run on the GPUs (src/transport/cuda_ipc/low_latency.hpp:
//    no host synchronisation, CUDA-graph capturable in whole calls, an even number per graph; results bit-identical
//    to the threads backend); calls on CPU tensors still use the group's CPU transport.
#pragma once

#include <epmoe/group.hpp>
#include <epmoe/layout.hpp>
#include <epmoe/stream.hpp>
#include <epmoe/tensor.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace epmoe {

/// The most experts per token (topk_idx's K) each mode takes (semantics §1).
inline constexpr int kNormalMaxTopk = 32;
inline constexpr int kLowLatencyMaxTopk = 16;

/// What a GPU backend's event does (the cuda_ipc backend wraps a cudaEvent_t in one).
class EventImpl {
 public:
  virtual ~EventImpl() = default;
  /// Makes the calling thread's current stream (stream.hpp) wait for the event.
  virtual void current_stream_wait() const = 0;
  virtual bool done() const = 0;
};

/// Completion of an operation. CPU backends complete synchronously, so their events are already
/// done; GPU backends record a CUDA event on the buffer's communication stream.
class Event {
 public:
  Event() = default;
  explicit Event(std::shared_ptr<void> impl) : impl_(std::move(impl)) {}
  /// An event of a GPU backend.
  static Event from_backend(std::shared_ptr<EventImpl> impl) {
    Event e;
    e.backend_ = std::move(impl);
    return e;
  }
  /// Makes the caller's current stream wait for this event (no-op on CPU).
  void current_stream_wait() const;
  bool done() const;
  /// The backend event, or null (CPU events).
  const EventImpl* backend() const { return backend_.get(); }

 private:
  std::shared_ptr<void> impl_;
  std::shared_ptr<EventImpl> backend_;
};

/// The backend that moves the bytes.
enum class Backend { automatic, threads, mpi, cuda_ipc };

struct BufferOptions {
  Backend backend = Backend::automatic;  ///< automatic: the Group's backend ("threads" or "mpi")
  /// Normal-mode buffer bytes (GPU backends); cuda_ipc: 0 only with low_latency_mode, a low-latency-only buffer
  /// whose normal-mode calls raise invalid_argument.
  std::int64_t num_nvl_bytes = 0;
  /// Low-latency buffer bytes per rank; 0 = sized on the first low-latency call.
  /// get_low_latency_rdma_size_hint() gives the size needed.
  std::int64_t num_rdma_bytes = 0;
  bool low_latency_mode = false;
  /// Validate topk_idx values eagerly (always on for CPU ranks). cuda_ipc low-latency mode: with it, eager calls copy
  /// topk_idx to the host first and raise before any communication (a host synchronisation per call, so it is
  /// opt-in); without it (the default), or under graph capture, the kernels skip bad ids and the next call raises
  /// the error. Also, on every backend: topk_weights on CPU tensors must be finite (invalid_argument naming the
  /// first [t, k] and the value, before any communication; semantics §11).
  bool debug_validate = false;
  /// cuda_ipc: the CUDA device of this rank; -1 = rank % the number of visible devices.
  int device = -1;
  /// cuda_ipc: blocks of each data kernel (dispatch send or gather, combine send; the copy-engine path runs the
  /// dispatch's staging and own-rows passes side by side, and its combine reduce with twice as many), 1..64;
  /// 0 = 24. Equal on all ranks.
  int num_sms = 0;
  /// cuda_ipc: move the bulk rows with the copy engines when the host knows the counts (the default path:
  /// no num_worst_tokens): dispatch gathers each destination's rows locally and the receiver pulls them with
  /// cudaMemcpyAsync; combine pushes each source's rows with cudaMemcpyAsync. No SM is busy during the NVLink
  /// transfer, and the copy engines reach the peer rate (SM stores reach ~90% of it, PERF.md). false: SM
  /// stores only (the path num_worst_tokens always takes). Equal on all ranks.
  bool use_copy_engine = true;
  /// cuda_ipc: with use_copy_engine, ops where no rank moves at least this many rows take the SM-store path
  /// anyway (fewer host calls: it is faster for small batches). Equal on all ranks.
  std::int64_t copy_engine_min_rows = 1024;
  /// cuda_ipc copy-engine path: dispatch pipeline stages (1..16; 0 = 4; the combine uses twice as many, at most
  /// 16). Each peer's run of rows is moved in this many pieces, sized 1:2:...:2:1, so gathering (dispatch) or
  /// reducing (combine) one piece overlaps the transfer of the next. Equal on all ranks.
  int num_chunks = 0;
  /// cuda_ipc: zero-copy receive slots per rank, 0..64, each num_nvl_bytes (rounded up to 4 KiB) more device
  /// memory. A dispatch without num_worst_tokens offers a free slot in its count exchange (a cached one in its
  /// handshake); when every rank offers one, the senders store each row (SM stores, num_sms blocks) straight
  /// into the receiver's slot, which is its output: recv_x, recv_x_scales, recv_topk_idx and recv_topk_weights
  /// are views of the slot (no staging, no receive pass), and the slot is free again once all four are dropped
  /// (the rule of Tensor::empty: after the work that reads them is enqueued on the stream the next dispatch is
  /// called from). Otherwise (no slot free on some rank, num_worst_tokens) the op takes the copy-engine or
  /// SM-store path. 0 (the default): never zero-copy; the copy-engine path stays the default because it is the
  /// path measured on 2 GPUs (bench/results/README.md). Per rank.
  int num_recv_slots = 0;
  /// cuda_ipc copy-engine combine (use_copy_engine): push each peer's rows into it with one SM-store kernel
  /// (num_sms blocks; each pipeline stage published as its rows land) instead of cudaMemcpyAsync calls per stage:
  /// no host call and no copy-engine start-up per copy, but SMs busy during the NVLink transfer, at the SM stores'
  /// rate (~90% of the peer rate, PERF.md). false (the default): the copy engines. Equal on all ranks.
  bool combine_sm_push = false;
  /// cuda_ipc low-latency dispatch with use_fp8 on CUDA tensors: quantize x with the library's quantizer
  /// (quantize_fp8_into) into a device scratch first and send those records (one more launch and one more pass
  /// over x), instead of inside the send kernel, which quantizes each row once while storing it (false, the
  /// default). Both give the CPU's bits: true is for A/B measurement and diagnosis. Per rank (the same bytes are
  /// sent either way).
  bool low_latency_separate_quant = false;
  /// mpi backend: rows sent from scattered positions (an exchange's indexed blocks, e.g. a dispatch's tokens) are
  /// copied into one send staging buffer first and sent from there (one more copy of the rows), instead of being
  /// described by an MPI hindexed datatype that the MPI library packs straight into its shared-memory fragments,
  /// pipelined with the receiver (false, the default: 22.5 / 54.7 ms per exchange at R = 2 / 4 against 33.3 /
  /// 96.1 ms packed; Open MPI 4.1, 16 cores, T = 4096, H = 7168). true can be faster with more ranks than cores,
  /// where the datatype path needs sender and receiver running at the same time. Per rank (the messages are the
  /// same either way).
  bool mpi_pack_rows = false;
};

/// The tunables of BufferOptions as a JSON object (src/transport/buffer_config.cpp), e.g. {"num_sms": 16}:
/// what `epmoe tune` writes and `epmoe run/bench --config` read. Fields: num_sms (0..64), use_copy_engine
/// (true/false), num_chunks (0..16), copy_engine_min_rows (>= 0), num_recv_slots (0..64), combine_sm_push,
/// low_latency_separate_quant and mpi_pack_rows (true/false). Keys starting
/// with '_' are notes (the tuner's measurements) and are ignored. Only the fields present are set in
/// `options`; the rest keep their values. Errors (invalid_argument, message naming `source` and the
/// field): text that is not a JSON object, an unknown field (the known ones are listed), a value of the
/// wrong type or out of range, a field given twice.
void apply_buffer_config_json(std::string_view json_text, BufferOptions& options, std::string_view source = "config");
/// Reads the file at `path` and applies it as apply_buffer_config_json does. Errors: unreadable file
/// (invalid_argument naming the path), then as above.
void load_buffer_config(const std::string& path, BufferOptions& options);
/// The tunables of `options` as a JSON object (2-space indented), readable by apply_buffer_config_json.
std::string buffer_config_json(const BufferOptions& options);

/// What combine (and a cached dispatch) needs from a normal-mode dispatch.
struct NormalHandle {
  Tensor rank_prefix_matrix;  ///< int32 [R, R]: [s][d] = tokens ranks 0..s send to rank d
  Tensor is_token_in_rank;    ///< bool [T, R] (sender side)
  Tensor send_pos;            ///< int32 [T, R]: row of token t in rank r's recv_x, or -1
  Tensor recv_src_idx;        ///< int32 [Nrecv]: source token index of each received row
  Tensor num_recv_tokens_per_expert;  ///< int32 [E_local], aligned to expert_alignment
  std::int64_t num_tokens = 0;        ///< T of this rank
  std::int64_t num_recv_tokens = 0;   ///< Nrecv (valid rows)
  std::int64_t num_recv_rows = 0;     ///< rows of recv_x (= num_worst_tokens when that is set)
  std::int64_t hidden = 0;
  int num_experts = 0;
  int expert_alignment = 1;
  int num_worst_tokens = 0;           ///< what the dispatch was made with (0 = none); a cached dispatch reuses it
  std::uint64_t buffer_id = 0;        ///< the Buffer that made it
  /// rank_prefix_matrix on the host, row-major [R * R], when the dispatch read it (empty with
  /// num_worst_tokens): lets combine and a cached dispatch size their copies without a device read.
  std::vector<std::int32_t> rank_prefix_matrix_host;
  bool defined() const { return buffer_id != 0; }
};

struct DispatchArgs {
  TensorView x;             ///< bfloat16 [T, H] (H % 8 == 0) or float8_e4m3fn [T, H] (H % 16 == 0)
  /// With fp8 x: float32 [T, ceil(H/128)] or UE8M0 int32 [T, ceil(ceil(H/128)/4)], row-major (any row stride) or
  /// column-major (any column stride: DeepGEMM's TMA-aligned layout, quantize_fp8's ScaleLayout::column_major);
  /// recv_x_scales are row-major either way (semantics §4).
  TensorView x_scales;
  TensorView topk_idx;      ///< int64/int32 [T, K], K in 1..32, ids in [-1, E)
  TensorView topk_weights;  ///< float32 [T, K]
  /// From get_dispatch_layout (not needed for a cached dispatch).
  TensorView num_tokens_per_rank;    ///< int32 [R]
  TensorView is_token_in_rank;       ///< bool [T, R]
  TensorView num_tokens_per_expert;  ///< int32 [E]
  const NormalHandle* handle = nullptr;  ///< cached dispatch: reuse this layout, move x (and scales) only
  int expert_alignment = 1;              ///< >= 1; counts rounded up to a multiple of it
  int num_worst_tokens = 0;              ///< > 0: pad outputs to this many rows, no host sync
  const Event* previous_event = nullptr; ///< wait for it before starting
  bool async_finish = false;
  bool allocate_on_comm_stream = false;
};

/// The DispatchArgs of a fresh dispatch: x routed by topk_idx (and topk_weights, optional; shapes as in
/// DispatchArgs) with the counts of `layout` (get_dispatch_layout of the same topk_idx); every other field keeps
/// its default. Views only: the tensors must outlive the dispatch. No errors here (dispatch checks everything).
DispatchArgs make_dispatch_args(const DispatchLayout& layout, const TensorView& x, const TensorView& topk_idx,
                                const TensorView& topk_weights = {});

struct DispatchResult {
  Tensor recv_x;             ///< [rows, H], dtype of x; rows = Nrecv, or num_worst_tokens
  Tensor recv_x_scales;      ///< scales of recv_x (fp8 only), same format as x_scales
  Tensor recv_topk_idx;      ///< int64 [rows, K]: local ids or -1 (undefined for cached dispatch)
  Tensor recv_topk_weights;  ///< float32 [rows, K]
  std::vector<int> num_recv_tokens_per_expert_list;  ///< E_local counts (empty with num_worst_tokens)
  NormalHandle handle;
  Event event;
};

struct CombineArgs {
  TensorView x;             ///< bfloat16 [rows, H]: one row per received row of the dispatch
  const NormalHandle* handle = nullptr;
  TensorView topk_weights;  ///< optional float32 [rows, K]: summed back per token
  TensorView bias_0;        ///< optional bfloat16 [T, H]
  TensorView bias_1;        ///< optional bfloat16 [T, H]
  const Event* previous_event = nullptr;
  bool async_finish = false;
  bool allocate_on_comm_stream = false;
};

struct CombineResult {
  Tensor combined_x;             ///< bfloat16 [T, H]
  Tensor combined_topk_weights;  ///< float32 [T, K] when topk_weights was given
  Event event;
};

/// Receive half of a low-latency call made with return_recv_hook. Call exactly once
/// (a second call throws ErrorCode::stale_handle).
class RecvHook {
 public:
  RecvHook() = default;
  explicit RecvHook(std::function<void()> fn) : state_(std::make_shared<State>(State{std::move(fn), false})) {}
  void operator()() const;
  bool defined() const { return state_ != nullptr; }

 private:
  struct State { std::function<void()> fn; bool called; };
  std::shared_ptr<State> state_;
};

/// What low_latency_combine needs from a low-latency dispatch.
struct LowLatencyHandle {
  TensorView src_info;      ///< int32 [E_local, R*Tmax] (lives in the receive buffer)
  TensorView layout_range;  ///< int64 [E_local, R]: begin << 32 | count
  int num_max_dispatch_tokens_per_rank = 0;
  std::int64_t hidden = 0;
  int num_experts = 0;
  std::uint64_t generation = 0;  ///< index of the low-latency call that made it (two-buffer rule)
  std::uint64_t buffer_id = 0;
  bool defined() const { return buffer_id != 0; }
};

struct LowLatencyDispatchArgs {
  TensorView x;         ///< bfloat16 [T, H], T <= Tmax
  TensorView topk_idx;  ///< int64/int32 [T, K], K in 1..16
  /// Routing weights float32 [T, K]. Optional: epmoe sends a token once per destination rank and
  /// keeps the weights of its local experts with it (see PERF "Leads").
  /// The CPU backends only validate it: their combine reduces on the token's own rank, over k
  /// ascending, which the bit-exact combine rule requires.
  TensorView topk_weights;
  int num_max_dispatch_tokens_per_rank = 0;  ///< Tmax, fixed for the buffer's life
  int num_experts = 0;                       ///< E, fixed for the buffer's life
  bool use_fp8 = true;
  bool round_scale = false;
  bool use_ue8m0 = false;
  /// NVFP4 on the wire (semantics §5, §6; nvfp4.hpp): e2m1 codes two per byte with an e4m3 scale per 16 channels,
  /// quantized with x_global_scale; needs use_fp8 = false and H % 64 == 0. The receiver returns the packed values and
  /// the block scales in the 128x4 swizzled layout, as DeepEP's nvfp4 low-latency dispatch does.
  bool use_nvfp4 = false;
  /// With use_nvfp4: the global scale, float32 with one element (shape [] or [1]), on the CPU or on x's device. A CPU
  /// value must be finite and > 0 (checked before any communication); a device value is read by the kernels (on
  /// cuda_ipc checked on the host with debug_validate, else on the device and raised by the next call).
  TensorView x_global_scale;
  bool async_finish = false;
  bool return_recv_hook = false;
  TensorView cumulative_local_expert_recv_stats;  ///< optional int32 [E_local], incremented by the counts
  /// Optional int64 [R] on x's device (DeepEP V1's diagnosis statistic, semantics §5): entry s += the nanoseconds
  /// this rank's receive waited for source rank s's data (DeepEP counts GPU clock cycles; epmoe counts time on
  /// both the CPU and the GPU). Cumulative: the caller zeroes it.
  TensorView dispatch_wait_recv_cost_stats;
};

struct LowLatencyDispatchResult {
  /// [E_local, R*Tmax, H] float8_e4m3fn or bfloat16; use_nvfp4: uint8 [E_local, R*Tmax, H / 2] (channel 2i in the
  /// low nibble of byte i).
  TensorView packed_recv_x;
  /// float32 [E_local, R*Tmax, G] or int32 [E_local, R*Tmax, ceil(G/4)], column-major per expert as DeepEP's:
  /// strides {C * M, 1, M}, M = tma_aligned_scale_rows(R*Tmax) (quant.hpp; semantics §5, 6). use_nvfp4:
  /// float8_e4m3fn [E_local, ceil(R*Tmax / 128), (H / 64) * 512], each expert's block scales as one swizzled matrix
  /// (nvfp4.hpp: row j's scale c at nvfp4_swizzled_offset(j, c, H / 64) of its expert's slab; DeepEP's
  /// (l, rm, rk, 32, 4, 4)).
  TensorView packed_recv_x_scales;
  TensorView packed_recv_count;     ///< int32 [E_local] (masked_m)
  LowLatencyHandle handle;
  Event event;
  RecvHook hook;  ///< set when return_recv_hook
};

struct LowLatencyCombineArgs {
  TensorView x;             ///< bfloat16 [E_local, R*Tmax, H] (ignored with zero_copy)
  TensorView topk_idx;      ///< int64/int32 [T, K], the same as at dispatch
  TensorView topk_weights;  ///< float32 [T, K]
  const LowLatencyHandle* handle = nullptr;
  /// Send the buffer's combine slab of this call (get_next_low_latency_combine_buffer) instead of x; x may then be
  /// undefined (when given, it is only checked). The send reads its input where it is either way.
  bool zero_copy = false;
  bool async_finish = false;
  bool return_recv_hook = false;
  /// optional bfloat16 [T, H] to write into; pass it under CUDA-graph capture (a fresh output is freed on the
  /// thread's current stream, which must not be another stream than the capture's)
  TensorView out;
  /// Optional int64 [R] on x's device: entry s += the nanoseconds the receive waited for source rank s's rows
  /// (as LowLatencyDispatchArgs::dispatch_wait_recv_cost_stats).
  TensorView combine_wait_recv_cost_stats;

  // Overlapped combine (single-batch overlap, docs/semantics.md "Overlapped low-latency combine"): the send half
  // sends each block of an expert's rows once the producer of x (the down GEMM) has signalled it done, so the
  // combine can run on a side stream (GPU) or thread (CPU) while the experts still compute. Two forms, one per
  // call: DeepEP's Hopper form (comp_signal with packed_recv_count, block_m, threshold; DeepEP PR #483, branch
  // antgroup-opt) and the per-expert form (src_signals, src_signal_expect_value; fzyzcjy/DeepEP combine_v2,
  // commit 914d3bc). The signals are only read (acquire loads); their writer resets them between calls. With
  // overlap false every field below is ignored (neither checked nor read), as DeepEP does. Checked before any
  // communication (invalid_argument naming the argument): exactly one form with overlap, its tensors on x's
  // device, 1-d with unit stride. A block or expert whose signal does not arrive within half the group's timeout
  // raises ErrorCode::timeout naming the rank, expert, block and phase, on this rank and its peers: on CPU ranks at
  // once, the buffer staying usable; on cuda_ipc at the next call, the buffer then unusable (a device timeout).

  /// Wait for the signals below before sending each block (false: send at once, the fields are ignored).
  bool overlap = false;
  /// Hopper form: int32 [>= E_local * ceil(R*Tmax / block_m)], expert-major: entry e * ceil(R*Tmax / block_m) + b
  /// covers expert e's packed rows [b * block_m, (b + 1) * block_m). The down GEMM adds 1 each time it has stored
  /// one N-tile (block_n columns of H) of the block; the block's rows are sent once the entry is >= threshold.
  /// Only blocks holding valid rows (b * block_m < packed_recv_count[e]) are waited on. Extra entries are unused
  /// (SGLang sizes it for its smallest block_m, 64).
  TensorView comp_signal;
  /// Hopper form: the dispatch's packed_recv_count, int32 [E_local] (which blocks hold rows). CPU: its values must
  /// equal the handle's counts; cuda_ipc: shape, dtype and device only (the kernel uses the handle's counts).
  TensorView packed_recv_count;
  /// Hopper form: rows per signal block, >= 1 (DeepGEMM's BLOCK_M of the down GEMM).
  int block_m = 0;
  /// Hopper form: the adds that mark a block done, >= 1: ceil(H / block_n) for DeepGEMM's producer (one per N-tile).
  int threshold = 0;
  /// Per-expert form: uint32 [E_local]; the GEMM adds to entry e as it finishes expert e (FlashInfer's CuteDSL
  /// masked GEMM: one add per CTA); expert e's rows are sent once the entry is >= src_signal_expect_value.
  /// Only experts with rows (packed_recv_count[e] > 0) are waited on.
  TensorView src_signals;
  /// Per-expert form: the value that marks an expert done, 1 .. 2^32 - 1 (SGLang passes the GEMM's SM count).
  std::int64_t src_signal_expect_value = 0;
  /// With overlap: the most SMs (thread blocks) the cuda_ipc send may use, so the rest stay with the GEMM; 0 = one
  /// per local expert, as without overlap (also the most it uses); 0 .. 1024. CPU backends: checked only.
  int num_sms = 0;
  /// With overlap, optional int64 [2] on x's device, for measuring the overlap: the send lowers [0] to the time of
  /// its first row store and raises [1] to that of its last (atomic min / max; cuda_ipc: %globaltimer ns, the
  /// device's clock of every stream; CPU: steady_clock ns). The caller sets [2^63 - 1, 0] first.
  TensorView send_stamps;
};

struct LowLatencyCombineResult {
  Tensor combined_x;  ///< bfloat16 [T, H] (a view of `out` when given)
  Event event;
  RecvHook hook;
};

/// Expected tokens per local expert, as the engines compute it: (T * R * K + E) / E.
constexpr std::int64_t low_latency_expected_m(std::int64_t T, int R, int K, int E) {
  return (T * R * K + E) / E;
}

class Buffer {
 public:
  /// Buffer of this rank of `group`. Errors: unsupported backend for this build.
  explicit Buffer(std::shared_ptr<Group> group, BufferOptions options = {});
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  int rank() const;
  int num_ranks() const;
  Group& group() const;

  /// The stream async_finish work of both modes runs on (DeepEP's Buffer.get_comm_stream): a non-blocking stream
  /// on this rank's GPU, owned by the buffer (cuda_ipc); the null Stream on CPU backends, whose work is done when
  /// a call returns.
  Stream comm_stream() const;
  /// This rank's own communication memory as bytes (DeepEP's Buffer.get_local_buffer_tensor): uint8 [bytes] on
  /// its GPU, `low_latency_window` false: the normal-mode data region (num_nvl_bytes; a dispatch or combine
  /// overwrites it), true: the low-latency window past its control block (both halves; the layout of
  /// low_latency_protocol.hpp, docs/semantics.md §5). Undefined (an empty TensorView) on CPU backends and, for the
  /// window, before the first low-latency call on CUDA tensors allocated it. Valid while the buffer lives.
  TensorView local_buffer(bool low_latency_window) const;

  /// Bytes per rank the low-latency buffer needs for these settings (both alternating halves).
  static std::int64_t get_low_latency_rdma_size_hint(int num_max_dispatch_tokens_per_rank, std::int64_t hidden,
                                                     int num_ranks, int num_experts);

  /// num_nvl_bytes a cuda_ipc buffer needs for normal-mode calls of up to `max_tokens_per_rank` tokens per
  /// rank (bf16 or fp8 rows of `hidden`, `num_topk` ids), whatever the routing.
  static std::int64_t get_normal_nvl_size_hint(std::int64_t max_tokens_per_rank, std::int64_t hidden, int num_ranks,
                                               int num_topk);

  /// get_dispatch_layout(topk_idx, num_experts, num_ranks()) of layout.hpp.
  DispatchLayout get_dispatch_layout(const TensorView& topk_idx, int num_experts) const;

  /// Normal-mode dispatch (semantics §4). Collective. All arguments are validated before any exchange;
  /// settings that must agree (H, dtype, K, E, alignment) are compared across ranks with the counts,
  /// and a mismatch throws rank_mismatch on every rank.
  DispatchResult dispatch(const DispatchArgs& args);
  /// Normal-mode combine (semantics §4). Collective. Errors: handle from another buffer, x rows != handle rows.
  CombineResult combine(const CombineArgs& args);

  /// Low-latency dispatch (semantics §5). Collective. Errors: T > Tmax (names both), Tmax/H/E differing
  /// from the buffer's first low-latency call or across ranks, K > 16, ids outside [-1, E).
  LowLatencyDispatchResult low_latency_dispatch(const LowLatencyDispatchArgs& args);
  /// Low-latency combine (semantics §5). Errors: stale handle (two-buffer rule), shapes.
  LowLatencyCombineResult low_latency_combine(const LowLatencyCombineArgs& args);
  /// The combine slab of the next low-latency call (DeepEP's get_next_low_latency_combine_buffer): a bfloat16
  /// [E_local, R*Tmax, H] contiguous view into this rank's window (of half n % 2 for call n since the last clean,
  /// on the handle's device), which a combine with `zero_copy` sends instead of x. Write the experts' outputs into
  /// it, in the rows of `handle`'s dispatch, before that combine. No call writes it; the two halves' slabs are
  /// distinct, so the one handed out stays as written until the caller writes it again. On GPUs it is valid while
  /// the buffer lives (a clean zeroes it); on CPU backends until the next clean (which re-makes the window). Errors: invalid_argument naming `handle` (empty, or of another buffer).
  TensorView get_next_low_latency_combine_buffer(const LowLatencyHandle& handle);
  /// Resets the low-latency receive buffers (after normal-mode use of a shared buffer).
  void clean_low_latency_buffer(int num_max_dispatch_tokens_per_rank, std::int64_t hidden, int num_experts);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace epmoe
