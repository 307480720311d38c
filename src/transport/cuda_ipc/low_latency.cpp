// cuda_ipc low-latency mode: the host side (argument checks, window, streams, hooks, errors). Kernels:
// cuda_ipc/low_latency_kernels.cu. Protocol: cuda_ipc/low_latency.hpp and docs/cuda_ipc_design.md.
#include "transport/cuda_ipc/low_latency.hpp"

#include "core/check.hpp"
#include <epmoe/error.hpp>

#if !defined(EPMOE_HAVE_CUDA)

namespace epmoe {
std::unique_ptr<CudaIpcLowLatency> make_cuda_ipc_low_latency(std::shared_ptr<Group>, int, const BufferOptions&,
                                                             std::uint64_t, std::shared_ptr<cuda_ipc::CommStream>) {
  raise(ErrorCode::unsupported, "backend cuda_ipc needs a CUDA build of epmoe (this one is CPU-only)");
}
}  // namespace epmoe

#else

#include <epmoe/quant.hpp>
#include <epmoe/stream.hpp>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "core/cuda_check.hpp"
#include "core/cuda_util.hpp"
#include "transport/cuda_ipc/low_latency_kernels.hpp"
#include "transport/cuda_ipc/low_latency_trace.hpp"
#include "transport/cuda_ipc/memory.hpp"
#include "transport/cuda_ipc/stream.hpp"
#include "transport/args/low_latency.hpp"
#include "transport/cpu/low_latency_mode.hpp"

