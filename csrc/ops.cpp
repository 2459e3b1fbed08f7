// The torch ops of fastsafetensors. A translation layer only: the Rust loader decides what
// to read and how; this file turns its buffers into at::Tensors and registers the ops.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "rust/cxx.h"
#include "fastsafetensors/rust/bridge.rs.h"

namespace fastsafetensors {
namespace {

using TensorDict = c10::Dict<std::string, at::Tensor>;
using Buffer = std::shared_ptr<::rust::Box<rs::BufferRef>>;

// Calls into Rust, turning its errors into torch errors (RuntimeError in Python).
template <class F>
auto call_rust(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const ::rust::Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

// The torch dtype of a safetensors dtype name.
at::ScalarType scalar_type(const rs::TensorSpec& t) {
  static const std::unordered_map<std::string, at::ScalarType> table = {
      {"BOOL", at::kBool},
      {"U8", at::kByte},
      {"I8", at::kChar},
      {"I16", at::kShort},
      {"U16", at::kUInt16},
      {"I32", at::kInt},
      {"U32", at::kUInt32},
      {"I64", at::kLong},
      {"U64", at::kUInt64},
      {"F16", at::kHalf},
      {"BF16", at::kBFloat16},
      {"F32", at::kFloat},
      {"F64", at::kDouble},
      {"C64", at::kComplexFloat},
      {"F8_E4M3", at::kFloat8_e4m3fn},
      {"F8_E5M2", at::kFloat8_e5m2},
      {"F8_E4M3FNUZ", at::kFloat8_e4m3fnuz},
      {"F8_E5M2FNUZ", at::kFloat8_e5m2fnuz},
      {"F8_E8M0", at::kFloat8_e8m0fnu},
      {"F4", at::kFloat4_e2m1fn_x2},
  };
  auto it = table.find(std::string(t.dtype));
  TORCH_CHECK(it != table.end(), "tensor '", std::string(t.name), "': dtype ", std::string(t.dtype),
              " has no torch equivalent");
  return it->second;
}

// The torch shape: torch packs F4 two per element (float4_e2m1fn_x2), halving the last dim.
std::vector<int64_t> torch_shape(const rs::TensorSpec& t) {
  std::vector<int64_t> shape(t.shape.begin(), t.shape.end());
  if (std::string(t.dtype) == "F4") {
    TORCH_CHECK(!shape.empty() && shape.back() % 2 == 0, "tensor '", std::string(t.name),
                "': F4 needs an even last dimension to load as torch.float4_e2m1fn_x2");
    shape.back() /= 2;
  }
  return shape;
}

// A tensor over the bytes of `t` in `buffer`. Each tensor's deleter holds a reference on
// its buffer, so the buffer lives exactly as long as the last tensor into it.
at::Tensor wrap(const rs::TensorSpec& t, const Buffer& buffer) {
  const auto type = scalar_type(t);
  const auto shape = torch_shape(t);
  const auto options = at::TensorOptions().dtype(type).device(at::kCPU);
  if (t.nbytes == 0) {
    return at::empty(shape, options);
  }
  auto* data = reinterpret_cast<uint8_t*>((*buffer)->address()) + t.offset;
  if (t.aligned) {
    return at::from_blob(data, shape, [buffer](void*) {}, options);
  }
  // Not aligned to its element size (the header length is not a multiple of it): copy the
  // bytes into fresh, aligned memory, then reinterpret them.
  auto bytes = at::from_blob(data, {static_cast<int64_t>(t.nbytes)}, at::TensorOptions(at::kByte));
  return bytes.clone().view(type).view(shape);
}

// Casts only what users mean by "the model's dtype": full-precision floating point.
// Quantised payloads (float8, float4, e8m0 scales) and integers keep their type.
bool castable(at::ScalarType type) {
  return type == at::kHalf || type == at::kBFloat16 || type == at::kFloat || type == at::kDouble;
}

::rust::Vec<::rust::String> to_rust(const std::vector<std::string>& strings) {
  ::rust::Vec<::rust::String> out;
  out.reserve(strings.size());
  for (const auto& s : strings) out.push_back(::rust::String(s));
  return out;
}

std::tuple<TensorDict, std::vector<std::string>> load_with_report(
    std::vector<std::string> files, std::string device, std::optional<at::ScalarType> dtype,
    std::optional<std::string> reader) {
  const c10::Device target(device);
  auto paths = to_rust(files);
  auto loaded = call_rust([&] { return rs::load_files(paths, reader.value_or("")); });

  std::vector<Buffer> buffers;
  for (size_t i = 0; i < loaded->buffer_count(); ++i) {
    buffers.push_back(std::make_shared<::rust::Box<rs::BufferRef>>(loaded->buffer(i)));
  }
  TensorDict tensors;
  for (const auto& spec : loaded->tensors()) {
    auto t = wrap(spec, buffers[spec.buffer]);
    if (!target.is_cpu()) t = t.to(target);
    if (dtype && castable(t.scalar_type()) && t.scalar_type() != *dtype) t = t.to(*dtype);
    tensors.insert(std::string(spec.name), std::move(t));
  }
  std::vector<std::string> read_paths;
  for (const auto& p : loaded->read_paths()) read_paths.emplace_back(p);
  return {std::move(tensors), std::move(read_paths)};
}

TensorDict load(std::vector<std::string> files, std::string device,
                std::optional<at::ScalarType> dtype, std::optional<std::string> reader) {
  return std::get<0>(load_with_report(std::move(files), std::move(device), dtype, std::move(reader)));
}

rs::HeaderSpec header(const std::string& file) {
  return call_rust([&] { return rs::read_header(file); });
}

std::optional<c10::Dict<std::string, std::string>> metadata_of(const rs::HeaderSpec& h) {
  if (!h.has_metadata) return std::nullopt;
  c10::Dict<std::string, std::string> out;
  for (const auto& e : h.metadata) out.insert(std::string(e.key), std::string(e.value));
  return out;
}

// Tensor names, dtypes and shapes in offset order, and the metadata, without reading data.
std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::vector<int64_t>>,
           std::optional<c10::Dict<std::string, std::string>>>
describe(std::string file) {
  const auto h = header(file);
  std::vector<std::string> names, dtypes;
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& t : h.tensors) {
    names.emplace_back(t.name);
    dtypes.emplace_back(t.dtype);
    shapes.emplace_back(t.shape.begin(), t.shape.end());
  }
  return {std::move(names), std::move(dtypes), std::move(shapes), metadata_of(h)};
}

std::vector<std::string> keys(std::string file) {
  auto names = std::get<0>(describe(std::move(file)));
  std::sort(names.begin(), names.end());
  return names;
}

std::optional<c10::Dict<std::string, std::string>> metadata(std::string file) {
  return metadata_of(header(file));
}

}  // namespace

TORCH_LIBRARY(fastsafetensors, m) {
  m.def("load(str[] files, str device=\"cpu\", ScalarType? dtype=None, str? reader=None) -> Dict(str, Tensor)");
  m.def(
      "load_with_report(str[] files, str device=\"cpu\", ScalarType? dtype=None, str? reader=None)"
      " -> (Dict(str, Tensor), str[])");
  m.def("keys(str file) -> str[]");
  m.def("metadata(str file) -> Dict(str, str)?");
  m.def("describe(str file) -> (str[] names, str[] dtypes, int[][] shapes, Dict(str, str)? metadata)");
}

TORCH_LIBRARY_IMPL(fastsafetensors, CompositeExplicitAutograd, m) {
  m.impl("load", TORCH_FN(load));
  m.impl("load_with_report", TORCH_FN(load_with_report));
  m.impl("keys", TORCH_FN(keys));
  m.impl("metadata", TORCH_FN(metadata));
  m.impl("describe", TORCH_FN(describe));
}

}  // namespace fastsafetensors
