// Placeholder until the MPI transport lands (issue: CPU ranks as processes over MPI).
#include "core/check.hpp"
#include <epmoe/error.hpp>

#include "transport/transport.hpp"

namespace epmoe {
#if defined(EPMOE_HAVE_MPI)
std::unique_ptr<Transport> make_mpi_transport(std::shared_ptr<Group>) {
  raise(ErrorCode::unsupported, "the mpi transport is not implemented yet");
}
#endif
}  // namespace epmoe
