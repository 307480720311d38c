#include "core/npy.hpp"

#include <cctype>
#include <charconv>
#include <fstream>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "core/check.hpp"

namespace epmoe {

namespace {

/// Where `key`'s value starts in the header (a Python dict literal), past spaces; npos without the key. (Scanned by
/// hand: std::regex cost compile time and GCC 12 -Wmaybe-uninitialized noise in the sanitizer build.)
std::size_t value_of(const std::string& header, std::string_view key) {
  std::size_t i = header.find(key);
  if (i == std::string::npos) return i;
  i += key.size();
  while (i < header.size() && std::isspace(static_cast<unsigned char>(header[i]))) ++i;
  return i;
}

}  // namespace

Tensor load_npy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) raise(ErrorCode::invalid_argument, "cannot open .npy file '{}'", path);
  char magic[8];
  in.read(magic, 8);
  if (!in || std::string(magic, 6) != "\x93NUMPY")
    raise(ErrorCode::invalid_argument, "'{}' is not a .npy file (bad magic)", path);
  std::uint32_t header_len = 0;
  if (magic[6] == 1) {
    unsigned char b[2];
    in.read(reinterpret_cast<char*>(b), 2);
    header_len = b[0] | (b[1] << 8);
  } else {
    unsigned char b[4];
    in.read(reinterpret_cast<char*>(b), 4);
    header_len = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<std::uint32_t>(b[3]) << 24);
  }
  if (!in || header_len > (1u << 20))
    raise(ErrorCode::invalid_argument, "'{}': expected a header of at most 1 MiB, got {} bytes", path, header_len);
  std::string header(header_len, '\0');
  in.read(header.data(), header_len);
  if (!in) raise(ErrorCode::invalid_argument, "'{}': file shorter than its header length ({} bytes)", path, header_len);

  // 'descr': '<i8' (byte order, kind letter, size in bytes)
  std::size_t at = value_of(header, "'descr':");
  const std::size_t quote = at == std::string::npos || at >= header.size() || header[at] != '\''
                                ? std::string::npos
                                : header.find('\'', at + 1);
  const std::string descr = quote == std::string::npos ? std::string() : header.substr(at + 1, quote - at - 1);
  if (descr.size() < 3 || std::string_view("<|>").find(descr[0]) == std::string_view::npos ||
      !std::islower(static_cast<unsigned char>(descr[1])) || descr.find_first_not_of("0123456789", 2) != std::string::npos)
    raise(ErrorCode::invalid_argument, "'{}': no dtype in header {}", path, header);
  if (descr[0] == '>') raise(ErrorCode::unsupported, "'{}': big-endian arrays are not supported", path);
  const std::string kind = descr.substr(1, 1), bytes = descr.substr(2);
  DType dtype;
  if (kind == "i" && bytes == "1") dtype = DType::int8;
  else if (kind == "i" && bytes == "2") dtype = DType::int16;
  else if (kind == "i" && bytes == "4") dtype = DType::int32;
  else if (kind == "i" && bytes == "8") dtype = DType::int64;
  else if (kind == "f" && bytes == "4") dtype = DType::fp32;
  else if (kind == "b" && bytes == "1") dtype = DType::boolean;
  else raise(ErrorCode::unsupported, "'{}': dtype {}{} is not supported", path, kind, bytes);
  if (header.find("'fortran_order': True") != std::string::npos)
    raise(ErrorCode::unsupported, "'{}': Fortran-order arrays are not supported", path);
  // 'shape': (3, 4) or (3,)
  at = value_of(header, "'shape':");
  const std::size_t close = at == std::string::npos ? at : header.find(')', at);
  if (at == std::string::npos || at >= header.size() || header[at] != '(' || close == std::string::npos)
    raise(ErrorCode::invalid_argument, "'{}': no shape in header {}", path, header);
  // Every size is checked before anything is allocated: a header may claim any shape.
  std::vector<std::int64_t> dims;
  const std::string shape_text = header.substr(at + 1, close - at - 1);
  std::uint64_t elements = 1;
  bool overflow = false;
  for (std::size_t begin = 0; begin <= shape_text.size();) {
    std::size_t end = shape_text.find(',', begin);
    if (end == std::string::npos) end = shape_text.size();
    std::string text = shape_text.substr(begin, end - begin);
    begin = end + 1;
    const auto first = text.find_first_not_of(" \t"), last = text.find_last_not_of(" \t");
    if (first == std::string::npos) continue;  // "(3,)": nothing after the last comma
    text = text.substr(first, last - first + 1);
    std::int64_t d = 0;
    const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), d);
    if (ec != std::errc() || ptr != text.data() + text.size() || d < 0)
      raise(ErrorCode::invalid_argument, "'{}': expected a shape of sizes in [0, 2^63), got ({}) in the header", path,
            shape_text);
    if (d != 0 && elements > std::numeric_limits<std::uint64_t>::max() / static_cast<std::uint64_t>(d)) overflow = true;
    elements *= static_cast<std::uint64_t>(d);
    dims.push_back(d);
  }
  if (dims.empty() || dims.size() > 4) raise(ErrorCode::unsupported, "'{}': {} dimensions", path, dims.size());
  const auto data_start = in.tellg();
  in.seekg(0, std::ios::end);
  const auto file_end = in.tellg();
  in.seekg(data_start);
  const std::uint64_t available = static_cast<std::uint64_t>(file_end - data_start);
  const std::uint64_t esize = dtype_size(dtype);
  if (overflow || elements > available / esize)
    raise(ErrorCode::invalid_argument, "'{}': expected {} bytes of data for shape ({}), got {} bytes in the file",
          path, overflow ? std::string("more than 2^64") : std::to_string(elements * esize), shape_text, available);
  Shape shape;
  switch (dims.size()) {
    case 1: shape = Shape{dims[0]}; break;
    case 2: shape = Shape{dims[0], dims[1]}; break;
    case 3: shape = Shape{dims[0], dims[1], dims[2]}; break;
    default: shape = Shape{dims[0], dims[1], dims[2], dims[3]}; break;
  }
  Tensor t = Tensor::empty(dtype, shape);
  in.read(static_cast<char*>(t.data()), static_cast<std::streamsize>(t.nbytes()));
  if (!in) raise(ErrorCode::invalid_argument, "'{}': file shorter than its header says ({} bytes of data)", path, t.nbytes());
  return t;
}

}  // namespace epmoe
