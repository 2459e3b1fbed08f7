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

// A tensor over the bytes of `t` in a host buffer. Each tensor's deleter holds a reference
// on its buffer, so the buffer lives exactly as long as the last tensor into it.
at::Tensor wrap_host(const rs::TensorSpec& t, const Buffer& buffer) {
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

// A tensor over the bytes of `t` in a file's device buffer: a view, so the buffer (owned by
// torch's caching allocator) is freed when the last tensor into it dies.
at::Tensor wrap_device(const rs::TensorSpec& t, const at::Tensor& buffer) {
  const auto type = scalar_type(t);
  const auto shape = torch_shape(t);
  if (t.nbytes == 0) {
    return at::empty(shape, buffer.options().dtype(type));
  }
  auto bytes = buffer.narrow(0, static_cast<int64_t>(t.offset), static_cast<int64_t>(t.nbytes));
  // Misaligned data is copied to fresh aligned memory on the device, not through the host.
  return (t.aligned ? bytes : bytes.clone()).view(type).view(shape);
}

// Casts only what users mean by "the model's dtype": full-precision floating point.
// Quantised payloads (float8, float4, e8m0 scales) and integers keep their type. The cast
// runs where the tensor is: on the GPU for device loads.
at::Tensor cast(at::Tensor t, std::optional<at::ScalarType> dtype) {
  const auto type = t.scalar_type();
  const bool castable = type == at::kHalf || type == at::kBFloat16 || type == at::kFloat || type == at::kDouble;
  return dtype && castable && type != *dtype ? t.to(*dtype) : t;
}

::rust::Vec<::rust::String> to_rust(const std::vector<std::string>& strings) {
  ::rust::Vec<::rust::String> out;
  out.reserve(strings.size());
  for (const auto& s : strings) out.push_back(::rust::String(s));
  return out;
}

std::vector<std::string> from_rust(const ::rust::Vec<::rust::String>& strings) {
  return std::vector<std::string>(strings.begin(), strings.end());
}

using Loaded = std::tuple<TensorDict, std::vector<std::string>>;

Loaded load_to_host(const std::vector<std::string>& files, const std::string& reader,
                    std::optional<at::ScalarType> dtype) {
  auto paths = to_rust(files);
  rs::TensorSelection everything{false, {}, ::rust::String("glob")};
  auto loaded = call_rust([&] { return rs::load_files(paths, reader, everything); });
  std::vector<Buffer> buffers;
  for (size_t i = 0; i < loaded->buffer_count(); ++i) {
    buffers.push_back(std::make_shared<::rust::Box<rs::BufferRef>>(loaded->buffer(i)));
  }
  TensorDict tensors;
  for (const auto& spec : loaded->tensors()) {
    tensors.insert(std::string(spec.name), cast(wrap_host(spec, buffers[spec.buffer]), dtype));
  }
  return {std::move(tensors), from_rust(loaded->read_paths())};
}

Loaded load_to_cuda(const std::vector<std::string>& files, const c10::Device& target,
                    const std::string& reader, std::optional<at::ScalarType> dtype,
                    std::optional<bool> nogds) {
  // Our own check first: a clear error, at once, on machines without a driver or device.
  size_t devices = 0;
  try {
    devices = rs::cuda_device_count();
  } catch (const ::rust::Error& e) {
    TORCH_CHECK(false, "fastsafetensors: cannot load to ", target.str(), ": ", e.what());
  }
  TORCH_CHECK(devices > 0, "fastsafetensors: cannot load to ", target.str(), ": CUDA: no CUDA device is visible");
  auto paths = to_rust(files);
  auto planned = call_rust([&] { return rs::plan_files(paths); });
  // Destination memory comes from torch's caching allocator, so torch's memory statistics
  // (which vLLM sizes its KV cache from) count it.
  std::vector<at::Tensor> buffers;
  ::rust::Vec<uint64_t> destinations;
  for (size_t i = 0; i < planned->file_count(); ++i) {
    const auto len = static_cast<int64_t>(planned->device_len(i));
    buffers.push_back(at::empty({len}, at::TensorOptions(at::kByte).device(target)));
    destinations.push_back(reinterpret_cast<uint64_t>(buffers.back().data_ptr()));
  }
  const int ordinal = buffers.empty() ? std::max<int>(target.index(), 0) : buffers.front().device().index();
  const int32_t gds = nogds.has_value() ? static_cast<int32_t>(*nogds) : -1;
  auto read_paths = call_rust([&] { return planned->copy_to_cuda(ordinal, destinations, reader, gds); });
  TensorDict tensors;
  for (const auto& spec : planned->tensors()) {
    tensors.insert(std::string(spec.name), cast(wrap_device(spec, buffers[spec.buffer]), dtype));
  }
  return {std::move(tensors), from_rust(read_paths)};
}

Loaded load_with_report(std::vector<std::string> files, std::string device,
                        std::optional<at::ScalarType> dtype, std::optional<std::string> reader,
                        std::optional<bool> nogds) {
  const c10::Device target(device);
  TORCH_CHECK(target.is_cpu() || target.is_cuda(), "fastsafetensors: cannot load to device '", device,
              "' (only cpu and cuda)");
  return target.is_cpu() ? load_to_host(files, reader.value_or(""), dtype)
                         : load_to_cuda(files, target, reader.value_or(""), dtype, nogds);
}

TensorDict load(std::vector<std::string> files, std::string device,
                std::optional<at::ScalarType> dtype, std::optional<std::string> reader,
                std::optional<bool> nogds) {
  return std::get<0>(load_with_report(std::move(files), std::move(device), dtype, std::move(reader), nogds));
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

double resident_fraction(std::string file) {
  return call_rust([&] { return rs::resident_fraction(file); });
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
  m.def(
      "load(str[] files, str device=\"cpu\", ScalarType? dtype=None, str? reader=None, bool? nogds=None)"
      " -> Dict(str, Tensor)");
  m.def(
      "load_with_report(str[] files, str device=\"cpu\", ScalarType? dtype=None, str? reader=None,"
      " bool? nogds=None) -> (Dict(str, Tensor), str[])");
  m.def("keys(str file) -> str[]");
  m.def("resident_fraction(str file) -> float");
  m.def("metadata(str file) -> Dict(str, str)?");
  m.def("describe(str file) -> (str[] names, str[] dtypes, int[][] shapes, Dict(str, str)? metadata)");
}

TORCH_LIBRARY_IMPL(fastsafetensors, CompositeExplicitAutograd, m) {
  m.impl("load", TORCH_FN(load));
  m.impl("load_with_report", TORCH_FN(load_with_report));
  m.impl("keys", TORCH_FN(keys));
  m.impl("resident_fraction", TORCH_FN(resident_fraction));
  m.impl("metadata", TORCH_FN(metadata));
  m.impl("describe", TORCH_FN(describe));
}

}  // namespace fastsafetensors
