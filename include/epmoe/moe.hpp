// The modular MoE layer (semantics §8): [Router] -> [Quantize-Dispatch] -> [Permute-Experts-Unpermute]
// -> [Combine], with any prepare/finalize (communication) paired with any experts of the same
// activation format (vLLM's FusedMoEModularKernel; SGLang's two-phase token dispatcher).
#pragma once

#include <epmoe/buffer.hpp>
#include <epmoe/eplb.hpp>
#include <epmoe/experts.hpp>
#include <epmoe/stream.hpp>
#include <epmoe/tensor.hpp>

#include <exception>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>

namespace epmoe {

class ExpertLoadRecorder;  // eplb.hpp (MoELayer::set_load_recorder)

/// Element type of the dispatched activations. nvfp4 (low-latency mode only; nvfp4.hpp): e2m1 with an e4m3 scale per
/// 16 channels and PrepareFinalizeOptions::nvfp4_global_scale.
enum class DispatchDtype : std::uint8_t { bf16, fp8, nvfp4 };

/// What the layer hands to prepare (the token side, one rank).
struct PrepareInputs {
  TensorView hidden;        ///< bfloat16 [T, H]
  TensorView topk_idx;      ///< int64/int32 [T, K], global expert ids or -1
  TensorView topk_weights;  ///< float32 [T, K]
  int global_num_experts = 0;
  /// K == 1 only: the token is scaled by its weight before dispatch and combine applies no weight.
  bool apply_router_weight_on_input = false;
  /// Optional bfloat16 [T, H], contiguous, on hidden's device: where combine_b writes its result on CUDA (the
  /// no-EP and low-latency prepare/finalize write straight into it, so a CUDA graph can own the output buffer;
  /// the normal one copies the combine's result into it on the current stream). The CPU implementations ignore
  /// it (MoELayer::forward copies their result there).
  TensorView output;
};

/// What prepare hands to the experts (the expert side). Activations arrive dequantized to bfloat16
/// when the dispatch was fp8, so every Experts implementation reads the values the wire carried.
struct PrepareOutput {
  ActivationFormat format = ActivationFormat::standard;
  Tensor hidden;             ///< standard [M, H]; batched_experts [E_local, max_tokens, H]; bfloat16
  Tensor topk_idx;           ///< standard: int64 [M, K], local ids or -1
  Tensor topk_weights;       ///< standard: float32 [M, K]
  Tensor expert_num_tokens;  ///< int32 [E_local]: tokens per local expert (batched: masked_m)
};

/// The stages of a two-phase dispatch/combine (SGLang's): INITIAL -> AFTER_DISPATCH_A ->
/// AFTER_DISPATCH_B -> AFTER_COMBINE_A -> INITIAL. A call out of order throws
/// ErrorCode::stale_handle naming the stage found and the one expected.
enum class Stage : std::uint8_t { initial, after_dispatch_a, after_dispatch_b, after_combine_a };
std::string_view stage_name(Stage s);

/// Quantize + dispatch and combine, behind one interface (vLLM's FusedMoEPrepareAndFinalize).
/// Public calls check the stage machine and run the hooks; implementations override the do_* steps.
class PrepareFinalize {
 public:
  virtual ~PrepareFinalize() = default;
  /// "no_ep", "normal", "low_latency", ...
  virtual std::string_view name() const = 0;
  virtual ActivationFormat activation_format() const = 0;
  /// What finalize does when the experts announce WeightAndReduce::delegate.
  virtual WeightAndReduce delegate_weight_and_reduce() const = 0;
  /// Local experts of this rank (E / R).
  virtual int num_local_experts(int global_num_experts) const = 0;
  /// This rank's index among the ranks that hold experts (0 without expert parallelism): its local experts are
  /// [ep_rank * E_local, (ep_rank + 1) * E_local). Fixes the expert_map a forward with expert parallelism implies,
  /// and places the received counts in an ExpertLoadRecorder's [E] record.
  virtual int ep_rank() const { return 0; }

  /// Sends (quantize + the send half of the dispatch). Stage INITIAL -> AFTER_DISPATCH_A.
  void dispatch_a(const PrepareInputs& in);
  /// Receives. Stage AFTER_DISPATCH_A -> AFTER_DISPATCH_B.
  PrepareOutput dispatch_b();
  /// Applies `weight_and_reduce` to the experts' output and sends it back.
  /// Stage AFTER_DISPATCH_B -> AFTER_COMBINE_A.
  void combine_a(const TensorView& fused_expert_output, WeightAndReduce weight_and_reduce);
  /// Receives the combined [T, H] bfloat16 result. Stage AFTER_COMBINE_A -> INITIAL.
  Tensor combine_b();
  Stage stage() const { return stage_; }
  /// The overlap fields (LowLatencyCombineArgs::overlap, its signal arguments and send_stamps; the other fields are
  /// ignored) the next combine_a passes to its low-latency combine, for that call only. Ignored by the
  /// prepare/finalize implementations without a low-latency combine (the default).
  virtual void set_next_combine_overlap(const LowLatencyCombineArgs& overlap_fields) {}

