// Normal (high-throughput) mode over Transport::exchange; the protocol is described in cpu/normal_mode.hpp.
#include "transport/cpu/normal_mode.hpp"
#include "transport/args/normal.hpp"

#include "core/check.hpp"
#include <epmoe/error.hpp>
#include <epmoe/layout.hpp>
#include <epmoe/quant.hpp>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace epmoe {

// ---- OutputPool ----

namespace {
constexpr std::size_t kMinPooledBytes = std::size_t{1} << 20;  // smaller ones come from malloc's heap
constexpr std::size_t kMaxFreeBlocks = 8;
}  // namespace

struct OutputPool::State {
  struct Block {
    void* p;
    std::size_t bytes;
  };
  std::mutex mutex;
  std::vector<Block> free;  // oldest first
  bool closed = false;

  void give_back(void* p, std::size_t bytes) {
    std::lock_guard lock(mutex);
    if (closed) {
      std::free(p);
      return;
    }
    free.push_back({p, bytes});
    if (free.size() > kMaxFreeBlocks) {
      std::free(free.front().p);
      free.erase(free.begin());
    }
  }
};

OutputPool::OutputPool() : state_(std::make_shared<State>()) {}

OutputPool::~OutputPool() {
  std::lock_guard lock(state_->mutex);
  state_->closed = true;  // tensors still out free their storage themselves
  for (const auto& b : state_->free) std::free(b.p);
  state_->free.clear();
}

Tensor OutputPool::empty(DType dtype, Shape shape) {
  const std::size_t bytes = static_cast<std::size_t>(shape.numel()) * dtype_size(dtype);
  if (bytes < kMinPooledBytes) return Tensor::empty(dtype, shape);
  void* p = nullptr;
  std::size_t capacity = 0;
  {
    // Best fit among blocks no more than twice the request.
    std::lock_guard lock(state_->mutex);
    auto& free = state_->free;
    auto best = free.end();
    for (auto it = free.begin(); it != free.end(); ++it)
      if (it->bytes >= bytes && it->bytes <= 2 * bytes && (best == free.end() || it->bytes < best->bytes)) best = it;
    if (best != free.end()) {
      p = best->p;
      capacity = best->bytes;
      free.erase(best);
    }
  }
  if (!p) {
    // 1/8 of slack so the next call, whose row count varies a little, still fits.
    capacity = (bytes + bytes / 8 + 65535) / 65536 * 65536;
    p = std::aligned_alloc(64, capacity);
    if (!p) raise(ErrorCode::out_of_memory, "host allocation of {} bytes for a {} output failed", capacity, dtype_name(dtype));
  }
  std::shared_ptr<State> state = state_;
  std::shared_ptr<void> storage(p, [state, capacity](void* q) { state->give_back(q, capacity); });
  return Tensor::wrap(TensorView(p, dtype, shape), std::move(storage));
}

