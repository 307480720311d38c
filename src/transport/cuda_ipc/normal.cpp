// cuda-ipc normal mode: the host side (argument checks, buffer mapping, streams, events, the host read
// of the counts). Kernels: cuda_ipc/normal_kernels.cu. Protocol: cuda_ipc/normal.hpp and docs/cuda_ipc_design.md.
#include "transport/args/normal.hpp"
#include "transport/cuda_ipc/normal.hpp"

#include "core/check.hpp"
#include <epmoe/error.hpp>
#include <epmoe/quant.hpp>
#include <epmoe/stream.hpp>

#include <algorithm>

namespace epmoe {

namespace {
constexpr std::int64_t kFieldSlack = 16;  // each field array starts on a 16-byte boundary
std::int64_t dispatch_row_bytes(std::int64_t x_row, std::int64_t scale_row, int K) {
  return x_row + scale_row + 12 * static_cast<std::int64_t>(K) + 4;  // x, scales, int64 ids, f32 weights, src
}
std::int64_t combine_row_bytes(std::int64_t H, int K) { return 2 * H + 4 * static_cast<std::int64_t>(K); }
}  // namespace

std::int64_t cuda_ipc_normal_size_hint(std::int64_t max_tokens_per_rank, std::int64_t hidden, int num_ranks,
                                       int num_topk) {
  EPMOE_CHECK_ARG(max_tokens_per_rank >= 0, "max_tokens_per_rank", ">= 0", max_tokens_per_rank);
  EPMOE_CHECK_ARG(hidden > 0, "hidden", "> 0", hidden);
  EPMOE_CHECK_ARG(num_ranks >= 1, "num_ranks", ">= 1", num_ranks);
  EPMOE_CHECK_ARG(num_topk >= 0 && num_topk <= kNormalMaxTopk, "num_topk", fmt::format("0..{}", kNormalMaxTopk),
                  num_topk);
  // A bf16 dispatch row is the largest row of either op (fp8 + scales is smaller for H >= 4). Rows: every rank's
  // tokens (the SM-store path receives them all), and twice the rows a copy-engine dispatch stages for its peers
  // (it alternates between the region's halves; see half_layout).
  const std::int64_t row = std::max(dispatch_row_bytes(2 * hidden, 0, num_topk), combine_row_bytes(hidden, num_topk));
  const std::int64_t rows = max_tokens_per_rank * std::max<std::int64_t>(num_ranks, 2 * (num_ranks - 1));
  return rows * row + 2 * (5 * kFieldSlack + 16);  // each half's field slack, and its 16-byte alignment
}

}  // namespace epmoe

#if !defined(EPMOE_HAVE_CUDA)

namespace epmoe {
std::unique_ptr<CudaIpcNormal> make_cuda_ipc_normal(std::shared_ptr<Group>, const BufferOptions&, std::uint64_t) {
  raise(ErrorCode::unsupported, "backend cuda_ipc needs a CUDA build of epmoe (this one is CPU-only)");
}
}  // namespace epmoe

#else

#include <array>
#include <atomic>
#include <initializer_list>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <utility>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <cuda_runtime.h>

#include "core/cuda_check.hpp"
#include "core/cuda_util.hpp"
#include "transport/cuda_ipc/normal_kernels.hpp"
#include "transport/cuda_ipc/memory.hpp"
#include "transport/cuda_ipc/stream.hpp"

