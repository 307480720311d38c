// `epmoe run`: the main job. A full expert-parallel MoE layer over R ranks:
//   router (or replayed routing) -> dispatch -> experts -> combine
// timed per phase and checked against the float64 reference (semantics §13).
// On GPUs (--device auto finds them; cuda forces): one rank per GPU, the router on the rank's GPU, then the MoE
// layer's prepare/finalize on CUDA tensors over a cuda_ipc buffer (normal mode: the layout, the fp8 quantization,
// dispatch, dequantization, weight-and-reduce and combine on the GPU; low-latency mode: the backend's GPU
// low-latency mode) with the CUDA experts (make_cuda_experts; standard or batched_experts format). On CPU ranks:
// the threads or MPI transport and the BLAS experts, through the same prepare/finalize.
#include <epmoe/buffer.hpp>
#include <epmoe/experts.hpp>
#include <epmoe/group.hpp>
#include <epmoe/moe.hpp>
#include <epmoe/quant.hpp>
#include <epmoe/replay.hpp>
#include <epmoe/router.hpp>
#include <epmoe/version.hpp>
#if defined(EPMOE_HAVE_MPI)
#include <epmoe/mpi.hpp>
#endif

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <thread>



#include "commands.hpp"
#include "common.hpp"

namespace epmoe::cli {
namespace {

struct RunConfig {
  int ranks = 4;
  std::int64_t tokens = 256;
  std::int64_t hidden = 2048;
  int experts = 64;
  int topk = 8;
  std::int64_t intermediate = 1024;
  std::string mode = "normal";
  std::string dispatch_dtype = "bf16";
  std::string activation = "silu";
  std::string experts_impl = "auto";
  std::uint64_t seed = 2024;
  std::string routing;
  std::string domain = "general";
  int layer = 0;
  std::int64_t offset = 0;
  std::int64_t chunk_size = 0;
  bool overlap = false;  // --overlap: the low-latency combine's send overlapped with the experts (MoELayerOptions)
  int iters = 3;
  std::int64_t check_tokens = 32;
  double tolerance = 1e-2;
  std::string tolerance_text;  // --tolerance as typed: 1e400 reads as inf (1e-400 as 0), named as given
  std::string json;
  std::string backend = "threads";
  std::string device = "auto";
  std::string config;       // --config: BufferOptions tunables (JSON)
  bool topk_given = false;  // --topk on the command line (it must then match a replayed trace's K)
  std::string replay_flags_given;  // --domain / --layer / --offset given (they apply only with --routing)
  std::string layer_flags_given;   // options of a layer run given (--eplb runs none: they are named as ignored)
  bool domain_given = false;       // --domain given (it applies only when --routing is a directory)
  bool ranks_given = false;
  // --eplb (eplb_report.cpp): the EPLB report of a replayed trace instead of a layer run.
  bool eplb = false;
  int redundant_experts = -1;  // -1: E / 4 rounded up to a multiple of --ranks
  bool redundant_given = false;
  // Resolved by run():
  DeviceKind kind = DeviceKind::cpu;
  BufferOptions buffer_options;
};

struct Model {
  Tensor w1, w2;  // all E experts: [E, 2N or N, H], [E, H, N]
};

Model make_model(const RunConfig& c, Activation act) {
  const std::int64_t rows1 = is_gated(act) ? 2 * c.intermediate : c.intermediate;
  Model m{Tensor::empty(DType::bf16, {c.experts, rows1, c.hidden}),
          Tensor::empty(DType::bf16, {c.experts, c.hidden, c.intermediate})};
  // Scales keep activations O(1) through both GEMMs (1/sqrt(fan_in)).
  const float s1 = 1.0f / std::sqrt(static_cast<float>(c.hidden)), s2 = 1.0f / std::sqrt(static_cast<float>(c.intermediate));
  const unsigned workers = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (unsigned w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      for (int e = static_cast<int>(w); e < c.experts; e += static_cast<int>(workers)) {
        fill_bf16(m.w1.ptr<bf16_t>() + e * rows1 * c.hidden, rows1 * c.hidden, c.seed, 1000000 + e, s1);
        fill_bf16(m.w2.ptr<bf16_t>() + e * c.hidden * c.intermediate, c.hidden * c.intermediate, c.seed, 2000000 + e, s2);
      }
    });
  for (auto& t : pool) t.join();
  return m;
}

TensorView expert_slice(const Tensor& w, std::int64_t begin, std::int64_t count) {
  return w.view().slice_rows(begin, begin + count);
}

struct Phase {
  const char* name;
  std::vector<double> seconds;  // per iteration, max over ranks
  double bytes = 0;             // per iteration, summed over ranks
};

struct RankResult {
  std::vector<double> router_s, dispatch_s, experts_s, combine_s;
  double dispatch_bytes = 0, combine_bytes = 0;
  double err_num = 0, err_den = 0;
  bool finite = true;
  std::int64_t checked = 0;
};

struct Shared {
  std::mutex mutex;
  const RunConfig* config;
  const Model* model;
  const RoutingTrace* trace;
  Activation activation;
};

// Compares the output of evenly spaced tokens with the float64 reference computed from the inputs the
// experts actually saw (the fp8 round trip included). All tensors on the CPU.
void check_reference(RankResult& res, const RunConfig& c, const Shared& sh, const Tensor& hidden, const TopkResult& routing,
                     const Tensor& output, bool fp8) {
  const std::int64_t T = c.tokens, H = c.hidden;
  const std::int64_t S = std::min<std::int64_t>(T, c.check_tokens);
  if (S <= 0) return;
  const int K = static_cast<int>(routing.topk_idx.size(1));
  Tensor xs = Tensor::empty(DType::bf16, {S, H}), topk_idx = Tensor::empty(DType::int64, {S, K}),
         topk_weights = Tensor::empty(DType::fp32, {S, K});
  std::vector<std::int64_t> picked(static_cast<std::size_t>(S));
  for (std::int64_t s = 0; s < S; ++s) {
    const std::int64_t t = s * T / S;
    picked[static_cast<std::size_t>(s)] = t;
    std::copy_n(hidden.ptr<bf16_t>() + t * H, H, xs.ptr<bf16_t>() + s * H);
    std::copy_n(routing.topk_idx.ptr<std::int64_t>() + t * K, K, topk_idx.ptr<std::int64_t>() + s * K);
    std::copy_n(routing.topk_weights.ptr<float>() + t * K, K, topk_weights.ptr<float>() + s * K);
  }
  Tensor seen = xs;
  if (fp8) {
    const Fp8Tensor q = quantize_fp8(xs);
    seen = dequantize_fp8(q.data, q.scales, DType::bf16);
  }
  ExpertsInputs in;
  in.hidden = seen;
  in.w1 = sh.model->w1;
  in.w2 = sh.model->w2;
  in.topk_idx = topk_idx;
  in.topk_weights = topk_weights;
  in.activation = sh.activation;
  const std::vector<double> ref = reference_experts_f64(in);
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t h = 0; h < H; ++h) {
      const double got = bf16_to_float(output.ptr<bf16_t>()[picked[static_cast<std::size_t>(s)] * H + h]);
      const double want = ref[static_cast<std::size_t>(s * H + h)];
      if (!std::isfinite(got)) res.finite = false;
      res.err_num += (got - want) * (got - want);
      res.err_den += want * want;
    }
  res.checked = S;
}