namespace epmoe {

namespace {

using cuda_util::DeviceGuard;
namespace ll = cuda_ipc_ll;
namespace args = low_latency_args;
using cuda_ipc::capturing;

const char* phase_name(int phase) {
  switch (phase) {
    case ll::kPhaseDispatchSend: return "low_latency_dispatch send";
    case ll::kPhaseDispatchRecv: return "low_latency_dispatch receive";
    case ll::kPhaseCombineSend: return "low_latency_combine send";
    case ll::kPhaseCombineRecv: return "low_latency_combine receive";
    default: return "unknown phase";
  }
}

/// A contiguous device int tensor's values on the host (a synchronisation on `s`): debug_validate only.
std::vector<std::int32_t> host_ids(const TensorView& idx, std::int64_t T, int E, cudaStream_t s) {
  Tensor h = Tensor::empty(idx.dtype, idx.shape);
  if (idx.nbytes() > 0) {
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(h.data(), idx.data, idx.nbytes(), cudaMemcpyDeviceToHost, s));
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  }
  return args::read_topk_idx(h.view(), T, E);
}

class CudaIpcLowLatencyImpl final : public CudaIpcLowLatency {
 public:
  CudaIpcLowLatencyImpl(std::shared_ptr<Group> group, int device, const BufferOptions& o, std::uint64_t buffer_id,
                        std::shared_ptr<cuda_ipc::CommStream> comm)
      : group_(std::move(group)),
        buffer_id_(buffer_id),
        device_(device),
        num_rdma_bytes_(o.num_rdma_bytes),
        debug_validate_(o.debug_validate),
        separate_quant_(o.low_latency_separate_quant),
        comm_owner_(std::move(comm)) {
    R_ = group_->size();
    me_ = group_->rank();
    EPMOE_CHECK_ARG(R_ <= ll::kMaxRanks, "group", fmt::format("at most {} ranks (one NVLink host)", ll::kMaxRanks), R_);
    DeviceGuard guard(Device::cuda(device_));
    EPMOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_), sizeof(ll::HostRecord),
                                   cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(static_cast<void*>(host_), 0, sizeof(ll::HostRecord));
    EPMOE_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev_), host_, 0));
    comm_ = comm_owner_->get();
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&caller_done_, cudaEventDisableTiming));
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&last_event_, cudaEventDisableTiming));
    timeout_ns_ = static_cast<long long>(group_->timeout_s() * 1e9);
    const char* trace = std::getenv("EPMOE_CUDA_IPC_TRACE");
    if (trace != nullptr && trace[0] != '\0' && std::string(trace) != "0")
      trace_ = std::make_unique<ll::LaunchTrace>(me_);
  }

  ~CudaIpcLowLatencyImpl() override {
    // No collective: once this rank's work is done no peer writes here any more (every peer call waits for this
    // rank's flags first), and the window memory outlives the views only as long as mem_ does.
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    if (comm_) cudaStreamSynchronize(comm_);
    if (has_last_) cudaEventSynchronize(last_event_);
    trace_.reset();  // prints the trace's figures
    mem_.reset();
    scratch_ = Tensor{};
    sent_idx_ = Tensor{};
    routing_save_ = Tensor{};
    if (last_event_) cudaEventDestroy(last_event_);
    if (caller_done_) cudaEventDestroy(caller_done_);
    if (host_) cudaFreeHost(host_);
    cudaSetDevice(previous);
  }

  LowLatencyDispatchResult dispatch(const LowLatencyDispatchArgs& a) override;
  LowLatencyCombineResult combine(const LowLatencyCombineArgs& a) override;
  void clean(int num_max_dispatch_tokens_per_rank, std::int64_t hidden, int num_experts) override;
  TensorView next_combine_buffer(const LowLatencyHandle& handle) override {
    LowLatencyCombineArgs a;
    a.handle = &handle;
    args::combine_handle(a, buffer_id_);
    EPMOE_CHECK_ARG(config_.set, "handle", "the handle of a low_latency_dispatch on CUDA tensors of this buffer",
                    "a handle of its CPU low-latency mode");
    return args::combine_slab_view(layout_, half_base(generation_ - base_), Device::cuda(device_));
  }
  bool configured() const override { return config_.set; }
  /// The window past its control block (both halves: num_rdma_bytes), as DeepEP's RDMA buffer.
  TensorView local_buffer() const override {
    if (!config_.set) return {};
    return TensorView(static_cast<std::byte*>(mem_->local()) + ll::kControlBytes, DType::uint8,
                      {static_cast<std::int64_t>(mem_->bytes() - ll::kControlBytes)}, {1}, Device::cuda(device_));
  }

 private:
  using Config = low_latency_args::Config;
  // What the receive of a call needs; kept per half so a hook can run after the call returned.
  struct Pending {
    bool active = false;
    bool is_dispatch = true;
    std::uint64_t generation = 0;
    std::uint32_t flags = 0;
    int scale_cols = 0;
    std::int32_t* stats = nullptr;
    std::int64_t stats_stride = 1;
    long long* wait_cost = nullptr;  // dispatch_ / combine_wait_recv_cost_stats (int64 [R] on the GPU) or null
    int K = 0;  // the call's top-k
    // combine
    const void* topk_idx = nullptr;
    bool idx64 = true;
    const float* weights = nullptr;
    std::int64_t T = 0;
    Tensor out;
    bool ids_swapped = false;  // bring_routing swapped sent_idx_'s halves for this combine: swap back after receive
  };
  struct Sent {
    std::uint64_t generation = ~0ull;
    std::int64_t num_tokens = 0, topk = 0;
    std::vector<std::int32_t> topk_idx;  // host copy when debug_validate read it
  };

  void check_state();
  void ensure_configured(int num_max_dispatch_tokens_per_rank, std::int64_t hidden, int num_experts,
                         std::string_view phase);
  void begin_call(std::string_view what);
  /// The kernels' common arguments for a launch of call `call` (since the last clean): it raises the consumed
  /// flags of the receives launched before it (unpublished_), which are then taken as raised. `received`: the
  /// launch runs call's receive, whose flag the next launch raises.
  ll::Common common(std::uint64_t call, bool received);
  /// Orders a launch on `s` after this buffer's previous launch (on whatever stream it was).
  void order(cudaStream_t s);
  void launched(cudaStream_t s);
  void enter(cudaStream_t caller) {
    EPMOE_CUDA_CHECK(cudaEventRecord(caller_done_, caller));
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(comm_, caller_done_, 0));
  }
  void receive(std::uint64_t generation, cudaStream_t s, long long lag);
  /// EPMOE_CUDA_IPC_TRACE=1: the stamps for a launch on `s` (null otherwise), and after it the launch's sums.
  long long* arm_trace(cudaStream_t s) { return trace_ ? trace_->arm(s) : nullptr; }
  void collect_trace(const char* op, int ran, cudaStream_t s) {
    if (trace_)
      trace_->collect(std::string(op) + (ran == ll::kSendPhase   ? " send"
                                         : ran == ll::kRecvPhase ? " recv"
                                                                    : " (send + recv)"),
                      s);
  }
  static ll::DispatchRecvArgs dispatch_recv_args(const Pending& p, long long lag);
  ll::CombineRecvArgs combine_recv_args(const Pending& p, long long lag) const;
  /// The phases of a call's launch: the send alone when a hook runs the receive later, else both in one kernel.
  static int phases(bool hook) { return hook ? ll::kSendPhase : ll::kSendPhase | ll::kRecvPhase; }
  /// A call's end, after its launch: with `hook`, `p` is kept for the receive the result's hook launches; else the
  /// receive ran in the same kernel, and with async_finish the result has an event on the communication stream.
  template <class Result>
  void finish(Result& r, Pending p, bool hook, bool async_finish) {
    Pending& kept = pending_[(p.generation - base_) % 2];
    kept = Pending{};
    if (hook) {
      kept = std::move(p);
      kept.active = true;
      const std::uint64_t generation = kept.generation;
      r.hook = RecvHook([this, generation] { receive_hook(generation); });
      return;
    }
    if (async_finish) r.event = Event::from_backend(std::make_shared<cuda_ipc::CudaEvent>(device_, comm_));
  }
  void receive_hook(std::uint64_t generation);
  /// The kernels of combine call `index` read its dispatch's routing (src_info, layout_range, packed_k, self_row in the
  /// output area; the ids in sent_idx_) from half (index - 1) % 2. When the dispatch (call `dispatch_index`) is in
  /// the other half (DeepEP's alternation lets a handle be combined later, e.g. twice), its routing is brought there
  /// on `s`: the half's own routing area is saved in routing_save_ and restored by put_back_routing after the send
  /// kernel (users see the output area unchanged), and the two halves' ids are swapped (sent_idx_ is internal),
  /// then swapped back after the combine's receive kernel (Pending::ids_swapped). Returns whether it moved anything.
  bool bring_routing(std::uint64_t dispatch_index, std::uint64_t index, cudaStream_t s);
  void put_back_routing(std::uint64_t index, cudaStream_t s);
  void swap_ids(cudaStream_t s);  // exchanges the two halves' ids in sent_idx_ (through routing_save_)
  std::size_t routing_bytes() const {
    return layout_.self_row + static_cast<std::size_t>(layout_.tmax) * ll::kMaxTopk * sizeof(std::int32_t) -
           layout_.src_info;
  }
  char* half_base(std::uint64_t index) const {
    return static_cast<char*>(mem_->local()) + ll::kControlBytes + (index % 2) * layout_.half_bytes;
  }

  std::shared_ptr<Group> group_;
  std::uint64_t buffer_id_;
  int device_ = 0, R_ = 0, me_ = 0;
  std::int64_t num_rdma_bytes_ = 0;
  bool debug_validate_ = false;
  bool separate_quant_ = false;  // BufferOptions::low_latency_separate_quant
  long long timeout_ns_ = 0;
  Config config_;
  LowLatencyMode::Layout layout_;
  std::unique_ptr<CudaIpcMemory> mem_;
  Tensor scratch_;   // fp8 records (quantized rows + scales, record_bytes apart) before they are sent
  Tensor sent_idx_;  // int32 [2, num_max_dispatch_tokens_per_rank * 16]: each half's dispatch ids (device)
  Tensor routing_save_;  // bring_routing's scratch: one half's routing area, then one half's ids (made on first use)
  ll::HostRecord* host_ = nullptr;
  ll::HostRecord* host_dev_ = nullptr;
  std::shared_ptr<cuda_ipc::CommStream> comm_owner_;  // the buffer's (normal mode's) communication stream
  cudaStream_t comm_ = nullptr;
  cudaEvent_t caller_done_ = nullptr;
  cudaEvent_t last_event_ = nullptr;  // after this buffer's last launch
  cudaStream_t last_stream_ = nullptr;
  bool has_last_ = false;
  std::string broken_;
  std::uint64_t generation_ = 0, base_ = 0;  // as the CPU class: calls over the buffer's life, and at the last clean
  std::array<Pending, 2> pending_;
  std::array<Sent, 2> sent_;
  // Per half: the call (since the last clean) whose receive was launched and whose consumed flags no launch has
  // raised yet (-1: none); the next launch raises them (Common::publish_mask).
  std::array<long long, 2> unpublished_ = {-1, -1};
  std::unique_ptr<ll::LaunchTrace> trace_;  // EPMOE_CUDA_IPC_TRACE=1
};

