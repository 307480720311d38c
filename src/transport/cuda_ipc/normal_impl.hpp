// cuda-ipc normal mode, the host side's private declarations: the row sizes every part shares and, in CUDA builds,
// the backend class (CudaIpcNormalImpl). Its parts: cuda_ipc/normal.cpp (construction, state, errors, trace,
// streams), cuda_ipc/normal_dispatch.cpp (dispatch), cuda_ipc/normal_combine.cpp (combine). Kernels:
// cuda_ipc/normal_kernels.cu. Protocol: cuda_ipc/normal.hpp and docs/cuda_ipc_design.md.
#pragma once

#include <cstdint>

namespace epmoe::cuda_ipc {

inline constexpr std::int64_t kFieldSlack = 16;  // each field array starts on a 16-byte boundary

/// Bytes of one dispatch row in the data region: x, scales, int64 ids, f32 weights, src index.
inline std::int64_t dispatch_row_bytes(std::int64_t x_row, std::int64_t scale_row, int K) {
  return x_row + scale_row + 12 * static_cast<std::int64_t>(K) + 4;
}
/// Bytes of one combine row in the data region: bf16 x, f32 weights.
inline std::int64_t combine_row_bytes(std::int64_t H, int K) { return 2 * H + 4 * static_cast<std::int64_t>(K); }

inline std::int64_t align16(std::int64_t v) { return (v + 15) / 16 * 16; }

}  // namespace epmoe::cuda_ipc

#if defined(EPMOE_HAVE_CUDA)

#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/stream.hpp>

#include <chrono>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <cuda_runtime.h>

#include "core/check.hpp"
#include "core/cuda_check.hpp"
#include "transport/args/normal.hpp"
#include "transport/cuda_ipc/memory.hpp"
#include "transport/cuda_ipc/normal.hpp"
#include "transport/cuda_ipc/normal_kernels.hpp"
#include "transport/cuda_ipc/stream.hpp"

namespace epmoe {

namespace cuda_ipc {

/// Several tensors carved out of one pool allocation: an op's outputs cost one allocation instead of one each
/// (host time per allocation adds up at small T). Each piece keeps the whole block alive.
class Carver {
 public:
  /// `sizes`: bytes of each piece, in the order take() is called (256-byte aligned pieces).
  Carver(std::initializer_list<std::size_t> sizes, Device device) {
    std::size_t total = 0;
    for (std::size_t b : sizes) total += align(b);
    block_ = std::make_shared<Tensor>(Tensor::empty(DType::int8, {static_cast<std::int64_t>(total)}, device));
    device_ = device;
  }
  Tensor take(DType dtype, Shape shape) {
    const std::size_t bytes = static_cast<std::size_t>(shape.numel()) * dtype_size(dtype);
    char* p = static_cast<char*>(block_->data()) + offset_;
    offset_ += align(bytes);
    return Tensor::wrap(TensorView(bytes ? p : nullptr, dtype, shape, device_), block_);
  }
  static std::size_t bytes(DType dtype, Shape shape) {
    return static_cast<std::size_t>(shape.numel()) * dtype_size(dtype);
  }

 private:
  static std::size_t align(std::size_t b) { return (b + 255) / 256 * 256; }
  std::shared_ptr<Tensor> block_;
  Device device_;
  std::size_t offset_ = 0;
};

/// The zero-copy dispatch's receive slots: slot i of a rank's buffer holds one dispatch's outputs (the data
/// region's whole-op layout) until every tensor viewing it is gone. Shared with the leases, so a tensor that
/// outlives its buffer keeps the device memory (and the free list) alive.
class RecvSlots {
 public:
  RecvSlots(std::shared_ptr<void> memory, int count)
      : memory_(std::move(memory)), busy_(static_cast<std::size_t>(count), false) {}
  /// A free slot: its index, released when the last copy of the lease is dropped; null when every slot is in use.
  static std::shared_ptr<int> acquire(const std::shared_ptr<RecvSlots>& self) {
    std::lock_guard<std::mutex> lock(self->mutex_);
    for (std::size_t i = 0; i < self->busy_.size(); ++i) {
      if (self->busy_[i]) continue;
      self->busy_[i] = true;
      return std::shared_ptr<int>(new int(static_cast<int>(i)), [self](int* p) {
        {
          std::lock_guard<std::mutex> relock(self->mutex_);
          self->busy_[static_cast<std::size_t>(*p)] = false;
        }
        delete p;
      });
    }
    return nullptr;
  }