// Inputs of one rank, the same on CPU and GPU runs (so both check against the same reference).
Tensor rank_hidden(const RunConfig& c, int rank) {
  Tensor hidden = Tensor::empty(DType::bf16, {c.tokens, c.hidden});
  fill_bf16(hidden.ptr<bf16_t>(), c.tokens * c.hidden, c.seed, 3000000 + static_cast<std::uint64_t>(rank), 1.0f);
  return hidden;
}
Tensor rank_logits(const RunConfig& c, int rank) {
  Tensor logits = Tensor::empty(DType::fp32, {c.tokens, c.experts});
  std::mt19937_64 rng(c.seed * 31 + static_cast<std::uint64_t>(rank));
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (std::int64_t i = 0; i < logits.numel(); ++i) logits.ptr<float>()[i] = d(rng);
  return logits;
}

/// One iteration's dispatch through the prepare/finalize stage (both halves, no overlap to hide here).
PrepareOutput prepare_iteration(PrepareFinalize& pf, const MoEForwardArgs& args) {
  PrepareInputs pin;
  pin.hidden = args.hidden;
  pin.topk_idx = args.topk_idx;
  pin.topk_weights = args.topk_weights;
  pin.global_num_experts = args.global_num_experts;
  pf.dispatch_a(pin);
  return pf.dispatch_b();
}

/// One iteration's routing, its time appended to res.router_s: this rank's tokens of the recorded trace
/// (--routing; copied to the GPU when device >= 0) or the router's top-k of its logits. On a GPU the time ends
/// after a device synchronisation, as every phase's does.
TopkResult route_iteration(const RunConfig& c, const Shared& sh, const Tensor& logits, int rank, std::int64_t T,
                           int device, RankResult& res) {
  const auto t0 = Clock::now();
  TopkResult routing;
  if (sh.trace) {
    const ReplayedRouting r = replay_routing(*sh.trace, c.layer, c.offset, rank, T, c.experts);
    routing = device >= 0 ? TopkResult{to_device(r.topk_weights, device), to_device(r.topk_idx, device)}
                          : TopkResult{r.topk_weights, r.topk_idx};
  } else {
    routing = topk_softmax(logits, c.topk, /*renormalize=*/true);
  }
  if (device >= 0) cuda_sync_device();
  res.router_s.push_back(seconds_since(t0));
  return routing;
}

// One rank on its GPU, through the MoE layer's prepare/finalize over a cuda_ipc buffer on that GPU and the CUDA
// experts, everything on the device: normal mode (make_normal_prepare_finalize on CUDA tensors: the layout, the
// fp8 quantization, the dispatch, the dequantization, then the standard-format experts (reduced, chunked by
// --chunk-size) and the combine) or low-latency mode (the buffer's GPU low-latency mode, Tmax = T, the fp8
// quantization fused into its send kernel; batched_experts experts). Phases are timed on the host with a device
// synchronisation at the end of each (so they add up to the layer's time, as on CPU ranks).
RankResult run_rank_gpu(const std::shared_ptr<Group>& group, Shared& sh, int device) {
  const RunConfig& c = *sh.config;
  cuda_set_device(device);
  const int R = group->size(), rank = group->rank();
  const int E_local = c.experts / R;
  const std::int64_t T = c.tokens, H = c.hidden;
  const bool low_latency = c.mode == "low-latency";
  RankResult res;

  const Tensor hidden_h = rank_hidden(c, rank);
  const Tensor hidden = to_device(hidden_h, device), logits = to_device(rank_logits(c, rank), device);
  const Tensor w1 = to_device(expert_slice(sh.model->w1, rank * E_local, E_local), device);
  const Tensor w2 = to_device(expert_slice(sh.model->w2, rank * E_local, E_local), device);

  BufferOptions bo = c.buffer_options;
  bo.backend = Backend::cuda_ipc;
  bo.device = device;
  if (low_latency)
    bo.low_latency_mode = true;  // num_nvl_bytes 0: a low-latency-only buffer; num_rdma_bytes 0: sized on first use
  else
    bo.num_nvl_bytes = Buffer::get_normal_nvl_size_hint(T, H, R, c.topk);
  auto buffer = std::make_shared<Buffer>(group, bo);
  PrepareFinalizeOptions po;
  po.dispatch_dtype = c.dispatch_dtype == "fp8" ? DispatchDtype::fp8 : DispatchDtype::bf16;
  auto pf = low_latency ? make_low_latency_prepare_finalize(buffer, static_cast<int>(T), po)
                        : make_normal_prepare_finalize(buffer, po);
  ExpertsConfig ec;
  ec.format = low_latency ? ActivationFormat::batched_experts : ActivationFormat::standard;
  ec.reduce = true;  // standard: [M, H], weighted and summed over the row's local experts, what combine sends back
  const std::shared_ptr<Experts> experts = make_cuda_experts(ec);
  MoELayerOptions lo;
  lo.chunk_size = c.chunk_size;
  lo.overlap = c.overlap;
  MoELayer layer(pf, experts, {}, lo);

  MoEForwardArgs args;
  args.hidden = hidden;
  args.w1 = w1;
  args.w2 = w2;
  args.activation = sh.activation;
  args.global_num_experts = c.experts;

  Tensor output;
  TopkResult routing;
  for (int it = 0; it < c.iters; ++it) {
    group->barrier("run.iteration");
    routing = route_iteration(c, sh, logits, rank, T, device, res);
    args.topk_idx = routing.topk_idx;
    args.topk_weights = routing.topk_weights;

    group->barrier("run.dispatch");
    const auto t1 = Clock::now();
    const PrepareOutput prepared = prepare_iteration(*pf, args);
    cuda_sync_device();
    res.dispatch_s.push_back(seconds_since(t1));
    // Received rows (low-latency: the counts, a view of the buffer's receive half, read before the combine).
    std::int64_t rows = prepared.hidden.size(0);
    if (low_latency) {
      const Tensor counts = to_host(prepared.expert_num_tokens);
      rows = 0;
      for (int e = 0; e < E_local; ++e) rows += counts.ptr<std::int32_t>()[e];
    }

    const auto t2 = Clock::now();
    // --overlap: the combine's send runs during the experts (their phase holds both; the combine's, the receive)
    const Tensor fused = c.overlap ? layer.run_experts_and_combine_a(prepared, args) : layer.run_experts(prepared, args);
    cuda_sync_device();
    res.experts_s.push_back(seconds_since(t2));

    group->barrier("run.combine");
    const auto t3 = Clock::now();
    if (!c.overlap) pf->combine_a(fused, experts->weight_and_reduce());
    output = pf->combine_b();
    cuda_sync_device();
    res.combine_s.push_back(seconds_since(t3));

    const double elt = po.dispatch_dtype == DispatchDtype::fp8 ? 1.0 + 4.0 / 128 : 2.0;
    res.dispatch_bytes = static_cast<double>(rows) * static_cast<double>(H) * elt;
    res.combine_bytes = static_cast<double>(rows) * static_cast<double>(H) * 2.0;
    if (rank == 0) fmt::print(stderr, "  iteration {}/{} done\n", it + 1, c.iters);
  }
  const TopkResult routing_h{to_host(routing.topk_weights), to_host(routing.topk_idx)};
  check_reference(res, c, sh, hidden_h, routing_h, to_host(output), po.dispatch_dtype == DispatchDtype::fp8);
  return res;
}