void CudaIpcLowLatencyImpl::check_state() {
  if (!broken_.empty())
    raise(ErrorCode::unusable, "rank {}: the low-latency buffer is unusable after an earlier fault ({}); re-create it",
          me_, broken_);
  volatile ll::HostRecord* h = host_;
  const int code = h->error_code;
  if (code == ll::kErrNone) return;
  std::atomic_thread_fence(std::memory_order_acquire);
  const int rank = h->error_rank, peer = h->error_peer, phase = h->error_phase;
  const long long value = h->error_value, value2 = h->error_value2;
  const unsigned long long index = h->error_index;
  const std::string where = fmt::format("rank {}, peer {}, phase '{}', call {}", rank, peer, phase_name(phase), index);
  switch (code) {
    case ll::kErrTimeout:
      broken_ = "device timeout: " + where;
      raise(ErrorCode::timeout,
            "rank {}: timed out after {} s on the device waiting for rank {} ({}; the flag read {})", me_,
            static_cast<double>(timeout_ns_) / 1e9, peer, where, value);
    case ll::kErrCopyTimeout:
      broken_ = "device copy timeout: " + where;
      raise(ErrorCode::timeout,
            "rank {}: a bulk copy of this rank's own memory did not complete within {} s on the device (local expert "
            "{}, row {}; {}): the device is preempted or faulty",
            me_, static_cast<double>(timeout_ns_) / 1e9, value, value2, where);
    case ll::kErrOtherCall:
      broken_ = "peer in another call: " + where;
      raise(ErrorCode::rank_mismatch,
            "rank {}: rank {} is not in the same low-latency call: this rank is in call {}, rank {} sent {} of call {} "
            "(every rank must make the same sequence of low-latency calls; {})",
            me_, peer, index, peer,
            value2 == ll::kKindCombine    ? "a combine"
            : value2 == ll::kKindDispatch ? "a dispatch"
                                          : "data",
            value, where);
    case ll::kErrFlags:
      broken_ = "settings differ: " + where;
      raise(
          ErrorCode::rank_mismatch,
          "rank {}: setting 'use_fp8/round_scale/use_ue8m0/use_nvfp4' must be equal on all ranks: rank {} has "
          "{}/{}/{}/{}, rank {} has {}/{}/{}/{} ({})",
          me_, rank, (value2 & 1) != 0, (value2 & 2) != 0, (value2 & 4) != 0, (value2 & ll::kFlagNvfp4) != 0, peer,
          (value & 1) != 0, (value & 2) != 0, (value & 4) != 0, (value & ll::kFlagNvfp4) != 0, where);
    case ll::kErrShape:
      broken_ = "settings differ: " + where;
      raise(ErrorCode::rank_mismatch,
            "rank {}: num_max_dispatch_tokens_per_rank, hidden and num_experts must be equal on all ranks: rank {} "
            "sent hidden = {}, num_max_dispatch_tokens_per_rank = {}, num_experts = {} ({})",
            me_, peer, value, value2 >> 32, value2 & 0xffffffff, where);
    case ll::kErrSignalTimeout:
      broken_ = "overlap signal timeout: " + where;
      raise(ErrorCode::timeout,
            "rank {}: {} (call {}): rank {} timed out on the device after {} s in phase 'low_latency_combine send: "
            "overlap signal' waiting for its local expert {} (global {}){}: its producer never marked it done ({})",
            me_, phase_name(phase), index, peer, static_cast<double>(timeout_ns_) / 2e9, value,
            static_cast<long long>(peer) * config_.num_experts / R_ + value,
            value2 >= 0 ? fmt::format(", block {}", value2) : std::string(), where);
    case ll::kErrCount:
      broken_ = "row counts differ: " + where;
      raise(ErrorCode::rank_mismatch,
            "rank {}: rank {} sent {} rows back at combine for this rank's tokens, but this rank's topk_idx routes {} "
            "(token, k) pairs to it ({})",
            me_, peer, value, value2, where);
    default: break;
  }
  // Id errors: every rank skipped the same ids, so the buffer stays usable; the record is reset.
  h->error_code = ll::kErrNone;
  auto* ctrl = static_cast<ll::Control*>(mem_->local());
  const int zero = 0;
  EPMOE_CUDA_CHECK(cudaMemcpy(&ctrl->claim, &zero, sizeof(int), cudaMemcpyHostToDevice));
  const long long K = sent_[0].topk > 0 ? sent_[0].topk : sent_[1].topk;
  const std::string at = K > 0 ? fmt::format("[{}, {}]", value2 / K, value2 % K) : fmt::format("flat {}", value2);
  if (code == ll::kErrBadId)
    throw_invalid_argument("topk_idx", fmt::format("expert ids in [-1, {})", config_.num_experts),
                           fmt::format("{} at {} (found on the device in {}; the id was skipped)", value, at, where));
  if (code == ll::kErrGlobalScale) {
    float v = 0.0f;
    const auto b = static_cast<std::uint32_t>(value);
    std::memcpy(&v, &b, sizeof(v));
    throw_invalid_argument("x_global_scale", "a finite global scale > 0",
                           fmt::format("{} (read on the device in {}; that dispatch's codes are meaningless)", v, where));
  }
  if (code == ll::kErrDuplicateId)
    throw_invalid_argument("topk_idx", "distinct expert ids per token (or -1)",
                           fmt::format("expert {} twice in token {} (found on the device in {}; skipped)", value,
                                       K > 0 ? value2 / K : value2, where));
  throw_invalid_argument("topk_idx", "the topk_idx given to the dispatch of this handle",
                         fmt::format("{} at {} (found on the device in {})", value, at, where));
}