namespace epmoe {

namespace {

using cuda_util::DeviceGuard;
namespace ipc = cuda_ipc;
using ipc::capturing;
using ipc::CudaEvent;

constexpr std::string_view kSetupPhase = "cuda_ipc setup";
constexpr std::string_view kDispatchPhase = "cuda_ipc normal dispatch";


std::int64_t align16(std::int64_t v) { return (v + 15) / 16 * 16; }

/// Field arrays of `capacity` rows each, one after the other, 16-byte aligned.
ipc::DataLayout make_layout(std::int64_t data_bytes, std::int64_t x_row, std::int64_t scale_row, int K, bool src);

/// The copy-engine dispatch's staging area: half `half` (0 or 1) of the data region. Consecutive eager ops
/// alternate halves (CudaIpcNormalImpl::ops_, the same count on every rank), so an op may stage before its count
/// exchange: the peers may still pull the previous op's rows, but from the other half, and the last op that used
/// this half finished on every rank (this rank passed the previous op's handshake, which says so).
ipc::DataLayout half_layout(int half, std::int64_t data_bytes, std::int64_t x_row, std::int64_t scale_row, int K,
                            bool src) {
  const std::int64_t half_bytes = data_bytes / 2 / 16 * 16;
  ipc::DataLayout L = make_layout(half_bytes, x_row, scale_row, K, src);
  const std::size_t base = static_cast<std::size_t>(half * half_bytes);
  L.x_off += base;
  L.scale_off += base;
  L.idx_off += base;
  L.w_off += base;
  L.src_off += base;
  return L;
}

ipc::DataLayout make_layout(std::int64_t data_bytes, std::int64_t x_row, std::int64_t scale_row, int K, bool src) {
  const std::int64_t per_row = x_row + scale_row + 12 * static_cast<std::int64_t>(K) + (src ? 4 : 0);
  ipc::DataLayout L;
  L.capacity = std::max<std::int64_t>(0, (data_bytes - 5 * kFieldSlack) / per_row);
  std::int64_t off = 0;
  L.x_off = static_cast<std::size_t>(off);
  off += align16(L.capacity * x_row);
  L.scale_off = static_cast<std::size_t>(off);
  off += align16(L.capacity * scale_row);
  L.idx_off = static_cast<std::size_t>(off);
  off += align16(L.capacity * 8 * K);
  L.w_off = static_cast<std::size_t>(off);
  off += align16(L.capacity * 4 * K);
  L.src_off = static_cast<std::size_t>(off);
  return L;
}

const char* phase_name(int phase) {
  switch (phase) {
    case ipc::kPhaseDispatchNotify:
      return "dispatch count exchange";
    case ipc::kPhaseDispatchData:
      return "dispatch data";
    case ipc::kPhaseCombineNotify:
      return "combine handshake";
    case ipc::kPhaseCombineData:
      return "combine data";
    case ipc::kPhaseCachedNotify:
      return "cached dispatch handshake";
    default:
      return "unknown phase";
  }
}

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

constexpr int kPullSmallBlocks = 16;  // the small fields' kernel: latency-bound reads over NVLink

class CudaIpcNormalImpl final : public CudaIpcNormal {
 public:
  CudaIpcNormalImpl(std::shared_ptr<Group> group, const BufferOptions& o, std::uint64_t buffer_id)
      : group_(std::move(group)), buffer_id_(buffer_id) {
    Group& g = *group_;
    R_ = g.size();
    me_ = g.rank();
    EPMOE_CHECK_ARG(R_ <= ipc::kMaxRanks, "group", fmt::format("at most {} ranks (one NVLink host)", ipc::kMaxRanks),
                    R_);
    blocks_ = o.num_sms == 0 ? ipc::kDefaultBlocks : o.num_sms;
    EPMOE_CHECK_ARG(blocks_ >= 1 && blocks_ <= ipc::kMaxBlocks, "options.num_sms",
                    fmt::format("0 (default {}) or 1..{}", ipc::kDefaultBlocks, ipc::kMaxBlocks), o.num_sms);
    // 0 is a low-latency-only buffer (as DeepEP's Buffer(group, 0, num_rdma_bytes, low_latency_mode=True)): its
    // normal-mode calls raise (require_normal_region).
    EPMOE_CHECK_ARG(o.num_nvl_bytes > 0 || (o.num_nvl_bytes == 0 && o.low_latency_mode), "options.num_nvl_bytes",
                    "> 0 bytes (Buffer::get_normal_nvl_size_hint gives the size for a token count; 0 only with "
                    "low_latency_mode = true)",
                    o.num_nvl_bytes);
    int count = 0;
    EPMOE_CUDA_CHECK(cudaGetDeviceCount(&count));
    device_ = o.device >= 0 ? o.device : (count > 0 ? me_ % count : 0);
    EPMOE_CHECK_ARG(device_ < count, "options.device", fmt::format("a device index < {}", count), device_);
    data_bytes_ = o.num_nvl_bytes;
    use_copy_engine_ = o.use_copy_engine;
    copy_engine_min_rows_ = o.copy_engine_min_rows;
    // EPMOE_CUDA_IPC_COPY_ENGINE=0|1 overrides the option (diagnosis: the same program on both paths).
    if (const char* ce = std::getenv("EPMOE_CUDA_IPC_COPY_ENGINE"); ce != nullptr && *ce != '\0')
      use_copy_engine_ = std::string_view(ce) != "0";
    // EPMOE_CUDA_IPC_COMBINE_PUSH=sm: the copy-engine combine's pushes by SM stores (A/B measurement).
    if (const char* push = std::getenv("EPMOE_CUDA_IPC_COMBINE_PUSH"); push != nullptr)
      combine_sm_push_ = std::string_view(push) == "sm";
    chunks_ = o.num_chunks == 0 ? ipc::kDefaultChunks : o.num_chunks;
    EPMOE_CHECK_ARG(chunks_ >= 1 && chunks_ <= ipc::kMaxChunks, "options.num_chunks",
                    fmt::format("0 (default {}) or 1..{}", ipc::kDefaultChunks, ipc::kMaxChunks), o.num_chunks);
    const std::array<Setting, 5> settings = {Setting{"num_nvl_bytes", o.num_nvl_bytes}, Setting{"num_sms", blocks_},
                                             Setting{"use_copy_engine", o.use_copy_engine ? 1 : 0},
                                             Setting{"num_chunks", chunks_},
                                             Setting{"copy_engine_min_rows", o.copy_engine_min_rows}};
    g.check_agreement(settings, kSetupPhase);

    DeviceGuard guard(Device::cuda(device_));
    int sms = 0;
    EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
    recv_blocks_ = std::max(1, sms);
    EPMOE_CHECK_ARG(o.num_recv_slots >= 0 && o.num_recv_slots <= 64, "options.num_recv_slots", "0..64",
                    o.num_recv_slots);
    const int num_recv_slots = o.num_recv_slots;
    // Slots start at multiples of 4 KiB past the data region's start (its fields are 16-byte aligned from there;
    // num_nvl_bytes need not be a multiple of 16).
    slot_stride_ = (static_cast<std::size_t>(data_bytes_) + 4095) / 4096 * 4096;
    const std::size_t total =
        ipc::kControlBytes + slot_stride_ * (1 + static_cast<std::size_t>(num_recv_slots));
    // Allocated, its control region zeroed, and mapped by every peer (collective; CudaIpcMemory).
    mem_ = std::make_unique<CudaIpcMemory>(
        g, device_, total, ipc::kControlBytes,
        fmt::format("cuda_ipc buffer (num_nvl_bytes = {} for the data region and each of num_recv_slots = {} "
                    "receive slots)",
                    data_bytes_, num_recv_slots),
        kSetupPhase);
    base_ = mem_->local();
    memory_ = mem_->owner();
    for (int r = 0; r < R_; ++r) peers_[r] = mem_->peer(r);
    recv_slots_ = std::make_shared<RecvSlots>(memory_, num_recv_slots);
    EPMOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_), sizeof(ipc::HostRecord),
                                   cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(static_cast<void*>(host_), 0, sizeof(ipc::HostRecord));
    EPMOE_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev_), host_, 0));
    EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_, cudaStreamNonBlocking));
    for (int i = 0; i < 2; ++i) {
      EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&side_[i], cudaStreamNonBlocking));
      EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&joined_[i], cudaEventDisableTiming));
    }
    EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stage_, cudaStreamNonBlocking));
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&staged_, cudaEventDisableTiming));
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&listed_, cudaEventDisableTiming));
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&forked_, cudaEventDisableTiming));
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&allocated_, cudaEventDisableTiming));
    for (cudaEvent_t& e : stage_copied_) EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&caller_done_, cudaEventDisableTiming));
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&comm_done_, cudaEventDisableTiming));
    const char* trace = std::getenv("EPMOE_CUDA_IPC_TRACE");
    trace_ = trace != nullptr && std::string_view(trace) == "1";
    if (trace_)
      for (cudaEvent_t& e : trace_ev_) EPMOE_CUDA_CHECK(cudaEventCreate(&e));
    timeout_ns_ = static_cast<long long>(g.timeout_s() * 1e9);
  }

  ~CudaIpcNormalImpl() override {
    // No collective here: once this rank's stream is idle, no peer writes into this buffer any more
    // (every peer op needs this rank's handshake first).
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    if (comm_) cudaStreamSynchronize(comm_);
    for (int i = 0; i < 2; ++i) {
      if (side_[i]) cudaStreamSynchronize(side_[i]);
      if (side_[i]) cudaStreamDestroy(side_[i]);
      if (joined_[i]) cudaEventDestroy(joined_[i]);
    }
    if (forked_) cudaEventDestroy(forked_);
    if (allocated_) cudaEventDestroy(allocated_);
    if (stage_) cudaStreamSynchronize(stage_);
    if (stage_) cudaStreamDestroy(stage_);
    if (staged_) cudaEventDestroy(staged_);
    if (listed_) cudaEventDestroy(listed_);
    for (cudaEvent_t e : stage_copied_)
      if (e) cudaEventDestroy(e);
    if (caller_done_) cudaEventDestroy(caller_done_);
    if (comm_done_) cudaEventDestroy(comm_done_);
    if (trace_) {
      trace_print();
      for (cudaEvent_t e : trace_ev_) cudaEventDestroy(e);
    }
    mem_.reset();  // closes the opened IPC handles
    if (comm_) cudaStreamDestroy(comm_);
    if (host_) cudaFreeHost(host_);
    recv_slots_.reset();
    memory_.reset();  // cudaFree, unless tensors in receive slots still hold it
    cudaSetDevice(previous);
  }

  int device() const override { return device_; }

  DispatchResult dispatch(const DispatchArgs& a) override;
  CombineResult combine(const CombineArgs& a) override;

 private:
  ipc::Common common() const {
    ipc::Common c;
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

  void raise_device_error() {
    volatile ipc::HostRecord* h = host_;
    const int code = h->error_code;
    if (code == ipc::kErrNone) return;
    std::atomic_thread_fence(std::memory_order_acquire);
    const int rank = h->error_rank, peer = h->error_peer, phase = h->error_phase;
    const long long value = h->error_value;
    const std::string where = fmt::format("rank {}, peer {}, phase '{}', op {}", rank, peer, phase_name(phase),
                                          static_cast<unsigned long long>(h->error_seq));
    const long long value2 = h->error_value2;
    const int index = static_cast<int>(h->error_index);
    if (code == ipc::kErrTimeout) {
      unusable_ = "device timeout: " + where;
      raise(ErrorCode::timeout,
            "rank {}: timed out after {} s on the device waiting for rank {} ({}; the flag read {})", me_,
            static_cast<double>(timeout_ns_) / 1e9, peer, where, value);
    }
    // Input errors every rank detects alike: the op was abandoned on every rank; the buffer stays usable.
    h->error_code = ipc::kErrNone;
    reset_claim();
    if (code == ipc::kErrSettings) {
      const auto& names = phase == ipc::kPhaseCombineNotify ? combine_setting_names() : dispatch_setting_names();
      const std::string name = index >= 0 && index < static_cast<int>(names.size()) ? names[index] : "a setting";
      raise(ErrorCode::invalid_argument,
            "rank {}: '{}' differs across ranks: rank {} has {}, rank {} has {} (every rank must call this op with "
            "the same settings; {})",
            me_, name, rank, value2, peer, value, where);
    }
    if (code == ipc::kErrWorstTokens)
      throw_invalid_argument("num_worst_tokens",
                             fmt::format("at least the rows every rank receives (rank {} receives {})", peer, value),
                             "fewer (" + where + ")");
    if (code == ipc::kErrCapacity)
      raise(ErrorCode::out_of_memory,
            "rank {}: num_nvl_bytes too small: rank {} receives {} rows ({}); see "
            "Buffer::get_normal_nvl_size_hint",
            me_, peer, value, where);
    raise(ErrorCode::invalid_argument, "rank {}: rank {} would receive more than 2^31 - 1 rows ({})", me_, peer, where);
  }

  // The settings compared in-band by the notify kernel, in NotifyArgs::settings order.
  static const std::vector<std::string>& dispatch_setting_names() {
    static const std::vector<std::string> names = {"hidden",          "x dtype",          "num_topk (0 = no topk_idx)",
                                                   "num_experts",     "x_scales format",  "expert_alignment",
                                                   "num_worst_tokens", "cached dispatch (handle given)",
                                                   "topk_weights given"};
    return names;
  }
  static const std::vector<std::string>& combine_setting_names() {
    static const std::vector<std::string> names = {"hidden", "topk_weights K (0 = not given)",
                                                   "num_worst_tokens of the handle"};
    return names;
  }
  static void set_settings(ipc::NotifyArgs& n, std::initializer_list<long long> values) {
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
    double stamp_us[ipc::kNumStamps] = {};
    int stamp_ops[ipc::kNumStamps] = {};
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
  void trace_end(const char* op) {
    if (!trace_) return;
    trace_mark("end");
    EPMOE_CUDA_CHECK(cudaEventSynchronize(trace_ev_[trace_n_ - 1]));
    TraceSum& t = trace_sums_[op];
    if (t.names.empty()) {
      t.names.assign(trace_names_, trace_names_ + trace_n_);
      t.gpu_us.assign(static_cast<std::size_t>(trace_n_), 0.0);
      t.host_us.assign(static_cast<std::size_t>(trace_n_), 0.0);
    }
    if (static_cast<int>(t.names.size()) != trace_n_) return;
    if (t.skipped < kTraceWarmup) {
      ++t.skipped;
      return;
    }
    for (int i = 0; i < trace_n_; ++i) {
      float ms = 0;
      if (trace_gpu_[i]) EPMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, trace_ev_[0], trace_ev_[i]));
      t.gpu_us[static_cast<std::size_t>(i)] += ms * 1e3;
      t.host_us[static_cast<std::size_t>(i)] += trace_host_[i];
    }
    const volatile long long* st = host_->stamps;
    if (st[ipc::kStampNotifyStart] != 0)
      for (int i = 0; i < ipc::kNumStamps; ++i)
        if (st[i] != 0) {
          t.stamp_us[i] += static_cast<double>(st[i] - st[ipc::kStampNotifyStart]) / 1e3;
          ++t.stamp_ops[i];
        }
    ++t.ops;
  }
  void trace_print() const {
    for (const auto& [op, t] : trace_sums_) {
      if (t.ops == 0) continue;
      std::string line = fmt::format("epmoe cuda_ipc trace, rank {}, {} ({} ops after {} left out), mean us from the "
                                     "op's start [gpu reached / host passed; h: host only]:",
                                     me_, op, t.ops, t.skipped);
      for (std::size_t i = 0; i < t.names.size(); ++i)
        line += fmt::format("  {} {:.1f}/{:.1f}", t.names[i], t.gpu_us[i] / t.ops, t.host_us[i] / t.ops);
      static constexpr const char* kStampNames[ipc::kNumStamps] = {
          "notify start", "seq read", "tags released", "positions", "peers seen", "peers read",
          "notify end",   "send start", "send go",     "block 0 rows", "all senders seen"};
      std::string dev;
      for (int i = 0; i < ipc::kNumStamps; ++i)
        if (t.stamp_ops[i] > 0) dev += fmt::format("  {} {:.1f}", kStampNames[i], t.stamp_us[i] / t.stamp_ops[i]);
      if (!dev.empty()) line += "\n  device stamps, mean us after the notify's start (block 0, %globaltimer):" + dev;
      std::fprintf(stderr, "%s\n", line.c_str());
    }
  }

  void fork_side_streams() {
    EPMOE_CUDA_CHECK(cudaEventRecord(forked_, comm_));
    for (cudaStream_t st : side_) EPMOE_CUDA_CHECK(cudaStreamWaitEvent(st, forked_, 0));
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(stage_, forked_, 0));
  }
  void join_side_streams() {
    for (int i = 0; i < 2; ++i) {
      EPMOE_CUDA_CHECK(cudaEventRecord(joined_[i], side_[i]));
      EPMOE_CUDA_CHECK(cudaStreamWaitEvent(comm_, joined_[i], 0));
    }
  }

  void reset_claim() {
    auto* ctrl = static_cast<ipc::Control*>(base_);
    EPMOE_CUDA_CHECK(cudaMemsetAsync(&ctrl->claim, 0, sizeof(int), comm_));
  }

  /// Makes the communication stream wait for previous_event, or else for the caller's current stream.
  void enter(const Event* previous, Stream caller) {
    if (previous && previous->backend()) {
      const auto* ev = dynamic_cast<const CudaEvent*>(previous->backend());
      EPMOE_CHECK_ARG(ev != nullptr, "previous_event", "an event of a cuda_ipc buffer", "another backend's event");
      EPMOE_CUDA_CHECK(cudaStreamWaitEvent(comm_, ev->get(), 0));
    } else if (!previous) {
      // One reusable event: a wait captures the event's state when it is enqueued.
      EPMOE_CUDA_CHECK(cudaEventRecord(caller_done_, cuda_util::to_cuda(caller)));
      EPMOE_CUDA_CHECK(cudaStreamWaitEvent(comm_, caller_done_, 0));
    }
  }

  /// async_finish: an event on the communication stream; else the caller's stream waits for it.
  Event leave(bool async_finish, Stream caller) {
    if (async_finish) return Event::from_backend(std::make_shared<CudaEvent>(device_, comm_));
    EPMOE_CUDA_CHECK(cudaEventRecord(comm_done_, comm_));
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(cuda_util::to_cuda(caller), comm_done_, 0));
    return Event{};
  }

  /// Host wait for the count exchange (its ticket, ticket_, in the host-mapped record, or an error recorded), with the
  /// group's timeout (plus a margin for the device's own).
  void wait_notified(std::string_view phase) {
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::nanoseconds(timeout_ns_) + std::chrono::seconds(5);
    const volatile ipc::HostRecord* h = host_;
    for (;;) {
      if (h->ticket == ticket_ || h->error_code != ipc::kErrNone) break;
      if (std::chrono::steady_clock::now() > deadline) {
        unusable_ = fmt::format("host timeout in {}", phase);
        raise(ErrorCode::timeout, "rank {}: timed out on the host in '{}' waiting for the count exchange", me_, phase);
      }
      std::this_thread::yield();
    }
    std::atomic_thread_fence(std::memory_order_seq_cst);  // the record's fields after its ticket
    raise_device_error();
  }

  std::shared_ptr<Group> group_;
  std::uint64_t buffer_id_;
  int R_ = 0, me_ = 0, device_ = 0, blocks_ = 0, recv_blocks_ = 1;
  bool use_copy_engine_ = true;
  bool combine_sm_push_ = false;
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
  int chunks_ = ipc::kDefaultChunks;
  // The copy-engine path's two side streams: pipeline stages alternate between them, so one stage's wait or
  // signal kernel overlaps the other's copies. They fork from and join back into the communication stream.
  cudaStream_t side_[2] = {};
  cudaEvent_t forked_ = nullptr, joined_[2] = {};
  // A dispatch's staging runs on its own stream, enqueued before the host read; the outputs are allocated on the
  // communication stream after that read (allocated_), which the side streams wait for, and the communication
  // stream waits for the staging (staged_) before its own-rows pass.
  cudaStream_t stage_ = nullptr;
  cudaEvent_t staged_ = nullptr, allocated_ = nullptr, listed_ = nullptr;
  cudaEvent_t stage_copied_[ipc::kMaxChunks] = {};  // combine: stage j's pushes done (its signal's start)
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
  std::shared_ptr<RecvSlots> recv_slots_;
  void* peers_[ipc::kMaxRanks] = {};
  std::unique_ptr<CudaIpcMemory> mem_;  // base_'s allocation and its mappings in every peer
  ipc::HostRecord* host_ = nullptr;
  ipc::HostRecord* host_dev_ = nullptr;
  cudaStream_t comm_ = nullptr;
  std::uint64_t ticket_ = 0;  // the last count exchange the host waited for (NotifyArgs::ticket)
  long long timeout_ns_ = 0;
  std::string unusable_;
};

