// The MPI backend: CPU ranks as processes of an MPI job (semantics §10).
//
// make_mpi_group() wraps an MPI communicator in an epmoe::Group; a Buffer built on that group moves
// its bytes with MPI (two-sided messages for normal mode, one-sided MPI_Put into MPI_Win_allocate
// windows for low-latency mode) and gives results bit-identical to the threads backend.
//
//   int main(int argc, char** argv) {
//     epmoe::MpiSession mpi(&argc, &argv);          // or MPI_Init yourself
//     auto group = epmoe::make_mpi_group();         // MPI_COMM_WORLD, duplicated
//     epmoe::Buffer buffer(group);                  // backend "mpi"
//     ...
//   }
//
// Threading: epmoe makes MPI calls from the thread that calls into the Group or Buffer. With
// MPI_THREAD_FUNNELED or SERIALIZED that must be one thread at a time (the usual case); concurrent use
// of several groups from several threads needs MPI_THREAD_MULTIPLE.
//
// Only available when epmoe was built with MPI (EPMOE_HAVE_MPI; CMake found MPI).
#pragma once

#if !defined(EPMOE_HAVE_MPI)
#error "epmoe/mpi.hpp: this epmoe was built without MPI (CMake did not find MPI when epmoe was configured)"
#endif

#include <epmoe/group.hpp>

#include <mpi.h>

#include <memory>

namespace epmoe {

/// A Group over the ranks of `comm` (rank and size are those of `comm`).
///
/// The communicator is duplicated (MPI_Comm_idup), so epmoe's messages never match the caller's; the
/// duplicate is freed with the group. Collective over `comm`: every rank of `comm` must call it.
/// Every wait inside the group and its Buffer's transport is non-blocking with the group's timeout
/// (Group::timeout_s); a timeout throws ErrorCode::timeout naming this rank, the phase and, where
/// MPI can tell, the peer, and leaves the group unusable (ErrorCode::unusable afterwards).
///
/// Errors: ErrorCode::unsupported if MPI is not initialised or already finalised;
/// ErrorCode::invalid_argument if `comm` is MPI_COMM_NULL; ErrorCode::timeout if the other ranks do
/// not join the duplication within default_timeout_s(); ErrorCode::internal if an MPI call fails.
std::shared_ptr<Group> make_mpi_group(MPI_Comm comm = MPI_COMM_WORLD);

/// RAII MPI_Init_thread / MPI_Finalize for programs that have no MPI setup of their own.
///
/// Initialises MPI if it is not initialised yet (requesting `required`, by default
/// MPI_THREAD_FUNNELED) and finalises it on destruction if this object initialised it. Destroy every
/// epmoe Group and Buffer of the MPI backend before the session ends.
/// Errors: ErrorCode::unsupported if MPI was already finalised or provides less than `required`.
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv, int required = MPI_THREAD_FUNNELED);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  /// The thread level MPI provides (MPI_THREAD_SINGLE .. MPI_THREAD_MULTIPLE).
  int thread_level() const { return provided_; }

 private:
  bool owns_ = false;
  int provided_ = MPI_THREAD_SINGLE;
};

}  // namespace epmoe
