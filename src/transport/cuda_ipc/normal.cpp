// cuda-ipc normal mode, the host side: construction (options, the buffer every peer maps, streams, events), the
// buffer's state and errors, the trace, the stream plumbing every op shares. The ops: cuda_ipc/normal_dispatch.cpp
// and cuda_ipc/normal_combine.cpp; the class: cuda_ipc/normal_impl.hpp. Kernels: cuda_ipc/normal_kernels.cu.
// Protocol: cuda_ipc/normal.hpp and docs/cuda_ipc_design.md.
#include "transport/cuda_ipc/normal.hpp"

#include "core/check.hpp"
#include <epmoe/error.hpp>

#include <algorithm>
#include <climits>
#include <string>

#include "transport/cuda_ipc/normal_impl.hpp"

namespace epmoe {

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
  const std::int64_t row =
      std::max(cuda_ipc::dispatch_row_bytes(2 * hidden, 0, num_topk), cuda_ipc::combine_row_bytes(hidden, num_topk));
  // Checked products: a size past 2^63 would wrap to a small, wrong hint.
  std::int64_t rows = 0, bytes = 0;
  if (__builtin_mul_overflow(max_tokens_per_rank, std::max<std::int64_t>(num_ranks, 2 * (num_ranks - 1)), &rows) ||
      __builtin_mul_overflow(rows, row, &bytes) || bytes > INT64_MAX - 2 * (5 * cuda_ipc::kFieldSlack + 16))
    throw_invalid_argument("max_tokens_per_rank",
                           fmt::format("a size whose buffer fits in 2^63 bytes (hidden = {}, num_ranks = {}, "
                                       "num_topk = {})",
                                       hidden, num_ranks, num_topk),
                           std::to_string(max_tokens_per_rank));
  return bytes + 2 * (5 * cuda_ipc::kFieldSlack + 16);  // each half's field slack, and its 16-byte alignment
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
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include <cuda_runtime.h>

#include "core/cuda_check.hpp"
#include "core/cuda_util.hpp"
#include "transport/cuda_ipc/stream.hpp"

namespace epmoe {

namespace {

using cuda_util::DeviceGuard;
namespace ipc = cuda_ipc;
using ipc::CudaEvent;

constexpr std::string_view kSetupPhase = "cuda_ipc setup";

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

}  // namespace

CudaIpcNormalImpl::CudaIpcNormalImpl(std::shared_ptr<Group> group, const BufferOptions& o, std::uint64_t buffer_id)
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
  combine_sm_push_ = o.combine_sm_push;
  chunks_ = o.num_chunks == 0 ? ipc::kDefaultChunks : o.num_chunks;
  EPMOE_CHECK_ARG(chunks_ >= 1 && chunks_ <= ipc::kMaxChunks, "options.num_chunks",
                  fmt::format("0 (default {}) or 1..{}", ipc::kDefaultChunks, ipc::kMaxChunks), o.num_chunks);
  const std::array<Setting, 6> settings = {Setting{"num_nvl_bytes", o.num_nvl_bytes}, Setting{"num_sms", blocks_},
                                           Setting{"use_copy_engine", o.use_copy_engine ? 1 : 0},
                                           Setting{"num_chunks", chunks_},
                                           Setting{"copy_engine_min_rows", o.copy_engine_min_rows},
                                           Setting{"combine_sm_push", o.combine_sm_push ? 1 : 0}};
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
  recv_slots_ = std::make_shared<ipc::RecvSlots>(memory_, num_recv_slots);
  EPMOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_), sizeof(ipc::HostRecord),
                                 cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(static_cast<void*>(host_), 0, sizeof(ipc::HostRecord));
  EPMOE_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev_), host_, 0));
  comm_owner_ = std::make_shared<cuda_ipc::CommStream>(device_);
  comm_ = comm_owner_->get();
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

CudaIpcNormalImpl::~CudaIpcNormalImpl() {
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
  comm_owner_.reset();  // destroyed once the low-latency mode lets go of it too
  if (host_) cudaFreeHost(host_);
  recv_slots_.reset();
  memory_.reset();  // cudaFree, unless tensors in receive slots still hold it
  cudaSetDevice(previous);
}

void CudaIpcNormalImpl::raise_device_error() {
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

// The notify kernel compares the first nine of args/normal.hpp's settings, in that order (NotifyArgs::settings).
const std::vector<std::string>& CudaIpcNormalImpl::dispatch_setting_names() {
  static const std::vector<std::string> names(kDispatchSettingNames.begin(), kDispatchSettingNames.end() - 1);
  return names;
}
const std::vector<std::string>& CudaIpcNormalImpl::combine_setting_names() {
  static const std::vector<std::string> names = {"hidden", "topk_weights K (0 = not given)",
                                                 "num_worst_tokens of the handle"};
  return names;
}

void CudaIpcNormalImpl::trace_end(const char* op) {
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

void CudaIpcNormalImpl::trace_print() const {
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

void CudaIpcNormalImpl::fork_side_streams() {
  EPMOE_CUDA_CHECK(cudaEventRecord(forked_, comm_));
  for (cudaStream_t st : side_) EPMOE_CUDA_CHECK(cudaStreamWaitEvent(st, forked_, 0));
  EPMOE_CUDA_CHECK(cudaStreamWaitEvent(stage_, forked_, 0));
}
void CudaIpcNormalImpl::join_side_streams() {
  for (int i = 0; i < 2; ++i) {
    EPMOE_CUDA_CHECK(cudaEventRecord(joined_[i], side_[i]));
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(comm_, joined_[i], 0));
  }
}

void CudaIpcNormalImpl::reset_claim() {
  auto* ctrl = static_cast<ipc::Control*>(base_);
  EPMOE_CUDA_CHECK(cudaMemsetAsync(&ctrl->claim, 0, sizeof(int), comm_));
}

void CudaIpcNormalImpl::enter(const Event* previous, Stream caller) {
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

Event CudaIpcNormalImpl::leave(bool async_finish, Stream caller) {
  if (async_finish) return Event::from_backend(std::make_shared<CudaEvent>(device_, comm_));
  EPMOE_CUDA_CHECK(cudaEventRecord(comm_done_, comm_));
  EPMOE_CUDA_CHECK(cudaStreamWaitEvent(cuda_util::to_cuda(caller), comm_done_, 0));
  return Event{};
}

void CudaIpcNormalImpl::wait_notified(std::string_view phase) {
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

std::unique_ptr<CudaIpcNormal> make_cuda_ipc_normal(std::shared_ptr<Group> group, const BufferOptions& options,
                                                    std::uint64_t buffer_id) {
  EPMOE_CHECK_ARG(group != nullptr, "group", "a Group", "null");
  return std::make_unique<CudaIpcNormalImpl>(std::move(group), options, buffer_id);
}

}  // namespace epmoe

#endif  // EPMOE_HAVE_CUDA
