// Experts: the [Permute-Experts-Unpermute] stage (semantics §7), on CPU.
//
// Each local expert e is a two-layer MLP:
//   y = w2[e] @ act(w1[e] @ x)        x: [H], w1[e]: [2N, H] (gated) or [N, H] (non-gated), w2[e]: [H, N]
// Two input ("activation") formats, as vLLM's modular fused-MoE kernel names them:
//   Standard:       hidden [M, H] with topk_idx / topk_weights [M, K]; each token visits its K experts.
//   BatchedExperts: hidden [E_local, max_tokens, H] with a token count per local expert (masked_m);
//                   rows i < count[e] of slab e go through expert e; no router weights.
// Two implementations share one interface and one argument check:
//   make_reference_experts(): float64 arithmetic throughout (inputs converted exactly, intermediates kept
//     in double, one bf16 rounding of the output). This is what correctness is measured against.
//   make_blas_experts(): the fast path. Tokens are grouped per expert (gather, cblas_sgemm per GEMM
//     per expert, scatter); bf16 inputs/weights are widened to float32 tiles, the GEMMs accumulate in
//     float32, and -- like vLLM's fused kernels, whose intermediate caches are bf16 -- both the first
//     GEMM's output and the activation output are rounded to bf16. That rounding is why the fast and
//     GPU paths agree with the reference only to semantics §13's relative L2 1e-2 (typically ~1e-3).
#pragma once

#include <epmoe/tensor.hpp>

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