void CudaIpcLowLatencyImpl::ensure_configured(int num_max_dispatch_tokens_per_rank, std::int64_t hidden,
                                              int num_experts, std::string_view phase) {
  if (config_.set) return;
  const LowLatencyMode::Layout L =
      LowLatencyMode::Layout::make(num_max_dispatch_tokens_per_rank, hidden, R_, num_experts);
  const std::int64_t bytes = num_rdma_bytes_ > 0 ? num_rdma_bytes_ : static_cast<std::int64_t>(2 * L.half_bytes);
  const Setting settings[] = {{"num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank},
                              {"hidden", hidden},
                              {"num_experts", num_experts},
                              {"num_rdma_bytes (low-latency window bytes)", bytes}};
  group_->check_agreement(settings, fmt::format("{}: low-latency settings", phase));
  DeviceGuard guard(Device::cuda(device_));
  const std::size_t total = ll::kControlBytes + static_cast<std::size_t>(bytes);
  mem_ = std::make_unique<CudaIpcMemory>(
      *group_, device_, total, total,
      fmt::format("low-latency window (num_rdma_bytes = {} plus a {}-byte control block)", bytes, ll::kControlBytes),
      fmt::format("{}: map the low-latency window", phase));
  {
    StreamGuard on_comm(Stream{comm_});
    scratch_ = Tensor::empty(
        DType::int8,
        {static_cast<std::int64_t>(num_max_dispatch_tokens_per_rank) * static_cast<std::int64_t>(L.record_bytes)},
        Device::cuda(device_));
    sent_idx_ =
        Tensor::empty(DType::int32, {2 * static_cast<std::int64_t>(num_max_dispatch_tokens_per_rank) * ll::kMaxTopk},
                      Device::cuda(device_));
    EPMOE_CUDA_CHECK(cudaMemsetAsync(sent_idx_.data(), 0xff, sent_idx_.nbytes(), comm_));
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(comm_));
  }
  layout_ = L;
  config_ = {true, num_max_dispatch_tokens_per_rank, hidden, num_experts};
}

void CudaIpcLowLatencyImpl::begin_call(std::string_view what) {
  const Pending& p = pending_[(generation_ - base_) % 2];
  if (p.active)
    raise(ErrorCode::stale_handle,
          "rank {}: {} would reuse the receive buffer of low-latency call {}, whose recv hook was never called; "
          "call that hook first (at most two low-latency calls can be in flight)",
          me_, what, p.generation);
}