RankResult run_rank(const std::shared_ptr<Group>& group, Shared& sh) {
  const RunConfig& c = *sh.config;
  const int R = group->size(), rank = group->rank();
  const int E_local = c.experts / R;
  const std::int64_t T = c.tokens, H = c.hidden;
  RankResult res;

  // Inputs of this rank.
  const Tensor hidden = rank_hidden(c, rank);
  const Tensor logits = rank_logits(c, rank);

  const bool low_latency = c.mode == "low-latency";
  PrepareFinalizeOptions po;
  po.dispatch_dtype = c.dispatch_dtype == "fp8" ? DispatchDtype::fp8 : DispatchDtype::bf16;
  auto buffer = std::make_shared<Buffer>(group, c.buffer_options);
  auto pf = low_latency ? make_low_latency_prepare_finalize(buffer, static_cast<int>(T), po)
                        : make_normal_prepare_finalize(buffer, po);
  ExpertsConfig ec;
  ec.format = low_latency ? ActivationFormat::batched_experts : ActivationFormat::standard;
  std::shared_ptr<Experts> experts = c.experts_impl == "reference" ? std::shared_ptr<Experts>(make_reference_experts(ec))
                                                                   : std::shared_ptr<Experts>(make_blas_experts(ec));
  MoELayerOptions lo;
  lo.chunk_size = c.chunk_size;
  lo.overlap = c.overlap;
  MoELayer layer(pf, experts, {}, lo);

  MoEForwardArgs args;
  args.hidden = hidden;
  args.w1 = expert_slice(sh.model->w1, rank * E_local, E_local);
  args.w2 = expert_slice(sh.model->w2, rank * E_local, E_local);
  args.activation = sh.activation;
  args.global_num_experts = c.experts;

  Tensor output;
  TopkResult routing;
  for (int it = 0; it < c.iters; ++it) {
    group->barrier("run.iteration");
    routing = route_iteration(c, sh, logits, rank, T, /*device=*/-1, res);
    args.topk_idx = routing.topk_idx;
    args.topk_weights = routing.topk_weights;

    group->barrier("run.dispatch");
    const auto t1 = Clock::now();
    const PrepareOutput prepared = prepare_iteration(*pf, args);
    res.dispatch_s.push_back(seconds_since(t1));

    const auto t2 = Clock::now();
    // --overlap: the experts on a side thread while this thread sends each block they finish
    const Tensor fused = c.overlap ? layer.run_experts_and_combine_a(prepared, args) : layer.run_experts(prepared, args);
    res.experts_s.push_back(seconds_since(t2));

    group->barrier("run.combine");
    const auto t3 = Clock::now();
    if (!c.overlap) pf->combine_a(fused, experts->weight_and_reduce());
    output = pf->combine_b();
    res.combine_s.push_back(seconds_since(t3));

    // Payload moved, as DeepEP counts it: the received rows (each way).
    std::int64_t rows = 0;
    if (low_latency) {
      for (int e = 0; e < E_local; ++e) rows += prepared.expert_num_tokens.ptr<std::int32_t>()[e];
    } else {
      rows = prepared.hidden.size(0);
    }
    const double elt = po.dispatch_dtype == DispatchDtype::fp8 ? 1.0 + 4.0 / 128 : 2.0;
    res.dispatch_bytes = static_cast<double>(rows) * static_cast<double>(H) * elt;
    res.combine_bytes = static_cast<double>(rows) * static_cast<double>(H) * 2.0;
    if (rank == 0) fmt::print(stderr, "  iteration {}/{} done\n", it + 1, c.iters);
  }

  check_reference(res, c, sh, hidden, routing, output, po.dispatch_dtype == DispatchDtype::fp8);
  return res;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Flattens a rank's result into doubles so MPI ranks can all-gather them.
std::vector<double> pack(const RankResult& r) {
  std::vector<double> v;
  for (const auto* series : {&r.router_s, &r.dispatch_s, &r.experts_s, &r.combine_s}) v.insert(v.end(), series->begin(), series->end());
  v.insert(v.end(), {r.dispatch_bytes, r.combine_bytes, r.err_num, r.err_den, r.finite ? 1.0 : 0.0, static_cast<double>(r.checked)});
  return v;
}
RankResult unpack(const double* v, int iters) {
  RankResult r;
  for (auto* series : {&r.router_s, &r.dispatch_s, &r.experts_s, &r.combine_s}) {
    series->assign(v, v + iters);
    v += iters;
  }
  r.dispatch_bytes = v[0];
  r.combine_bytes = v[1];
  r.err_num = v[2];
  r.err_den = v[3];
  r.finite = v[4] != 0.0;
  r.checked = static_cast<std::int64_t>(v[5]);
  return r;
}

// Runs every rank as a thread of this process.
std::vector<RankResult> launch_threads(const RunConfig& c, Shared& sh) {
  std::vector<RankResult> results(static_cast<std::size_t>(c.ranks));
  ThreadWorld world(c.ranks);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(c.ranks));
  world.run_threads([&](int r) {
    try {
      results[static_cast<std::size_t>(r)] =
          c.kind == DeviceKind::cuda ? run_rank_gpu(world.group(r), sh, r) : run_rank(world.group(r), sh);
    } catch (const std::exception& e) {
      errors[static_cast<std::size_t>(r)] = std::current_exception();
      world.abort(r, e.what());  // the other ranks stop waiting for this one at once
    }
  });
  if (auto e = first_root_cause(errors)) std::rethrow_exception(e);
  return results;
}

int report(const RunConfig& c, const std::vector<RankResult>& results, const RoutingTrace* trace, bool print);

Activation parse_activation_flag(const std::string& name) {
  try {
    return parse_activation(name);
  } catch (const Error& e) {  // the library names its argument 'activation'; on the command line it is the flag
    rethrow_naming_flag(e, "activation", "--activation");
  }
}