namespace epmoe {

/// Expert activation function (vLLM's names). Gated ones read a gate value g and an up value u per
/// intermediate channel from w1 [E_local, 2N, H]; the `*_no_mul` ones read one value x from
/// w1 [E_local, N, H].
///   silu          silu(g) * u,                  silu(x) = x / (1 + exp(-x))
///   gelu          gelu(g) * u,                  gelu(x) = x/2 * (1 + erf(x / sqrt(2)))   (exact erf form)
///   swigluoai     gpt-oss: g = min(g, 7), u = clamp(u, -7, 7), (u + 1) * g * sigmoid(1.702 * g);
///                 here w1's rows interleave: gate of channel j at row 2j, up at row 2j + 1
///   silu_no_mul   silu(x)
///   gelu_no_mul   gelu(x)
///   relu2_no_mul  relu(x)^2
/// For silu and gelu, gate rows are [0, N) and up rows [N, 2N).
enum class Activation : std::uint8_t { silu, gelu, swigluoai, silu_no_mul, gelu_no_mul, relu2_no_mul };

/// vLLM's name: "silu", "gelu", "swigluoai", "silu_no_mul", "gelu_no_mul", "relu2_no_mul".
std::string_view activation_name(Activation activation);
/// Inverse of activation_name (exact, lower case). Errors: invalid_argument naming 'activation' and
/// listing the accepted names.
Activation parse_activation(std::string_view name);
/// True for silu, gelu, swigluoai (w1 holds 2N rows per expert).
bool is_gated(Activation activation);
/// The scalar definition above, in double: for gated activations `gate` and `up`; for non-gated ones
/// only `gate` (the single input x) is used. The reference experts evaluate exactly this.
double activation_value(Activation activation, double gate, double up = 0.0);

/// Layout of the hidden states the experts read and write (vLLM's FusedMoEActivationFormat).
enum class ActivationFormat : std::uint8_t {
  standard,         ///< [M, H] tokens with topk_idx / topk_weights [M, K]
  batched_experts,  ///< [E_local, max_tokens, H] with expert_num_tokens int32 [E_local]
};
/// "standard" or "batched_experts".
std::string_view activation_format_name(ActivationFormat format);

/// Who applies the router weights and sums over the K experts of a token after the experts ran
/// (vLLM's TopKWeightAndReduce). An Experts object announces one; the finalize step honours it.
enum class WeightAndReduce : std::uint8_t {
  /// TopKWeightAndReduceNoOP: the experts' output is already weighted and reduced: [M, H] with
  /// out[m] = sum_k topk_weights[m, k] * y[m, k] (weights skipped with apply_router_weight_on_input).
  /// Finalize copies it as is.
  none,
  /// TopKWeightAndReduceContiguous: the experts' output is [M, K, H], unweighted, one row per
  /// (token, k) slot (a slot whose expert is -1 or not local holds zeros). Finalize computes
  /// out[m] = sum_k topk_weights[m, k] * fused[m, k] (plain sum with apply_router_weight_on_input).
  contiguous,
  /// TopKWeightAndReduceNaiveBatched(rank): the experts' output is batched [E_local, max_tokens, H]
  /// where slot i of local expert e holds the i-th token, in token order, whose topk_idx row contains
  /// the global expert id rank * E_local + e. Finalize zeroes out[M, H] and, for each local expert and
  /// each such token m (choice k), adds topk_weights[m, k] * fused[e, i] (no weight with
  /// apply_router_weight_on_input).
  naive_batched,
  /// TopKWeightAndReduceDelegate: the experts leave the choice to finalize, which uses its own
  /// default (e.g. Contiguous after a normal-mode dispatch; the low-latency combine applies the
  /// weights itself).
  delegate,
};
/// "none", "contiguous", "naive_batched" or "delegate".
std::string_view weight_and_reduce_name(WeightAndReduce w);

/// Number formats of the expert weights and of the activations the GEMMs read.
enum class ExpertsQuant : std::uint8_t {
  /// bf16 weights; bf16 (or float32) activations (the default).
  none,
  /// DeepSeek-V3's fp8 format (the DeepSeek-V3 checkpoints' "weight_block_size": [128, 128]; vLLM's
  /// block-quantized fused MoE, DeepGEMM's m-grouped fp8 GEMMs):
  ///   w1 float8_e4m3fn [E_local, 2N or N, H] with float32 w1_scales [E_local, ceil(rows / 128), ceil(H / 128)],
  ///   w2 float8_e4m3fn [E_local, H, N] with float32 w2_scales [E_local, ceil(H / 128), ceil(N / 128)]:
  ///   weight value = fp8 value * the scale of its 128x128 block (edge blocks may be partial);
  ///   activations float8_e4m3fn with one float32 scale per token and group of 128 hidden channels (semantics §6,
  ///   quant.hpp): either given (hidden fp8 + hidden_scales, as a normal-mode fp8 dispatch delivers them) or
  ///   quantized by the experts from bf16/float32 hidden (semantics §6 in float32, after the router weight with
  ///   apply_router_weight_on_input); the activation output is quantized the same way (1 x 128 groups of
  ///   the N channels) before the second GEMM, as vLLM and DeepGEMM do. Output bfloat16.
  ///   H % 16 == 0 and N % 16 == 0 (semantics §1's fp8 rows). Through MoELayer: MoEForwardArgs::w1_scale, w2_scale.
  fp8_block,
};
/// "none" or "fp8_block".
std::string_view experts_quant_name(ExpertsQuant q);

/// How an Experts object is set up.
struct ExpertsConfig {
  ActivationFormat format = ActivationFormat::standard;
  /// Standard format only: true -> output [M, H], weighted and summed over k (WeightAndReduce::none);
  /// false -> output [M, K, H], unweighted per (token, k) (WeightAndReduce::contiguous).
  /// Ignored for batched_experts, whose output is always per slot (WeightAndReduce::delegate).
  bool reduce = true;
  /// Weight/activation number format (make_reference_experts and make_cuda_experts support fp8_block; the
  /// BLAS experts take bf16 weights only).
  ExpertsQuant quant = ExpertsQuant::none;
};

/// Where batched experts report their progress to an overlapped low-latency combine (buffer.hpp,
/// LowLatencyCombineArgs::overlap; docs/semantics.md "Overlapped low-latency combine"). The experts only add to it
/// (release order after the output rows it covers); the caller zeroes it before each forward.
struct ExpertsCombineSignal {
  /// int32 [>= E_local * ceil(max_tokens / block_m)], expert-major (the combine's comp_signal): for each block b of
  /// block_m rows of expert e holding counted rows, 1 is added to entry e * ceil(max_tokens / block_m) + b after
  /// each N-tile (block_n columns of H) of the block's output rows is stored, as DeepGEMM's down GEMM does, so a
  /// block is done at ceil(H / block_n) adds (the combine's threshold). Blocks without counted rows are not written.
  /// Or uint32 [E_local] (the combine's src_signals): 1 is added to entry e once every row of expert e is stored,
  /// for every expert (empty ones too), so each reaches 1 (the combine's src_signal_expect_value).
  TensorView signal;
  int block_m = 0;  ///< int32 form: rows per block, >= 1 (0 with uint32)
  int block_n = 0;  ///< int32 form: columns per N-tile, >= 1 (0 with uint32)
};

/// Arguments of one Experts::apply call (vLLM's FusedMoEPermuteExpertsUnpermute.apply). All tensors
/// are on the CPU (on one GPU for make_cuda_experts), row-major and contiguous, and are only read.
struct ExpertsInputs {
  /// Standard: [M, H]; batched_experts: [E_local, max_tokens, H]. bfloat16 or float32 (e.g. the
  /// dequantized fp8 activations), read exactly.
  TensorView hidden;
  /// bfloat16 [E_local, 2N, H] for gated activations, [E_local, N, H] for *_no_mul ones.
  TensorView w1;
  /// bfloat16 [E_local, H, N]. N is taken from here.
  TensorView w2;
  /// Standard: float32 [M, K]. Not read in batched_experts format.
  TensorView topk_weights;
  /// Standard: int64 or int32 [M, K]. Without an expert_map: local expert ids in [-1, E_local); with
  /// one: global ids in [-1, E), mapped through it. -1 = no expert. Not read in batched_experts.
  TensorView topk_idx;
  Activation activation = Activation::silu;
  /// E, only used with an expert_map (which must then have E entries); -1: take E from expert_map.
  std::int64_t global_num_experts = -1;
  /// Optional int32 [E]: global id -> local id in [0, E_local), or -1 when the expert is not local.
  /// Standard format only (batched slabs are already local).
  TensorView expert_map;
  /// batched_experts: int32 [E_local], 0 <= count <= max_tokens (vLLM's expert_num_tokens).
  TensorView expert_num_tokens;
  /// ExpertsQuant::fp8_block only. hidden_scales: float32 [M, ceil(H/128)] (standard) or
  /// [E_local, max_tokens, ceil(H/128)] (batched) when hidden is float8_e4m3fn, else None.
  /// w1_scales / w2_scales: float32 per-128x128-block scales of w1 / w2 (shapes at ExpertsQuant::fp8_block).
  TensorView hidden_scales;
  TensorView w1_scales;
  TensorView w2_scales;
  /// Standard format with K == 1 only: hidden[m] is multiplied by topk_weights[m, 0] before the MLP
  /// and the output is not weighted again. K > 1, or the batched_experts format (which has no router
  /// weights: its producer applies them), is an error.
  bool apply_router_weight_on_input = false;
  /// batched_experts only, optional: the combine signal to write as the rows are done (make_reference_experts and
  /// make_cuda_experts with ExpertsQuant::none; other experts raise unsupported when it is set). On the tensors'
  /// device. Errors: invalid_argument naming 'combine_signal' (dtype, shape, stride, device, standard format) or
  /// 'block_m' / 'block_n' (< 1 with int32, set with uint32).
  ExpertsCombineSignal combine_signal;
};

struct ExpertsProblem;  // the checked form of ExpertsInputs (src/experts/problem.hpp)

/// Expert MLPs behind one interface (vLLM's FusedMoEPermuteExpertsUnpermute). Objects hold no
/// per-call state: apply() may be called concurrently from several threads (e.g. CPU ranks).
class Experts {
 public:
  explicit Experts(const ExpertsConfig& config) : config_(config) {}
  virtual ~Experts() = default;
  Experts(const Experts&) = delete;
  Experts& operator=(const Experts&) = delete;