ll::Common CudaIpcLowLatencyImpl::common(std::uint64_t call, bool received) {
  ll::Common c;
  for (int h = 0; h < 2; ++h) {
    if (unpublished_[h] < 0) continue;
    c.publish_mask |= 1 << h;
    c.publish_delta[h] = static_cast<long long>(call) - unpublished_[h];
    unpublished_[h] = -1;
  }
  if (received) unpublished_[call % 2] = static_cast<long long>(call);
  static_cast<LowLatencyMode::Layout&>(c) = layout_;  // its num_ranks is R_ (made for this group)
  for (int r = 0; r < R_; ++r) c.peers[r] = mem_->peer(r);
  c.rank = me_;
  c.timeout_ns = timeout_ns_;
  c.host = host_dev_;
  c.sent_idx = sent_idx_.ptr<std::int32_t>();
  return c;
}

// Every kernel of this buffer runs after the one enqueued before it (they share the window's counters and
// halves), also across streams (async_finish, hooks on another stream): the stream waits for an event after the
// previous launch. Inside a capture the stream is the capture's, so nothing is waited for there.
void CudaIpcLowLatencyImpl::order(cudaStream_t s) {
  if (has_last_ && last_stream_ != s && !capturing(s)) EPMOE_CUDA_CHECK(cudaStreamWaitEvent(s, last_event_, 0));
}
void CudaIpcLowLatencyImpl::launched(cudaStream_t s) {
  if (capturing(s)) {
    has_last_ = false;
    return;
  }
  EPMOE_CUDA_CHECK(cudaEventRecord(last_event_, s));
  last_stream_ = s;
  has_last_ = true;
}

// ------------------------------------------------------------------------------------------------

LowLatencyDispatchResult CudaIpcLowLatencyImpl::dispatch(const LowLatencyDispatchArgs& a) {
  check_state();
  const Device gpu = Device::cuda(device_);
  // --- every argument, before any communication
  args::DispatchSpec spec = args::check_dispatch(a, R_, gpu);
  const std::int64_t T = spec.T, H = spec.H, K = spec.K;
  const int num_max_dispatch_tokens_per_rank = spec.tmax, E = spec.E;
  args::check_against_config(config_.set, config_.tmax, config_.hidden, config_.num_experts,
                             num_max_dispatch_tokens_per_rank, H, E, R_, num_rdma_bytes_,
                             config_.set ? 0 : LowLatencyMode::size_hint(num_max_dispatch_tokens_per_rank, H, R_, E),
                             "x");
  DeviceGuard guard(gpu);
  const cudaStream_t caller = cuda_util::to_cuda(current_stream());
  std::vector<std::int32_t> ids;
  const bool graph = capturing(caller);
  if (!config_.set && graph)
    raise(ErrorCode::unsupported,
          "rank {}: the first low-latency call of a cuda_ipc buffer allocates and maps its window (collective, with "
          "host synchronisation) and cannot be captured in a CUDA graph: make one eager call first",
          me_);
  if (debug_validate_ && !graph) {
    ids = host_ids(a.topk_idx, T, E, caller);
    if (a.use_nvfp4 && spec.global_scale.device != nullptr) {
      float v = 0.0f;
      EPMOE_CUDA_CHECK(cudaMemcpyAsync(&v, spec.global_scale.device, sizeof(v), cudaMemcpyDeviceToHost, caller));
      EPMOE_CUDA_CHECK(cudaStreamSynchronize(caller));
      quant_detail::check_global_scale_value(v, "x_global_scale");
    }
  }
  begin_call("low_latency_dispatch");

  ensure_configured(num_max_dispatch_tokens_per_rank, H, E, "low_latency_dispatch");
  const LowLatencyMode::Layout& L = layout_;
  const std::uint64_t gen = generation_, index = gen - base_;
  // Scale words per record: float32 groups, UE8M0 words, or (nvfp4) words of four e4m3 block scales.
  const std::int64_t sc_cols = a.use_nvfp4 ? H / 64 : a.use_ue8m0 ? num_ue8m0_words(H) : L.groups;
  const std::uint32_t flags = ll::dispatch_flags(a.use_fp8, a.round_scale, a.use_ue8m0, a.use_nvfp4);
  const cudaStream_t s = a.async_finish ? comm_ : caller;
  Pending p;
  p.is_dispatch = true;
  p.generation = gen;
  p.K = static_cast<int>(K);
  p.flags = flags;
  p.scale_cols = static_cast<int>(sc_cols);
  if (a.cumulative_local_expert_recv_stats.defined()) {
    p.stats = static_cast<std::int32_t*>(a.cumulative_local_expert_recv_stats.data);
    p.stats_stride = a.cumulative_local_expert_recv_stats.stride(0);
  }
  p.wait_cost = static_cast<long long*>(a.dispatch_wait_recv_cost_stats.data);
  try {
    if (a.async_finish) enter(caller);
    order(s);
    ll::Common c = common(index, !a.return_recv_hook);
    if (a.use_nvfp4 && T > 0) {
      // NVFP4 is quantized by the library's quantizer into the records the send kernel copies (one more pass over
      // x than a fused send, the simplest correct route): the packed row, then its linear block scales.
      StreamGuard on(Stream{s});
      const auto stride = static_cast<std::int64_t>(L.record_bytes);
      auto* rec = static_cast<std::byte*>(scratch_.data());
      const TensorView q(rec, DType::uint8, {T, H / 2}, {stride, 1}, gpu);
      const TensorView sc(rec + H / 2, DType::fp8_e4m3, {T, H / 16}, {stride, 1}, gpu);
      quant_detail::quantize_nvfp4_cuda({a.x, q, sc, T, H, Nvfp4ScaleLayout::linear, spec.global_scale}, Stream{s});
    }
    if (a.use_fp8 && T > 0 && separate_quant_) {
      StreamGuard on(Stream{s});
      const auto stride = static_cast<std::int64_t>(L.record_bytes);
      auto* rec = static_cast<std::byte*>(scratch_.data());
      const TensorView q(rec, DType::fp8_e4m3, {T, H}, {stride, 1}, gpu);
      const TensorView sc(rec + H, a.use_ue8m0 ? DType::int32 : DType::fp32, {T, sc_cols}, {stride / 4, 1}, gpu);
      quantize_fp8_into(a.x, q, sc, Fp8Options{a.round_scale, a.use_ue8m0});
    }
    ll::DispatchSendArgs sa;
    sa.x = a.x.data;
    sa.x_stride = T > 1 ? a.x.stride(0) : H;
    // null: a bf16 row, or an fp8 row quantized in the send kernel
    sa.records = a.use_nvfp4 || (a.use_fp8 && separate_quant_) ? scratch_.data() : nullptr;
    sa.global_scale = a.use_nvfp4 ? spec.global_scale.device : nullptr;
    sa.topk_idx = a.topk_idx.data;
    sa.idx64 = a.topk_idx.dtype == DType::int64;
    sa.K = static_cast<int>(K);
    sa.T = T;
    sa.flags = flags;
    sa.scale_cols = static_cast<int>(sc_cols);
    c.stamps = arm_trace(s);
    ll::launch_dispatch(c, sa, dispatch_recv_args(p, 0), phases(a.return_recv_hook), s);
    collect_trace("dispatch", phases(a.return_recv_hook), s);
    launched(s);
  } catch (...) {
    broken_ = "a dispatch failed while being enqueued";
    throw;
  }
  ++generation_;
  Sent& sent = sent_[index % 2];
  sent = {gen, T, K, std::move(ids)};

  LowLatencyDispatchResult r =
      LowLatencyMode::output_views(L, half_base(index), a.use_fp8, a.use_ue8m0, a.use_nvfp4, gpu);
  r.handle.generation = gen;
  r.handle.buffer_id = buffer_id_;
  finish(r, std::move(p), a.return_recv_hook, a.async_finish);
  return r;
}