// CPU or GPU ranks, and the experts for them: auto takes the GPUs when there are any, in both modes (low-latency
// mode on GPUs: the MoE layer's low-latency prepare/finalize over the cuda_ipc buffer's GPU low-latency mode).
// Returns the visible GPUs (0 on CPU ranks).
int resolve_devices(RunConfig& c) {
  c.kind = resolve_device(c.device);
  if (c.kind == DeviceKind::cpu) {
    // --overlap needs experts that write the combine signal: the float64 reference ones on CPU ranks
    if (c.experts_impl == "auto") c.experts_impl = c.overlap ? "reference" : "blas";
    if (c.experts_impl == "cuda") bad("--experts-impl", "blas or reference on CPU ranks (cuda needs --device cuda)", c.experts_impl);
    return 0;
  }
  const int gpus = cuda_device_count();
  if (c.experts_impl == "auto") c.experts_impl = "cuda";
  if (c.experts_impl != "cuda")
    bad("--experts-impl", "cuda or auto on GPU ranks (or --device cpu)", c.experts_impl);
  if (c.backend == "threads") {
    if (!c.ranks_given) {  // one rank per local GPU (the most GPUs whose count divides E)
      c.ranks = gpus;
      while (c.experts >= 1 && c.ranks > 1 && c.experts % c.ranks != 0) --c.ranks;
      if (c.ranks < gpus) fmt::print(stderr, "note: {} of the {} GPUs, so that they divide --experts {}\n", c.ranks, gpus, c.experts);
    }
    if (c.ranks > gpus) bad("--ranks", fmt::format("at most the {} visible GPUs (one rank per GPU)", gpus), c.ranks);
  }
  return gpus;
}

/// The most experts per token the --mode's dispatch takes (semantics §1).
int mode_max_topk(const RunConfig& c) { return c.mode == "normal" ? kNormalMaxTopk : kLowLatencyMaxTopk; }

// The sizes and counts of the job, each named by its flag.
void check_job_flags(const RunConfig& c) {
  if (c.ranks < 1) bad("--ranks", ">= 1", c.ranks);
  if (c.kind == DeviceKind::cpu && c.backend == "threads" && c.experts_impl == "blas" &&
      c.ranks > blas_experts_max_concurrent_threads())
    // Past OpenBLAS's table of work buffers the thread ranks' concurrent GEMMs crash it (experts.hpp).
    bad("--ranks",
        fmt::format("at most {} CPU ranks as threads with the BLAS experts (OpenBLAS's limit; more with --backend mpi "
                    "or --experts-impl reference)",
                    blas_experts_max_concurrent_threads()),
        c.ranks);
  if (c.experts < 1) bad("--experts", ">= 1", c.experts);
  if (c.experts % c.ranks != 0) {
    if (c.backend != "mpi" && !c.ranks_given)  // the ranks are a default: the experts are what was asked
      bad("--experts", fmt::format("a multiple of the {} ranks (--ranks)", c.ranks), c.experts);
    bad(c.backend == "mpi" ? "mpirun -np" : "--ranks", fmt::format("a divisor of --experts ({})", c.experts), c.ranks);
  }
  if (c.experts / c.ranks > 1024)  // semantics §1; the layout would say so only after the weights are made, as 'num_experts'
    bad("--experts", fmt::format("at most {} (1024 per rank on {} rank{})", 1024LL * c.ranks, c.ranks,
                                 c.ranks == 1 ? "" : "s"),
        c.experts);
  if (c.tokens < 1) bad("--tokens", ">= 1", c.tokens);
  // semantics §1: bf16 rows move in 16-byte pieces (H % 8), fp8 rows too (H % 16).
  const std::int64_t hidden_multiple = c.dispatch_dtype == "fp8" ? 16 : 8;
  if (c.hidden < hidden_multiple || c.hidden % hidden_multiple != 0)
    bad("--hidden",
        fmt::format("a positive multiple of {} for --dispatch-dtype {}", hidden_multiple, c.dispatch_dtype),
        c.hidden);
  if (c.intermediate < 1) bad("--intermediate", ">= 1", c.intermediate);
  const int max_topk = std::min(c.experts, mode_max_topk(c));
  if (c.topk < 1 || c.topk > max_topk)
    bad("--topk", fmt::format("in [1, {}] (at most --experts and {} in {} mode)", max_topk, mode_max_topk(c), c.mode),
        c.topk);
  if (c.check_tokens < 1) bad("--check-tokens", ">= 1", c.check_tokens);
  if (!(c.tolerance > 0) || !std::isfinite(c.tolerance))
    bad("--tolerance",
        fmt::format("a positive finite number (a double: in [{}, {}])", std::numeric_limits<double>::denorm_min(),
                    std::numeric_limits<double>::max()),
        c.tolerance_text.empty() ? fmt::format("{}", c.tolerance) : c.tolerance_text);
  if (c.layer < 0) bad("--layer", ">= 0", c.layer);
  if (c.offset < 0) bad("--offset", ">= 0", c.offset);
  if (c.chunk_size < 0) bad("--chunk-size", ">= 0", c.chunk_size);
  if (c.iters < 1) bad("--iters", ">= 1", c.iters);
  if (!c.json.empty()) check_writable("--json", c.json);
}

// The trace of --routing, checked against the other flags; --topk becomes the trace's K.
RoutingTrace load_replayed_trace(RunConfig& c, bool root) {
  // A file names its own domain: a --domain beside it would be silently ignored, so the pair is refused.
  if (c.domain_given && std::filesystem::exists(c.routing) && !std::filesystem::is_directory(c.routing))
    bad("--domain",
        fmt::format("nothing when --routing is a file (its name, {}, gives the domain; --domain picks a "
                    "DOMAIN.topk_idx.npy of a --routing directory)",
                    std::filesystem::path(c.routing).filename().string()),
        c.domain);
  RoutingTrace trace;
  try {
    trace = load_routing_trace(c.routing, c.domain);
  } catch (const Error& e) {
    rethrow_naming_flag(e, "routing", "--routing");  // the library names its argument 'routing'
  }
  if (c.layer >= trace.num_layers()) bad("--layer", fmt::format("in [0, {})", trace.num_layers()), c.layer);
  // Ranks take tokens from the offset on, wrapping at the end: an offset past the trace means nothing.
  if (c.offset >= trace.num_tokens())
    bad("--offset", fmt::format("in [0, {}) (the tokens of --routing)", trace.num_tokens()), c.offset);
  if (c.experts % trace.num_experts != 0)
    bad("--experts", fmt::format("a multiple of the trace's {} experts", trace.num_experts), c.experts);
  if (c.topk_given && c.topk != trace.num_topk())
    bad("--topk", fmt::format("the trace's K = {} (or nothing) with --routing", trace.num_topk()), c.topk);
  // The trace's K replaces --topk: held to the mode's range here, as --topk is, not refused by the layer later.
  if (trace.num_topk() > mode_max_topk(c))
    bad("--routing", fmt::format("a trace of K in 1..{} in {} mode", mode_max_topk(c), c.mode),
        fmt::format("K = {} in {}", trace.num_topk(), c.routing));
  c.topk = trace.num_topk();
  // The replayed span's end, saturated: sizes past 64-bit counts reach the memory check (which refuses them) after
  // this note, and a wrapped product was undefined behaviour.
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  const std::int64_t end = c.tokens > (kMax - c.offset) / c.ranks ? kMax : c.offset + c.ranks * c.tokens;
  if (root && end > trace.num_tokens())
    fmt::print("note: tokens [{}, {}) wrap around the trace's {}\n", c.offset, end,
               plural(trace.num_tokens(), "recorded token"));
  if (root)
    fmt::print("routing: replaying '{}' layer {} from offset {} ({}, ids mapped onto {} experts)\n", trace.domain,
               c.layer, c.offset, plural(trace.num_tokens(), "recorded token"), c.experts);
  return trace;
}

