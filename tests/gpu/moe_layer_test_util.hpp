// What the MoE layer tests on GPU ranks share: tests/gpu/moe_layer_{normal,low_latency}_gpu_test.cpp (thread ranks,
// rank r on cuda:r) and tests/mpi/cuda_ipc_moe_layer_mpi_test.cpp (one process per GPU; test_mpi builds this with
// gpu_util.cpp when CUDA is enabled). The seeded expert weights and per-rank inputs, the values the experts see
// after the wire, the forward's and prepare's arguments, one forward with its checks, and the check of a case's
// outputs against the float64 reference and the CPU ranks'.
#pragma once

#include <epmoe/moe.hpp>
#include <epmoe/tensor.hpp>

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace epmoe::gputest {

inline constexpr double kLayerTolerance = 1e-2;  // semantics §13: relative L2 of a layer's output

/// What the normal and the low-latency layer tests' cases share; each test's Case adds its own fields and name().
struct LayerCase {
  std::vector<std::int64_t> T = {24, 9};  // per rank, repeated over the ranks (tokens_of)
  std::int64_t H = 2048, N = 128;
  int K = 8;
  bool fp8 = false, ue8m0 = false, weight_on_input = false, int32_idx = false;
  bool nvfp4 = false;               ///< an nvfp4 wire (low-latency only) with this global scale
  float nvfp4_global_scale = 200.0f;
  double p_minus_one = 0.1;
  int forwards = 2;
  /// The wire: bf16, fp8 with float32 scales or (ue8m0) rounded UE8M0 ones, or nvfp4.
  PrepareFinalizeOptions options() const;
  /// Rank r's token count: the per-rank counts repeat over the ranks.
  std::int64_t tokens_of(int r) const;
  /// Makes this K = 1 with the router weight on the input and int32 ids.
  void set_k_one_weight_on_input_int32_ids();
};

/// All E experts' weights on the host (gated silu): w1 bf16 [E, 2N, H], w2 bf16 [E, H, N], each scaled by
/// 1/sqrt(its fan-in), drawn from rng in that order.
struct ExpertWeights {
  Tensor w1, w2;
};
ExpertWeights make_expert_weights(std::mt19937_64& rng, std::int64_t E, std::int64_t H, std::int64_t N);
/// Rank r's El experts of m ([r * El, (r + 1) * El)): copies on cuda:r (gpu), else views of m's host tensors.
ExpertWeights rank_weights(const ExpertWeights& m, int r, int El, bool gpu);

/// One forward's host inputs: x bf16 [T, H], idx int64 [T, K] (global ids, some -1), w float32 [T, K].
struct CallIn {
  Tensor x, idx, w;
};
using Ins = std::vector<std::vector<CallIn>>;  // [rank][forward]
/// c.forwards calls for each of R ranks (c.tokens_of(r) tokens, ids among E experts), drawn from rng rank by rank.
Ins make_inputs(std::mt19937_64& rng, const LayerCase& c, int R, int E);
/// An int32 copy of int64 ids when `int32`, else idx64 itself.
Tensor ids_as(const Tensor& idx64, bool int32);
/// The values the experts see after the wire (bf16 [T, H]; the CPU quantizer is bit-identical to the CUDA one),
/// with the router weight on the input applied first as prepare does (x * w rounded to bf16).
Tensor seen_by_experts(const LayerCase& c, const CallIn& ci);

/// A call's inputs where a rank runs it: copies on cuda:r (gpu), else ci's host tensors.
CallIn put_call(const CallIn& ci, int r, bool gpu);
/// MoELayer::forward's arguments (the others left at their defaults).
MoEForwardArgs forward_args(const TensorView& hidden, const TensorView& w1, const TensorView& w2,
                            const TensorView& topk_idx, const TensorView& topk_weights, int global_num_experts);
/// PrepareFinalize::dispatch_a's inputs (the others left at their defaults).
PrepareInputs prepare_inputs(const TensorView& hidden, const TensorView& topk_idx, const TensorView& topk_weights,
                             int global_num_experts);

/// One forward of `ci` through `layer` on thread rank r with the rank's weights `w` (rank_weights): on GPU ranks
/// the inputs are copied to cuda:r; the ids go as int32 when the case asks, the router weight on the input when it
/// does; with give_output the result goes into a given [T, H] output poisoned with 0xff bytes first, else into one
/// the layer allocates. Expects the output's shape and device and, when given, that it was written into (failures
/// name `name` and the rank). `adjust`, when given, edits the forward's arguments last (e.g. the batch kind of an
/// automatic-mode layer). Returns a host copy of the output.
Tensor forward_checked(MoELayer& layer, const LayerCase& c, const std::string& name, const CallIn& ci,
                       const ExpertWeights& w, int global_num_experts, int r, bool gpu, bool give_output,
                       const std::function<void(MoEForwardArgs&)>& adjust = {});

using Outs = std::vector<std::vector<Tensor>>;  // [rank][forward] host bf16 [T, H]
/// Runs a case's forwards with weights m and inputs `in` on R thread ranks: GPU ranks (gpu) or CPU ranks.
using RunLayer = std::function<Outs(const ExpertWeights& m, const Ins& in, int R, bool gpu)>;
/// One case of a layer test on R = thread_ranks() ranks (skipped without a GPU) with experts(R) experts: draws
/// their weights then every rank's inputs from `seed`, runs them on the GPU ranks then the CPU ranks, and expects
/// every forward's output (GPU and CPU) within kLayerTolerance of the float64 reference of the values the experts
/// saw, and the GPU's within it of the CPU ranks'. Failures name `name`, the rank, the forward and the seed; each
/// GPU relative L2 is logged (log_width: the width of the name column).
void check_layer_case(const LayerCase& c, const std::string& name, std::uint64_t seed,
                      const std::function<int(int R)>& experts, const RunLayer& run, int log_width);
/// A good forward (args, of ci with all of m's experts on one rank) after refused ones: expects its output within
/// kLayerTolerance of the float64 reference; logs the relative L2 as `what`.
void expect_forward_matches_float64(MoELayer& layer, const MoEForwardArgs& args, const CallIn& ci,
                                    const ExpertWeights& m, std::uint64_t seed, const std::string& what,
                                    int log_width);

/// ||got - want|| / ||want|| over got's elements, both bf16 (want at least as many): NaN when either holds a NaN,
/// infinite when want is zero and got is not, 0 when both are.
double bf16_relative_l2(const Tensor& got, const Tensor& want);
/// Prints "[ rel_l2   ] <what> <err>" with `what` left-aligned in `width` columns.
void log_relative_l2(const std::string& what, double err, int width);

}  // namespace epmoe::gputest
