// Overlapped low-latency combine on CPU ranks (docs/semantics.md "Overlapped low-latency combine"): the send waits
// for each block's (or expert's) signal, written by another thread as it produces the rows; the result is the
// reference's, bit for bit, as the plain combine's; a signal that never arrives times out naming rank, expert,
// block and phase with the buffer still usable; every bad overlap argument is refused by name before any
// communication.
#include <epmoe/experts.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "transport/low_latency_test_common.hpp"

namespace epmoe::test::ll {
namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

enum class Form { blocks, experts };

struct OverlapCase {
  Case c;
  Form form = Form::blocks;
  int block_m = 4, block_n = 64;  // blocks: threshold = ceil(H / block_n)
  bool hook = false;
};

// A bf16 [E_local, R*Tmax, H] tensor of NaNs: rows the combine sends before their producer wrote them show.
Tensor nan_rows(const Case& c) {
  Tensor t = Tensor::empty(DType::bf16, {c.E / c.R, static_cast<std::int64_t>(c.R) * c.tmax, c.H});
  for (std::int64_t i = 0; i < t.numel(); ++i) t.ptr<bf16_t>()[i] = bf16_t{0x7fc0};
  return t;
}

// The producer of one rank: copies the expert outputs `y` into `x` block by block (N-tile by N-tile with the block
// form), adding 1 to each block's (expert's) signal after its part is stored, after `delay` (so a combine that does
// not wait sends NaNs). Returns the time of its last add to a block (expert) holding rows.
std::chrono::steady_clock::time_point produce(const OverlapCase& oc, const Tensor& y, Tensor& x,
                                              const std::int32_t* count, void* signal, std::chrono::milliseconds delay,
                                              int skip_expert = -1, std::int64_t skip_block = -1) {
  const Case& c = oc.c;
  const int El = c.E / c.R;
  const std::int64_t rows = static_cast<std::int64_t>(c.R) * c.tmax, H = c.H;
  std::this_thread::sleep_for(delay);
  const std::int64_t bm = oc.block_m, bpe = ceil_div(rows, bm);
  auto last = std::chrono::steady_clock::now();
  for (int e = 0; e < El; ++e) {
    const std::int64_t n = count[e];
    if (oc.form == Form::experts) {
      std::memcpy(x.ptr<bf16_t>() + e * rows * H, y.ptr<bf16_t>() + e * rows * H, static_cast<std::size_t>(n * H) * 2);
      if (e != skip_expert) {  // two adds: the combine waits for src_signal_expect_value = 2
        __atomic_fetch_add(static_cast<std::uint32_t*>(signal) + e, 1u, __ATOMIC_RELEASE);
        if (n > 0) last = std::chrono::steady_clock::now();
        __atomic_fetch_add(static_cast<std::uint32_t*>(signal) + e, 1u, __ATOMIC_RELEASE);
      }
      continue;
    }
    for (std::int64_t b = 0; b * bm < n; ++b)
      for (std::int64_t c0 = 0; c0 < H; c0 += oc.block_n) {
        for (std::int64_t r = b * bm; r < std::min(n, (b + 1) * bm); ++r)
          std::memcpy(x.ptr<bf16_t>() + (e * rows + r) * H + c0, y.ptr<bf16_t>() + (e * rows + r) * H + c0,
                      static_cast<std::size_t>(std::min<std::int64_t>(oc.block_n, H - c0)) * 2);
        if (e == skip_expert && b == skip_block) continue;
        last = std::chrono::steady_clock::now();  // before the add: the block's last add happens after this
        __atomic_fetch_add(static_cast<std::int32_t*>(signal) + e * bpe + b, 1, __ATOMIC_RELEASE);
      }
    if (e % 2 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return last;
}

// The combine's signal tensor for the case (zeroed).
Tensor make_signal(const OverlapCase& oc) {
  const int El = oc.c.E / oc.c.R;
  if (oc.form == Form::experts) return Tensor::zeros(DType::uint32, {El});
  // One spare entry per expert's worth: extra entries are allowed (SGLang sizes it for block_m = 64).
  return Tensor::zeros(DType::int32, {El * ceil_div(static_cast<std::int64_t>(oc.c.R) * oc.c.tmax, oc.block_m) + 3});
}

void set_overlap(const OverlapCase& oc, LowLatencyCombineArgs& a, const Tensor& signal,
                 const LowLatencyDispatchResult& d) {
  a.overlap = true;
  if (oc.form == Form::experts) {
    a.src_signals = signal;
    a.src_signal_expect_value = 2;
    return;
  }
  a.comp_signal = signal;
  a.packed_recv_count = d.packed_recv_count;
  a.block_m = oc.block_m;
  a.threshold = static_cast<int>(ceil_div(oc.c.H, oc.block_n));
  a.num_sms = 3;
}

// Plain and overlapped combines of random expert outputs against the reference, bit for bit.
void run_case(const OverlapCase& oc) {
  const Case& c = oc.c;
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  const auto layout = reference_low_latency_dispatch(in, c.E);
  const auto y = make_expert_out(rng, c);
  const auto want = reference_low_latency_combine(in, layout, y, c.E);
  std::vector<Tensor> plain(static_cast<std::size_t>(c.R)), overlapped(static_cast<std::size_t>(c.R));
  std::atomic<int> finished_early{0};
  run_buffers(c.R, [&](Buffer& buf, Group& g) {
    const auto r = static_cast<std::size_t>(g.rank());
    const LowLatencyDispatchResult d = buf.low_latency_dispatch(dispatch_args(c, in[r]));
    LowLatencyCombineArgs a;
    a.x = y[r];
    a.topk_idx = in[r].topk_idx;
    a.topk_weights = in[r].topk_weights;
    a.handle = &d.handle;
    plain[r] = clone(buf.low_latency_combine(a).combined_x);

    Tensor x = nan_rows(c), signal = make_signal(oc);
    a.x = x;
    set_overlap(oc, a, signal, d);
    a.return_recv_hook = oc.hook;
    std::chrono::steady_clock::time_point last_add;
    std::thread producer([&] {
      last_add = produce(oc, y[r], x, d.packed_recv_count.ptr<std::int32_t>(), signal.data(),
                         std::chrono::milliseconds(20));
    });
    LowLatencyCombineResult res;
    try {
      res = buf.low_latency_combine(a);
      if (oc.hook) res.hook();
    } catch (...) {
      producer.join();
      throw;
    }
    const auto done = std::chrono::steady_clock::now();
    producer.join();
    bool any_rows = false;
    for (int e = 0; e < c.E / c.R; ++e) any_rows |= d.packed_recv_count.ptr<std::int32_t>()[e] > 0;
    if (any_rows && done < last_add) ++finished_early;  // the send cannot be done before the last block is
    overlapped[r] = clone(res.combined_x);
  });
  EXPECT_EQ(finished_early.load(), 0) << "an overlapped combine returned before its last signal was written";
  for (int r = 0; r < c.R; ++r) {
    const auto i = static_cast<std::size_t>(r);
    expect_bf16_equal(plain[i], want[i], describe_case(c) + " plain combine, rank " + std::to_string(r));
    expect_bf16_equal(overlapped[i], want[i], describe_case(c) + " overlapped combine, rank " + std::to_string(r));
  }
}

Case base_case() {
  Case c;
  c.R = 2;
  c.E = 8;
  c.K = 2;
  c.H = 256;
  c.tmax = 16;
  return c;
}

TEST(LowLatencyOverlap, BlockSignalsMatchReferenceAndPlainCombine) {
  OverlapCase oc;
  oc.c = base_case();
  run_case(oc);
  oc.block_m = 5;  // blocks straddling source ranks; H / block_n not whole
  oc.block_n = 96;
  oc.c.R = 3;
  oc.c.E = 6;
  oc.c.K = 3;
  run_case(oc);
}

TEST(LowLatencyOverlap, ExpertSignalsMatchReferenceAndPlainCombine) {
  OverlapCase oc;
  oc.c = base_case();
  oc.form = Form::experts;
  run_case(oc);
  oc.hook = true;
  run_case(oc);
}

TEST(LowLatencyOverlap, EdgesKOneZeroTokensAllMinusOneOneExpert) {
  for (Form form : {Form::blocks, Form::experts}) {
    OverlapCase oc;
    oc.form = form;
    oc.c = base_case();
    oc.c.K = 1;
    SCOPED_TRACE("K = 1");
    run_case(oc);
    oc.c = base_case();
    oc.c.T = {0, 16};  // a rank with zero tokens
    run_case(oc);
    oc.c = base_case();
    oc.c.routing.p_minus_one = 1.0;  // all -1: no rows anywhere
    run_case(oc);
    oc.c = base_case();
    oc.c.routing.only_expert = 3;  // one expert takes every token (T = Tmax on both ranks)
    oc.hook = true;
    run_case(oc);
  }
}

// The reference experts write the signal (block by block, N-tile by N-tile) on a side thread while the combine
// waits on it: the result is the combine of the experts' output written before the combine (bit for bit).
TEST(LowLatencyOverlap, ReferenceExpertsOnASideThreadReleaseTheCombine) {
  for (Form form : {Form::blocks, Form::experts}) {
    OverlapCase oc;
    oc.c = base_case();
    oc.c.H = 128;
    oc.form = form;
    const Case& c = oc.c;
    std::mt19937_64 rng(fresh_seed());
    const auto in = make_inputs(rng, c);
    const std::int64_t N = 64, El = c.E / c.R;
    const Tensor w1 = random_bf16(rng, El * 2 * N, c.H, 0.1f), w2 = random_bf16(rng, El * c.H, N, 0.1f);
    const auto experts = make_reference_experts(ExpertsConfig{ActivationFormat::batched_experts});
    std::vector<Tensor> plain(static_cast<std::size_t>(c.R)), overlapped(static_cast<std::size_t>(c.R));
    run_buffers(c.R, [&](Buffer& buf, Group& g) {
      const auto r = static_cast<std::size_t>(g.rank());
      const LowLatencyDispatchResult d = buf.low_latency_dispatch(dispatch_args(c, in[r]));
      ExpertsInputs ei;
      ei.hidden = d.packed_recv_x;
      ei.w1 = TensorView(w1.data(), DType::bf16, {El, 2 * N, c.H});
      ei.w2 = TensorView(w2.data(), DType::bf16, {El, c.H, N});
      ei.expert_num_tokens = d.packed_recv_count;
      const Tensor y = Tensor::zeros(DType::bf16, {El, static_cast<std::int64_t>(c.R) * c.tmax, c.H});
      experts->apply(ei, y.view());
      LowLatencyCombineArgs a;
      a.x = y;
      a.topk_idx = in[r].topk_idx;
      a.topk_weights = in[r].topk_weights;
      a.handle = &d.handle;
      plain[r] = clone(buf.low_latency_combine(a).combined_x);

      Tensor x = nan_rows(c), signal = make_signal(oc);
      ei.combine_signal.signal = signal;
      if (form == Form::blocks) {
        ei.combine_signal.block_m = oc.block_m;
        ei.combine_signal.block_n = oc.block_n;
      }
      a.x = x;
      set_overlap(oc, a, signal, d);
      if (form == Form::experts) a.src_signal_expect_value = 1;  // the experts add 1 per expert
      std::thread side([&] { experts->apply(ei, x.view()); });
      LowLatencyCombineResult res;
      try {
        res = buf.low_latency_combine(a);
      } catch (...) {
        side.join();
        throw;
      }
      side.join();
      overlapped[r] = clone(res.combined_x);
    });
    for (int r = 0; r < c.R; ++r)
      expect_bf16_equal(overlapped[static_cast<std::size_t>(r)], plain[static_cast<std::size_t>(r)],
                        "rank " + std::to_string(r) + (form == Form::blocks ? " block signals" : " expert signals"));
  }
}

// A block never signalled: the waiting rank raises timeout naming itself, the expert, the block and the phase; its
// peer raises naming it; both then combine again correctly (the buffer stays usable).
TEST(LowLatencyOverlap, SignalThatNeverArrivesTimesOutNamingExpertBlockPhase) {
  for (Form form : {Form::blocks, Form::experts}) {
    OverlapCase oc;
    oc.c = base_case();
    oc.c.routing.only_expert = 1;  // rank 0's local expert 1 gets every token: 32 rows, 8 blocks
    oc.form = form;
    const Case& c = oc.c;
    std::mt19937_64 rng(fresh_seed());
    const auto in = make_inputs(rng, c);
    const auto layout = reference_low_latency_dispatch(in, c.E);
    const auto y = make_expert_out(rng, c);
    const auto want = reference_low_latency_combine(in, layout, y, c.E);
    std::vector<Caught> errors(static_cast<std::size_t>(c.R));
    std::vector<Tensor> after(static_cast<std::size_t>(c.R));
    run_buffers(c.R, [&](Buffer& buf, Group& g) {
      const auto r = static_cast<std::size_t>(g.rank());
      const LowLatencyDispatchResult d = buf.low_latency_dispatch(dispatch_args(c, in[r]));
      LowLatencyCombineArgs a;
      a.topk_idx = in[r].topk_idx;
      a.topk_weights = in[r].topk_weights;
      a.handle = &d.handle;
      Tensor x = nan_rows(c), signal = make_signal(oc);
      a.x = x;
      set_overlap(oc, a, signal, d);
      (void)produce(oc, y[r], x, d.packed_recv_count.ptr<std::int32_t>(), signal.data(), std::chrono::milliseconds(0),
                    r == 0 ? 1 : -1, 2);
      const double timeout = g.timeout_s();
      if (r == 0) g.set_timeout_s(0.3);  // shorter than the peer's wait for this rank's header
      errors[r] = catch_error([&] { buf.low_latency_combine(a); });
      g.set_timeout_s(timeout);
      a = LowLatencyCombineArgs{};
      a.x = y[r];
      a.topk_idx = in[r].topk_idx;
      a.topk_weights = in[r].topk_weights;
      a.handle = &d.handle;
      after[r] = clone(buf.low_latency_combine(a).combined_x);
    });
    const std::string block = form == Form::blocks ? ", block 2" : "";
    ASSERT_TRUE(errors[0].thrown);
    EXPECT_EQ(errors[0].code, ErrorCode::timeout) << errors[0].what;
    EXPECT_TRUE(contains(errors[0].what, "rank 0") && contains(errors[0].what, "local expert 1 (global 1)" + block) &&
                contains(errors[0].what, "overlap signal") && contains(errors[0].what, "low_latency_combine send"))
        << errors[0].what;
    ASSERT_TRUE(errors[1].thrown);
    EXPECT_EQ(errors[1].code, ErrorCode::timeout) << errors[1].what;
    EXPECT_TRUE(contains(errors[1].what, "rank 0's send gave up") &&
                contains(errors[1].what, "local expert 1" + block) && contains(errors[1].what, "receive"))
        << errors[1].what;
    for (int r = 0; r < c.R; ++r)
      expect_bf16_equal(after[static_cast<std::size_t>(r)], want[static_cast<std::size_t>(r)],
                        "combine after the timeout, rank " + std::to_string(r));
  }
}

// Each bad overlap argument raises invalid_argument naming it on every rank, before any communication (the next
// combine of the same handle still works); overlap = false ignores the signal fields.
TEST(LowLatencyOverlap, BadArgumentsAreRefusedByNameBeforeAnyCommunication) {
  OverlapCase oc;
  oc.c = base_case();
  const Case& c = oc.c;
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  const auto layout = reference_low_latency_dispatch(in, c.E);
  const auto y = make_expert_out(rng, c);
  const auto want = reference_low_latency_combine(in, layout, y, c.E);
  const int El = c.E / c.R;
  struct Bad {
    std::string name, argument;
    std::function<void(LowLatencyCombineArgs&, const LowLatencyDispatchResult&)> edit;
  };
  const Tensor full = Tensor::zeros(DType::int32, {El * 8}), uint_sig = Tensor::zeros(DType::uint32, {El});
  const Tensor short_sig = Tensor::zeros(DType::int32, {El * 8 - 1}), i64_sig = Tensor::zeros(DType::int64, {El * 8});
  const Tensor sig_2d = Tensor::zeros(DType::int32, {El, 8}), i32_experts = Tensor::zeros(DType::int32, {El});
  const Tensor uint_long = Tensor::zeros(DType::uint32, {El + 1}), count_i64 = Tensor::zeros(DType::int64, {El});
  const Tensor strided = Tensor::zeros(DType::int32, {El * 16});
  const auto blocks = [&](LowLatencyCombineArgs& a, const LowLatencyDispatchResult& d) {
    a.overlap = true;
    a.comp_signal = full;
    a.packed_recv_count = d.packed_recv_count;
    a.block_m = 4;  // rows = 32: 8 blocks per expert
    a.threshold = 4;
  };
  const auto experts = [&](LowLatencyCombineArgs& a, const LowLatencyDispatchResult&) {
    a.overlap = true;
    a.src_signals = uint_sig;
    a.src_signal_expect_value = 1;
  };
  std::vector<Bad> bads = {
      {"no signal", "overlap", [](auto& a, auto&) { a.overlap = true; }},
      {"both forms", "src_signals", [&](auto& a, auto& d) { blocks(a, d); a.src_signals = uint_sig; }},
      {"block_m 0", "block_m", [&](auto& a, auto& d) { blocks(a, d); a.block_m = 0; }},
      {"threshold 0", "threshold", [&](auto& a, auto& d) { blocks(a, d); a.threshold = 0; }},
      {"num_sms -1", "num_sms", [&](auto& a, auto& d) { blocks(a, d); a.num_sms = -1; }},
      {"num_sms 2000", "num_sms", [&](auto& a, auto& d) { experts(a, d); a.num_sms = 2000; }},
      {"comp_signal int64", "comp_signal", [&](auto& a, auto& d) { blocks(a, d); a.comp_signal = i64_sig; }},
      {"comp_signal short", "comp_signal", [&](auto& a, auto& d) { blocks(a, d); a.comp_signal = short_sig; }},
      {"comp_signal 2-d", "comp_signal", [&](auto& a, auto& d) { blocks(a, d); a.comp_signal = sig_2d; }},
      {"comp_signal strided", "comp_signal",
       [&](auto& a, auto& d) {
         blocks(a, d);
         a.comp_signal = TensorView(strided.data(), DType::int32, {El * 8}, {2}, Device::cpu());
       }},
      {"block_m too small for comp_signal", "comp_signal", [&](auto& a, auto& d) { blocks(a, d); a.block_m = 3; }},
      {"no packed_recv_count", "packed_recv_count",
       [&](auto& a, auto& d) { blocks(a, d); a.packed_recv_count = TensorView{}; }},
      {"packed_recv_count int64", "packed_recv_count",
       [&](auto& a, auto& d) { blocks(a, d); a.packed_recv_count = count_i64; }},
      {"packed_recv_count values", "packed_recv_count",
       [&](auto& a, auto& d) { blocks(a, d); a.packed_recv_count = i32_experts; }},  // zeros: the dispatch has rows
      {"expect value with comp_signal", "src_signal_expect_value",
       [&](auto& a, auto& d) { blocks(a, d); a.src_signal_expect_value = 1; }},
      {"src_signals int32", "src_signals", [&](auto& a, auto& d) { experts(a, d); a.src_signals = i32_experts; }},
      {"src_signals size", "src_signals", [&](auto& a, auto& d) { experts(a, d); a.src_signals = uint_long; }},
      {"expect 0", "src_signal_expect_value", [&](auto& a, auto& d) { experts(a, d); a.src_signal_expect_value = 0; }},
      {"expect 2^32", "src_signal_expect_value",
       [&](auto& a, auto& d) { experts(a, d); a.src_signal_expect_value = std::int64_t{1} << 32; }},
      {"block_m with src_signals", "block_m", [&](auto& a, auto& d) { experts(a, d); a.block_m = 64; }},
      {"threshold with src_signals", "threshold", [&](auto& a, auto& d) { experts(a, d); a.threshold = 1; }},
      {"packed_recv_count with src_signals", "packed_recv_count",
       [&](auto& a, auto& d) { experts(a, d); a.packed_recv_count = d.packed_recv_count; }},
  };
  std::vector<std::vector<Caught>> got(static_cast<std::size_t>(c.R));
  std::vector<Tensor> ignored(static_cast<std::size_t>(c.R)), after(static_cast<std::size_t>(c.R));
  run_buffers(c.R, [&](Buffer& buf, Group& g) {
    const auto r = static_cast<std::size_t>(g.rank());
    const LowLatencyDispatchResult d = buf.low_latency_dispatch(dispatch_args(c, in[r]));
    LowLatencyCombineArgs base;
    base.x = y[r];
    base.topk_idx = in[r].topk_idx;
    base.topk_weights = in[r].topk_weights;
    base.handle = &d.handle;
    for (const Bad& bad : bads) {
      LowLatencyCombineArgs a = base;
      bad.edit(a, d);
      got[r].push_back(catch_error([&] { buf.low_latency_combine(a); }));
    }
    LowLatencyCombineArgs a = base;  // overlap false: garbage in the signal fields is not looked at
    a.comp_signal = i64_sig;
    a.src_signals = i32_experts;
    a.block_m = -5;
    a.threshold = -1;
    a.num_sms = -7;
    ignored[r] = clone(buf.low_latency_combine(a).combined_x);
    after[r] = clone(buf.low_latency_combine(base).combined_x);
  });
  for (int r = 0; r < c.R; ++r)
    for (std::size_t i = 0; i < bads.size(); ++i) {
      const Caught& e = got[static_cast<std::size_t>(r)][i];
      ASSERT_TRUE(e.thrown) << bads[i].name;
      EXPECT_EQ(e.code, ErrorCode::invalid_argument) << bads[i].name << ": " << e.what;
      EXPECT_TRUE(contains(e.what, "'" + bads[i].argument + "'")) << bads[i].name << ": " << e.what;
    }
  for (int r = 0; r < c.R; ++r) {
    expect_bf16_equal(ignored[static_cast<std::size_t>(r)], want[static_cast<std::size_t>(r)], "overlap false");
    expect_bf16_equal(after[static_cast<std::size_t>(r)], want[static_cast<std::size_t>(r)], "after the refusals");
  }
}

}  // namespace
}  // namespace epmoe::test::ll