// Host memory the job needs, roughly, against the machine's: an impossible size is named here, not by a failed
// allocation (or the OOM killer) later. The bf16 weights of every expert; per rank its tokens, their K copies after
// dispatch and the expert intermediates; the buffers of the CPU transport: normal mode's count exchange and
// handles, which grow with R^2 per rank (threads_normal_bytes_per_rank; ranks that are threads of this process),
// or the low-latency window (E_local x R x T rows and an R x T staging area).
void check_job_memory(const RunConfig& c, Activation act) {
  const double weights = static_cast<double>(c.experts) * (is_gated(act) ? 3 : 2) * c.intermediate * c.hidden * 2;
  double per_rank = static_cast<double>(c.tokens) * (c.hidden * 2.0 * (3 + c.topk) + 4.0 * c.intermediate * c.topk);
  if (c.kind == DeviceKind::cpu && c.mode == "normal") {
    per_rank += threads_normal_bytes_per_rank(c.ranks, c.tokens, 1);
  } else if (c.kind == DeviceKind::cpu) {
    // Sizes past the library's limit or past 64-bit counts are infinite here. Settings the window cannot have (more
    // than 1024 experts per rank) are left for the layer to name.
    try {
      per_rank += low_latency_window_estimate(c.tokens, c.hidden, c.ranks, c.experts);
    } catch (const Error&) {
    }
  }
  // With MPI each process holds its own rank's share; the machine's memory is still shared by all of them.
  check_host_memory(weights + per_rank * c.ranks, "--ranks/--tokens/--hidden/--experts/--intermediate",
                    fmt::format("weights {}, {}{} tokens and buffers {}", gib(weights), plural(c.ranks, "rank"),
                                c.ranks == 1 ? "'s" : "'", gib(per_rank * c.ranks)));
}

void print_run_header(const RunConfig& c) {
  const std::string where =
      c.kind == DeviceKind::cuda
          ? fmt::format("{} GPU ranks ({} x {}, cuda_ipc over a {} group, num_sms {})", c.ranks, c.ranks, device_name(0),
                        c.backend, c.buffer_options.num_sms == 0 ? std::string("default") : std::to_string(c.buffer_options.num_sms))
          : fmt::format("{} CPU rank{} ({}; {})", c.ranks, c.ranks == 1 ? "" : "s", c.backend,
                        cpu_ranks_reason(c.device));
  fmt::print("epmoe {} run: {}, T={} per rank, H={}, E={}, K={}, N={}, {} mode, {} dispatch, {}, experts={}\n", version(),
             where, c.tokens, c.hidden, c.experts, c.topk, c.intermediate, c.mode, c.dispatch_dtype, c.activation,
             c.experts_impl);
}

#if defined(EPMOE_HAVE_MPI)
// FNV-1a of a text: a value to compare across processes.
std::int64_t text_code(std::string_view s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return static_cast<std::int64_t>(h >> 1);
}

// Under mpirun every process parses its own command line: the flags that define the job must be equal on all of
// them (an MPMD launch with another --seed would otherwise run and report a false FAIL). rank_mismatch names the
// flag and both values on every rank, before any weight is made.
void check_flags_agree(Group& g, const RunConfig& c) {
  const std::array<Setting, 7> numbers = {
      Setting{"--seed", static_cast<std::int64_t>(c.seed)}, Setting{"--tokens", c.tokens},
      Setting{"--hidden", c.hidden}, Setting{"--intermediate", c.intermediate}, Setting{"--experts", c.experts},
      Setting{"--topk", c.topk}, Setting{"--iters", c.iters}};
  g.check_agreement(numbers, "epmoe run flags");
  // Text flags travel as their text (a fixed slot each; a longer one, a --routing path, as its first bytes and its
  // hash), so a difference is named in the words typed, not as two numbers.
  constexpr std::size_t kSlot = 256;
  const std::array<std::pair<std::string_view, std::string_view>, 6> texts = {{{"--mode", c.mode},
                                                                               {"--dispatch-dtype", c.dispatch_dtype},
                                                                               {"--activation", c.activation},
                                                                               {"--experts-impl", c.experts_impl},
                                                                               {"--routing", c.routing},
                                                                               {"--domain", c.domain}}};
  std::array<char, texts.size() * kSlot> mine{};
  for (std::size_t i = 0; i < texts.size(); ++i)
    texts[i].second.copy(mine.data() + i * kSlot, kSlot - 1);  // NUL-terminated: the slot's last byte stays 0
  std::vector<char> all(mine.size() * static_cast<std::size_t>(g.size()));
  g.all_gather(mine.data(), all.data(), mine.size(), "epmoe run text flags");
  const auto text = [&](int r, std::size_t i) {
    return std::string_view(all.data() + static_cast<std::size_t>(r) * mine.size() + i * kSlot);
  };
  // The same scan on every rank over the same data: every rank names the same difference.
  for (int r = 1; r < g.size(); ++r)
    for (std::size_t i = 0; i < texts.size(); ++i)
      if (text(r, i) != text(0, i))
        throw Error(ErrorCode::rank_mismatch,
                    fmt::format("epmoe: rank {}: setting '{}' must be equal on all ranks (phase 'epmoe run flags'): "
                                "rank 0 has '{}', rank {} has '{}'",
                                g.rank(), texts[i].first, text(0, i), r, text(r, i)));
  // A difference past a slot's first bytes (two long --routing paths alike that far): the whole path by its hash.
  const std::array<Setting, 1> whole = {Setting{"--routing (the whole path, hashed)", text_code(c.routing)}};
  g.check_agreement(whole, "epmoe run flags");
}
#endif

#if defined(EPMOE_HAVE_MPI)
/// Who says a message that several ranks share, given every rank's message code (`codes[r]`): the lowest rank with
/// that code says it for all of them, naming them ("ranks 1, 2") unless every rank shares it; the others stay quiet.
struct Speaker {
  bool says = false;
  int count = 0;      // ranks that share the message
  std::string ranks;  // "rank 1", "ranks 1, 2"; "" when every rank shares it
};
Speaker speaker_of(const std::vector<std::int64_t>& codes, int rank) {
  const std::int64_t mine = codes[static_cast<std::size_t>(rank)];
  Speaker s;
  std::string alike;
  for (int r = 0; r < static_cast<int>(codes.size()); ++r)
    if (codes[static_cast<std::size_t>(r)] == mine) {
      if (s.count++ == 0) s.says = r == rank;
      alike += (alike.empty() ? "" : ", ") + std::to_string(r);
    }
  if (s.count < static_cast<int>(codes.size())) s.ranks = (s.count == 1 ? "rank " : "ranks ") + alike;
  return s;
}