  /// "reference", "blas" or "cuda".
  virtual std::string_view name() const = 0;
  const ExpertsConfig& config() const { return config_; }
  /// Input format = output format.
  ActivationFormat activation_format() const { return config_.format; }
  /// What finalize must do with the output: none (standard, reduce), contiguous (standard, no reduce)
  /// or delegate (batched_experts).
  WeightAndReduce weight_and_reduce() const;
  /// Whether ExpertsInputs::expert_map is accepted (standard format only).
  bool supports_expert_map() const { return config_.format == ActivationFormat::standard; }
  /// Whether ExpertsInputs::combine_signal is written (else setting it raises unsupported).
  virtual bool writes_combine_signal() const { return false; }

  /// Checks `in` and returns the output shape: [M, H] (standard, reduce), [M, K, H] (standard, no
  /// reduce) or [E_local, max_tokens, H] (batched_experts).
  /// Errors (invalid_argument, naming the argument, the expected and the actual value): a tensor not
  /// on the CPU or not contiguous; wrong dtype (hidden bf16/fp32, w1/w2 bf16, topk_weights fp32,
  /// topk_idx int32/int64, expert_map/expert_num_tokens int32); wrong rank or mismatched sizes
  /// between hidden, w1, w2, topk_*, expert_map, expert_num_tokens; N or H zero; an id outside
  /// [-1, E_local) (or [-1, E) with an expert_map); a map entry outside [-1, E_local); a count outside
  /// [0, max_tokens]; global_num_experts that disagrees with expert_map; expert_map in batched
  /// format; apply_router_weight_on_input with K != 1 or in batched format.
  /// (Virtual so that the CUDA experts, whose tensors live on a GPU, can check them without reading them.)
  virtual Shape output_shape(const ExpertsInputs& in) const;

