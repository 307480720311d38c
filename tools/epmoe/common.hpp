// Helpers shared by the `epmoe` subcommands: flag errors, the CPU/GPU choice, deterministic inputs,
// host <-> device copies and timing. The CUDA parts compile to stubs in builds without CUDA.
#pragma once

#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/tensor.hpp>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <functional>
#include <memory>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace epmoe::cli {

/// Throws invalid_argument "epmoe: invalid argument 'FLAG': expected EXPECTED, got ACTUAL" (exit code 2).
template <class T>
[[noreturn]] void bad(std::string_view flag, std::string_view expected, const T& actual) {
  throw Error(ErrorCode::invalid_argument, fmt::format("epmoe: invalid argument '{}': expected {}, got {}", flag, expected, actual));
}

/// Rethrows a library error `e` whose argument the library names `name` (e.g. 'routing topk_idx', or a --config
/// file's path) with that name said as the command line says it (`flag`: '--routing topk_idx', '--config PATH');
/// other errors are rethrown as they are.
[[noreturn]] void rethrow_naming_flag(const Error& e, std::string_view name, std::string_view flag);

/// Where the ranks of a command run.
enum class DeviceKind { cpu, cuda };

/// CUDA devices visible to this process: 0 in a build without CUDA or when cudaGetDeviceCount fails
/// (no driver, no device). `why` (optional) receives the reason when it is 0.
int cuda_device_count(std::string* why = nullptr);
/// "NVIDIA H200" (or "cpu" for -1).
std::string device_name(int device);

/// --device auto|cpu|cuda: auto is cuda when a CUDA device is visible (and `cuda_allowed`, e.g. the mode
/// has a GPU path), cpu otherwise. cuda without a device throws invalid_argument naming `flag` and why.
DeviceKind resolve_device(std::string_view choice, bool cuda_allowed = true, std::string_view flag = "--device");

/// Why a command runs on CPU ranks, for its header: "--device cpu", "this epmoe was built without CUDA", "no CUDA
/// GPU found", or `no_gpu_path` (e.g. a mode without a GPU path) when GPUs are there but `cuda_allowed` is false
/// ("--device auto" if that is empty, or if GPUs are there and allowed: not a CPU run of resolve_device).
std::string cpu_ranks_reason(std::string_view choice, bool cuda_allowed = true, std::string_view no_gpu_path = "");

/// A CLI11 check for path options: an empty path is refused, output or input alike (an output would silently write
/// nothing; for --config or --routing, '' would silently mean the flag was not given, as an unset shell variable
/// does). No type of its own in --help: the option says PATH or FILE (type_name), not "TEXT:PATH".
const CLI::Validator& non_empty_path();

/// "1 rank", "4 ranks": `n` and `noun`, plural unless n is 1.
std::string plural(std::int64_t n, std::string_view noun);

/// Raises invalid_argument naming `flag` (and the OS's reason) unless `path` opens for writing now: an existing
/// regular file is opened without truncation, a new name is created and removed again, so a command refused
/// afterwards leaves no file behind; an existing device or pipe is only checked for write permission.
void check_writable(std::string_view flag, const std::string& path);

/// Raises invalid_argument naming `flag`, `path` and the OS's reason (strerror, e.g. "No such file or directory")
/// unless `path` exists now: an input missing on this machine is said as that, before any work, not as a path of the
/// wrong kind. `expected` says what the flag takes.
void check_exists(std::string_view flag, std::string_view expected, const std::string& path);

/// Writes a command's results, `text`, to `path` (truncating) once the job has run; raises ErrorCode::internal
/// (exit 1, a failure while running: the flags were good, check_writable passed them) naming `flag`, the path and
/// the OS's reason (strerror, e.g. "No space left on device") when opening, writing or closing fails.
void write_text_file(std::string_view flag, const std::string& path, const std::string& text);

/// A byte count for messages: "12.3 GiB", or "more than 1 EiB" past 2^60 bytes (no machine has that much; figures
/// of 20 digits, or an infinite estimate, say nothing more).
std::string gib(double bytes);

/// Raises invalid_argument naming `flags` when `need` bytes (a command's rough host-memory estimate, `what`
/// describes it; infinite for sizes past any count) exceed this machine's physical memory: an impossible size is
/// named up front, not by a failed allocation later.
void check_host_memory(double need, std::string_view flags, std::string_view what);

/// The CPU low-latency window (Buffer::get_low_latency_rdma_size_hint) of `tokens` per rank, in bytes: infinity where
/// R x T >= 2^31 (the library's limit) or the window passes 2^60 bytes, where the hint's own 64-bit arithmetic would
/// wrap around to a small figure that passes any memory check. Errors: the hint's, for settings the window cannot have.
double low_latency_window_estimate(std::int64_t tokens, std::int64_t hidden, int num_ranks, int num_experts);

/// Host bytes per rank that the CPU threads backend's normal mode allocates besides the payload rows, which grow
/// with the rank count R: the count all-gather of a dispatch (R x (R + 16) int64 on every rank) and, per live
/// dispatch handle, its rank_prefix_matrix (R x R int32) and [T, R] tables (is_token_in_rank, send_pos and the
/// layout's copies), times 1.5 for what glibc's arenas keep of freed ones (peak RSS measured 1.4-1.5x the live
/// sum at 300-600 thread ranks), plus 128 KiB for the rank's thread. R^2 per rank: R^3 for one process of R
/// thread ranks (bench at T = 1: 0.6 GB at R = 300, 5 GB at R = 600).
double threads_normal_bytes_per_rank(int num_ranks, std::int64_t tokens, int live_handles);

/// Reads BufferOptions' tunables from --config PATH (empty: nothing), naming the flag on a bad file.
void apply_config_flag(const std::string& path, BufferOptions& options);

/// Deterministic bf16 fill, uniform in [-scale, scale): one splitmix64 stream per (seed, id).
void fill_bf16(bf16_t* p, std::int64_t n, std::uint64_t seed, std::uint64_t id, float scale);

/// Uniform top-K of E without repeats per token (seeded), int64 [T, K] on the CPU.
Tensor random_topk(std::int64_t T, int K, int E, std::uint64_t seed);

/// Runs fn(group of rank r) on R threads of one ThreadWorld; a rank that throws aborts the world (the
/// others stop waiting at once) and the root cause is rethrown after every thread joined.
void launch_ranks(int num_ranks, const std::function<void(const std::shared_ptr<Group>&)>& fn);

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
double median(std::vector<double> v);

// CUDA helpers (they throw ErrorCode::unsupported in builds without CUDA).
void cuda_set_device(int device);
void cuda_sync_device();
/// Contiguous copy of a CPU tensor on cuda:device (undefined stays undefined).
Tensor to_device(const TensorView& host, int device);
/// Contiguous CPU copy of a CUDA tensor, after the device is idle.
Tensor to_host(const TensorView& dev);
/// Throws ErrorCode::internal naming `what` when `status` (a cudaError_t) is not cudaSuccess.
void cuda_check(int status, const char* what);

}  // namespace epmoe::cli