 private:
  std::shared_ptr<void> memory_;
  std::mutex mutex_;
  std::vector<bool> busy_;
};

inline constexpr int kPullSmallBlocks = 16;  // the small fields' kernel: latency-bound reads over NVLink

}  // namespace cuda_ipc

class CudaIpcNormalImpl final : public CudaIpcNormal {
 public:
  /// Collective: checks the options, compares them across ranks, allocates and maps the buffer (normal.cpp).
  CudaIpcNormalImpl(std::shared_ptr<Group> group, const BufferOptions& o, std::uint64_t buffer_id);
  ~CudaIpcNormalImpl() override;

  int device() const override { return device_; }
  std::shared_ptr<cuda_ipc::CommStream> shared_comm_stream() const override { return comm_owner_; }
  Stream comm_stream() const override { return Stream{comm_}; }
  /// The data region (num_nvl_bytes), as DeepEP's NVL buffer.
  TensorView local_buffer() const override {
    return TensorView(static_cast<std::byte*>(base_) + cuda_ipc::kControlBytes, DType::uint8, {data_bytes_}, {1},
                      Device::cuda(device_));
  }

  DispatchResult dispatch(const DispatchArgs& a) override;  // normal_dispatch.cpp
  CombineResult combine(const CombineArgs& a) override;     // normal_combine.cpp

 private:
  // ---- one dispatch, in steps (normal_dispatch.cpp) ----
  /// What the local checks give (check_dispatch): the op's shape and row sizes. Holds no memory.
  struct DispatchShape {
    const DispatchArgs* a = nullptr;
    DispatchSpec spec;
    std::int64_t T = 0, H = 0, scale_cols = 0;
    int K = 0, E = 0, E_local = 0, alignment = 1, worst = 0;
    bool fp8 = false, cached = false, has_topk = false, has_weights = false;
    std::size_t x_row = 0, scale_row = 0;  // bytes of one row of x and of x_scales
    cuda_ipc::DataLayout L;                // the whole data region (SM-store path, zero-copy slots)
    Device gpu;
  };
  /// The state the steps share. Made once the device and the communication stream are current (dispatch()), so
  /// that its temporaries are freed on that stream, as the outputs were allocated.
  struct DispatchOp : DispatchShape {
    explicit DispatchOp(const DispatchShape& shape) : DispatchShape(shape) {}
    cuda_ipc::DataLayout Lh;  // this op's half of the data region (copy-engine staging: half_layout)
    Stream caller;
    cuda_ipc::Common c;
    // Routing: prefix matrix, expert counts, send positions, the handle's copy of is_token_in_rank, send lists.
    Tensor pm, expert_counts, send_pos, in_rank, list;
    std::optional<cuda_ipc::Carver> routing_block;
    std::vector<std::int32_t> pm_host;
    std::int64_t num_recv = -1;  // rows this rank receives (-1 until known on the host)
    std::int64_t rows = 0;       // rows of the outputs: num_recv, or num_worst_tokens
    bool ce_allowed = false;     // the copy-engine path may be taken (counts known on the host)
    bool ce = false;             // the copy-engine path is taken
    bool stage_early = false;    // the staging is enqueued before the count exchange
    bool host_read = false;      // the host waits for the count exchange's result
    bool staging_enqueued = false;
    bool direct = false;          // the zero-copy path is taken: the outputs are views of `slot`
    std::shared_ptr<int> slot;    // this rank's receive slot offered for the zero-copy path
    std::shared_ptr<Tensor> src_block;  // zero-copy: the source indices, capacity rows
    Tensor recv_src;
    cuda_ipc::NotifyArgs notify;
    cuda_ipc::GatherArgs ga;
  };
  DispatchShape check_dispatch(const DispatchArgs& a) const;
  void plan_dispatch(DispatchOp& op);
  void prepare_gather(DispatchOp& op) const;
  cuda_ipc::DispatchSendArgs dispatch_send_args(const DispatchOp& op) const;
  void fork_stage_stream();
  void enqueue_staging(DispatchOp& op, bool before_exchange);
  void launch_final_send_pos(const DispatchOp& op);
  void launch_dispatch_notify(DispatchOp& op);
  void send_zero_copy(DispatchOp& op);
  void read_dispatch_counts(DispatchOp& op);
  void allocate_dispatch_outputs(DispatchOp& op, DispatchResult& out);
  void gather_own_rows(DispatchOp& op, DispatchResult& out);
  void pull_dispatch_rows(DispatchOp& op, DispatchResult& out);
  void receive_dispatch_rows(const DispatchOp& op, DispatchResult& out);
  void finish_dispatch(const DispatchOp& op, DispatchResult& out);