namespace {

constexpr std::string_view kDispatchPhase = "normal dispatch";
constexpr std::string_view kCombinePhase = "normal combine";

// ---- argument checks (all local, before any communication); the dispatch's own are in normal_args ----


/// First position where two equally shaped int32/bool tensors differ, compared as `T`; -1 if none.
template <class V>
std::int64_t first_difference(const TensorView& a, const Tensor& b) {
  const V* pa = static_cast<const V*>(a.data);
  const V* pb = static_cast<const V*>(b.data());
  for (std::int64_t i = 0; i < b.numel(); ++i)
    if (pa[i] != pb[i]) return i;
  return -1;
}

/// The layout tensors must be what get_dispatch_layout computes from topk_idx (SPEC 3).
void check_layout_matches(const DispatchArgs& a, const DispatchLayout& want, int R) {
  if (const auto i = first_difference<std::int32_t>(a.num_tokens_per_rank, want.num_tokens_per_rank); i >= 0)
    throw_invalid_argument("num_tokens_per_rank", fmt::format("the layout of topk_idx ({} at [{}])",
                                                              want.num_tokens_per_rank.ptr<std::int32_t>()[i], i),
                           fmt::format("{}", static_cast<const std::int32_t*>(a.num_tokens_per_rank.data)[i]));
  if (const auto i = first_difference<std::int32_t>(a.num_tokens_per_expert, want.num_tokens_per_expert); i >= 0)
    throw_invalid_argument("num_tokens_per_expert", fmt::format("the layout of topk_idx ({} at [{}])",
                                                                want.num_tokens_per_expert.ptr<std::int32_t>()[i], i),
                           fmt::format("{}", static_cast<const std::int32_t*>(a.num_tokens_per_expert.data)[i]));
  if (const auto i = first_difference<bool>(a.is_token_in_rank, want.is_token_in_rank); i >= 0)
    throw_invalid_argument("is_token_in_rank", fmt::format("the layout of topk_idx ({} at [{}, {}])",
                                                           want.is_token_in_rank.ptr<bool>()[i], i / R, i % R),
                           fmt::format("{}", static_cast<const bool*>(a.is_token_in_rank.data)[i]));
}

std::int64_t layout_hash(const NormalHandle& h) {
  // FNV-1a over rank_prefix_matrix: handles of different dispatches almost surely differ.
  std::uint64_t x = 1469598103934665603ull;
  const auto* p = static_cast<const unsigned char*>(h.rank_prefix_matrix.data());
  for (std::size_t i = 0; i < h.rank_prefix_matrix.nbytes(); ++i) x = (x ^ p[i]) * 1099511628211ull;
  return static_cast<std::int64_t>(x & 0x7fffffffffffffffull);
}


// ---- the settings packet of dispatch (one all-gather) ----

// Slots [0, kNumAgreed) must be equal on every rank; the rest are per rank. After the header come R
// counts: the tokens this rank sends to each rank. The size depends only on R.
enum Slot : int {
  kHidden, kDtype, kTopk, kExperts, kScaleFormat, kAlignment, kWorstTokens, kCached, kHasWeights, kHandleLayout,
  kNumAgreed,
  kIdxBytes = kNumAgreed,  // 8 or 4 (int64 / int32 topk_idx); may differ between ranks
  kNumTokens,
  kHeader
};
constexpr std::array<std::string_view, kNumAgreed> kSlotNames = {
    "hidden", "x dtype", "num_topk (0 = no topk_idx)", "num_experts", "x_scales format", "expert_alignment",
    "num_worst_tokens", "cached dispatch (handle given)", "topk_weights given", "handle layout (rank_prefix_matrix hash)"};

std::string setting_text(int slot, std::int64_t v) {
  if (slot == kDtype) return std::string(dtype_name(static_cast<DType>(v)));
  if (slot == kScaleFormat) return v == 0 ? "none" : v == 1 ? "float32" : "ue8m0 int32";
  return std::to_string(v);
}

// ---- row copies ----

/// Copies the first n rows of `b` to dst, consecutive rows of b.row_bytes bytes.
void copy_rows(const RowBlock& b, std::int64_t n, std::byte* dst) {
  if (n == 0) return;
  if (!b.index && b.stride_bytes == b.row_bytes) {  // a staged, dense block (MPI): one copy
    std::memcpy(dst, b.base, static_cast<std::size_t>(n) * b.row_bytes);
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) std::memcpy(dst + static_cast<std::size_t>(i) * b.row_bytes, b.row(i), b.row_bytes);
}

/// Reads global id k of a received topk row whose ids are `idx_bytes` wide.
inline std::int64_t read_id(const std::byte* row, int k, std::int64_t idx_bytes) {
  if (idx_bytes == 8) return reinterpret_cast<const std::int64_t*>(row)[k];
  return reinterpret_cast<const std::int32_t*>(row)[k];
}

RowBlock dense_block(const void* base, std::size_t row_bytes, std::int64_t first, std::int64_t count) {
  return RowBlock{static_cast<const std::byte*>(base) + static_cast<std::size_t>(first) * row_bytes, row_bytes, row_bytes,
                  nullptr, count};
}

/// Runs `fn` between exchange() and end_exchange(); end_exchange is reached even if fn throws, so the
/// peers are not left waiting for this rank.
template <class Fn>
void while_exchanged(Transport& transport, std::string_view phase, Fn&& fn) {
  try {
    fn();
  } catch (...) {
    try { transport.end_exchange(phase); } catch (...) {}
    throw;
  }
  transport.end_exchange(phase);
}

}  // namespace

