// Paths for the files a test writes, in GoogleTest's temporary directory.
#pragma once

#include <string>
#include <string_view>

namespace epmoe::test {

/// TempDir/<prefix>_<pid>_<test name>_<leaf>: unique per test and per process, so two suites running at once on one
/// machine (ctest runs each test in its own process) never share a file.
std::string temp_path(std::string_view prefix, std::string_view leaf);

}  // namespace epmoe::test