DispatchResult CudaIpcNormalImpl::dispatch(const DispatchArgs& a) {
  require_normal_region("dispatch");
  trace_begin();  // before the checks: the trace's host times include them
  trace_host("h:begun");
  check_state();
  const int R = R_, me = me_, dev = device_;
  // ---- validate everything locally ----
  const DispatchSpec spec = check_dispatch_args(a, R, buffer_id_, Device::cuda(dev));
  const TensorView& x = a.x;
  const bool fp8 = spec.fp8, cached = spec.cached, has_topk = spec.has_topk, has_weights = spec.has_weights;
  const std::int64_t T = spec.T, H = spec.H, scale_cols = spec.scale_cols;
  const ScaleFormat scale_format = spec.scale_format;
  const int K = spec.K, E = spec.E, alignment = spec.alignment, worst = spec.worst;
  const int E_local = E / R;
  const std::size_t x_row = static_cast<std::size_t>(H) * dtype_size(x.dtype);
  const std::size_t scale_row = static_cast<std::size_t>(scale_cols) * 4;
  const ipc::DataLayout L =
      make_layout(data_bytes_, static_cast<std::int64_t>(x_row), static_cast<std::int64_t>(scale_row), K, !cached);
  if (worst > L.capacity)
    raise(ErrorCode::out_of_memory,
          "rank {}: num_worst_tokens = {} rows do not fit num_nvl_bytes = {} ({} rows of {} "
          "bytes fit; Buffer::get_normal_nvl_size_hint gives the size)",
          me, worst, data_bytes_, L.capacity,
          dispatch_row_bytes(static_cast<std::int64_t>(x_row), static_cast<std::int64_t>(scale_row), K));
  trace_host("h:checked");

  DeviceGuard guard(Device::cuda(dev));
  const cudaStream_t s = comm_;
  const Stream caller = current_stream();
  if (worst == 0 && capturing(cuda_util::to_cuda(caller)))
    throw_invalid_argument("num_worst_tokens",
                           "> 0 while the caller's stream captures a CUDA graph (without it the receive counts are "
                           "read on the host, which a graph cannot do)",
                           "0");
  StreamGuard on_comm(Stream{s});  // outputs and temporaries are allocated (stream-ordered) on the comm stream
  trace_host("h:guards");
  enter(a.previous_event, caller);
  trace_mark("entered");
  const ipc::Common c = common();
  const Device gpu = Device::cuda(dev);

  Tensor pm, expert_counts, send_pos, in_rank, list;
  std::optional<Carver> routing_block;
  std::vector<std::int32_t> pm_host;
  std::int64_t num_recv = -1;
  const auto set_dispatch_settings = [&](ipc::NotifyArgs& n) {
    set_settings(n, {H, static_cast<long long>(x.dtype), K, E, static_cast<long long>(scale_format), alignment, worst,
                     cached ? 1 : 0, has_weights ? 1 : 0});
  };
  // The copy-engine path needs the counts on the host (no num_worst_tokens); a fresh dispatch's count exchange
  // decides on the device whether it is taken, a cached dispatch on the host (its counts are in the handle).
  const bool ce_allowed = worst == 0 && use_copy_engine_;
  const ipc::DataLayout Lh = half_layout(static_cast<int>(ops_++ & 1), data_bytes_, static_cast<std::int64_t>(x_row),
                                         static_cast<std::int64_t>(scale_row), K, !cached);
  bool ce = false;
  // Zero-copy: a fresh dispatch without num_worst_tokens offers a free receive slot in the count exchange; when
  // every rank offered one, the senders store straight into the slots, which are the outputs (no staging, no
  // receive pass), from right after the exchange: their kernel is enqueued before the host read.
  std::shared_ptr<int> slot;
  if (worst == 0) slot = RecvSlots::acquire(recv_slots_);
  trace_host("h:slot");
  ipc::NotifyArgs notify;
  if (cached) {
    notify.phase = ipc::kPhaseCachedNotify;
    set_dispatch_settings(notify);
    pm = a.handle->rank_prefix_matrix;
    send_pos = a.handle->send_pos;
    if (worst == 0) num_recv = a.handle->num_recv_tokens;
    pm_host = a.handle->rank_prefix_matrix_host;
    ce = ce_allowed && ipc::copy_engine_fits(pm_host.data(), R, Lh.capacity, copy_engine_min_rows_);
    notify.recv_slot = slot ? *slot : -1;
    if (ce) list = Tensor::empty(DType::int32, {R, T}, gpu);
  } else {
    // The routing side of the op in one block: prefix matrix, expert counts, send positions, the handle's copy of
    // is_token_in_rank, the send lists.
    routing_block.emplace(
        std::initializer_list<std::size_t>{Carver::bytes(DType::int32, {R, R}), Carver::bytes(DType::int32, {E_local}),
                                           Carver::bytes(DType::int32, {T, R}), Carver::bytes(DType::boolean, {T, R}),
                                           Carver::bytes(DType::int32, {R, T})},
        gpu);
    pm = routing_block->take(DType::int32, {R, R});
    expert_counts = routing_block->take(DType::int32, {E_local});
    send_pos = routing_block->take(DType::int32, {T, R});
    in_rank = routing_block->take(DType::boolean, {T, R});
    list = routing_block->take(DType::int32, {R, T});
    trace_host("h:allocated");
    notify.per_rank = static_cast<const std::int32_t*>(a.num_tokens_per_rank.data);
    notify.per_expert = static_cast<const std::int32_t*>(a.num_tokens_per_expert.data);
    notify.experts_per_rank = E_local;
    notify.alignment = alignment;
    notify.recv_capacity = worst > 0 ? worst : L.capacity;
    notify.worst = worst > 0;
    notify.pm_out = pm.ptr<std::int32_t>();
    notify.expert_out = expert_counts.ptr<std::int32_t>();
    notify.phase = ipc::kPhaseDispatchNotify;
    notify.ce_min_rows = ce_allowed ? copy_engine_min_rows_ : -1;
    notify.ce_capacity = Lh.capacity;
    notify.recv_slot = slot ? *slot : -1;
    if (slot) {  // zero-copy attempt: local positions in the notify, the offsets added by the send kernel
      notify.in_rank = static_cast<const bool*>(a.is_token_in_rank.data);
      notify.local_pos = send_pos.ptr<std::int32_t>();
      notify.T = T;
    }
    set_dispatch_settings(notify);
  }
  const auto send_args = [&] {
    ipc::DispatchSendArgs sa;
    sa.x = x.data;
    sa.x_row = x_row;
    sa.scales = fp8 ? a.x_scales.data : nullptr;
    sa.scale_row = scale_row;
    sa.topk_idx = has_topk ? a.topk_idx.data : nullptr;
    sa.idx64 = has_topk && a.topk_idx.dtype == DType::int64;
    sa.K = K;
    sa.weights = has_weights ? static_cast<const float*>(a.topk_weights.data) : nullptr;
    sa.T = T;
    sa.send_pos = send_pos.ptr<std::int32_t>();
    sa.experts_per_rank = E_local;
    sa.write_src = !cached;
    sa.layout = L;
    return sa;
  };

  ipc::GatherArgs ga;
  ga.x = x.data;
  ga.x_row = x_row;
  ga.scales = fp8 ? a.x_scales.data : nullptr;
  ga.scale_row = scale_row;
  ga.topk_idx = has_topk ? a.topk_idx.data : nullptr;
  ga.idx64 = has_topk && a.topk_idx.dtype == DType::int64;
  ga.K = K;
  ga.weights = has_weights ? static_cast<const float*>(a.topk_weights.data) : nullptr;
  ga.experts_per_rank = E_local;
  ga.write_src = !cached;
  ga.T = T;
  ga.pm = pm.ptr<std::int32_t>();
  ga.chunks = chunks_;
  ga.layout = Lh;
  // The staging (send lists, stage counters reset, the staging pass on its own stream). It needs only this rank's
  // routing, so it starts before the count exchange (begin_op advances the op's sequence number first) when the
  // copy-engine path is known (cached) or likely (this rank has copy_engine_min_rows tokens; should the exchange
  // choose the SM path, its send kernel meets every peer first: see sm_barrier_seq). Otherwise it runs after the
  // host read, if chosen: small batches skip its launches.
  bool staging_enqueued = false;
  // Everything of the staging runs on its own stream, which joined the communication stream at `forked_`; the
  // own-rows pass waits only for its send list (`listed_`). A staging before the exchange is enqueued after the
  // notify, whose launch it would otherwise delay by its host calls (the host then waits for the counts anyway).
  const auto enqueue_staging = [&](bool before_exchange) {
    if (before_exchange && !cached) {  // the lists from local positions: final ones need the prefix matrix
      ipc::SendPosArgs sp;
      sp.in_rank = static_cast<const bool*>(a.is_token_in_rank.data);
      sp.T = T;
      sp.list = list.ptr<std::int32_t>();
      ipc::launch_send_pos(c, sp, stage_);
      ga.per_rank = static_cast<const std::int32_t*>(a.num_tokens_per_rank.data);
    } else {
      ipc::SendListArgs sl;
      sl.send_pos = send_pos.ptr<std::int32_t>();
      sl.pm = pm.ptr<std::int32_t>();
      sl.T = T;
      sl.list = list.ptr<std::int32_t>();
      ipc::launch_send_list(c, sl, stage_);
    }
    EPMOE_CUDA_CHECK(cudaEventRecord(listed_, stage_));
    auto* ctrl = static_cast<ipc::Control*>(base_);
    EPMOE_CUDA_CHECK(cudaMemsetAsync(ctrl->chunk_arrive, 0, sizeof(ctrl->chunk_arrive), stage_));
    ga.list = list.ptr<std::int32_t>();
    ga.part = ipc::kGatherStages;
    ipc::launch_gather(c, ga, blocks_, stage_);
    EPMOE_CUDA_CHECK(cudaEventRecord(staged_, stage_));
    trace_mark("staged", stage_);
    staging_enqueued = true;
  };
  const auto fork_stage_stream = [&] {
    EPMOE_CUDA_CHECK(cudaEventRecord(forked_, s));
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(stage_, forked_, 0));
  };
  const bool stage_early = !slot && (cached ? ce : ce_allowed && T >= copy_engine_min_rows_);
  if (stage_early) {
    ipc::launch_begin_op(c, s);
    fork_stage_stream();
  }
  notify.advance = !stage_early;
  notify.prestaged = stage_early;
  // The host reads the count exchange's result (a fresh dispatch: the counts and the path; a cached one offering a
  // slot: whether the zero-copy path was chosen).
  const bool host_read = worst == 0 && (!cached || slot);
  if (host_read) notify.ticket = ++ticket_;
  trace_host("h:notify args");
  ipc::launch_notify(c, notify, s);
  trace_host("h:notify launched");
  // No event here: the zero-copy send kernel right behind is the notify's programmatic dependent (an event between
  // them would serialise the two launches; the device stamps trace this stretch).
  if (!slot) trace_mark(cached ? "handshake" : "count exchange");
  if (stage_early) enqueue_staging(true);
  const auto launch_final_send_pos = [&] {
    ipc::SendPosArgs sp;
    sp.in_rank = static_cast<const bool*>(a.is_token_in_rank.data);
    sp.pm = pm.ptr<std::int32_t>();
    sp.T = T;
    sp.send_pos = send_pos.ptr<std::int32_t>();
    ipc::launch_send_pos(c, sp, s);
  };
  if (!cached && !slot) launch_final_send_pos();
  // Zero-copy: the source indices land in a capacity-sized tensor (the send kernel's last block copies them there
  // once every sender is done; num_recv is not known on the host yet).
  std::shared_ptr<Tensor> src_block;
  if (slot) {
    ipc::DispatchSendArgs sa = send_args();
    sa.slot_base = slot_stride_;
    sa.slot_bytes = slot_stride_;
    if (!cached) {
      sa.pm = pm.ptr<std::int32_t>();
      sa.final_pos = send_pos.ptr<std::int32_t>();
      src_block = std::make_shared<Tensor>(Tensor::empty(DType::int32, {L.capacity}, gpu));
      sa.recv_src = src_block->ptr<std::int32_t>();
    }
    ipc::launch_dispatch_send(c, sa, blocks_, s, /*after_notify=*/true);
    trace_mark("rows sent");
  }
  bool direct = false;
  if (host_read) {  // the one host read of normal mode
    wait_notified(kDispatchPhase);
    trace_mark("host read");
    if (!cached) {
      num_recv = host_->pm[(R - 1) * R + me];
      pm_host.assign(host_->pm, host_->pm + R * R);
      ce = ce_allowed && host_->use_copy_engine != 0;
    }
    direct = slot && host_->use_direct != 0;
    // Not chosen after a fresh zero-copy attempt: send_pos holds local positions; the other paths need final ones.
    if (slot && !direct && !cached) launch_final_send_pos();
    if (!direct) slot.reset();
    if (ce && !staging_enqueued) {
      fork_stage_stream();
      enqueue_staging(false);
    }
  }
  const std::int64_t rows = worst > 0 ? worst : num_recv;

  DispatchResult out;
  Tensor recv_src;
  if (direct) {
    // The outputs are views of this rank's slot (field arrays of layout L); the handle's source indices are copied
    // out, so a kept handle does not hold the slot.
    char* mine = static_cast<char*>(base_) + ipc::kControlBytes + slot_stride_ * (1 + static_cast<std::size_t>(*slot));
    const auto view = [&](std::size_t off, DType dtype, Shape shape) {
      return Tensor::wrap(TensorView(mine + off, dtype, shape, gpu), slot);
    };
    out.recv_x = view(L.x_off, x.dtype, {rows, H});
    if (fp8) out.recv_x_scales = view(L.scale_off, a.x_scales.dtype, {rows, scale_cols});
    if (has_topk) out.recv_topk_idx = view(L.idx_off, DType::int64, {rows, K});
    if (has_weights) out.recv_topk_weights = view(L.w_off, DType::fp32, {rows, K});
    // The send kernel's last block waited for every sender's rows and copied the source indices: no kernel here.
    if (!cached) recv_src = Tensor::wrap(TensorView(src_block->data(), DType::int32, {rows}, gpu), src_block);
  } else {
    // The outputs in one block (the source indices too: they go into the handle).
    Carver outputs({Carver::bytes(x.dtype, {rows, H}), fp8 ? Carver::bytes(a.x_scales.dtype, {rows, scale_cols}) : 0,
                    has_topk ? Carver::bytes(DType::int64, {rows, K}) : 0,
                    has_weights ? Carver::bytes(DType::fp32, {rows, K}) : 0,
                    cached ? 0 : Carver::bytes(DType::int32, {rows})},
                   gpu);
    out.recv_x = outputs.take(x.dtype, {rows, H});
    if (fp8) out.recv_x_scales = outputs.take(a.x_scales.dtype, {rows, scale_cols});
    if (has_topk) out.recv_topk_idx = outputs.take(DType::int64, {rows, K});
    if (has_weights) out.recv_topk_weights = outputs.take(DType::fp32, {rows, K});
    if (!cached) recv_src = outputs.take(DType::int32, {rows});
    if (staging_enqueued) {
      EPMOE_CUDA_CHECK(cudaEventRecord(allocated_, comm_));
      for (cudaStream_t st : side_) EPMOE_CUDA_CHECK(cudaStreamWaitEvent(st, allocated_, 0));
      if (!ce) EPMOE_CUDA_CHECK(cudaStreamWaitEvent(comm_, staged_, 0));  // before the SM path's stores
    }
  }

  if (ce) {
    // Every receiver pulls each stage of each source's run with the copy engine as soon as the source publishes
    // it (side streams; the first stage's copies are enqueued first: the engines are idle until then), while the
    // own rows go into the outputs by SMs, beside the staging (measured: fp8 225 -> 192 us).
    const auto own_rows = [&] {
      ga.part = ipc::kGatherOwn;
      EPMOE_CUDA_CHECK(cudaStreamWaitEvent(s, listed_, 0));
      ga.recv_x = out.recv_x.data();
      ga.recv_scales = fp8 ? out.recv_x_scales.data() : nullptr;
      ga.recv_idx = has_topk ? out.recv_topk_idx.ptr<std::int64_t>() : nullptr;
      ga.recv_w = has_weights ? out.recv_topk_weights.ptr<float>() : nullptr;
      ga.recv_src = cached ? nullptr : recv_src.ptr<std::int32_t>();
      ipc::launch_gather(c, ga, blocks_, s);
      trace_mark("own rows done");
      EPMOE_CUDA_CHECK(cudaStreamWaitEvent(comm_, staged_, 0));
    };
    const auto at = [&](int r, int d) -> std::int64_t { return pm_host[static_cast<std::size_t>(r * R + d)]; };
    // Per source: where its run for me starts in its region (rows it staged for peers before me) and in my outputs.
    std::vector<std::int64_t> src_first(static_cast<std::size_t>(R)), dst_first(static_cast<std::size_t>(R)),
        count(static_cast<std::size_t>(R));
    for (int src = 0; src < R; ++src) {
      dst_first[src] = src > 0 ? at(src - 1, me) : 0;
      count[src] = at(src, me) - dst_first[src];
      for (int d = 0; d < me; ++d)
        if (d != src) src_first[src] += at(src, d) - (src > 0 ? at(src - 1, d) : 0);
    }
    const auto pull = [&](int src, void* dst, std::size_t off, std::size_t row_bytes, std::int64_t lo,
                          std::int64_t hi, cudaStream_t st) {
      if (hi <= lo) return;
      const char* region = static_cast<const char*>(peers_[src]) + ipc::kControlBytes;
      EPMOE_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + (dst_first[src] + lo) * row_bytes,
                                       region + off + (src_first[src] + lo) * row_bytes, (hi - lo) * row_bytes,
                                       cudaMemcpyDeviceToDevice, st));
    };
    for (int j = 0; j < chunks_; ++j) {
      const cudaStream_t st = side_[j & 1];
      ipc::launch_wait_chunk(c, j, ipc::kPhaseDispatchData, st);
      for (int src = 0; src < R; ++src) {
        if (src == me) continue;
        const std::int64_t lo = ipc::stage_begin(count[src], j, chunks_),
                           hi = ipc::stage_begin(count[src], j + 1, chunks_);
        pull(src, out.recv_x.data(), Lh.x_off, x_row, lo, hi, st);
      }
      trace_mark("stage pulled", st);
      if (j == 0) own_rows();
      if (j + 2 == chunks_ || chunks_ == 1) {
        // The small fields of every run, read by a kernel once every stage is published; on the stream that
        // does not carry the last stage, so it overlaps that stage's copies.
        ipc::PullSmallArgs ps;
        ps.chunks = chunks_;
        ps.scale_row = fp8 ? scale_row : 0;
        ps.K = has_topk ? K : 0;
        ps.layout = Lh;
        for (int src = 0; src < R; ++src) {
          ps.src_first[src] = src_first[src];
          ps.dst_first[src] = dst_first[src];
          ps.count[src] = src == me ? 0 : count[src];
        }
        ps.recv_scales = fp8 ? out.recv_x_scales.data() : nullptr;
        ps.recv_idx = has_topk ? out.recv_topk_idx.ptr<std::int64_t>() : nullptr;
        ps.recv_w = has_weights ? out.recv_topk_weights.ptr<float>() : nullptr;
        ps.recv_src = cached ? nullptr : recv_src.ptr<std::int32_t>();
        ipc::launch_pull_small(c, ps, kPullSmallBlocks, chunks_ == 1 ? side_[1] : st);
      }
    }
    join_side_streams();
    trace_mark("pulls done");
  } else if (!direct) {
    ipc::launch_dispatch_send(c, send_args(), blocks_, s);
    trace_mark("rows sent");
  }

  ipc::DispatchRecvArgs ra;
  ra.pm = pm.ptr<std::int32_t>();
  ra.rows = rows;
  ra.x_row = x_row;
  ra.scale_row = scale_row;
  ra.K = K;
  ra.recv_x = out.recv_x.data();
  ra.recv_scales = fp8 ? out.recv_x_scales.data() : nullptr;
  ra.recv_idx = has_topk ? out.recv_topk_idx.ptr<std::int64_t>() : nullptr;
  ra.recv_w = has_weights ? out.recv_topk_weights.ptr<float>() : nullptr;
  ra.recv_src = cached ? nullptr : recv_src.ptr<std::int32_t>();
  ra.layout = L;
  if (!ce && !direct) ipc::launch_dispatch_recv(c, ra, recv_blocks_, blocks_, s);

  if (cached) {
    out.handle = *a.handle;
  } else {
    if (T > 0)
      EPMOE_CUDA_CHECK(
          cudaMemcpyAsync(in_rank.data(), a.is_token_in_rank.data, in_rank.nbytes(), cudaMemcpyDeviceToDevice, s));
    NormalHandle& h = out.handle;
    h.rank_prefix_matrix = pm;
    h.is_token_in_rank = in_rank;
    h.send_pos = send_pos;
    h.recv_src_idx = recv_src;
    h.num_recv_tokens_per_expert = expert_counts;
    h.num_tokens = T;
    h.num_recv_tokens = num_recv;  // -1 with num_worst_tokens: known on the device only
    h.num_recv_rows = rows;
    h.hidden = H;
    h.num_experts = E;
    h.expert_alignment = alignment;
    h.num_worst_tokens = worst;
    h.buffer_id = buffer_id_;
    h.rank_prefix_matrix_host = pm_host;
  }
  if (worst == 0) {
    if (cached) {
      out.num_recv_tokens_per_expert_list.resize(static_cast<std::size_t>(E_local));
      EPMOE_CUDA_CHECK(cudaMemcpy(out.num_recv_tokens_per_expert_list.data(),
                                  a.handle->num_recv_tokens_per_expert.data(),
                                  sizeof(std::int32_t) * static_cast<std::size_t>(E_local), cudaMemcpyDeviceToHost));
    } else {
      out.num_recv_tokens_per_expert_list.assign(host_->expert_counts, host_->expert_counts + E_local);
    }
  }
  out.event = leave(a.async_finish, caller);
  trace_end(cached ? "cached dispatch" : "dispatch");
  return out;
}