ll::DispatchRecvArgs CudaIpcLowLatencyImpl::dispatch_recv_args(const Pending& p, long long lag) {
  ll::DispatchRecvArgs ra;
  ra.lag = lag;
  ra.flags = p.flags;
  ra.scale_cols = p.scale_cols;
  ra.stats = p.stats;
  ra.stats_stride = p.stats_stride;
  ra.wait_cost = p.wait_cost;
  return ra;
}

ll::CombineRecvArgs CudaIpcLowLatencyImpl::combine_recv_args(const Pending& p, long long lag) const {
  ll::CombineRecvArgs ra;
  ra.lag = lag;
  ra.topk_idx = p.topk_idx;
  ra.idx64 = p.idx64;
  ra.K = p.K;
  ra.weights = p.weights;
  ra.T = p.T;
  ra.out = p.out.data();
  ra.out_stride = p.T > 1 ? p.out.view().stride(0) : layout_.hidden;
  ra.wait_cost = p.wait_cost;
  return ra;
}

void CudaIpcLowLatencyImpl::receive_hook(std::uint64_t gen) {
  check_state();
  DeviceGuard guard(Device::cuda(device_));
  receive(gen, cuda_util::to_cuda(current_stream()), static_cast<long long>(generation_ - 1 - gen));
}

void CudaIpcLowLatencyImpl::receive(std::uint64_t gen, cudaStream_t s, long long lag) {
  Pending& p = pending_[(gen - base_) % 2];
  if (gen < base_ || !p.active || p.generation != gen)
    raise(ErrorCode::stale_handle,
          "rank {}: the receive of low-latency call {} is no longer pending (the buffer was cleaned since)", me_, gen);
  try {
    order(s);
    ll::Common c = common(gen - base_, true);
    c.stamps = arm_trace(s);
    if (p.is_dispatch) {
      ll::DispatchSendArgs unused;
      unused.K = p.K;  // the send's instantiation: one kernel name per op, also in a profile with hooks
      ll::launch_dispatch(c, unused, dispatch_recv_args(p, lag), ll::kRecvPhase, s);
      collect_trace("dispatch", ll::kRecvPhase, s);
    } else {
      ll::launch_combine(c, {}, combine_recv_args(p, lag), ll::kRecvPhase, s);
      collect_trace("combine", ll::kRecvPhase, s);
      if (p.ids_swapped) swap_ids(s);
    }
    launched(s);
  } catch (...) {
    p = Pending{};
    broken_ = "a receive failed while being enqueued";
    throw;
  }
  p = Pending{};
}

// ------------------------------------------------------------------------------------------------