DispatchResult NormalMode::dispatch(const DispatchArgs& a) {
  Group& group = transport_.group();
  const int R = group.size(), me = group.rank();

  // ---- validate everything locally ----
  const DispatchSpec spec = check_dispatch_args(a, R, buffer_id_, Device::cpu());
  if (spec.cached) check_normal_handle(a.handle, buffer_id_, R);
  const TensorView& x = a.x;
  const bool fp8 = spec.fp8, cached = spec.cached, has_topk = spec.has_topk, has_weights = spec.has_weights;
  const std::int64_t T = spec.T, H = spec.H, scale_cols = spec.scale_cols;
  const ScaleFormat scale_format = spec.scale_format;
  const int K = spec.K, E = spec.E, alignment = spec.alignment, worst = spec.worst;
  const int E_local = E / R;
  if (has_topk) {
    // Recomputing the layout checks every id (naming the first bad one and its position).
    const DispatchLayout layout = get_dispatch_layout(a.topk_idx, E, R);
    if (cached) {
      if (const auto i = first_difference<bool>(a.handle->is_token_in_rank, layout.is_token_in_rank); i >= 0)
        throw_invalid_argument("topk_idx", "the routing the handle was made with",
                               fmt::format("token {} {} rank {}", i / R,
                                           layout.is_token_in_rank.ptr<bool>()[i] ? "routed to" : "not routed to",
                                           i % R));
    } else {
      check_layout_matches(a, layout, R);
    }
  }

  // ---- what this rank sends: the tokens of each destination, ascending ----
  const TensorView& in_rank = cached ? a.handle->is_token_in_rank.view() : a.is_token_in_rank;
  const bool* in_rank_p = static_cast<const bool*>(in_rank.data);
  std::vector<std::int64_t> send_begin(static_cast<std::size_t>(R) + 1, 0);
  for (std::int64_t t = 0; t < T; ++t)
    for (int d = 0; d < R; ++d) send_begin[static_cast<std::size_t>(d) + 1] += in_rank_p[t * R + d] ? 1 : 0;
  for (int d = 0; d < R; ++d) send_begin[static_cast<std::size_t>(d) + 1] += send_begin[static_cast<std::size_t>(d)];
  std::vector<std::int32_t> send_tokens(static_cast<std::size_t>(send_begin[static_cast<std::size_t>(R)]));
  {
    std::vector<std::int64_t> fill(send_begin.begin(), send_begin.end() - 1);
    for (std::int64_t t = 0; t < T; ++t)
      for (int d = 0; d < R; ++d)
        if (in_rank_p[t * R + d]) send_tokens[static_cast<std::size_t>(fill[static_cast<std::size_t>(d)]++)] = static_cast<std::int32_t>(t);
  }

  // ---- one all-gather: settings that must agree, and the counts ----
  const std::size_t P = static_cast<std::size_t>(kHeader + R);
  std::vector<std::int64_t> packet(P, 0), gathered(P * static_cast<std::size_t>(R));
  packet[kHidden] = H;
  packet[kDtype] = static_cast<std::int64_t>(x.dtype);
  packet[kTopk] = K;
  packet[kExperts] = E;
  packet[kScaleFormat] = static_cast<std::int64_t>(scale_format);
  packet[kAlignment] = alignment;
  packet[kWorstTokens] = worst;
  packet[kCached] = cached;
  packet[kHasWeights] = has_weights;
  packet[kHandleLayout] = cached ? layout_hash(*a.handle) : 0;
  packet[kIdxBytes] = has_topk ? static_cast<std::int64_t>(dtype_size(a.topk_idx.dtype)) : 0;
  packet[kNumTokens] = T;
  for (int d = 0; d < R; ++d)
    packet[static_cast<std::size_t>(kHeader + d)] = send_begin[static_cast<std::size_t>(d) + 1] - send_begin[static_cast<std::size_t>(d)];
  group.all_gather(packet.data(), gathered.data(), P * sizeof(std::int64_t), kDispatchPhase);
  auto at = [&](int r, int slot) { return gathered[static_cast<std::size_t>(r) * P + static_cast<std::size_t>(slot)]; };
  // Every rank scans the same data in the same order, so every rank raises the same error.
  for (int r = 1; r < R; ++r)
    for (int s = 0; s < kNumAgreed; ++s)
      if (at(r, s) != at(0, s))
        raise(ErrorCode::rank_mismatch,
              "rank {}: setting '{}' of normal dispatch must be equal on all ranks: rank 0 has {}, rank {} has {}", me,
              kSlotNames[static_cast<std::size_t>(s)], setting_text(s, at(0, s)), r, setting_text(s, at(r, s)));

  // prefix[s][d] = tokens ranks 0..s send to rank d (the handle's rank_prefix_matrix).
  Tensor prefix = Tensor::empty(DType::int32, {R, R});
  auto* pm = prefix.ptr<std::int32_t>();
  for (int d = 0; d < R; ++d) {
    std::int64_t acc = 0;
    for (int s = 0; s < R; ++s) {
      acc += at(s, kHeader + d);
      if (acc > INT32_MAX)  // every rank sees the same counts, so every rank raises
        raise(ErrorCode::invalid_argument, "rank {}: rank {} would receive more than 2^31 - 1 rows", me, d);
      pm[s * R + d] = static_cast<std::int32_t>(acc);
    }
  }
  if (cached && std::memcmp(pm, a.handle->rank_prefix_matrix.data(), prefix.nbytes()) != 0)
    raise(ErrorCode::rank_mismatch, "rank {}: the handles passed to the cached dispatch do not describe the tokens the "
          "ranks send (is every rank passing the handle of the same dispatch?)", me);
  if (worst > 0)
    for (int d = 0; d < R; ++d)
      if (pm[(R - 1) * R + d] > worst)
        throw_invalid_argument("num_worst_tokens",
                               fmt::format("at least the rows every rank receives (rank {} receives {})", d,
                                           pm[(R - 1) * R + d]),
                               std::to_string(worst));
  auto before = [&](int s, int d) -> std::int64_t { return s > 0 ? pm[(s - 1) * R + d] : 0; };
  const std::int64_t num_recv = pm[(R - 1) * R + me];
  const std::int64_t rows = worst > 0 ? worst : num_recv;

  // ---- outputs, allocated before the exchange so an allocation failure leaves no peer waiting ----
  DispatchResult out;
  const std::size_t x_row = static_cast<std::size_t>(H) * dtype_size(x.dtype);
  const std::size_t scale_row = static_cast<std::size_t>(scale_cols) * 4;
  const std::size_t idx_row = static_cast<std::size_t>(K) * (has_topk ? dtype_size(a.topk_idx.dtype) : 0);
  const std::size_t w_row = static_cast<std::size_t>(K) * sizeof(float);
  out.recv_x = pool_.empty(x.dtype, {rows, H});
  if (fp8) out.recv_x_scales = pool_.empty(a.x_scales.dtype, {rows, scale_cols});
  if (has_topk) out.recv_topk_idx = pool_.empty(DType::int64, {rows, K});
  if (has_weights) out.recv_topk_weights = pool_.empty(DType::fp32, {rows, K});
  Tensor recv_src_idx, expert_counts;
  if (!cached) {
    recv_src_idx = pool_.empty(DType::int32, {num_recv});
    expert_counts = Tensor::zeros(DType::int32, {E_local});
  }

  // ---- one exchange: a field per row-wise tensor ----
  const int f_x = 0;
  int F = 1;
  const int f_scales = fp8 ? F++ : -1;
  const int f_idx = has_topk ? F++ : -1;
  const int f_w = has_weights ? F++ : -1;
  const int f_src = cached ? -1 : F++;
  std::vector<RowBlock> offered(static_cast<std::size_t>(R * F));
  for (int d = 0; d < R; ++d) {
    const std::int64_t b = send_begin[static_cast<std::size_t>(d)];
    const std::int64_t n = send_begin[static_cast<std::size_t>(d) + 1] - b;
    const std::int32_t* index = send_tokens.data() + b;
    RowBlock* o = &offered[static_cast<std::size_t>(d * F)];
    o[f_x] = RowBlock{static_cast<const std::byte*>(x.data), x_row, x_row, index, n};
    if (fp8) o[f_scales] = RowBlock{static_cast<const std::byte*>(a.x_scales.data), scale_row, scale_row, index, n};
    if (has_topk) o[f_idx] = RowBlock{static_cast<const std::byte*>(a.topk_idx.data), idx_row, idx_row, index, n};
    if (has_weights) o[f_w] = RowBlock{static_cast<const std::byte*>(a.topk_weights.data), w_row, w_row, index, n};
    if (!cached) o[f_src] = dense_block(send_tokens.data(), sizeof(std::int32_t), b, n);
  }
  const std::vector<RowBlock> received = transport_.exchange(offered, F, kDispatchPhase);

  while_exchanged(transport_, kDispatchPhase, [&] {
    auto* recv_x = static_cast<std::byte*>(out.recv_x.data());
    auto* recv_scales = fp8 ? static_cast<std::byte*>(out.recv_x_scales.data()) : nullptr;
    std::int64_t* recv_idx = has_topk ? out.recv_topk_idx.ptr<std::int64_t>() : nullptr;
    float* recv_w = has_weights ? out.recv_topk_weights.ptr<float>() : nullptr;
    std::int32_t* counts = cached ? nullptr : expert_counts.ptr<std::int32_t>();
    const std::int64_t first_expert = static_cast<std::int64_t>(me) * E_local;
    for (int s = 0; s < R; ++s) {
      const std::int64_t off = before(s, me), n = pm[s * R + me] - off;
      const RowBlock* blk = &received[static_cast<std::size_t>(s * F)];
      for (int f = 0; f < F; ++f) EPMOE_ASSERT(blk[f].count == n);
      copy_rows(blk[f_x], n, recv_x + static_cast<std::size_t>(off) * x_row);
      if (fp8) copy_rows(blk[f_scales], n, recv_scales + static_cast<std::size_t>(off) * scale_row);
      if (!cached) copy_rows(blk[f_src], n, reinterpret_cast<std::byte*>(recv_src_idx.ptr<std::int32_t>() + off));
      if (!has_topk) continue;
      const std::int64_t idx_bytes = at(s, kIdxBytes);
      for (std::int64_t i = 0; i < n; ++i) {
        const std::byte* ids = blk[f_idx].row(i);
        const float* w = has_weights ? reinterpret_cast<const float*>(blk[f_w].row(i)) : nullptr;
        std::int64_t* oi = recv_idx + (off + i) * K;
        float* ow = has_weights ? recv_w + (off + i) * K : nullptr;
        for (int k = 0; k < K; ++k) {
          const std::int64_t local = read_id(ids, k, idx_bytes) - first_expert;
          const bool mine = local >= 0 && local < E_local;
          oi[k] = mine ? local : -1;
          if (ow) ow[k] = mine ? w[k] : 0.0f;
          if (counts && mine) ++counts[local];
        }
      }
    }
  });

  // Padding rows of num_worst_tokens: x and scales zero, no expert, weight 0.
  if (rows > num_recv) {
    const std::size_t pad = static_cast<std::size_t>(rows - num_recv);
    std::memset(static_cast<std::byte*>(out.recv_x.data()) + static_cast<std::size_t>(num_recv) * x_row, 0, pad * x_row);
    if (fp8)
      std::memset(static_cast<std::byte*>(out.recv_x_scales.data()) + static_cast<std::size_t>(num_recv) * scale_row, 0,
                  pad * scale_row);
    if (has_topk) std::fill_n(out.recv_topk_idx.ptr<std::int64_t>() + num_recv * K, pad * static_cast<std::size_t>(K), -1);
    if (has_weights) std::fill_n(out.recv_topk_weights.ptr<float>() + num_recv * K, pad * static_cast<std::size_t>(K), 0.0f);
  }

  // ---- handle ----
  if (cached) {
    out.handle = *a.handle;
  } else {
    NormalHandle& h = out.handle;
    for (int e = 0; e < E_local; ++e) {
      std::int32_t& c = expert_counts.ptr<std::int32_t>()[e];
      c = static_cast<std::int32_t>((static_cast<std::int64_t>(c) + alignment - 1) / alignment * alignment);
    }
    h.rank_prefix_matrix = prefix;
    h.is_token_in_rank = pool_.empty(DType::boolean, {T, R});
    if (T > 0) std::memcpy(h.is_token_in_rank.data(), in_rank_p, h.is_token_in_rank.nbytes());
    h.send_pos = pool_.empty(DType::int32, {T, R});
    auto* sp = h.send_pos.ptr<std::int32_t>();
    std::fill_n(sp, T * R, -1);
    for (int d = 0; d < R; ++d) {
      const std::int64_t b = send_begin[static_cast<std::size_t>(d)];
      const std::int64_t n = send_begin[static_cast<std::size_t>(d) + 1] - b;
      for (std::int64_t j = 0; j < n; ++j)
        sp[static_cast<std::int64_t>(send_tokens[static_cast<std::size_t>(b + j)]) * R + d] =
            static_cast<std::int32_t>(before(me, d) + j);
    }
    h.recv_src_idx = recv_src_idx;
    h.num_recv_tokens_per_expert = expert_counts;
    h.num_tokens = T;
    h.num_recv_tokens = num_recv;
    h.num_recv_rows = rows;
    h.hidden = H;
    h.num_experts = E;
    h.expert_alignment = alignment;
    h.num_worst_tokens = worst;
    h.buffer_id = buffer_id_;
  }
  if (worst == 0) {
    const auto* c = out.handle.num_recv_tokens_per_expert.ptr<std::int32_t>();
    out.num_recv_tokens_per_expert_list.assign(c, c + E_local);
  }
  return out;
}