  // ---- one combine, in steps (normal_combine.cpp) ----
  /// The state the steps share. Holds no memory (the outputs are allocated in combine(), on the communication
  /// stream).
  struct CombineOp {
    const CombineArgs* a = nullptr;
    const NormalHandle* h = nullptr;
    std::int64_t T = 0, H = 0;
    int K = 0;
    bool has_w = false;
    cuda_ipc::DataLayout L_half;  // this op's half of the data region (copy-engine path)
    cuda_ipc::DataLayout L;       // the layout in use: L_half, or the whole region (SM-store path)
    Stream caller;
    cuda_ipc::Common c;
    Device gpu;
    bool ce = false;  // the copy-engine path is taken
    int chunks = 0;   // its pipeline stages
    cuda_ipc::NotifyArgs notify;
    cuda_ipc::CombineSendArgs sa;
  };
  /// Where rank `dst`'s rows for this rank's tokens are: first row and count in x, and `slot`, the rows `dst`
  /// receives back from its peers before this rank (its own rows stay in its x).
  struct CombineRun {
    std::int64_t first = 0, count = 0, slot = 0;
  };
  CombineOp check_combine(const CombineArgs& a) const;
  void choose_combine_path(CombineOp& op) const;
  void combine_handshake(CombineOp& op);
  CombineRun combine_run(const CombineOp& op, int dst) const;
  void push_combine_rows_by_sm(CombineOp& op);
  void push_combine_rows_by_copy_engine(CombineOp& op);
  void reduce_combined_rows(CombineOp& op, CombineResult& out);

  // ---- state and errors (normal.cpp) ----
  cuda_ipc::Common common() const {
    cuda_ipc::Common c;
    for (int r = 0; r < R_; ++r) c.peers[r] = peers_[r];
    c.rank = me_;
    c.num_ranks = R_;
    c.timeout_ns = timeout_ns_;
    c.host = host_dev_;
    c.trace = trace_ ? 1 : 0;
    return c;
  }

  /// Raises if an earlier fault broke the buffer, or a kernel recorded an error since the last call.
  void check_state() {
    if (!unusable_.empty())
      raise(ErrorCode::unusable, "rank {}: this cuda_ipc buffer is unusable after an earlier fault ({}); re-create it",
            me_, unusable_);
    raise_device_error();
  }
  void raise_device_error();
  // The settings compared in-band by the notify kernel, in NotifyArgs::settings order.
  static const std::vector<std::string>& dispatch_setting_names();
  static const std::vector<std::string>& combine_setting_names();
  static void set_settings(cuda_ipc::NotifyArgs& n, std::initializer_list<long long> values) {
    n.num_settings = 0;
    for (long long v : values) n.settings[n.num_settings++] = v;
  }

