// Helpers shared by the low-latency tests: run R thread ranks with a Buffer each, make per-rank
// inputs, copy a rank's outputs out of its window, and compare them with the reference.
#pragma once

#include <epmoe/buffer.hpp>
#include <epmoe/dtype.hpp>
#include <epmoe/error.hpp>
#include <epmoe/group.hpp>
#include <epmoe/quant.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "support/low_latency_reference.hpp"
#include "support/random.hpp"
#include "support/tensor_bytes.hpp"

namespace epmoe::test::ll {

/// Runs fn(buffer, group) on R thread ranks, each with its own Buffer of a fresh ThreadWorld.
/// Returns one exception_ptr per rank (null where the rank returned normally).
inline std::vector<std::exception_ptr> run_buffers_collect(int R, const std::function<void(Buffer&, Group&)>& fn,
                                                           BufferOptions options = {},
                                                           double timeout_s = default_timeout_s()) {
  return run_thread_ranks_collect(
      R,
      [&](Group& g) {
        std::shared_ptr<Group> shared(&g, [](Group*) {});  // the runner owns the group; it outlives fn
        Buffer buffer(shared, options);
        fn(buffer, g);
      },
      timeout_s);
}

/// As run_buffers_collect, then rethrows the lowest rank's exception.
inline void run_buffers(int R, const std::function<void(Buffer&, Group&)>& fn, BufferOptions options = {}) {
  for (auto& e : run_buffers_collect(R, fn, options))
    if (e) std::rethrow_exception(e);
}

/// The ErrorCode and message of the exception, or {internal, ""} when there was none.
struct Caught {
  bool thrown = false;
  ErrorCode code = ErrorCode::internal;
  std::string what;
};
inline Caught caught(const std::exception_ptr& e) {
  Caught c;
  if (!e) return c;
  c.thrown = true;
  try {
    std::rethrow_exception(e);
  } catch (const Error& err) {
    c.code = err.code();
    c.what = err.what();
  } catch (const std::exception& err) {
    c.what = std::string("non-epmoe exception: ") + err.what();
  }
  return c;
}
template <class Fn>
Caught catch_error(Fn&& fn) {
  try {
    fn();
  } catch (...) {
    return caught(std::current_exception());
  }
  return {};
}

/// An owning, contiguous copy of a view.
inline Tensor clone(const TensorView& v) {
  Tensor t = Tensor::empty(v.dtype, v.shape);
  EPMOE_ASSERT(v.is_contiguous());
  if (t.nbytes()) std::memcpy(t.data(), v.data, t.nbytes());
  return t;
}

struct Case {
  int R = 2, E = 8, K = 2;
  std::int64_t H = 128;
  int tmax = 8;
  std::vector<std::int64_t> T;  ///< tokens per rank (empty: tmax on every rank)
  RoutingOptions routing;
  bool use_fp8 = false, round_scale = false, use_ue8m0 = false;
  std::int64_t tokens(int r) const { return T.empty() ? tmax : T[static_cast<std::size_t>(r)]; }
};

inline std::string describe_case(const Case& c) {
  return "R=" + std::to_string(c.R) + " E=" + std::to_string(c.E) + " K=" + std::to_string(c.K) +
         " H=" + std::to_string(c.H) + " Tmax=" + std::to_string(c.tmax) + (c.use_fp8 ? " fp8" : " bf16") +
         (c.round_scale ? " round_scale" : "") + (c.use_ue8m0 ? " ue8m0" : "");
}

inline std::vector<LowLatencyRankInput> make_inputs(std::mt19937_64& rng, const Case& c) {
  std::vector<LowLatencyRankInput> in;
  for (int r = 0; r < c.R; ++r) {
    const std::int64_t T = c.tokens(r);
    LowLatencyRankInput i;
    i.x = random_bf16(rng, T, c.H, 3.0f);
    i.topk_idx = random_topk_idx(rng, T, c.K, c.E, c.routing);
    i.topk_weights = random_topk_weights(rng, i.topk_idx);
    in.push_back(i);
  }
  return in;
}

/// Random bf16 expert outputs [E_local, R*Tmax, H] per rank.
inline std::vector<Tensor> make_expert_out(std::mt19937_64& rng, const Case& c) {
  std::vector<Tensor> y;
  const std::int64_t El = c.E / c.R, rows = static_cast<std::int64_t>(c.R) * c.tmax;
  for (int r = 0; r < c.R; ++r) {
    Tensor flat = random_bf16(rng, El * rows, c.H, 2.0f);
    y.push_back(Tensor::wrap(TensorView(flat.data(), DType::bf16, {El, rows, c.H}),
                             std::shared_ptr<void>(flat.data(), [flat](void*) {})));
  }
  return y;
}

inline LowLatencyDispatchArgs dispatch_args(const Case& c, const LowLatencyRankInput& in) {
  LowLatencyDispatchArgs a;
  a.x = in.x;
  a.topk_idx = in.topk_idx;
  a.topk_weights = in.topk_weights;
  a.num_max_dispatch_tokens_per_rank = c.tmax;
  a.num_experts = c.E;
  a.use_fp8 = c.use_fp8;
  a.round_scale = c.round_scale;
  a.use_ue8m0 = c.use_ue8m0;
  return a;
}

/// A row-major copy of a 3-d view of 4-byte elements with any strides.
inline Tensor clone_row_major(const TensorView& v) {
  Tensor t = Tensor::empty(v.dtype, v.shape);
  const std::size_t es = dtype_size(v.dtype);  // 4-byte fp8 scales / UE8M0 words, 1-byte nvfp4 scales
  auto* d = static_cast<std::byte*>(t.data());
  const auto* src = static_cast<const std::byte*>(v.data);
  for (std::int64_t i = 0; i < v.size(0); ++i)
    for (std::int64_t j = 0; j < v.size(1); ++j)
      for (std::int64_t k = 0; k < v.size(2); ++k, d += es)
        std::memcpy(d, src + static_cast<std::size_t>(i * v.stride(0) + j * v.stride(1) + k * v.stride(2)) * es, es);
  return t;
}

/// DeepEP's strides of the low-latency scales [E_local, R*Tmax, C]: a transposed [E_local, C, M] allocation, M the
/// rows R*Tmax rounded up to a multiple of 4 (DeepGEMM's TMA alignment of 4-byte elements; DeepEP itself requires
/// R*Tmax % 4 == 0, where M = R*Tmax).
inline Shape deepep_scale_strides(std::int64_t rows, std::int64_t cols) {
  const std::int64_t m = (rows + 3) / 4 * 4;
  return Shape{cols * m, 1, m};
}

/// A rank's dispatch outputs, copied out of its window (scales: a row-major copy of the column-major view).
struct DispatchCopy {
  Tensor packed_x, scales, count, src_info, layout_range;
  Shape scale_strides;  ///< the strides the dispatch returned its scales with
};
inline DispatchCopy copy_dispatch(const LowLatencyDispatchResult& r) {
  DispatchCopy c;
  c.packed_x = clone(r.packed_recv_x);
  if (r.packed_recv_x_scales.defined()) {
    c.scales = clone_row_major(r.packed_recv_x_scales);
    c.scale_strides = r.packed_recv_x_scales.strides;
  }
  c.count = clone(r.packed_recv_count);
  c.src_info = clone(r.handle.src_info);
  c.layout_range = clone(r.handle.layout_range);
  return c;
}

/// Checks one rank's dispatch outputs against the reference: counts, layout ranges and src_info
/// exactly; rows bit for bit (bf16: the source row; fp8: quantize_fp8 of the source row, data and
/// scales), and with fp8 the dequantized rows within the e4m3 rounding bound of the originals.
inline void expect_dispatch_matches(const Case& c, int d, const DispatchCopy& got,
                                    const std::vector<LowLatencyRankInput>& in,
                                    const std::vector<LowLatencyReferenceRank>& ref,
                                    const std::vector<Fp8Tensor>& quantized) {
  SCOPED_TRACE(describe_case(c) + " receiving rank " + std::to_string(d));
  const int El = c.E / c.R;
  const std::int64_t rows = static_cast<std::int64_t>(c.R) * c.tmax, H = c.H;
  const auto& rr = ref[static_cast<std::size_t>(d)];
  ASSERT_EQ(got.packed_x.shape(), (Shape{El, rows, H}));
  ASSERT_EQ(got.packed_x.dtype(), c.use_fp8 ? DType::fp8_e4m3 : DType::bf16);
  const std::int64_t G = num_scale_groups(H), W = num_ue8m0_words(H);
  if (c.use_fp8) {
    ASSERT_EQ(got.scales.dtype(), c.use_ue8m0 ? DType::int32 : DType::fp32);
    ASSERT_EQ(got.scales.shape(), (Shape{El, rows, c.use_ue8m0 ? W : G}));
    ASSERT_EQ(got.scale_strides, deepep_scale_strides(rows, c.use_ue8m0 ? W : G)) << to_string(got.scale_strides);
  }
  std::int64_t mismatched_rows = 0;
  for (int e = 0; e < El; ++e) {
    const auto& er = rr.rows[static_cast<std::size_t>(e)];
    ASSERT_EQ(got.count.ptr<std::int32_t>()[e], static_cast<std::int32_t>(er.size())) << "expert " << e;
    for (int s = 0; s < c.R; ++s)
      EXPECT_EQ(got.layout_range.ptr<std::int64_t>()[e * c.R + s],
                rr.layout_range[static_cast<std::size_t>(e * c.R + s)])
          << "expert " << e << " source " << s;
    for (std::size_t j = 0; j < er.size(); ++j) {
      const std::int64_t row = e * rows + static_cast<std::int64_t>(j);
      const auto& src = er[j];
      EXPECT_EQ(got.src_info.ptr<std::int32_t>()[row], src.token) << "expert " << e << " row " << j;
      if (!c.use_fp8) {
        const void* want = in[static_cast<std::size_t>(src.rank)].x.ptr<bf16_t>() + src.token * H;
        if (std::memcmp(got.packed_x.ptr<bf16_t>() + row * H, want, static_cast<std::size_t>(H) * 2) != 0)
          ++mismatched_rows;
        continue;
      }
      const Fp8Tensor& q = quantized[static_cast<std::size_t>(src.rank)];
      const auto* qrow = q.data.ptr<fp8_e4m3_t>() + src.token * H;
      const auto* grow = got.packed_x.ptr<fp8_e4m3_t>() + row * H;
      const std::int64_t sc_cols = c.use_ue8m0 ? W : G;
      const std::size_t sc_bytes = static_cast<std::size_t>(sc_cols) * 4;
      const auto* gsc = static_cast<const std::byte*>(got.scales.data()) + static_cast<std::size_t>(row) * sc_bytes;
      const auto* qsc = static_cast<const std::byte*>(q.scales.data()) + static_cast<std::size_t>(src.token) * sc_bytes;
      if (std::memcmp(grow, qrow, static_cast<std::size_t>(H)) != 0 || std::memcmp(gsc, qsc, sc_bytes) != 0) {
        ++mismatched_rows;
        continue;
      }
      // Dequantize independently: value * group scale (UE8M0: 2^(byte - 127)).
      const bf16_t* orig = in[static_cast<std::size_t>(src.rank)].x.ptr<bf16_t>() + src.token * H;
      for (std::int64_t ch = 0; ch < H; ++ch) {
        const std::int64_t grp = ch / 128;
        double scale;
        if (c.use_ue8m0) {
          std::int32_t word;
          std::memcpy(&word, gsc + (grp / 4) * 4, 4);
          const int byte = (static_cast<std::uint32_t>(word) >> (8 * (grp % 4))) & 0xff;
          scale = std::ldexp(1.0, byte - 127);
        } else {
          float f;
          std::memcpy(&f, gsc + grp * 4, 4);
          scale = f;
        }
        const double deq = static_cast<double>(fp8_e4m3_to_float(grow[ch])) * scale;
        const double x = bf16_to_float(orig[ch]);
        // e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 relative; subnormals step by 2^-9 * scale.
        const double bound = std::fabs(x) * 0.0625 * (1 + 1e-5) + scale * (1.0 / 1024) * (1 + 1e-5);
        if (!(std::fabs(deq - x) <= bound)) {
          ADD_FAILURE() << "expert " << e << " row " << j << " channel " << ch << ": dequantized " << deq
                        << ", original " << x << ", bound " << bound;
          return;
        }
      }
    }
  }
  EXPECT_EQ(mismatched_rows, 0) << "rows whose bytes differ from the (quantized) source row";
}

inline std::vector<Fp8Tensor> quantize_all(const Case& c, const std::vector<LowLatencyRankInput>& in) {
  std::vector<Fp8Tensor> q;
  if (!c.use_fp8) return q;
  for (const auto& i : in) q.push_back(quantize_fp8(i.x, Fp8Options{c.round_scale, c.use_ue8m0}));
  return q;
}

/// What a low-latency dispatch reads and must leave as it was (semantics §1); the statistics it adds to are outputs.
inline InputBytes& add_dispatch_inputs(InputBytes& b, const LowLatencyDispatchArgs& a) {
  b.add("x", a.x).add("topk_idx", a.topk_idx).add("topk_weights", a.topk_weights);
  return b.add("x_global_scale", a.x_global_scale);
}

/// What a low-latency combine reads: its arguments and the dispatch's handle (which stays valid for more combines).
inline InputBytes& add_combine_inputs(InputBytes& b, const LowLatencyCombineArgs& a) {
  b.add("combine x", a.x).add("combine topk_idx", a.topk_idx).add("combine topk_weights", a.topk_weights);
  return b.add("handle.src_info", a.handle->src_info).add("handle.layout_range", a.handle->layout_range);
}

inline void expect_bf16_equal(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  std::int64_t bad = 0, first = -1;
  for (std::int64_t i = 0; i < want.numel(); ++i)
    if (got.ptr<bf16_t>()[i].bits != want.ptr<bf16_t>()[i].bits && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0) << what << ": " << bad << " elements differ, first at flat index " << first << " (got "
                    << (first >= 0 ? bf16_to_float(got.ptr<bf16_t>()[first]) : 0.0f) << ", want "
                    << (first >= 0 ? bf16_to_float(want.ptr<bf16_t>()[first]) : 0.0f) << ")";
}

}  // namespace epmoe::test::ll