// Under mpirun a flag refused on some ranks alone (a --json folder or a --routing file that only their nodes lack, an
// MPMD launch) must stop every rank at once, not leave the others in their first collective until its timeout: the
// ranks exchange a code of their message (0: their checks passed), and those that passed say which ranks did not.
// Each message is said once, by the lowest rank that has it (speaker_of): a flag refused alike on every rank is one
// line, not one per rank. Every line is written before any rank exits: mpirun ends the job at the first non-zero exit,
// which would cut off a rank still about to speak.
void stop_unless_every_rank_passed(Group& g, const std::exception_ptr& refused) {
  std::string message;
  std::optional<ErrorCode> code;
  try {
    if (refused != nullptr) std::rethrow_exception(refused);
  } catch (const Error& e) {
    message = e.what();
    code = e.code();
  } catch (...) {  // not one of the checks' refusals: its own rank says it, as it is
  }
  // A refusal's code is odd, so never 0; a failure that is not an Error gets a negative one that no rank shares.
  const std::int64_t mine = refused == nullptr ? 0 : code ? text_code(message) | 1 : -1 - g.rank();
  std::vector<std::int64_t> all(static_cast<std::size_t>(g.size()));
  g.all_gather(&mine, all.data(), sizeof(mine), "epmoe run flags checked");
  std::string refusing;
  for (int r = 0; r < g.size(); ++r)
    if (all[static_cast<std::size_t>(r)] != 0) refusing += (refusing.empty() ? "" : ", ") + std::to_string(r);
  if (refusing.empty()) return;
  const Speaker speaker = speaker_of(all, g.rank());
  constexpr std::string_view head = "epmoe: ";
  std::string line;  // this rank's message as the job says it
  if (refused == nullptr)
    line = fmt::format("epmoe: {}: {} flags were accepted, but rank(s) {} refused theirs (their messages name the "
                       "flag); no rank runs",
                       speaker.ranks, speaker.count == 1 ? "its" : "their", refusing);
  else if (code)
    line = speaker.ranks.empty() ? message
                                 : fmt::format("{}{}: {}", head, speaker.ranks,
                                               message.rfind(head, 0) == 0 ? message.substr(head.size()) : message);
  if (speaker.says && !line.empty()) {
    std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
  }
  g.barrier("epmoe run refusals said");
  if (line.empty()) std::rethrow_exception(refused);
  throw AlreadyReported(code.value_or(ErrorCode::invalid_argument), line);
}
#endif

/// What run's checks found: the activation and the GPUs to use, the replayed trace when --routing gives one, or the
/// exit code of the --eplb report that ran instead.
struct CheckedRun {
  Activation act{};
  int gpus = 0;
  RoutingTrace trace;
  std::optional<int> eplb_code;
};

/// The flags' checks that need no other rank (run's first part).
CheckedRun check_run_flags(RunConfig& c, bool root) {
  CheckedRun r;
  // A trace missing on this machine is named first, with the OS's reason (the library's loader would call the path
  // neither a directory nor a .npy file).
  if (!c.routing.empty()) check_exists("--routing", "an existing directory or DOMAIN.topk_idx.npy file", c.routing);
  if (c.overlap && c.mode != "low-latency")
    bad("--overlap", "--mode low-latency beside it (it overlaps the low-latency combine's send with the experts)",
        c.mode);
  // ---- --eplb: plan and measure on a replayed trace (host only, no layer run) ----
  if (c.redundant_given && !c.eplb)
    bad("--redundant-experts", "--eplb beside it (it sets the spare slots of the EPLB plan)", c.redundant_experts);
  if (c.eplb) {
    if (c.routing.empty()) bad("--eplb", "--routing DIR or FILE (the trace to plan from)", "no --routing");
    if (c.mode != "normal")
      bad("--mode", "normal with --eplb (the report counts the normal dispatch's layout; low-latency is not supported)",
          c.mode);
    if (c.backend != "threads") bad("--backend", "threads with --eplb (the report runs in one process)", c.backend);
    if (c.ranks < 1) bad("--ranks", ">= 1", c.ranks);
    if (c.redundant_experts < 0) {
      if (c.redundant_given) bad("--redundant-experts", fmt::format(">= 0 and a multiple of --ranks ({})", c.ranks),
                                 c.redundant_experts);
      c.redundant_experts = (c.experts / 4 + c.ranks - 1) / c.ranks * c.ranks;
    }
    if (c.redundant_experts % c.ranks != 0)
      bad("--redundant-experts", fmt::format(">= 0 and a multiple of --ranks ({})", c.ranks), c.redundant_experts);
    check_job_flags(c);
    if (!c.replay_flags_given.empty() && c.replay_flags_given != "--domain")
      fmt::print(stderr, "note: --layer and --offset are ignored with --eplb (every layer, both halves of the trace)\n");
    if (!c.layer_flags_given.empty())
      fmt::print(stderr, "note: ignored with --eplb (it plans and counts the trace's routing, no layer runs): {}\n",
                 c.layer_flags_given);
    const RoutingTrace eplb_trace = load_replayed_trace(c, /*root=*/false);  // its replay lines are a layer run's
    r.eplb_code = run_eplb_report(eplb_trace, c.experts, c.ranks, c.redundant_experts, c.json, c.routing);
    return r;
  }
  r.act = parse_activation_flag(c.activation);
  r.gpus = resolve_devices(c);
  if (c.overlap && c.experts_impl == "blas")
    bad("--experts-impl", "reference or cuda with --overlap (the BLAS experts write no combine signal)", "blas");
  apply_config_flag(c.config, c.buffer_options);
  if (!c.config.empty() && c.kind == DeviceKind::cpu && root)
    fmt::print(stderr, "note: --config holds cuda_ipc tunables; CPU ranks run without them\n");
  check_job_flags(c);

  // The trace's flags without a trace: refused, not ignored (the run would go on random routing, as if replayed).
  if (c.routing.empty() && !c.replay_flags_given.empty()) {
    const std::string flag = c.replay_flags_given.substr(0, c.replay_flags_given.find(','));
    bad(flag, "--routing beside it (it picks from the replayed trace; without --routing the routing is random)",
        flag == "--domain" ? c.domain : std::to_string(flag == "--layer" ? c.layer : c.offset));
  }
  if (!c.routing.empty()) r.trace = load_replayed_trace(c, root);
  check_job_memory(c, r.act);
  return r;
}

