// NCCL for `epmoe bench`: an all-to-all-v of the same rows as epmoe's dispatch/combine, for comparison.
// Compiled when CMake found nccl.h (EPMOE_HAVE_NCCL); libnccl.so.2 is opened with dlopen on first use,
// so the tool starts on machines without NCCL and the bench says why it has no NCCL column.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace epmoe {
class Group;
}

namespace epmoe::cli {

/// "2.28.9 (runtime)", or why NCCL is not there: "not built" (no nccl.h at build time), "not loaded: ...".
std::string nccl_status();
/// True when NCCL can be used in this process.
bool nccl_available();

/// One rank's NCCL communicator, made collectively over `group` (rank 0 makes the unique id and
/// broadcasts it through the group); the calling thread's current CUDA device is the rank's.
class NcclComm {
 public:
  explicit NcclComm(Group& group);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  /// All-to-all-v of bytes on `stream` (a cudaStream_t; nullptr = legacy default): to each rank p, send
  /// send_bytes[p] bytes from send + send_off[p]; from each p, receive recv_bytes[p] bytes into
  /// recv + recv_off[p]. One ncclGroupStart/End around ncclSend/ncclRecv pairs; zero sizes are skipped.
  void all_to_all_v(const void* send, const std::vector<std::size_t>& send_bytes, const std::vector<std::size_t>& send_off,
                    void* recv, const std::vector<std::size_t>& recv_bytes, const std::vector<std::size_t>& recv_off,
                    void* stream);

 private:
  void* comm_ = nullptr;  // ncclComm_t
  int rank_ = 0, size_ = 0;
};

}  // namespace epmoe::cli
