#include "common.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <numeric>
#include <random>
#include <thread>

#include <fcntl.h>
#include <unistd.h>

#include <epmoe/group.hpp>
#include <epmoe/version.hpp>

#if defined(EPMOE_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace epmoe::cli {

int cuda_device_count(std::string* why) {
#if defined(EPMOE_HAVE_CUDA)
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" state
    if (why)
      *why = fmt::format("no CUDA device is visible: cudaGetDeviceCount failed with '{}' (no driver or device, or a "
                         "driver older than this build's CUDA)",
                         cudaGetErrorString(e));
    return 0;
  }
  if (n == 0 && why) *why = "no CUDA device is visible: cudaGetDeviceCount found 0";
  return n;
#else
  if (why) *why = "this epmoe was built without CUDA";
  return 0;
#endif
}

std::string device_name(int device) {
  if (device < 0) return "cpu";
#if defined(EPMOE_HAVE_CUDA)
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, device) == cudaSuccess) return p.name;
#endif
  return fmt::format("cuda:{}", device);
}

DeviceKind resolve_device(std::string_view choice, bool cuda_allowed, std::string_view flag) {
  if (choice == "cpu") return DeviceKind::cpu;
  std::string why;
  const int n = cuda_device_count(&why);
  if (choice == "cuda") {
    if (n == 0) bad(flag, fmt::format("cpu or auto here; {}", why), choice);
    return DeviceKind::cuda;
  }
  if (choice != "auto") bad(flag, "auto, cpu or cuda", choice);
  return n > 0 && cuda_allowed ? DeviceKind::cuda : DeviceKind::cpu;
}

std::string cpu_ranks_reason(std::string_view choice, bool cuda_allowed, std::string_view no_gpu_path) {
  if (choice == "cpu") return "--device cpu";
#if defined(EPMOE_HAVE_CUDA)
  if (cuda_device_count() == 0) return "no CUDA GPU found";
  return cuda_allowed || no_gpu_path.empty() ? std::string("--device auto") : std::string(no_gpu_path);
#else
  (void)cuda_allowed;
  (void)no_gpu_path;
  return "this epmoe was built without CUDA";
#endif
}

const CLI::Validator& non_empty_path() {
  static const CLI::Validator check(
      [](std::string& v) { return v.empty() ? std::string("expected a path, got an empty value") : std::string(); },
      "");
  return check;
}

std::string plural(std::int64_t n, std::string_view noun) { return fmt::format("{} {}{}", n, noun, n == 1 ? "" : "s"); }

void check_writable(std::string_view flag, const std::string& path) {
  namespace fs = std::filesystem;
  if (path.empty()) bad(flag, "a writable file", "an empty path");
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  const bool exists = fs::exists(st);
  if (exists && fs::is_directory(st)) bad(flag, "a writable file", path + " (a directory)");
  if (exists && !fs::is_regular_file(st)) {
    // A device or a pipe (/dev/stdout): opening it would block or consume the reader; permissions only.
    if (::access(path.c_str(), W_OK) != 0)
      bad(flag, "a writable file", fmt::format("{} ({})", path, std::strerror(errno)));
    return;
  }
  // Opened as the final write will open it (no truncation here); a name that did not exist is created
  // exclusively and removed again, so a command refused later leaves nothing behind.
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC | (exists ? 0 : O_CREAT | O_EXCL), 0644);
  if (fd < 0) bad(flag, "a writable file", fmt::format("{} ({})", path, std::strerror(errno)));
  ::close(fd);
  if (!exists) ::unlink(path.c_str());
}

void check_exists(std::string_view flag, std::string_view expected, const std::string& path) {
  if (::access(path.c_str(), F_OK) != 0) bad(flag, expected, fmt::format("{} ({})", path, std::strerror(errno)));
}

void write_text_file(std::string_view flag, const std::string& path, const std::string& text) {
  // The job has run: not a bad argument (exit 2) but a failure while running (exit 1), e.g. a disk that filled up.
  const auto failed = [&](int err) {
    throw Error(ErrorCode::internal, fmt::format("epmoe: {}: could not write the results to {} ({})", flag, path,
                                                 std::strerror(err)));
  };
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) failed(errno);
  int err = 0;
  if (std::fwrite(text.data(), 1, text.size(), f) != text.size()) err = errno;
  if (std::fflush(f) != 0 && err == 0) err = errno;  // a full disk (/dev/full) shows here, not in fwrite
  if (std::fclose(f) != 0 && err == 0) err = errno;
  if (err != 0) failed(err);
}

namespace {
constexpr double kEib = 1152921504606846976.0;  // 2^60 bytes
}  // namespace

std::string gib(double bytes) {
  return bytes >= kEib ? std::string("more than 1 EiB") : fmt::format("{:.1f} GiB", bytes / 1073741824.0);
}

void check_host_memory(double need, std::string_view flags, std::string_view what) {
  const double have = host_memory_bytes();
  if (have > 0 && need > have)
    bad(flags, fmt::format("sizes whose host memory fits this machine's {}", gib(have)),
        fmt::format("{}{} ({})", need >= kEib ? "" : "about ", gib(need), what));
}