LowLatencyCombineResult CudaIpcLowLatencyImpl::combine(const LowLatencyCombineArgs& a) {
  const Device gpu = Device::cuda(device_);
  // --- every argument, before any communication (the handle checks are the CPU class's)
  const LowLatencyHandle& hd = args::combine_handle(a, buffer_id_);
  check_state();
  EPMOE_CHECK_ARG(config_.set, "handle", "the handle of a low_latency_dispatch on CUDA tensors of this buffer",
                  "a handle of its CPU low-latency mode");
  const LowLatencyMode::Layout& L = layout_;
  const int El = L.local_experts, num_max_dispatch_tokens_per_rank = L.tmax;
  const std::int64_t H = L.hidden, rows = static_cast<std::int64_t>(R_) * num_max_dispatch_tokens_per_rank;
  const Sent& sent = sent_[(hd.generation - base_) % 2];
  const Pending& unreceived = pending_[(hd.generation - base_) % 2];
  args::check_combine_handle(hd, me_, num_max_dispatch_tokens_per_rank, H, L.num_experts, base_, generation_,
                             sent.generation == hd.generation,
                             unreceived.active && unreceived.generation == hd.generation);
  const std::int64_t T = sent.num_tokens, K = sent.topk;

  const TensorView x = args::combine_input(a, args::combine_slab_view(L, half_base(generation_ - base_), gpu), El,
                                           rows, H, gpu);
  args::check_combine_idx_shape(a.topk_idx, T, K);
  args::check_on(a.topk_idx, "topk_idx", gpu);
  check_topk_idx_dtype(a.topk_idx);
  EPMOE_CHECK_ARG(T <= 1 || (a.topk_idx.stride(1) == 1 && a.topk_idx.stride(0) == K), "topk_idx",
                  "a contiguous tensor on CUDA", args::strides_of(a.topk_idx));
  EPMOE_CHECK_ARG(a.topk_weights.defined(), "topk_weights", fmt::format("float32[{}, {}]", T, K), "None");
  args::check_on(a.topk_weights, "topk_weights", gpu);
  EPMOE_CHECK_ARG(a.topk_weights.ndim() == 2 && a.topk_weights.dtype == DType::fp32 && a.topk_weights.size(0) == T &&
                      a.topk_weights.size(1) == K &&
                      (T <= 1 || (a.topk_weights.stride(1) == 1 && a.topk_weights.stride(0) == K)),
                  "topk_weights", fmt::format("contiguous float32[{}, {}]", T, K), args::strides_of(a.topk_weights));
  if (a.out.defined()) args::check_combine_out(a.out, T, H, gpu);
  args::check_wait_cost_stats(a.combine_wait_recv_cost_stats, "combine_wait_recv_cost_stats", R_, gpu);
  EPMOE_CHECK_ARG(!(a.return_recv_hook && a.async_finish), "async_finish",
                  "false with return_recv_hook (the hook and async_finish exclude each other)", "true");
  const args::OverlapSpec overlap = args::check_combine_overlap(a, El, rows, gpu);
  // zero_copy sends the window's slab instead of x; either way the send kernel reads its input where it is and
  // stores each row straight into its destination (no staging copy, which is what DeepEP's zero_copy saves).
  DeviceGuard guard(gpu);
  const cudaStream_t caller = cuda_util::to_cuda(current_stream());
  if (debug_validate_ && !capturing(caller) && !sent.topk_idx.empty()) {
    const std::vector<std::int32_t> idx = host_ids(a.topk_idx, T, L.num_experts, caller);
    for (std::size_t i = 0; i < idx.size(); ++i)
      if (idx[i] != sent.topk_idx[i])
        throw_invalid_argument(
            "topk_idx", "the topk_idx given to the dispatch of this handle",
            fmt::format("{} at [{}, {}] where the dispatch had {}", idx[i], i / K, i % K, sent.topk_idx[i]));
  }
  begin_call("low_latency_combine");

  const std::uint64_t gen = generation_, index = gen - base_;
  const cudaStream_t s = a.async_finish ? comm_ : caller;
  Tensor out;
  bool moved = false;
  Pending p;
  p.is_dispatch = false;
  p.generation = gen;
  p.topk_idx = a.topk_idx.data;
  p.idx64 = a.topk_idx.dtype == DType::int64;
  p.K = static_cast<int>(K);
  p.weights = static_cast<const float*>(a.topk_weights.data);
  p.T = T;
  p.wait_cost = static_cast<long long*>(a.combine_wait_recv_cost_stats.data);
  try {
    if (a.async_finish) enter(caller);
    order(s);
    {
      StreamGuard on(Stream{s});  // a fresh output is allocated (stream-ordered) where the receive runs first
      out = a.out.defined() ? Tensor::wrap(a.out, nullptr) : Tensor::empty(DType::bf16, {T, H}, gpu);
    }
    ll::CombineSendArgs sa;
    sa.x = x.data;
    sa.stride0 = x.stride(0);
    sa.stride1 = x.stride(1);
    if (overlap.active()) {
      sa.signal_form = overlap.form == args::OverlapSpec::Form::blocks ? ll::kSignalBlocks : ll::kSignalExperts;
      sa.signal = overlap.signal;
      sa.block_m = overlap.block_m;
      sa.blocks_per_expert = overlap.blocks_per_expert;
      sa.expect = overlap.expect;
      sa.grid = overlap.num_sms;  // the launch bounds it by E_local (a block per local expert at most)
      sa.stamps = reinterpret_cast<long long*>(overlap.send_stamps);
    }
    moved = bring_routing(hd.generation - base_, index, s);
    p.ids_swapped = moved;
    p.out = out;
    ll::Common c = common(index, !a.return_recv_hook);
    // An overlapped combine is not traced: the trace's wait after the launch could precede the caller's enqueue of
    // the signals' producer, and the send would give up on them.
    c.stamps = overlap.active() ? nullptr : arm_trace(s);
    ll::launch_combine(c, sa, combine_recv_args(p, 0), phases(a.return_recv_hook), s);
    collect_trace("combine", phases(a.return_recv_hook), s);
    if (moved) {
      put_back_routing(index, s);  // after the send read the routing (the receive reads none of it)
      if (!a.return_recv_hook) swap_ids(s);  // after the receive checked the ids (same kernel)
    }
    launched(s);
  } catch (...) {
    broken_ = "a combine failed while being enqueued";
    throw;
  }
  ++generation_;

  LowLatencyCombineResult r;
  r.combined_x = out;
  finish(r, std::move(p), a.return_recv_hook, a.async_finish);
  return r;
}