  /// Hooks around the phases, e.g. to record events or overlap work (called on the calling thread).
  std::function<void()> before_dispatch, after_dispatch, before_combine, after_combine;

 protected:
  virtual void do_dispatch_a(const PrepareInputs& in) = 0;
  virtual PrepareOutput do_dispatch_b() = 0;
  virtual void do_combine_a(const TensorView& fused_expert_output, WeightAndReduce weight_and_reduce) = 0;
  virtual Tensor do_combine_b() = 0;

 private:
  void expect(Stage s, std::string_view call) const;
  Stage stage_ = Stage::initial;
};

/// Settings shared by the prepare/finalize implementations.
struct PrepareFinalizeOptions {
  DispatchDtype dispatch_dtype = DispatchDtype::bf16;
  bool round_scale = false;  ///< fp8 scales rounded up to powers of two
  bool use_ue8m0 = false;    ///< UE8M0 scales on the wire (needs round_scale)
  /// dispatch_dtype nvfp4: the global scale x_global_scale of the low-latency dispatch (finite, > 0; the producers'
  /// 448 * 6 / amax, e.g. a checkpoint's 1 / input_scale). The experts see the dequantized rows (Hopper has no fp4 GEMM).
  float nvfp4_global_scale = 0.0f;
};

/// One rank, no expert parallelism: prepare only (optionally) quantizes; finalize reduces.
std::shared_ptr<PrepareFinalize> make_no_ep_prepare_finalize(const PrepareFinalizeOptions& options = {});
/// Normal mode over `buffer` (standard format: one row per (token, rank); combine after a
/// contiguous weight-and-reduce of each row's local experts; the experts' input topk_idx holds local ids or -1).
/// CPU tensors: every step on the host, over a threads or MPI buffer; topk_idx and topk_weights must be on the
/// CPU too (invalid_argument naming them, before any communication).
/// CUDA tensors (hidden, topk_idx, topk_weights and the optional output on one GPU; `buffer` a cuda_ipc Buffer
/// with num_nvl_bytes > 0 on that GPU): everything runs on the GPU, enqueued on the calling thread's current
/// stream -- the router weight on the input (K == 1), get_dispatch_layout, the optional fp8 quantization, the
/// cuda_ipc normal dispatch (the whole dispatch runs in dispatch_a; it waits on the host for the receive counts,
/// the one synchronisation), the dequantization to bfloat16 (dispatch_b), the weight-and-reduce (CUDA twin of the
/// CPU's, same bits) and the combine (combine_a). The received rows the experts see are bit-identical to a CPU
/// run's on the same inputs. Pairs with make_cuda_experts in the standard format (reduce or not). The experts'
/// input (PrepareOutput) holds the dispatch's outputs, valid until combine_b; expert_num_tokens stays on the
/// device. Not capturable in a CUDA graph (the host read). Errors before any communication, stage left INITIAL:
/// the token side as check_cuda_prepare_inputs (hidden contiguous bfloat16 [T, H], H % 8 == 0 (fp8: % 16),
/// 16-byte aligned; topk_idx, topk_weights, output on hidden's device), and the buffer's own checks (a tensor
/// on another GPU than the buffer's, named 'x'; K > 32; a low-latency-only buffer).
std::shared_ptr<PrepareFinalize> make_normal_prepare_finalize(std::shared_ptr<Buffer> buffer,
                                                              const PrepareFinalizeOptions& options = {});
/// Low-latency mode over `buffer` (batched_experts format, at most `num_max_dispatch_tokens_per_rank`
/// tokens per rank per call; the combine applies the router weights). The only prepare/finalize taking
/// DispatchDtype::nvfp4 (the others refuse it, naming dispatch_dtype): the rows travel as NVFP4 and are dequantized
/// to bfloat16 in dispatch_b (CPU; on CUDA a kernel over each slab's counted rows). Errors: nvfp4 with a
/// nvfp4_global_scale that is not finite and > 0 (invalid_argument naming it). Calls on CUDA tensors (hidden, topk_idx,
/// topk_weights and the optional output on one GPU; `buffer` a cuda_ipc Buffer on it) run on the buffer's GPU
/// low-latency mode, asynchronous on the current stream, with the CUDA experts (make_cuda_experts); the experts'
/// input and counts are then views of the buffer's receive half, valid until the next forward's dispatch.
std::shared_ptr<PrepareFinalize> make_low_latency_prepare_finalize(std::shared_ptr<Buffer> buffer,
                                                                   int num_max_dispatch_tokens_per_rank,
                                                                   const PrepareFinalizeOptions& options = {});

// ---- all-gather + reduce-scatter baseline (vLLM's naive / allgather_reducescatter all2all backend) ----
/// Expert parallelism over `group` with no Buffer (semantics §8, "the all-gather + reduce-scatter baseline"):
/// dispatch_a all-gathers every rank's tokens (bfloat16, or fp8 data + scales quantized before the gather and
/// dequantized after), topk_idx and topk_weights; the experts of this rank (E_local = E / R, global ids
/// [rank * E_local, (rank + 1) * E_local)) run in the standard format over all M = R * T_max rows, T_max the
/// largest token count of any rank (rows r * T_max + t, t < T_r, are rank r's tokens; rows past T_r are padding:
/// zeros with every id -1); topk_idx holds local ids, -1 for other ranks' experts; topk_weights the gathered
/// weights (all ones with apply_router_weight_on_input, K == 1); expert_num_tokens int32 [E_local]. combine_a
/// weight-and-reduces each row (contiguous) to bfloat16 [M, H], widens it to float32 and reduce-scatters it
/// (Group::reduce_scatter_sum: summed over ranks in rank order 0..R-1 in float32, one bfloat16 rounding), so each
/// rank gets its T rows back. The result equals normal mode's bit for bit on the same inputs and experts (both
/// add the same bfloat16 partials in rank order; the zero partial of a rank without an expert of the token adds
/// exactly). Tokens per rank may differ (T = 0 works); the ranks first all-gather their T and settings (H, K, E,
/// dispatch dtype), a differing one raises rank_mismatch on every rank. R == 1 does no communication and no copy.
/// CUDA tensors (hidden, topk_idx, topk_weights, the optional output on one GPU; CUDA experts): the host-staged
/// baseline -- for R > 1 the token side is copied to the host on the current stream (which is synchronised), the
/// host steps above run there and the experts' input is copied back; the combine copies its reduced rows to the
/// host, reduce-scatters them and copies the result to the device (into PrepareInputs::output when given). At
/// R == 1 everything stays on the device, asynchronous on the current stream (fp8 round trip, counts and invalid
/// ids as the no-EP prepare/finalize: cuda::check_moe_faults). Errors, before any communication (invalid_argument
/// naming the argument, the expected and the actual value): group null; the token side as
/// make_normal_prepare_finalize's (CPU or CUDA); global_num_experts not a multiple of R; an id outside [-1, E)
/// (CPU, and CUDA with R > 1); fp8 with H % 16 != 0; fused_expert_output of the wrong shape or weight_and_reduce
/// other than none/contiguous.
std::shared_ptr<PrepareFinalize> make_all_gather_prepare_finalize(std::shared_ptr<Group> group,
                                                                  const PrepareFinalizeOptions& options = {});

/// Workspaces shared by every layer of a model: one set per micro-batch, grown on demand, so layers
/// run one after another reuse the same memory (vLLM's shared workspace).
class WorkspaceCache {
 public:
  /// A bfloat16/float32 workspace named `name` of micro-batch `micro_batch`, at least `shape` big
  /// (returned as exactly `shape`); contents undefined.
  TensorView get(int micro_batch, std::string_view name, DType dtype, Shape shape);
  /// The same on `device`. On CUDA the memory comes from Tensor::empty(dtype, shape, device) on the calling
  /// thread's current stream; a workspace that must grow while that stream is being captured in a CUDA graph
  /// raises unsupported (run the same shapes once before capturing).
  TensorView get(int micro_batch, std::string_view name, DType dtype, Shape shape, Device device);
  std::size_t bytes() const;

