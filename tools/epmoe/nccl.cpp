#include "nccl.hpp"

#include <epmoe/error.hpp>
#include <epmoe/group.hpp>

#include <fmt/format.h>

#include <mutex>

#if defined(EPMOE_HAVE_NCCL)
#include <dlfcn.h>
#include <nccl.h>
#endif

namespace epmoe::cli {

#if defined(EPMOE_HAVE_NCCL)
namespace {

// The NCCL entry points the bench uses, resolved from libnccl.so.2 once.
struct Api {
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  std::string error;  // why it is not loaded
  int version = 0;
};

const Api& api() {
  static Api a;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
#if defined(EPMOE_NCCL_LIBRARY)
    if (!lib) lib = dlopen(EPMOE_NCCL_LIBRARY, RTLD_NOW | RTLD_LOCAL);
#endif
    if (!lib) {
      const char* e = dlerror();
      a.error = fmt::format("not loaded: {}", e ? e : "libnccl.so.2 not found");
      return;
    }
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn && a.error.empty()) a.error = fmt::format("not loaded: {} missing from libnccl.so.2", name);
    };
    sym(a.get_version, "ncclGetVersion");
    sym(a.get_unique_id, "ncclGetUniqueId");
    sym(a.comm_init_rank, "ncclCommInitRank");
    sym(a.comm_destroy, "ncclCommDestroy");
    sym(a.group_start, "ncclGroupStart");
    sym(a.group_end, "ncclGroupEnd");
    sym(a.send, "ncclSend");
    sym(a.recv, "ncclRecv");
    sym(a.error_string, "ncclGetErrorString");
    if (a.error.empty() && a.get_version(&a.version) != ncclSuccess) a.error = "not loaded: ncclGetVersion failed";
  });
  return a;
}

void check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess)
    throw Error(ErrorCode::internal, fmt::format("epmoe: {}: {}", what, api().error_string ? api().error_string(r) : "error"));
}

}  // namespace

std::string nccl_status() {
  const Api& a = api();
  if (!a.error.empty()) return a.error;
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  return fmt::format("{}.{}.{}", a.version / 10000, a.version / 100 % 100, a.version % 100);
}
bool nccl_available() { return api().error.empty(); }

NcclComm::NcclComm(Group& group) : rank_(group.rank()), size_(group.size()) {
  if (!nccl_available()) throw Error(ErrorCode::unsupported, "epmoe: nccl " + nccl_status());
  ncclUniqueId id{};
  if (rank_ == 0) check(api().get_unique_id(&id), "ncclGetUniqueId");
  group.broadcast(&id, sizeof(id), 0, "nccl.unique_id");
  ncclComm_t comm = nullptr;
  check(api().comm_init_rank(&comm, size_, id, rank_), "ncclCommInitRank");
  comm_ = comm;
}

NcclComm::~NcclComm() {
  if (comm_) api().comm_destroy(static_cast<ncclComm_t>(comm_));
}

void NcclComm::all_to_all_v(const void* send, const std::vector<std::size_t>& send_bytes,
                            const std::vector<std::size_t>& send_off, void* recv, const std::vector<std::size_t>& recv_bytes,
                            const std::vector<std::size_t>& recv_off, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const auto comm = static_cast<ncclComm_t>(comm_);
  check(api().group_start(), "ncclGroupStart");
  for (int p = 0; p < size_; ++p) {
    const auto q = static_cast<std::size_t>(p);
    if (send_bytes[q] > 0)
      check(api().send(static_cast<const char*>(send) + send_off[q], send_bytes[q], ncclUint8, p, comm, s), "ncclSend");
    if (recv_bytes[q] > 0)
      check(api().recv(static_cast<char*>(recv) + recv_off[q], recv_bytes[q], ncclUint8, p, comm, s), "ncclRecv");
  }
  check(api().group_end(), "ncclGroupEnd");
}

#else

std::string nccl_status() { return "not built"; }
bool nccl_available() { return false; }
NcclComm::NcclComm(Group&) { throw Error(ErrorCode::unsupported, "epmoe: nccl: not built"); }
NcclComm::~NcclComm() = default;
void NcclComm::all_to_all_v(const void*, const std::vector<std::size_t>&, const std::vector<std::size_t>&, void*,
                            const std::vector<std::size_t>&, const std::vector<std::size_t>&, void*) {}

#endif

}  // namespace epmoe::cli