int run(RunConfig c) {
  if (c.backend != "threads" && c.backend != "mpi")
    throw Error(ErrorCode::invalid_argument, fmt::format("epmoe: invalid argument '--backend': expected threads or mpi, got {}", c.backend));
  bool root = true;
  // Started by mpirun without --backend mpi, every process would run its own independent job: refuse.
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"})
    if (const char* n = std::getenv(var); c.backend == "threads" && n != nullptr && std::atoi(n) > 1)
      bad("--backend", fmt::format("mpi when started by mpirun with several processes ({}={})", var, n), c.backend);
#if defined(EPMOE_HAVE_MPI)
  std::optional<MpiSession> session;
  std::shared_ptr<Group> mpi_group;
  if (c.backend == "mpi") {
    session.emplace(nullptr, nullptr);
    mpi_group = make_mpi_group();
    root = mpi_group->rank() == 0;
  }
#endif
  std::exception_ptr refused;  // this rank's checks failed (raised once every rank knows)
  CheckedRun checked;
  try {
#if defined(EPMOE_HAVE_MPI)
    if (mpi_group) {
      // One rank per process of mpirun: --ranks, when given, must say the same (outside mpirun there is 1 process).
      if (c.ranks_given && c.ranks != mpi_group->size())
        bad("--ranks",
            fmt::format("the number of MPI processes ({}: set it with mpirun -np) or nothing with --backend mpi",
                        mpi_group->size()),
            c.ranks);
      c.ranks = mpi_group->size();
    }
#endif
    checked = check_run_flags(c, root);
  } catch (...) {
    refused = std::current_exception();
  }
#if defined(EPMOE_HAVE_MPI)
  if (mpi_group) {
    stop_unless_every_rank_passed(*mpi_group, refused);
    if (refused == nullptr) check_flags_agree(*mpi_group, c);
  }
#endif
  if (refused != nullptr) std::rethrow_exception(refused);
  if (checked.eplb_code) return *checked.eplb_code;
  const Activation act = checked.act;
  const int gpus = checked.gpus;
  const RoutingTrace& trace = checked.trace;
  const bool replay = !c.routing.empty();
  if (root) print_run_header(c);

  const auto tg = Clock::now();
  if (root)
    fmt::print(stderr, "  generating expert weights ({:.0f} MiB)...\n",
             static_cast<double>(c.experts) * (is_gated(act) ? 3 : 2) * c.intermediate * c.hidden * 2 / 1048576.0);
  const Model model = make_model(c, act);
  if (root) fmt::print(stderr, "  weights ready in {:.1f} s\n", seconds_since(tg));

  Shared sh;
  sh.config = &c;
  sh.model = &model;
  sh.trace = replay ? &trace : nullptr;
  sh.activation = act;
  if (c.backend == "threads") return report(c, launch_threads(c, sh), sh.trace, true);
#if defined(EPMOE_HAVE_MPI)
  // One rank per process (mpirun -np R): every rank gathers every result and returns the same code.
  auto& group = mpi_group;
  const std::vector<double> mine = pack(c.kind == DeviceKind::cuda ? run_rank_gpu(group, sh, group->rank() % gpus)
                                                                    : run_rank(group, sh));
  std::vector<double> all(mine.size() * static_cast<std::size_t>(group->size()));
  group->all_gather(mine.data(), all.data(), mine.size() * sizeof(double), "run.results");
  std::vector<RankResult> results;
  for (int r = 0; r < group->size(); ++r) results.push_back(unpack(all.data() + r * mine.size(), c.iters));
  return report(c, results, sh.trace, group->rank() == 0);
#else
  (void)gpus;
  throw Error(ErrorCode::unsupported, "epmoe: --backend mpi: this epmoe was built without MPI");
#endif
}

int report(const RunConfig& c, const std::vector<RankResult>& results, const RoutingTrace* trace, bool print) {
  const bool replay = trace != nullptr;
  // Per phase: the slowest rank per iteration, median over iterations.
  Phase phases[] = {{"router", {}, 0}, {"dispatch", {}, 0}, {"experts", {}, 0}, {"combine", {}, 0}};
  for (int it = 0; it < c.iters; ++it) {
    double m[4] = {0, 0, 0, 0};
    for (const auto& r : results) {
      m[0] = std::max(m[0], r.router_s[static_cast<std::size_t>(it)]);
      m[1] = std::max(m[1], r.dispatch_s[static_cast<std::size_t>(it)]);
      m[2] = std::max(m[2], r.experts_s[static_cast<std::size_t>(it)]);
      m[3] = std::max(m[3], r.combine_s[static_cast<std::size_t>(it)]);
    }
    for (int p = 0; p < 4; ++p) phases[p].seconds.push_back(m[p]);
  }
  double num = 0, den = 0;
  bool finite = true;
  std::int64_t checked = 0;
  for (const auto& r : results) {
    phases[1].bytes += r.dispatch_bytes;
    phases[3].bytes += r.combine_bytes;
    num += r.err_num;
    den += r.err_den;
    finite = finite && r.finite;
    checked += r.checked;
  }
  // NaN anywhere (an output or the reference) makes the metric NaN, printed as nan, never a quiet 0.
  const double rel = std::isnan(num) || std::isnan(den) ? std::numeric_limits<double>::quiet_NaN()
                     : den > 0                          ? std::sqrt(num / den)
                     : num > 0                          ? std::numeric_limits<double>::infinity()
                                                        : 0.0;
  const bool pass = finite && rel <= c.tolerance && checked > 0;

  if (!print) return pass ? 0 : 1;
  fmt::print("\n{:<10} {:>12} {:>14} {:>12}\n", "phase", "time (ms)", "bytes", "GB/s");
  nlohmann::json jphases = nlohmann::json::array();
  double total = 0;
  for (const auto& p : phases) {
    const double s = median(p.seconds);
    total += s;
    const double gbs = p.bytes > 0 && s > 0 ? p.bytes / s / 1e9 : 0.0;
    fmt::print("{:<10} {:>12.3f} {:>14} {:>12}\n", p.name, s * 1e3, p.bytes > 0 ? fmt::format("{:.0f}", p.bytes) : "-",
               p.bytes > 0 ? fmt::format("{:.2f}", gbs) : "-");
    // A phase that moves no rows (router, experts) has no bytes and no rate: null, as the table's "-".
    const nlohmann::json bytes = p.bytes > 0 ? nlohmann::json(std::llround(p.bytes)) : nlohmann::json(nullptr);
    jphases.push_back({{"phase", p.name}, {"time_ms", s * 1e3}, {"bytes", bytes},
                       {"gb_per_s", p.bytes > 0 ? nlohmann::json(gbs) : nlohmann::json(nullptr)}});
  }
  fmt::print("{:<10} {:>12.3f}\n", "total", total * 1e3);
  fmt::print("time: per phase the slowest rank of each iteration, median of {} (--iters)\n",
             plural(c.iters, "iteration"));
  // The payload as DeepEP counts it (see run_rank): not only what crossed ranks, unlike bench's "remote MB".
  fmt::print("bytes: x rows each rank received (dispatch) or sent back (combine), its own rows included, summed over "
             "ranks; bench's remote MB counts only rows crossing ranks\n");
  fmt::print("\nrelative L2 error vs float64 reference ({} checked over {}): {:.3e} (tolerance {:.0e})\n",
             plural(checked, "token"), plural(static_cast<std::int64_t>(results.size()), "rank"), rel, c.tolerance);
  fmt::print("{}\n", pass ? "PASS" : "FAIL");

  if (!c.json.empty()) {
    nlohmann::json j = {{"command", "run"}, {"version", std::string(version())}, {"backend", c.backend},
                        {"device", c.kind == DeviceKind::cuda ? "cuda" : "cpu"},
                        {"transport", c.kind == DeviceKind::cuda ? "cuda_ipc" : c.backend},
                        {"buffer_config", nlohmann::json::parse(buffer_config_json(c.buffer_options))},
                        {"ranks", c.ranks}, {"tokens_per_rank", c.tokens}, {"hidden", c.hidden},
                        {"num_experts", c.experts}, {"num_topk", c.topk}, {"intermediate", c.intermediate},
                        {"mode", c.mode}, {"dispatch_dtype", c.dispatch_dtype}, {"activation", c.activation},
                        {"experts_impl", c.experts_impl}, {"seed", c.seed}, {"routing", c.routing},
                        {"domain", replay ? trace->domain : ""}, {"layer", c.layer}, {"offset", c.offset},
                        {"iters", c.iters}, {"phases", jphases}, {"relative_l2_error", rel},
                        {"tokens_checked", checked}, {"tolerance", c.tolerance}, {"pass", pass}};
    write_text_file("--json", c.json, j.dump(2) + "\n");
    fmt::print("wrote {}\n", c.json);
  }
  return pass ? 0 : 1;
}

}  // namespace