 private:
  std::map<std::tuple<int, std::string>, Tensor> buffers_;
};

struct MoELayerOptions {
  /// Standard format: the experts run over chunks of this many rows (0 = one chunk); each chunk's
  /// workspace and expert counts are its own. (130 rows with 128-row chunks: chunks of 128 and 2.)
  /// Chunking changes the rows per expert GEMM, not the math: with make_reference_experts the output is
  /// bit-identical for every chunk_size; with make_blas_experts OpenBLAS picks its kernel (summation
  /// order) by shape, so some outputs may differ from one chunk in the last bf16 bit (both stay within
  /// semantics §13's tolerance of the float64 reference).
  std::int64_t chunk_size = 0;
  int micro_batch = 0;  ///< which workspace set to use
  std::shared_ptr<WorkspaceCache> workspaces;  ///< shared across layers; made when null
  /// Low-latency forwards: overlap the combine's send with the experts (single-batch overlap; docs/semantics.md
  /// "Overlapped low-latency combine"). The experts write a combine signal (int32, block_m = 64 rows, block_n =
  /// 128 columns: threshold ceil(H / 128)) and the combine sends each block once it is done: on a GPU the combine
  /// is enqueued on a side stream of the layer (its receive on the caller's stream after it), on CPU ranks the
  /// experts run on a side thread while the calling thread combines. Only experts that write signals
  /// (Experts::writes_combine_signal: the reference and CUDA bf16 ones) overlap; others run as without it. The
  /// output is bit-identical either way (the combine's order is fixed; the CUDA experts then run their down GEMM
  /// expert by expert). On a GPU the layer's first overlapped forward runs its experts before the send (CUDA's lazy
  /// module loading would otherwise make the spinning send wait on a kernel not yet loaded); run one forward before
  /// capturing a CUDA graph.
  bool overlap = false;
  /// With overlap on a GPU: the most SMs the combine's send may use (LowLatencyCombineArgs::num_sms; 0 = one
  /// block per local expert), the rest staying with the GEMMs.
  int overlap_num_sms = 0;
};

/// Arguments of MoELayer::forward (vLLM's FusedMoEModularKernel.forward).
struct MoEForwardArgs {
  TensorView hidden;        ///< bfloat16 [T, H]
  TensorView w1;            ///< bfloat16 [E_local, 2N, H] (gated) or [E_local, N, H]
  TensorView w2;            ///< bfloat16 [E_local, H, N]
  TensorView topk_weights;  ///< float32 [T, K]
  TensorView topk_idx;      ///< int64/int32 [T, K], global ids or -1
  Activation activation = Activation::silu;
  int global_num_experts = 0;
  // ---- expert_map (semantics §8) ----
  /// Optional int32 [E] (E = global_num_experts, or P with an EPLB plan) on the CPU or on hidden's device: global
  /// -> local expert id, or -1 when not local (vLLM's FusedMoE expert_map). No-EP prepare/finalize: it says which
  /// global experts this rank holds and their slot in w1/w2 (E_local = w1.size(0) <= E); a choice that maps to -1
  /// contributes nothing from this rank. Normal / low-latency: the map is implied by the rank (rank r owns experts
  /// [r*E_local, (r+1)*E_local)); a given map must equal it. See MoELayer::forward for the checks.
  TensorView expert_map;
  bool apply_router_weight_on_input = false;
  /// Optional bfloat16 [T, H] on hidden's device: the result is written there and MoEForwardResult::output
  /// views it (needed to capture forward in a CUDA graph: nothing is allocated then).
  TensorView output;
  /// Whether the batch holds prefill (extend) tokens (SGLang's is_extend_in_batch): required by a layer in
  /// DispatchMode::automatic, ignored otherwise. Every rank must pass the same value (engines all-reduce it).
  std::optional<bool> is_extend_in_batch;
  // ---- fp8 block-scaled weights (semantics §8; ExpertsQuant::fp8_block) ----
  /// With experts made for ExpertsQuant::fp8_block (make_cuda_experts / make_reference_experts with config.quant =
  /// fp8_block) w1 and w2 are float8_e4m3fn (same shapes as above) and these are their float32 block scales, one per
  /// 128x128 block of each expert's matrix (DeepSeek-V3's "weight_block_size": [128, 128], as DeepGEMM and vLLM's
  /// block-quantized MoE read them; edge blocks may be partial): w1_scale [E_local, ceil(2N (or N) / 128),
  /// ceil(H / 128)], w2_scale [E_local, ceil(H / 128), ceil(N / 128)], contiguous, on the weights' device; weight =
  /// fp8 value * its block's scale. Both None with bf16 weights. Handed to Experts::apply as ExpertsInputs::w1_scales
  /// and w2_scales.
  TensorView w1_scale;
  TensorView w2_scale;
};

struct MoEForwardResult {
  Tensor output;         ///< bfloat16 [T, H]
  Tensor shared_output;  ///< bfloat16 [T, H], when the layer has shared experts
};

/// DeepEP's modes (SGLang's DeepEPMode): normal, low_latency, or automatic ("auto"), which picks per forward.
enum class DispatchMode : std::uint8_t { normal, low_latency, automatic };
std::string_view dispatch_mode_name(DispatchMode mode);
/// DeepEPMode.resolve: automatic -> normal when the batch holds prefill (extend) tokens, else low_latency;
/// normal and low_latency resolve to themselves.
DispatchMode resolve_dispatch_mode(DispatchMode mode, bool is_extend_in_batch);

/// A callable run between dispatch_a and dispatch_b of every forward (SGLang's deepep dispatch hooks), on the
/// calling thread, with the prepare/finalize of that forward in stage AFTER_DISPATCH_A: e.g. to launch work
/// that overlaps the receive half, or to record that the send half was issued.
using DispatchHook = std::function<void(PrepareFinalize& dispatcher)>;

/// Owns one registration of MoELayer::register_dispatch_hook: destroying it or calling remove() unregisters
/// the hook (a no-op once removed, or when the layer is gone). Movable, not copyable.
class DispatchHookHandle {
 public:
  DispatchHookHandle() = default;
  DispatchHookHandle(DispatchHookHandle&& other) noexcept;
  DispatchHookHandle& operator=(DispatchHookHandle&& other) noexcept;
  DispatchHookHandle(const DispatchHookHandle&) = delete;
  DispatchHookHandle& operator=(const DispatchHookHandle&) = delete;
  ~DispatchHookHandle() { remove(); }
  void remove();
  bool active() const;