CombineResult NormalMode::combine(const CombineArgs& a) {
  Group& group = transport_.group();
  const int R = group.size(), me = group.rank();

  // ---- validate everything locally ----
  const CombineSpec spec = check_combine_args(a, R, buffer_id_, Device::cpu());
  const NormalHandle& h = *a.handle;
  const TensorView& x = a.x;
  const std::int64_t T = spec.T, H = spec.H;
  const int K = spec.K;
  const bool has_w = K > 0;

  const std::array<Setting, 3> settings = {Setting{"hidden", H}, Setting{"topk_weights K (0 = not given)", K},
                                           Setting{"handle layout (rank_prefix_matrix hash)", layout_hash(h)}};
  group.check_agreement(settings, kCombinePhase);

  // ---- outputs ----
  CombineResult out;
  out.combined_x = pool_.empty(DType::bf16, {T, H});
  if (has_w) out.combined_topk_weights = pool_.empty(DType::fp32, {T, K});

  // ---- one exchange: each rank returns to source s the rows it received from s ----
  const std::int32_t* pm = h.rank_prefix_matrix.ptr<std::int32_t>();
  auto before = [&](int s, int d) -> std::int64_t { return s > 0 ? pm[(s - 1) * R + d] : 0; };
  const int F = has_w ? 2 : 1;
  const std::size_t x_row = static_cast<std::size_t>(H) * sizeof(bf16_t), w_row = static_cast<std::size_t>(K) * sizeof(float);
  std::vector<RowBlock> offered(static_cast<std::size_t>(R * F));
  for (int s = 0; s < R; ++s) {
    const std::int64_t b = before(s, me), n = pm[s * R + me] - b;
    offered[static_cast<std::size_t>(s * F)] = dense_block(x.data, x_row, b, n);
    if (has_w) offered[static_cast<std::size_t>(s * F + 1)] = dense_block(a.topk_weights.data, w_row, b, n);
  }
  const std::vector<RowBlock> received = transport_.exchange(offered, F, kCombinePhase);

  while_exchanged(transport_, kCombinePhase, [&] {
    for (int d = 0; d < R; ++d) EPMOE_ASSERT(received[static_cast<std::size_t>(d * F)].count == pm[me * R + d] - before(me, d));
    const std::int32_t* send_pos = h.send_pos.ptr<std::int32_t>();
    const auto* b0 = a.bias_0.defined() ? static_cast<const bf16_t*>(a.bias_0.data) : nullptr;
    const auto* b1 = a.bias_1.defined() ? static_cast<const bf16_t*>(a.bias_1.data) : nullptr;
    auto* out_x = out.combined_x.ptr<bf16_t>();
    float* out_w = has_w ? out.combined_topk_weights.ptr<float>() : nullptr;
    // Rows of one token, in ascending destination rank; the sum runs over H in chunks that stay in L1.
    constexpr std::int64_t kChunk = 2048;
    std::vector<const bf16_t*> src(static_cast<std::size_t>(R));
    std::vector<const float*> src_w(static_cast<std::size_t>(R));
    std::vector<float> acc(static_cast<std::size_t>(kChunk));
    for (std::int64_t t = 0; t < T; ++t) {
      int n = 0;
      for (int d = 0; d < R; ++d) {
        const std::int64_t pos = send_pos[t * R + d];
        if (pos < 0) continue;
        const std::int64_t i = pos - before(me, d);
        const RowBlock& blk = received[static_cast<std::size_t>(d * F)];
        EPMOE_ASSERT(i >= 0 && i < blk.count);
        src[static_cast<std::size_t>(n)] = reinterpret_cast<const bf16_t*>(blk.row(i));
        if (has_w) src_w[static_cast<std::size_t>(n)] = reinterpret_cast<const float*>(received[static_cast<std::size_t>(d * F + 1)].row(i));
        ++n;
      }
      for (std::int64_t h0 = 0; h0 < H; h0 += kChunk) {
        const std::int64_t len = std::min(kChunk, H - h0);
        float* ac = acc.data();
        for (std::int64_t j = 0; j < len; ++j) ac[j] = 0.0f;
        for (int r = 0; r < n; ++r) {
          const bf16_t* row = src[static_cast<std::size_t>(r)] + h0;
          for (std::int64_t j = 0; j < len; ++j) ac[j] += bf16_to_float(row[j]);
        }
        if (b0) for (std::int64_t j = 0; j < len; ++j) ac[j] += bf16_to_float(b0[t * H + h0 + j]);
        if (b1) for (std::int64_t j = 0; j < len; ++j) ac[j] += bf16_to_float(b1[t * H + h0 + j]);
        bf16_t* o = out_x + t * H + h0;
        for (std::int64_t j = 0; j < len; ++j) o[j] = float_to_bf16(ac[j]);
      }
      if (has_w) {
        float* ow = out_w + t * K;
        for (int k = 0; k < K; ++k) ow[k] = 0.0f;
        for (int r = 0; r < n; ++r)
          for (int k = 0; k < K; ++k) ow[k] += src_w[static_cast<std::size_t>(r)][k];
      }
    }
  });
  return out;
}

}  // namespace epmoe