  /// Runs the experts into `out` (bfloat16, contiguous, shape output_shape(in); must not overlap the
  /// inputs). Standard: every element of `out` is written (zero rows for tokens without a local
  /// expert; zero slots for -1 in unreduced output). batched_experts: only rows i < count[e] of slab
  /// e are written; the rest of `out` is left untouched. M == 0 (or all counts 0) does no work.
  /// Errors: as output_shape, plus `out` of the wrong dtype/shape/device/layout (argument 'out').
  virtual void apply(const ExpertsInputs& in, const TensorView& out) const;

  /// As apply(in, out), into a new bfloat16 tensor; in batched_experts format the rows past each
  /// count are zero.
  virtual Tensor apply(const ExpertsInputs& in) const;

 protected:
  /// Computes a checked, non-empty problem into a checked `out`.
  virtual void run(const ExpertsProblem& problem, const TensorView& out) const = 0;

 private:
  ExpertsConfig config_;
};

/// The float64 reference: per (token, k) slot, g = w1[e] @ x, a = act(g), y = w2[e] @ a, all in
/// double (bf16/fp32 inputs convert exactly); the weighted sum over k in double; one round to bf16.
/// With ExpertsQuant::fp8_block (src/experts/reference_fp8.cpp): weights dequantized exactly in double (fp8
/// value * block scale), the input as the GEMMs see it (fp8 hidden dequantized per group; bf16/fp32 hidden
/// quantized by semantics §6 in float32 first), and act(g), rounded to float32, quantized by semantics §6 before w2.
std::unique_ptr<Experts> make_reference_experts(const ExpertsConfig& config = {});

/// The fast CPU path on OpenBLAS: per local expert, gather its tokens (up to 512 rows at a time) into
/// a float32 tile; per layer, widen the bf16 weights to float32 about 1 MiB of rows at a time, each
/// tile followed by the cblas_sgemm that reads it while it is in cache (float32 accumulation); round
/// the first GEMM's output and the activation output to bf16 as vLLM's kernels do; then scatter: the
/// weighted sum over k accumulated in float32, one round to bf16. With apply_router_weight_on_input
/// the scaled input is rounded to the input dtype first (as vLLM's prepare step stores it).
/// OpenBLAS threads each GEMM (OPENBLAS_NUM_THREADS); the rest runs on the calling thread.
std::unique_ptr<Experts> make_blas_experts(const ExpertsConfig& config = {});

/// The most threads that may be inside make_blas_experts' apply at the same time (thread ranks, say).
/// OpenBLAS keeps a build-time table of max(50, 2 x NUM_THREADS) work buffers (its memory.c), one per
/// GEMM in flight plus one per pool thread (up to NUM_THREADS - 1); past it, it prints "precompiled
/// NUM_THREADS exceeded" and falls back to a path that crashes under concurrency. So this returns
/// max(50, 2 x NUM_THREADS) - (NUM_THREADS - 1), NUM_THREADS read from openblas_get_config()'s
/// MAX_THREADS (65 for the usual NUM_THREADS = 64; 32 when the build does not say).
int blas_experts_max_concurrent_threads();

/// The reference experts' result before its final bf16 rounding: float64 values in the layout of
/// Experts::output_shape (row-major). Batched format: rows past each count are 0. Checks `in` as
/// Experts::apply does. For tests and for error measurements against the unrounded reference.
std::vector<double> reference_experts_f64(const ExpertsInputs& in, const ExpertsConfig& config = {});

/// The experts on one GPU (src/experts/cuda.cpp): every tensor of ExpertsInputs and `out` on
/// the same CUDA device; work is enqueued on the calling thread's current stream (stream.hpp).
/// Per local expert: gemm1 on cuBLAS (bf16 in, float32 accumulation, bf16 out), one fused activation
/// kernel, gemm2 on cuBLAS (bf16 out) -- the CPU fast path's roundings. Float32 hidden is rounded to
/// bf16 first (and, with apply_router_weight_on_input, the scaled input too).
///   Standard: the (token, k) slots are grouped per local expert with make_permute_layout/permute
///     (permute.hpp), per-expert GEMMs (a loop of cublasGemmEx, or one cublasGemmGroupedBatchedEx when the
///     non-empty experts average <= 64 rows: faster for decode, slower for prefill on an H200; the
///     environment variable EPMOE_CUDA_EXPERTS_GEMM=loop|grouped|streams|auto overrides), then unpermute
///     (weighted sum over k ascending in float32, one bf16 rounding) or, unreduced, a copy of each slot's
///     row. The float64-reference error is ~3e-3 (relative L2). cuBLAS takes each expert's
///     row count from the host, so apply() waits once for the stream (after the layout) and checks the
///     ids then (invalid_argument as on the CPU); not capturable in a CUDA graph.
///   BatchedExperts: strided-batched GEMMs over all max_tokens rows of every slab, the activation and
///     the final copy masked by expert_num_tokens read on the device: no host synchronisation, so it
///     can be captured in a CUDA graph (call apply once on the thread before capturing: that creates
///     the cuBLAS handle). Counts outside [0, max_tokens] are clamped there (they cannot be checked
///     without a synchronisation). Rows past each count are left untouched.
/// ExpertsQuant::fp8_block (src/experts/cuda_fp8.cpp): DeepSeek-V3's format on cuBLASLt's
///   block-scaled fp8 GEMMs (cuBLAS >= 12.9 on Hopper; weights as A with 128x128 float32 block scales,
///   activations as B with 1x128 float32 group scales, float32 accumulation, no fast accumulation). Per layer
///   one GEMM per non-empty local expert; gemm1 writes float32, one kernel applies the activation and
///   quantizes the result per 1x128 group (semantics §6), gemm2 writes bf16. A bf16/fp32 hidden is quantized first
///   (semantics §6, with the router weight folded in for apply_router_weight_on_input). Standard: as above, with
///   one synchronisation (expert row counts; segments padded to 4 rows); BatchedExperts: no synchronisation,
///   every slab's rows (rounded up to 4) through the GEMMs, CUDA-graph capturable. H or N not a multiple of 128:
///   should cuBLASLt have no kernel for the partial last block, operands are copied zero-padded (slower). The
///   GEMMs of a layer go to 4 forked streams when experts average <= 256 rows (EPMOE_CUDA_EXPERTS_FP8_STREAMS=
///   auto|1..4 overrides). Measured against
///   reference_experts_f64 with the same config (which models the same quantizations), semantics §13's relative
///   L2 <= 1e-2. Errors as above, plus the fp8 argument errors of ExpertsQuant::fp8_block (naming
///   w1_scales, w2_scales, hidden_scales, ...) and unsupported when cuBLASLt offers no such GEMM.
/// Restrictions on CUDA: H % 8 == 0 and N % 8 == 0 (16-byte rows; fp8: % 16), 16-byte-aligned data pointers.
/// Errors: as Experts::apply, with "a CUDA tensor on the weights' device" for the device; unsupported in
/// builds without CUDA (make_cuda_experts itself raises then).
std::unique_ptr<Experts> make_cuda_experts(const ExpertsConfig& config = {});

}  // namespace epmoe