  struct Registry;

 private:
  friend class MoELayer;
  DispatchHookHandle(std::weak_ptr<Registry> registry, std::uint64_t id) : registry_(std::move(registry)), id_(id) {}
  std::weak_ptr<Registry> registry_;
  std::uint64_t id_ = 0;
};

/// Shared experts: a dense MLP every token goes through, run beside the routed experts. Takes hidden (bfloat16
/// [T, H], as MoEForwardArgs::hidden) and returns bfloat16 [T, H] (MoEForwardResult::shared_output).
/// CPU tensors: called on a side thread of MoELayer::forward. CUDA tensors: called on the calling thread with the
/// layer's side stream as the current stream (stream.hpp): it must enqueue its work there, on hidden's device, and
/// not wait for the host (MoELayer::forward says how the side stream is ordered with the caller's).
using SharedExperts = std::function<Tensor(const TensorView& hidden)>;

// ---- shared experts on a GPU (src/moe/shared_experts.cpp) ----
/// A built-in GPU SharedExperts: the dense MLP y = w2_shared @ act(w1_shared @ x) of every token, with the CUDA
/// experts (make_cuda_experts, batched_experts format, as one expert holding all T tokens: cuBLAS GEMMs, bf16
/// in and out, float32 accumulation, the CUDA experts' roundings; no host synchronisation, CUDA-graph capturable
/// once the same T ran eagerly). w1_shared bfloat16 [2N_s, H] (gated activation) or [N_s, H] (*_no_mul),
/// w2_shared bfloat16 [H, N_s], contiguous, on one GPU, H % 8 == 0 and N_s % 8 == 0; the callable holds them
/// (a Tensor wrapping a view does not own it: keep the memory alive). Each call checks hidden (bfloat16
/// [T, H], contiguous, on the weights' GPU; invalid_argument naming 'hidden') and writes into a buffer of its own,
/// grown on demand (on the current stream; growing while that stream is captured raises unsupported): the
/// returned tensor views it and is overwritten by the next call of the same callable (copy it to keep it).
/// Errors (invalid_argument naming w1_shared, w2_shared or activation): a tensor not bfloat16, not 2-D, not
/// contiguous, not on CUDA or on another GPU than w1_shared; shapes that disagree; unsupported without CUDA.
SharedExperts make_cuda_shared_experts(Tensor w1_shared, Tensor w2_shared, Activation activation = Activation::silu);
/// The side stream and events of one layer's GPU shared experts (shared_experts.cpp).
struct SharedExpertsStream;

/// The composition. Construction refuses a prepare/finalize whose activation format differs from
/// the experts' (invalid_argument naming both).
class MoELayer {
 public:
  MoELayer(std::shared_ptr<PrepareFinalize> prepare_finalize, std::shared_ptr<Experts> experts,
           SharedExperts shared_experts = {}, MoELayerOptions options = {});