std::function<int()> add_run_command(CLI::App& app) {
  auto config = std::make_shared<RunConfig>();
  CLI::App* cmd = app.add_subcommand("run", "Run a full expert-parallel MoE layer and check it against the float64 reference");
  auto& c = *config;
  at_least(1, cmd->add_option("--ranks", c.ranks,
                              "expert-parallel ranks (threads backend, on CPU at most OpenBLAS's limit, 65 in the "
                              "usual build; with mpi, mpirun's -np; on GPUs: all of them)"))
      ->capture_default_str();
  cmd->add_option("--backend", c.backend, "threads (ranks are threads of this process) or mpi (one rank per process, under mpirun)")
      ->check(CLI::IsMember({"threads", "mpi"}))->capture_default_str();
  at_least(1, cmd->add_option("-t,--tokens", c.tokens, "tokens per rank"))->capture_default_str();
  at_least(8, cmd->add_option("--hidden", c.hidden, "hidden size H"))->capture_default_str();
  at_least(1, cmd->add_option("-e,--experts", c.experts, "experts E (a multiple of --ranks)"))->capture_default_str();
  // The most any --mode takes (check_job_flags holds it to the mode's and to --experts).
  in_range(1, std::max(kNormalMaxTopk, kLowLatencyMaxTopk),
           cmd->add_option("-k,--topk", c.topk, "experts per token K (random routing)"))
      ->capture_default_str();
  at_least(1, cmd->add_option("--intermediate", c.intermediate, "expert intermediate size N"))->capture_default_str();
  cmd->add_option("--mode", c.mode, "normal or low-latency")->check(CLI::IsMember({"normal", "low-latency"}))->capture_default_str();
  cmd->add_option("--dispatch-dtype", c.dispatch_dtype, "bf16 or fp8")->check(CLI::IsMember({"bf16", "fp8"}))->capture_default_str();
  cmd->add_option("--activation", c.activation, "silu, gelu, swigluoai, silu_no_mul, gelu_no_mul, relu2_no_mul")->capture_default_str();
  cmd->add_option("--experts-impl", c.experts_impl, "auto (cuda on GPUs, blas on CPU), blas, reference (float64) or cuda")
      ->check(CLI::IsMember({"auto", "blas", "reference", "cuda"}))->capture_default_str();
  cmd->add_option("--device", c.device, "auto (all local GPUs when CUDA devices exist, else CPU ranks), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))->capture_default_str();
  cmd->add_option("--config", c.config,
                  "a JSON file of BufferOptions tunables (what `epmoe tune` writes), e.g. containing {\"num_sms\": 16}")
      ->type_name("FILE")
      ->check(non_empty_path());
  cmd->add_option("--seed", c.seed, "seed of weights, activations and random routing")
      ->check(non_negative_integer())
      ->capture_default_str();
  cmd->add_option("--routing", c.routing,
                  "replay recorded routing: a directory or a DOMAIN.topk_idx.npy file; .npy files DOMAIN.topk_idx "
                  "(int16 [tokens, layers, K], ids in [-1, 64)) and DOMAIN.topk_weights (float32, same shape, finite)")
      ->type_name("PATH")
      ->check(non_empty_path());
  cmd->add_option("--domain", c.domain, "domain of --routing when it is a directory (refused with a --routing file: "
                                        "the file's name gives its domain)")
      ->capture_default_str();
  at_least(0, cmd->add_option("--layer", c.layer, "layer of --routing"))->capture_default_str();
  at_least(0, cmd->add_option("--offset", c.offset,
                              "first token of --routing, in [0, the trace's tokens) (rank r takes [offset + r*T, "
                              "offset + (r+1)*T), wrapping)"))
      ->capture_default_str();
  at_least(0, cmd->add_option("--chunk-size", c.chunk_size, "experts run over chunks of this many rows (0: one chunk)"))
      ->capture_default_str();
  cmd->add_flag("--overlap", c.overlap,
                "--mode low-latency: the combine's send overlaps the experts, each block sent once the experts signal "
                "it done (MoELayerOptions::overlap; the experts phase then holds the send, the combine phase the "
                "receive); needs experts that signal: --experts-impl reference or cuda (auto picks them), not blas");
  at_least(1, cmd->add_option("--iters", c.iters, "timed iterations (median reported)"))->capture_default_str();
  at_least(1, cmd->add_option("--check-tokens", c.check_tokens,
                              "tokens per rank checked against the float64 reference (all of them when fewer)"))
      ->capture_default_str();
  cmd->add_option("--tolerance", c.tolerance, "relative L2 error allowed (semantics §13)")
      ->each([&c](const std::string& v) { c.tolerance_text = v; })
      ->capture_default_str();
  cmd->add_option("--json", c.json, "also write the results as JSON to this file")
      ->type_name("PATH")
      ->check(non_empty_path());
  cmd->add_flag("--eplb", c.eplb,
                "EPLB report of --routing instead of a layer run: every layer planned on the first half of the tokens "
                "(rebalance_experts), max/mean choices per rank of both halves before and after (semantics §9)");
  at_least(0, cmd->add_option("--redundant-experts", c.redundant_experts,
                              "spare physical expert slots of the --eplb plan, a multiple of --ranks (default: experts "
                              "/ 4 rounded up to a multiple of --ranks)"));
  return [config, cmd] {
    config->redundant_given = cmd->count("--redundant-experts") > 0;
    config->topk_given = cmd->count("--topk") > 0;
    for (const char* flag : {"--domain", "--layer", "--offset"})
      if (cmd->count(flag) > 0) config->replay_flags_given += (config->replay_flags_given.empty() ? "" : ", ") + std::string(flag);
    for (const char* flag : {"--tokens", "--hidden", "--intermediate", "--dispatch-dtype", "--activation", "--experts-impl",
                             "--device", "--config", "--seed", "--chunk-size", "--iters", "--check-tokens", "--tolerance"})
      if (cmd->count(flag) > 0) config->layer_flags_given += (config->layer_flags_given.empty() ? "" : ", ") + std::string(flag);
    config->domain_given = cmd->count("--domain") > 0;
    config->ranks_given = cmd->count("--ranks") > 0;
    return run(*config);
  };
}

}  // namespace epmoe::cli
