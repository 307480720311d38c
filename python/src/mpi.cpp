// epmoe._ext: the native MPI group from an mpi4py communicator (builds with MPI only).
//
// mpi4py hands its communicator over as a Fortran handle (comm.py2f()), which MPI_Comm_f2c turns back into
// an MPI_Comm, valid only when mpi4py and this extension use the same MPI library: epmoe/_group.py compares
// mpi_library_version() with mpi4py's MPI.Get_library_version() first and falls back to the all-gather
// adapter otherwise.
#include "ext.hpp"

#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>

#if defined(EPMOE_HAVE_MPI)
#include <epmoe/mpi.hpp>
#endif

namespace epmoe::py {

void bind_mpi(nb::module_& m) {
#if defined(EPMOE_HAVE_MPI)
  m.def(
      "mpi_library_version",
      [] {
        char text[MPI_MAX_LIBRARY_VERSION_STRING] = {};
        int len = 0;
        MPI_Get_library_version(text, &len);  // allowed before MPI_Init
        return std::string(text, static_cast<std::size_t>(len));
      },
      "MPI_Get_library_version() of the MPI library this extension links.");
  m.def(
      "mpi_group_from_fortran",
      [](std::int64_t fortran_handle) {
        const MPI_Comm comm = MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_handle));
        std::shared_ptr<Group> g;
        {
          nb::gil_scoped_release release;  // collective (MPI_Comm_idup)
          g = make_mpi_group(comm);
        }
        return PyGroup{std::move(g)};
      },
      nb::arg("fortran_handle"),
      "The native MPI Group (backend 'mpi') over the communicator with this Fortran handle (mpi4py: comm.py2f()). "
      "Collective. The caller must use the same MPI library (compare mpi_library_version()).");
#else
  (void)m;
#endif
}

}  // namespace epmoe::py