  /// Runs dispatch_a, dispatch_b, the experts (chunked), combine_a, combine_b. Shared experts run on
  /// a side thread overlapped with dispatch and combine (CPU tensors), or, on CUDA tensors, on the layer's side
  /// stream (one per layer, non-blocking, made on hidden's device by the first such forward): forward records an
  /// event on the current stream, makes the side stream wait on it, calls the shared experts with the side stream
  /// current (their work overlaps the dispatch, experts and combine enqueued after it on the current stream), records
  /// an event on the side stream, and makes the current stream wait on it before returning: no host
  /// synchronisation, capturable in a CUDA graph (the side stream joins the capture) once a forward ran eagerly.
  /// shared_output is then ready where the current stream is. An exception of the shared experts propagates after
  /// the routed forward completed (so the other ranks are not left waiting), as on the CPU.
  /// fp8 block-scaled experts (ExpertsQuant::fp8_block): w1, w2 float8_e4m3fn with w1_scale, w2_scale (see
  /// MoEForwardArgs), checked here too (each named; fp8 weights without scales, scales with bf16 weights, wrong
  /// shapes, dtypes or devices, H or N not a multiple of 16). Collective over the ranks of the buffer.
  /// Every argument is checked before any communication (invalid_argument naming it, the expected and the
  /// actual value: hidden [T, H] on the experts' device (a GPU for make_cuda_experts, else the CPU);
  /// global_num_experts > 0; activation; w1 [E_local, 2N or N, H] and w2 [E_local, H, N] in bfloat16 (fp8 with w1_scale/w2_scale),
  /// contiguous, on the experts' device (hidden's GPU), with E_local from the prepare/finalize, H from hidden and
  /// N from w1; output; topk_idx and topk_weights on hidden's device, by the prepare/finalize), so such an error
  /// leaves the layer usable. A call that fails after
  /// the dispatch started (a timeout, a broken group) leaves the ranks out of step: every later call raises
  /// unusable naming that failure.
  /// On CUDA tensors (no-EP, normal or low-latency prepare/finalize, CUDA experts) the work is enqueued on the
  /// calling thread's current stream; in the batched_experts format nothing waits for the device, and with
  /// args.output given a call can be captured in a CUDA graph once the same shapes ran eagerly (workspaces,
  /// cuBLAS handle). The standard format waits for the device where the normal dispatch reads its
  /// receive counts and where the CUDA experts read their row counts.
  /// expert_map (args.expert_map, semantics §8): checked before any communication (invalid_argument naming
  /// 'expert_map': dtype int32, shape [E], device (CPU or hidden's), entries in [-1, E_local), each local id at most
  /// once; with expert parallelism, the entry that differs from the rank's implied map, expected and actual; no-EP:
  /// w1.size(0) > E). No-EP: topk_idx is mapped to local ids before prepare (CPU: ids outside [-1, E) named as
  /// topk_idx). With CUDA tensors, a map on the GPU is read to the host (a synchronous copy of E int32) every
  /// forward, so such a forward cannot be captured in a CUDA graph; a map on the CPU is checked on the host and
  /// uploaded (asynchronously, on the current stream) only when its contents differ from the last upload.
  /// With an EPLB plan (set_eplb_plan), forward first maps topk_idx (logical ids) to physical slots (semantics §9,
  /// map_to_physical; on CUDA a kernel on the current stream, no host synchronisation) and dispatches over P.
  MoEForwardResult forward(const MoEForwardArgs& args);

