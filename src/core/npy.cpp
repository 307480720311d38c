#include "core/npy.hpp"

#include <fstream>
#include <regex>
#include <vector>

#include "core/check.hpp"

namespace epmoe {

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
  std::string header(header_len, '\0');
  in.read(header.data(), header_len);

  std::smatch m;
  if (!std::regex_search(header, m, std::regex("'descr':\\s*'([<|>])([a-z])(\\d+)'")))
    raise(ErrorCode::invalid_argument, "'{}': no dtype in header {}", path, header);
  if (m[1] == ">") raise(ErrorCode::unsupported, "'{}': big-endian arrays are not supported", path);
  const std::string kind = m[2], bytes = m[3];
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
  if (!std::regex_search(header, m, std::regex("'shape':\\s*\\(([^)]*)\\)")))
    raise(ErrorCode::invalid_argument, "'{}': no shape in header {}", path, header);
  std::vector<std::int64_t> dims;
  const std::string shape_text = m[1];
  const std::regex number("\\d+");
  for (std::sregex_iterator it(shape_text.begin(), shape_text.end(), number), end; it != end; ++it)
    dims.push_back(std::stoll(it->str()));
  if (dims.empty() || dims.size() > 4) raise(ErrorCode::unsupported, "'{}': {} dimensions", path, dims.size());
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