double low_latency_window_estimate(std::int64_t tokens, std::int64_t hidden, int num_ranks, int num_experts) {
  const double R = num_ranks, T = static_cast<double>(tokens), H = static_cast<double>(hidden);
  if (T * R >= 2147483648.0) return std::numeric_limits<double>::infinity();
  // Above the window's layout, in double: two halves of E_local x R x T rows (and up to 128 padding rows per expert
  // in the scale slabs) of 8H + 256 bytes, twice a row's 4H + 5 there. The hint is asked only where its size_t sums
  // stay far (16x) below 2^64.
  const double local_experts = std::max(1, num_experts / std::max(1, num_ranks));
  const double bound = 2.0 * (local_experts * R * T + 128.0 * local_experts) * (8.0 * H + 256.0);
  if (bound >= kEib) return std::numeric_limits<double>::infinity();
  return static_cast<double>(
      Buffer::get_low_latency_rdma_size_hint(static_cast<int>(tokens), hidden, num_ranks, num_experts));
}

double threads_normal_bytes_per_rank(int num_ranks, std::int64_t tokens, int live_handles) {
  const double R = num_ranks, T = static_cast<double>(tokens);
  const double counts = 8.0 * R * (R + 16), handle = 4.0 * R * R + 8.0 * T * R;
  return 1.5 * (counts + live_handles * handle) + 128.0 * 1024;
}

void apply_config_flag(const std::string& path, BufferOptions& options) {
  if (path.empty()) return;
  // The README's example config is {"num_sms": 16}: a value that looks like it was typed inline says it is not taken.
  const std::string expected = std::string("a readable JSON file of BufferOptions fields") +
                               (path[0] == '{' ? " (a path to a JSON file; inline JSON is not taken)" : "");
  check_exists("--config", expected, path);
  if (std::filesystem::is_directory(path)) bad("--config", expected, path + " (a directory)");
  if (!std::filesystem::is_regular_file(path)) bad("--config", expected, path + " (not a regular file)");
  try {
    load_buffer_config(path, options);
  } catch (const Error& e) {
    rethrow_naming_flag(e, path, "--config " + path);  // the library names the file (and field: 'FILE:num_sms')
  }
}

void rethrow_naming_flag(const Error& e, std::string_view name, std::string_view flag) {
  if (e.code() != ErrorCode::invalid_argument) throw e;
  throw Error(ErrorCode::invalid_argument, naming_argument(e.what(), name, flag));
}

void fill_bf16(bf16_t* p, std::int64_t n, std::uint64_t seed, std::uint64_t id, float scale) {
  std::uint64_t state = seed * 0x9E3779B97F4A7C15ull ^ (id + 0x632BE59BD9B4E019ull);
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    p[i] = float_to_bf16((2.0f * u - 1.0f) * scale);
  }
}

Tensor random_topk(std::int64_t T, int K, int E, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Tensor h = Tensor::empty(DType::int64, {T, K});
  std::vector<int> ids(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < T; ++t) {
    std::iota(ids.begin(), ids.end(), 0);
    for (int k = 0; k < K; ++k) {  // partial Fisher-Yates: K distinct experts
      std::uniform_int_distribution<int> pick(k, E - 1);
      std::swap(ids[static_cast<std::size_t>(k)], ids[static_cast<std::size_t>(pick(rng))]);
      h.ptr<std::int64_t>()[t * K + k] = ids[static_cast<std::size_t>(k)];
    }
  }
  return h;
}

void launch_ranks(int num_ranks, const std::function<void(const std::shared_ptr<Group>&)>& fn) {
  ThreadWorld world(num_ranks);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(num_ranks));
  world.run_threads([&](int r) {
    try {
      fn(world.group(r));
    } catch (const std::exception& e) {
      errors[static_cast<std::size_t>(r)] = std::current_exception();
      world.abort(r, e.what());
    }
  });
  if (auto e = first_root_cause(errors)) std::rethrow_exception(e);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

#if defined(EPMOE_HAVE_CUDA)
void cuda_check(int status, const char* what) {
  if (status != cudaSuccess)
    throw Error(ErrorCode::internal, fmt::format("epmoe: {}: {}", what, cudaGetErrorString(static_cast<cudaError_t>(status))));
}
void cuda_set_device(int device) { cuda_check(cudaSetDevice(device), "cudaSetDevice"); }
void cuda_sync_device() { cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }
Tensor to_device(const TensorView& host, int device) {
  if (!host.defined()) return {};
  EPMOE_ASSERT(host.device.is_cpu() && host.is_contiguous());
  Tensor d = Tensor::empty(host.dtype, host.shape, Device::cuda(device));
  if (host.numel() > 0) cuda_check(cudaMemcpy(d.data(), host.data, host.nbytes(), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  return d;
}
Tensor to_host(const TensorView& dev) {
  if (!dev.defined()) return {};
  EPMOE_ASSERT(dev.is_contiguous());
  cuda_sync_device();
  Tensor h = Tensor::empty(dev.dtype, dev.shape);
  if (dev.numel() > 0) cuda_check(cudaMemcpy(h.data(), dev.data, dev.nbytes(), cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  return h;
}
#else
namespace {
[[noreturn]] void no_cuda() { throw Error(ErrorCode::unsupported, "epmoe: this epmoe was built without CUDA"); }
}  // namespace
void cuda_check(int status, const char* what) {
  if (status != 0) throw Error(ErrorCode::internal, fmt::format("epmoe: {}: error {}", what, status));
}
void cuda_set_device(int) { no_cuda(); }
void cuda_sync_device() { no_cuda(); }
Tensor to_device(const TensorView&, int) { no_cuda(); }
Tensor to_host(const TensorView&) { no_cuda(); }
#endif

}  // namespace epmoe::cli