  // ---- EPLB mapping (semantics §9) ----
  /// Makes every later forward map topk_idx from logical ids to physical slots of layer `layer` of `plan`
  /// (map_to_physical: token t's choice e goes to replica t mod count[layer, e]) before dispatch. forward then
  /// takes global_num_experts = plan.num_logical_experts (E) and dispatches over P = plan.num_physical_experts:
  /// w1/w2 hold this rank's P / R physical experts (slots [r*P/R, (r+1)*P/R), each a copy of logical expert
  /// physical_to_logical[layer, p]), and the layer's output equals the unbalanced layer's up to the summation
  /// order of the combine (semantics §8). On CUDA the plan's rows of `layer` are copied to the GPU by the first
  /// forward there (a synchronous copy: run once eagerly before capturing a CUDA graph).
  /// Errors (invalid_argument): 'layer' outside [0, L); 'plan' with inconsistent array sizes, a replica count
  /// outside [1, X], a slot outside [0, P) for a counted replica, or P not a multiple of what the prepare/finalize
  /// needs (checked by forward, naming global_num_experts).
  void set_eplb_plan(EplbPlan plan, std::int64_t layer);
  /// Back to logical ids dispatched as they are.
  void clear_eplb_plan();
  /// The plan set (nullptr when none) and its layer.
  const EplbPlan* eplb_plan() const { return eplb_ ? &eplb_->plan : nullptr; }
  std::int64_t eplb_layer() const { return eplb_ ? eplb_->layer : -1; }

  /// DeepEP's two modes on ONE Buffer (semantics §8): `mode` normal uses make_normal_prepare_finalize(buffer)
  /// with `normal_experts` (standard format); low_latency uses make_low_latency_prepare_finalize(buffer,
  /// num_max_dispatch_tokens_per_rank) with `low_latency_experts` (batched_experts format); automatic holds
  /// both and picks per forward with resolve_dispatch_mode(automatic, args.is_extend_in_batch). On each
  /// switch from normal to low_latency, forward calls buffer->clean_low_latency_buffer(
  /// num_max_dispatch_tokens_per_rank, H, global_num_experts) first (collective; DeepEP's rule for a buffer
  /// shared by both modes). Errors (invalid_argument): buffer null; num_max_dispatch_tokens_per_rank < 1 when
  /// low_latency can be used; the experts a mode needs null or of the other format. forward then also
  /// refuses, before any communication: is_extend_in_batch unset in automatic mode; a low_latency batch of
  /// more than num_max_dispatch_tokens_per_rank tokens (named hidden).
  MoELayer(std::shared_ptr<Buffer> buffer, DispatchMode mode, int num_max_dispatch_tokens_per_rank,
           std::shared_ptr<Experts> normal_experts, std::shared_ptr<Experts> low_latency_experts,
           const PrepareFinalizeOptions& prepare_options = {}, SharedExperts shared_experts = {},
           MoELayerOptions options = {});