bool CudaIpcLowLatencyImpl::bring_routing(std::uint64_t dispatch_index, std::uint64_t index, cudaStream_t s) {
  const std::uint64_t from = dispatch_index % 2, to = (index + 1) % 2;  // (index - 1) % 2 without underflow
  if (from == to) return false;
  const std::size_t bytes = routing_bytes();
  const std::size_t ids_bytes = static_cast<std::size_t>(layout_.tmax) * ll::kMaxTopk * sizeof(std::int32_t);
  if (!routing_save_.defined()) {
    StreamGuard on(Stream{s});
    routing_save_ = Tensor::empty(DType::int8, {static_cast<std::int64_t>(bytes + ids_bytes)}, Device::cuda(device_));
  }
  auto* save = static_cast<char*>(routing_save_.data());
  char* dst = half_base(to) + layout_.src_info;
  const char* src = half_base(from) + layout_.src_info;
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(save, dst, bytes, cudaMemcpyDeviceToDevice, s));
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
  swap_ids(s);
  return true;
}

void CudaIpcLowLatencyImpl::swap_ids(cudaStream_t s) {
  const std::size_t bytes = routing_bytes();
  const std::size_t ids_bytes = static_cast<std::size_t>(layout_.tmax) * ll::kMaxTopk * sizeof(std::int32_t);
  auto* ids = static_cast<char*>(sent_idx_.data());
  char* save = static_cast<char*>(routing_save_.data()) + bytes;
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(save, ids, ids_bytes, cudaMemcpyDeviceToDevice, s));
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(ids, ids + ids_bytes, ids_bytes, cudaMemcpyDeviceToDevice, s));
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(ids + ids_bytes, save, ids_bytes, cudaMemcpyDeviceToDevice, s));
}

void CudaIpcLowLatencyImpl::put_back_routing(std::uint64_t index, cudaStream_t s) {
  const std::uint64_t to = (index + 1) % 2;
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(half_base(to) + layout_.src_info, routing_save_.data(), routing_bytes(),
                                   cudaMemcpyDeviceToDevice, s));
}

void CudaIpcLowLatencyImpl::clean(int num_max_dispatch_tokens_per_rank, std::int64_t hidden, int num_experts) {
  args::check_settings(num_max_dispatch_tokens_per_rank, hidden, R_, num_experts);
  args::check_against_config(
      config_.set, config_.tmax, config_.hidden, config_.num_experts, num_max_dispatch_tokens_per_rank, hidden,
      num_experts, R_, num_rdma_bytes_,
      config_.set ? 0 : LowLatencyMode::size_hint(num_max_dispatch_tokens_per_rank, hidden, R_, num_experts),
      "hidden");
  check_state();
  if (!config_.set) {
    ensure_configured(num_max_dispatch_tokens_per_rank, hidden, num_experts, "clean_low_latency_buffer");
  } else {
    // Every rank's kernels are done before any window is zeroed, and every window is zeroed before any rank's
    // next call (its kernels write into the peers' windows).
    DeviceGuard guard(Device::cuda(device_));
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(comm_));
    if (has_last_) EPMOE_CUDA_CHECK(cudaEventSynchronize(last_event_));
    group_->barrier("clean_low_latency_buffer: kernels done");
    EPMOE_CUDA_CHECK(cudaMemset(mem_->local(), 0, mem_->bytes()));
    EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
    group_->barrier("clean_low_latency_buffer: windows zeroed");
  }
  base_ = generation_;
  pending_ = {};
  sent_ = {};
  unpublished_ = {-1, -1};
}

}  // namespace

std::unique_ptr<CudaIpcLowLatency> make_cuda_ipc_low_latency(std::shared_ptr<Group> group, int device,
                                                             const BufferOptions& options, std::uint64_t buffer_id,
                                                             std::shared_ptr<cuda_ipc::CommStream> comm) {
  return std::make_unique<CudaIpcLowLatencyImpl>(std::move(group), device, options, buffer_id, std::move(comm));
}

}  // namespace epmoe

#endif