  // ---- EPMOE_CUDA_IPC_TRACE=1: where an op's time goes (events on the communication stream + host clock at each
  // mark, averaged per op kind and printed when the buffer is destroyed). Syncs at the end of every op: for
  // diagnosis only, never in a benchmark's figures. ----
  struct TraceSum {
    std::vector<std::string> names;
    std::vector<double> gpu_us, host_us;
    int ops = 0, skipped = 0;  // the first kTraceWarmup ops of a kind are left out (first launches load modules)
    // Device stamps (HostRecord::stamps), us after the notify's start: sums and how many ops passed each point.
    double stamp_us[cuda_ipc::kNumStamps] = {};
    int stamp_ops[cuda_ipc::kNumStamps] = {};
  };
  static constexpr int kTraceWarmup = 5;
  void trace_begin() {
    if (!trace_) return;
    trace_n_ = 0;
    for (long long& v : host_->stamps) v = 0;  // the previous op's kernels are done (trace_end waited)
    trace_t0_ = std::chrono::steady_clock::now();
    trace_mark("start");
  }
  /// Marks when `stream` (default: the communication stream) reaches this point.
  void trace_mark(const char* name, cudaStream_t stream = nullptr) {
    if (!trace_ || trace_n_ >= kTraceMarks) return;
    EPMOE_CUDA_CHECK(cudaEventRecord(trace_ev_[trace_n_], stream ? stream : comm_));
    trace_gpu_[trace_n_] = true;
    trace_names_[trace_n_] = name;
    trace_host_[trace_n_] =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - trace_t0_).count();
    ++trace_n_;
  }
  /// Marks when the host passes this point (no event: splits the host's enqueue time).
  void trace_host(const char* name) {
    if (!trace_ || trace_n_ >= kTraceMarks) return;
    trace_gpu_[trace_n_] = false;
    trace_names_[trace_n_] = name;
    trace_host_[trace_n_] =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - trace_t0_).count();
    ++trace_n_;
  }
  void trace_end(const char* op);
  void trace_print() const;

  // ---- streams ----
  void fork_side_streams();
  void join_side_streams();
  void reset_claim();
  /// Makes the communication stream wait for previous_event, or else for the caller's current stream.
  void enter(const Event* previous, Stream caller);
  /// async_finish: an event on the communication stream; else the caller's stream waits for it.
  Event leave(bool async_finish, Stream caller);
  /// Host wait for the count exchange (its ticket, ticket_, in the host-mapped record, or an error recorded), with the
  /// group's timeout (plus a margin for the device's own).
  void wait_notified(std::string_view phase);

  std::shared_ptr<Group> group_;
  std::uint64_t buffer_id_;
  int R_ = 0, me_ = 0, device_ = 0, blocks_ = 0, recv_blocks_ = 1;
  bool use_copy_engine_ = true;
  bool combine_sm_push_ = false;  // BufferOptions::combine_sm_push
  std::uint64_t ops_ = 0;  // eager ops so far (the same on every rank): picks the staging's half (half_layout)
  std::int64_t copy_engine_min_rows_ = 1024;  // measured on 2x H200: below ~1K rows the SM path is faster
  static constexpr int kTraceMarks = 24;
  bool trace_ = false;
  int trace_n_ = 0;
  cudaEvent_t trace_ev_[kTraceMarks] = {};
  const char* trace_names_[kTraceMarks] = {};
  bool trace_gpu_[kTraceMarks] = {};
  double trace_host_[kTraceMarks] = {};
  std::chrono::steady_clock::time_point trace_t0_;
  std::map<std::string, TraceSum> trace_sums_;
  int chunks_ = cuda_ipc::kDefaultChunks;
  // The copy-engine path's two side streams: pipeline stages alternate between them, so one stage's wait or
  // signal kernel overlaps the other's copies. They fork from and join back into the communication stream.
  cudaStream_t side_[2] = {};
  cudaEvent_t forked_ = nullptr, joined_[2] = {};
  // A dispatch's staging runs on its own stream, enqueued before the host read; the outputs are allocated on the
  // communication stream after that read (allocated_), which the side streams wait for, and the communication
  // stream waits for the staging (staged_) before its own-rows pass.
  cudaStream_t stage_ = nullptr;
  cudaEvent_t staged_ = nullptr, allocated_ = nullptr, listed_ = nullptr;
  cudaEvent_t stage_copied_[cuda_ipc::kMaxChunks] = {};  // combine: stage j's pushes done (its signal's start)
  cudaEvent_t caller_done_ = nullptr, comm_done_ = nullptr;  // enter/leave of a synchronous op, reused
  std::int64_t data_bytes_ = 0;

  /// A normal-mode call on a low-latency-only buffer (num_nvl_bytes = 0) raises invalid_argument naming it.
  void require_normal_region(const char* op) const {
    if (data_bytes_ == 0)
      throw_invalid_argument("options.num_nvl_bytes",
                             fmt::format("> 0 for a normal-mode {} (this buffer was made for low-latency mode only; "
                                         "Buffer::get_normal_nvl_size_hint gives the size)",
                                         op),
                             "0");
  }
  void* base_ = nullptr;                   // [control | data region | receive slots], owned by memory_
  std::shared_ptr<void> memory_;
  std::size_t slot_stride_ = 0;  // bytes from one receive slot to the next (slot 0 one stride past the data region)
  std::shared_ptr<cuda_ipc::RecvSlots> recv_slots_;
  void* peers_[cuda_ipc::kMaxRanks] = {};
  std::unique_ptr<CudaIpcMemory> mem_;  // base_'s allocation and its mappings in every peer
  cuda_ipc::HostRecord* host_ = nullptr;
  cuda_ipc::HostRecord* host_dev_ = nullptr;
  std::shared_ptr<cuda_ipc::CommStream> comm_owner_;  // also the low-latency mode's
  cudaStream_t comm_ = nullptr;                        // comm_owner_'s
  std::uint64_t ticket_ = 0;  // the last count exchange the host waited for (NotifyArgs::ticket)
  long long timeout_ns_ = 0;
  std::string unusable_;
};

}  // namespace epmoe

#endif  // EPMOE_HAVE_CUDA