  /// Registers `hook` to run between dispatch_a and dispatch_b of every forward, after the hooks
  /// registered before it; once per forward (chunking splits only the experts, after dispatch_b). A hook
  /// that throws: the later hooks are skipped, the forward still completes its dispatch, experts and
  /// combine (so the other ranks, and this layer's next forward, are not left waiting), and then the hook's
  /// exception propagates unchanged; this rank's output of that forward is lost. Errors: hook empty
  /// (invalid_argument naming hook).
  [[nodiscard]] DispatchHookHandle register_dispatch_hook(DispatchHook hook);
  std::size_t num_dispatch_hooks() const;

  DispatchMode dispatch_mode() const { return mode_; }
  /// The mode the last forward that got past its argument checks ran in (normal or low_latency); `mode`
  /// itself before the first.
  DispatchMode last_resolved_mode() const { return last_mode_; }
  /// How many times forward cleaned the low-latency buffer on a switch from normal.
  std::int64_t num_low_latency_cleans() const { return num_cleans_; }

  /// The prepare/finalize of the last forward (of the forward running, inside a dispatch hook).
  PrepareFinalize& prepare_finalize() { return *prepare_finalize_; }
  const std::shared_ptr<PrepareFinalize>& shared_prepare_finalize() const { return prepare_finalize_; }
  const Experts& experts() const { return *experts_; }
  /// Chunk sizes of the last forward (one entry per chunk) and the per-chunk expert counts.
  const std::vector<std::int64_t>& last_chunk_rows() const { return last_chunk_rows_; }

  // ---- Expert load recorder (semantics §9) ----
  /// Attaches `recorder` as layer `layer` of it (a model's layers on one rank share one recorder, each with its
  /// own index); null detaches. Every later forward then records the counts of the experts this rank received
  /// tokens for -- the dispatch's PrepareOutput::expert_num_tokens (normal: num_recv_tokens_per_expert;
  /// low-latency: masked_m; no-EP: tokens per expert) -- with recorder->record_local(layer, counts,
  /// rank * E_local), right after dispatch_b, once per forward (in automatic mode from whichever half ran). On
  /// CUDA that is one kernel on the current stream reading the counts where the dispatch left them: no host
  /// synchronisation, and a CUDA-graph replay of the forward records too. forward refuses, before any
  /// communication (invalid_argument naming load_recorder), a recorder whose num_experts differs from
  /// global_num_experts or whose device is not hidden's. Sum every rank's record with
  /// ExpertLoadRecorder::global_loads(group) for the loads of all experts. Errors: invalid_argument naming
  /// 'layer' (outside [0, recorder->num_layers())).
  void set_load_recorder(std::shared_ptr<ExpertLoadRecorder> recorder, std::int64_t layer);
  const std::shared_ptr<ExpertLoadRecorder>& load_recorder() const { return load_recorder_; }
  std::int64_t load_recorder_layer() const { return load_recorder_layer_; }

  /// Runs the experts on prepared activations, chunked (exposed for the two-phase users).
  Tensor run_experts(const PrepareOutput& prepared, const MoEForwardArgs& args);
  /// The experts and then the prepare/finalize's combine_a, as forward runs them (exposed for the two-phase users):
  /// with MoELayerOptions::overlap in a low-latency forward the combine's send overlaps the experts (the experts
  /// write a combine signal the send waits on); otherwise run_experts, then combine_a. Returns the experts' output
  /// (what combine_a sent). combine_b follows as usual.
  Tensor run_experts_and_combine_a(const PrepareOutput& prepared, const MoEForwardArgs& args);

 private:
  std::shared_ptr<PrepareFinalize> prepare_finalize_;
  std::shared_ptr<Experts> experts_;
  SharedExperts shared_experts_;
  std::shared_ptr<SharedExpertsStream> shared_stream_;  ///< GPU shared experts' side stream, made on first use
  std::shared_ptr<SharedExpertsStream> overlap_stream_;  ///< GPU overlapped combine's side stream (options.overlap)
  /// options.overlap: the batched experts with a combine signal and combine_a overlapped with them (overlap.cpp);
  /// false when this forward cannot overlap (then nothing ran).
  bool run_experts_overlapped(const PrepareOutput& prepared, const MoEForwardArgs& args, Tensor& fused);
  bool overlap_kernels_loaded_ = false;  ///< GPU overlap: one forward ran its experts before the send (overlap.cpp)
  MoELayerOptions options_;
  std::vector<std::int64_t> last_chunk_rows_;
  std::string failed_;  ///< why a forward failed after its dispatch started; empty while usable
  std::shared_ptr<DispatchHookHandle::Registry> hooks_;
  // DeepEP mode layers: the two halves, the buffer they share, and the mode the last forward ran in.
  DispatchMode mode_ = DispatchMode::normal;
  std::shared_ptr<Buffer> buffer_;
  int tmax_ = 0;
  std::shared_ptr<PrepareFinalize> pf_normal_, pf_low_latency_;
  std::shared_ptr<Experts> experts_normal_, experts_low_latency_;
  DispatchMode last_mode_ = DispatchMode::normal;
  bool ran_ = false;
  std::int64_t num_cleans_ = 0;
  std::shared_ptr<ExpertLoadRecorder> load_recorder_;  // semantics §9; null: nothing recorded
  std::int64_t load_recorder_layer_ = 0;