CombineResult CudaIpcNormalImpl::combine(const CombineArgs& a) {
  require_normal_region("combine");
  trace_begin();
  check_state();
  const int R = R_, dev = device_;
  const CombineSpec spec = check_combine_args(a, R, buffer_id_, Device::cuda(dev));
  const NormalHandle& h = *a.handle;
  const TensorView& x = a.x;
  const std::int64_t T = spec.T, H = spec.H;
  const int K = spec.K;
  const bool has_w = K > 0;

  // Combine rows: x then weights, `capacity` rows each; every rank's rows in the whole region (SM stores), or
  // the peers' rows in this op's half (copy engine: pushed before the handshake, behind launch_push_gate).
  const auto combine_layout = [&](std::int64_t bytes, std::size_t base) {
    ipc::DataLayout l;
    l.capacity = std::max<std::int64_t>(0, (bytes - 5 * kFieldSlack) / combine_row_bytes(H, K));
    l.x_off = base;
    l.w_off = base + static_cast<std::size_t>(align16(l.capacity * 2 * H));
    return l;
  };
  const std::int64_t half_bytes = data_bytes_ / 2 / 16 * 16;
  const ipc::DataLayout L_half = combine_layout(half_bytes, static_cast<std::size_t>((ops_ & 1) * half_bytes));

  DeviceGuard guard(Device::cuda(dev));
  const cudaStream_t s = comm_;
  const Stream caller = current_stream();
  StreamGuard on_comm(Stream{s});
  enter(a.previous_event, caller);
  trace_mark("entered");
  const ipc::Common c = common();
  const Device gpu = Device::cuda(dev);

  const std::vector<std::int32_t>& pm_host = h.rank_prefix_matrix_host;
  const bool ce = h.num_worst_tokens == 0 && use_copy_engine_ && !pm_host.empty() &&
                  ipc::copy_engine_fits(pm_host.data(), R, L_half.capacity, copy_engine_min_rows_);
  const ipc::DataLayout L = ce ? L_half : combine_layout(data_bytes_, 0);
  // Twice the dispatch's stages: the reduce's tail after the last stage lands shrinks with it (measured, 2x H200,
  // two runs: 250-260 -> 243 us at 8 stages, where the dispatch is slower: more copies per stage).
  const int chunks = std::min(ipc::kMaxChunks, 2 * chunks_);
  if (ce) {
    ipc::launch_begin_op(c, s);
    fork_side_streams();
    ipc::launch_push_gate(c, side_[0]);
  }
  ipc::NotifyArgs n;
  n.phase = ipc::kPhaseCombineNotify;
  n.advance = !ce;
  set_settings(n, {H, K, h.num_worst_tokens});
  // The copy-engine path enqueues its first stage's pushes before the notify and the outputs' allocation (pushes
  // need no handshake: see launch_push_gate): the GPU is idle until the first push, so host time before it counts.
  const auto handshake = [&] {
    ipc::launch_notify(c, n, s);
    ++ops_;
    trace_mark("handshake");
  };
  if (!ce) handshake();

  ipc::CombineSendArgs sa;
  sa.x = x.data;
  sa.x_row = static_cast<std::size_t>(H) * 2;
  sa.weights = has_w ? static_cast<const float*>(a.topk_weights.data) : nullptr;
  sa.K = K;
  sa.pm = h.rank_prefix_matrix.ptr<std::int32_t>();
  sa.layout = L;
  if (ce) {
    // Each peer's rows are one contiguous run of x (received rows are grouped by source): push each run into that
    // peer's half with the copy engine in `chunks` stages, publishing each stage; the reduce kernel (on the
    // communication stream, concurrently) waits per stage. This rank's own rows stay in x.
    // The copies run back to back on side stream 0 (the weights first, all at once: each copy pays the copy
    // engine's start-up); each stage's signal kernel runs on side stream 1 once the stage's copies are done, so the
    // copy queue never waits for a kernel and the stages land one after another, not together.
    const int me = me_;
    const auto at = [&](int r, int d) -> std::int64_t { return pm_host[static_cast<std::size_t>(r * R + d)]; };
    const auto run_of = [&](int dst, std::int64_t* first, std::int64_t* count, std::int64_t* slot) {
      *first = dst > 0 ? at(dst - 1, me) : 0;
      *count = at(dst, me) - *first;
      *slot = 0;  // rows `dst` receives back from its peers before me (its own rows stay in its x)
      for (int d = 0; d < me; ++d)
        if (d != dst) *slot += at(dst, d) - (dst > 0 ? at(dst - 1, d) : 0);
    };
    const cudaStream_t copies = side_[0], signals = side_[1];
    if (combine_sm_push_) {
      ipc::CombinePushArgs pa;
      pa.x = x.data;
      pa.x_row = sa.x_row;
      pa.weights = sa.weights;
      pa.K = K;
      pa.chunks = chunks;
      pa.layout = L;
      for (int dst = 0; dst < R; ++dst)
        if (dst != me) run_of(dst, &pa.first[dst], &pa.count[dst], &pa.slot[dst]);
      ipc::launch_combine_push(c, pa, blocks_, copies);
      trace_mark("pushed", copies);
      handshake();
    }
    for (int dst = 0; dst < R && has_w && !combine_sm_push_; ++dst) {
      std::int64_t first = 0, count = 0, slot = 0;
      run_of(dst, &first, &count, &slot);
      if (dst == me || count == 0) continue;
      char* region = static_cast<char*>(peers_[dst]) + ipc::kControlBytes;
      EPMOE_CUDA_CHECK(cudaMemcpyAsync(region + L.w_off + slot * 4 * K,
                                       static_cast<const float*>(a.topk_weights.data) + first * K,
                                       count * 4 * static_cast<std::size_t>(K), cudaMemcpyDeviceToDevice, copies));
    }
    for (int j = 0; j < chunks && !combine_sm_push_; ++j) {
      for (int dst = 0; dst < R; ++dst) {
        if (dst == me) continue;
        std::int64_t first = 0, count = 0, slot = 0;
        run_of(dst, &first, &count, &slot);
        const std::int64_t lo = ipc::stage_begin(count, j, chunks), hi = ipc::stage_begin(count, j + 1, chunks);
        if (hi <= lo) continue;
        char* region = static_cast<char*>(peers_[dst]) + ipc::kControlBytes;
        EPMOE_CUDA_CHECK(cudaMemcpyAsync(region + L.x_off + (slot + lo) * sa.x_row,
                                         static_cast<const char*>(x.data) + (first + lo) * sa.x_row,
                                         (hi - lo) * sa.x_row, cudaMemcpyDeviceToDevice, copies));
      }
      EPMOE_CUDA_CHECK(cudaEventRecord(stage_copied_[j], copies));
      EPMOE_CUDA_CHECK(cudaStreamWaitEvent(signals, stage_copied_[j], 0));
      ipc::launch_signal_chunk(c, j, signals);
      trace_mark("stage pushed", copies);
      if (j == 0) handshake();
    }
  } else {
    ipc::launch_combine_send(c, sa, blocks_, s);
  }

  CombineResult out;
  Carver outputs({Carver::bytes(DType::bf16, {T, H}), has_w ? Carver::bytes(DType::fp32, {T, K}) : 0}, gpu);
  out.combined_x = outputs.take(DType::bf16, {T, H});
  if (has_w) out.combined_topk_weights = outputs.take(DType::fp32, {T, K});

  ipc::CombineReduceArgs ra;
  ra.send_pos = h.send_pos.ptr<std::int32_t>();
  ra.pm = h.rank_prefix_matrix.ptr<std::int32_t>();
  ra.T = T;
  ra.H = H;
  ra.K = K;
  ra.bias_0 = a.bias_0.defined() ? a.bias_0.data : nullptr;
  ra.bias_1 = a.bias_1.defined() ? a.bias_1.data : nullptr;
  ra.out = out.combined_x.data();
  ra.out_w = has_w ? out.combined_topk_weights.ptr<float>() : nullptr;
  ra.layout = L;
  if (ce) {
    ra.local_x = x.data;
    ra.local_w = has_w ? static_cast<const float*>(a.topk_weights.data) : nullptr;
    ra.chunks = chunks;
    for (int d = 0; d < R; ++d)  // rows d sends back = rows this rank sent it
      ra.n_back[d] = pm_host[static_cast<std::size_t>(me_ * R + d)] -
                     (me_ > 0 ? pm_host[static_cast<std::size_t>((me_ - 1) * R + d)] : 0);
  }
  // Pipelined, the reduce runs while the copies are in flight: fewer blocks, so the SMs stay free for others.
  ipc::launch_combine_reduce(c, ra, ce ? std::min(recv_blocks_, 2 * blocks_) : recv_blocks_, blocks_, s);
  trace_mark("reduce done");
  if (ce) join_side_streams();
  trace_mark("reduce + pushes done");
  (void)R;
  out.event = leave(a.async_finish, caller);
  trace_end("combine");
  return out;
}

}  // namespace

std::unique_ptr<CudaIpcNormal> make_cuda_ipc_normal(std::shared_ptr<Group> group, const BufferOptions& options,
                                                    std::uint64_t buffer_id) {
  EPMOE_CHECK_ARG(group != nullptr, "group", "a Group", "null");
  return std::make_unique<CudaIpcNormalImpl>(std::move(group), options, buffer_id);
}

}  // namespace epmoe

#endif  // EPMOE_HAVE_CUDA
