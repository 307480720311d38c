#include "support/npy_writer.hpp"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace epmoe::test {
namespace {

void write_npy(const std::string& path, const char* descr, const std::vector<std::int64_t>& shape, const void* data,
               std::size_t bytes) {
  std::string dims;
  for (std::int64_t d : shape) dims += std::to_string(d) + ", ";
  if (shape.size() > 1) dims.resize(dims.size() - 2);  // "(3,)" for one dimension, "(3, 2)" otherwise
  std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (" + dims + "), }";
  // Magic (6) + version (2) + length (2) + header, padded with spaces to a multiple of 64 ending in '\n'.
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  out.write("\x93NUMPY\x01\x00", 8);
  const char len[2] = {static_cast<char>(header.size() & 0xff), static_cast<char>(header.size() >> 8)};
  out.write(len, 2);
  out << header;
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!out) throw std::runtime_error("cannot write " + path);
}

}  // namespace

void write_npy_i16(const std::string& path, const std::vector<std::int64_t>& shape,
                   const std::vector<std::int16_t>& data) {
  write_npy(path, "<i2", shape, data.data(), data.size() * sizeof(std::int16_t));
}

void write_npy_f32(const std::string& path, const std::vector<std::int64_t>& shape, const std::vector<float>& data) {
  write_npy(path, "<f4", shape, data.data(), data.size() * sizeof(float));
}

void write_routing_trace(const std::string& dir, const std::string& domain, std::int64_t T, std::int64_t L,
                         std::int64_t K, const std::vector<std::int16_t>& ids, const std::vector<float>& weights) {
  std::filesystem::create_directories(dir);
  write_npy_i16(dir + "/" + domain + ".topk_idx.npy", {T, L, K}, ids);
  write_npy_f32(dir + "/" + domain + ".topk_weights.npy", {T, L, K}, weights);
}

}  // namespace epmoe::test
