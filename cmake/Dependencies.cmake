# Third-party libraries, all from Debian's packages (scripts/setup.sh installs them).
find_package(Threads REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
find_package(BLAS REQUIRED)
if(EPMOE_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(EPMOE_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()
find_package(MPI COMPONENTS CXX)
# NCCL (optional, CUDA builds only): `epmoe bench` times an NCCL all-to-all-v beside epmoe. Only the header
# is needed at build time; the tool loads libnccl.so.2 with dlopen when it runs, so a binary built here
# starts on machines without NCCL (the bench then says so). EPMOE_NCCL_ROOT points at another install.
option(EPMOE_ENABLE_NCCL "Compare against NCCL in `epmoe bench` when nccl.h is found (CUDA builds)" ON)
set(EPMOE_NCCL_FOUND OFF)
if(EPMOE_ENABLE_CUDA AND EPMOE_ENABLE_NCCL)
  find_path(EPMOE_NCCL_INCLUDE_DIR nccl.h
    HINTS ${EPMOE_NCCL_ROOT} $ENV{NCCL_HOME} ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda
    PATH_SUFFIXES include)
  find_library(EPMOE_NCCL_LIBRARY NAMES nccl libnccl.so.2
    HINTS ${EPMOE_NCCL_ROOT} $ENV{NCCL_HOME} ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda
    PATH_SUFFIXES lib lib64)
  if(EPMOE_NCCL_INCLUDE_DIR)
    set(EPMOE_NCCL_FOUND ON)
    message(STATUS "epmoe: NCCL header in ${EPMOE_NCCL_INCLUDE_DIR} (library ${EPMOE_NCCL_LIBRARY}, loaded at run time)")
  else()
    message(STATUS "epmoe: nccl.h not found; `epmoe bench` will say 'nccl: not built'")
  endif()
endif()