  void check_forward_args(const MoEForwardArgs& args) const;
  // ---- expert_map and EPLB mapping (semantics §8, §9) ----
  struct Eplb {
    EplbPlan plan;
    std::int64_t layer = 0;
    Device device;   ///< where l2p/count were copied (CPU: not yet)
    Tensor l2p, count;  ///< int64 [E, X] and [E] of `layer` on `device`
  };
  std::shared_ptr<Eplb> eplb_;
  /// A host expert_map's device copy, uploaded on the stream when its contents change (layer.cpp).
  struct ExpertMapCopy;
  std::shared_ptr<ExpertMapCopy> expert_map_copy_;
  /// Checks every argument, then maps args.topk_idx (EPLB plan, then a no-EP expert_map; host results kept in
  /// `keep`) and returns the args to dispatch.
  MoEForwardArgs route_ids(const MoEForwardArgs& args, std::vector<Tensor>& keep);
  DispatchMode select_mode(const MoEForwardArgs& args);
  /// Refuses a low-latency batch over Tmax, and cleans the low-latency buffer on a switch from normal.
  void enter_mode(DispatchMode resolved, const MoEForwardArgs& args);
  /// Runs the hooks in order; the first one's exception, if any (the later ones are skipped).
  std::exception_ptr run_dispatch_hooks();
};

/// Settings of the no-EP prepare/finalize beyond PrepareFinalizeOptions.
struct NoEpOptions {
  /// standard: the tokens go to the experts as they are, with their top-k ids. batched_experts: each
  /// (token, k) choice is copied into slot i of slab e of [E, max_tokens, H], i = the token's rank among the
  /// tokens choosing e (token order), counts in expert_num_tokens; finalize is NaiveBatched.
  ActivationFormat format = ActivationFormat::standard;
  /// batched_experts: slab rows. 0 = T (no choice can be dropped). Choices past it are dropped and flagged
  /// (cuda::check_moe_faults raises out_of_memory naming the expert and the count needed); on the CPU they
  /// are an error at once.
  std::int64_t max_tokens_per_expert = 0;
  /// Where CUDA buffers come from (made when null): everything prepare/finalize needs on a GPU is taken from
  /// here, so after one eager call of the same shapes a call can be captured in a CUDA graph.
  std::shared_ptr<WorkspaceCache> workspaces;
  int micro_batch = 0;
};

/// make_no_ep_prepare_finalize in either format. On CUDA tensors everything runs asynchronously on the
/// calling thread's current stream (stream.hpp) with no host synchronisation; with a batched format and a
/// caller-given PrepareInputs::output, the whole prepare -> experts -> finalize sequence can be captured in
/// a CUDA graph. Ids outside [-1, E) are skipped there and flagged (cuda::check_moe_faults).
/// Errors: max_tokens_per_expert < 0; format standard with max_tokens_per_expert set.
std::shared_ptr<PrepareFinalize> make_no_ep_prepare_finalize(const PrepareFinalizeOptions& options,
                                                              const NoEpOptions& no_ep);

namespace cuda {
/// semantics §11 on one GPU: faults the MoE kernels (no-EP prepare/finalize) raise in host-mapped memory
/// (cudaHostAlloc, mapped), one record per device, so the host reads them with no synchronisation and no
/// copy, also after CUDA-graph replays. The first bad id itself ([t, k] and value) is kept in the device
/// word that cuda::check_invalid_ids() reads.
struct MoEFaults {
  bool invalid_id = false;   ///< a topk_idx entry outside [-1, E) was skipped
  bool overflow = false;     ///< a batched slab got more choices than max_tokens_per_expert (some dropped)
  int overflow_expert = -1;  ///< one such expert
  int overflow_count = 0;    ///< the choices it received
  int overflow_limit = 0;    ///< max_tokens_per_expert
};
/// Reads the current device's record without waiting: kernels still running may raise more later.
MoEFaults peek_moe_faults();
/// Turns the current device's record into an error and clears it: a bad id -> invalid_argument naming
/// topk_idx, the bound, the first bad value and its [t, k] (as the CPU reports it; this waits for `stream`
/// to read the detail); an overflow -> out_of_memory naming the expert, the count and the limit. Returns at
/// once, without synchronising, when nothing is flagged. A no-op in builds without CUDA.
void check_moe_faults(Stream stream = {});
}  // namespace cuda

}  // namespace epmoe
