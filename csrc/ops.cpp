// The torch ops of fastsafetensors. A translation layer only: the Rust loader decides what
// to read and how; this file turns its buffers into at::Tensors and registers the ops.
#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
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

// A tensor over the bytes of `t` in a file's device buffer, whose byte 0 is at `start` in
// `buffer`: a view, so the buffer (owned by torch's caching allocator) is freed when the last
// tensor into it dies.
at::Tensor wrap_device(const rs::TensorSpec& t, const at::Tensor& buffer, int64_t start) {
  const auto type = scalar_type(t);
  const auto shape = torch_shape(t);
  if (t.nbytes == 0) {
    return at::empty(shape, buffer.options().dtype(type));
  }
  auto bytes = buffer.narrow(0, start + static_cast<int64_t>(t.offset), static_cast<int64_t>(t.nbytes));
  // Misaligned data is copied to fresh aligned memory on the device, not through the host.
  return (t.aligned ? bytes : bytes.clone()).view(type).view(shape);
}

// Fails, before anything is read, on a tensor torch cannot represent.
void check_torch_types(const rs::PlannedFiles& planned) {
  for (const auto& spec : planned.tensors()) {
    scalar_type(spec);
    torch_shape(spec);
  }
}

// `dtype=` casts only what users mean by "the model's dtype": full-precision floating point
// (F16, BF16, F32, F64), to one of those. Integers, bool, complex and quantised payloads
// (float8, float4, e8m0 scales) keep their type. A target outside that set is refused: a cast
// to int8 or float8 without scales turns weights into zeros and saturated values.
bool castable(at::ScalarType type) {
  return type == at::kHalf || type == at::kBFloat16 || type == at::kFloat || type == at::kDouble;
}

void check_cast_target(std::optional<at::ScalarType> dtype) {
  if (!dtype || castable(*dtype)) return;
  const std::string name = "torch." + std::string(c10::getDtypeNames(*dtype).first);
  TORCH_CHECK(false, "fastsafetensors: dtype=", name,
              " is not supported: dtype= casts floating-point tensors (F16, BF16, F32, F64) to torch.float16, "
              "torch.bfloat16, torch.float32 or torch.float64 and leaves the others as stored; convert to ",
              name, " yourself (tensor.to(", name, ")) if that is what you want");
}

// The cast runs where the tensor is: on the GPU for device loads.
at::Tensor cast(at::Tensor t, std::optional<at::ScalarType> dtype) {
  const auto type = t.scalar_type();
  return dtype && castable(type) && type != *dtype ? t.to(*dtype) : t;
}

// The device a load targets: "cpu" or "cuda[:N]"; anything else is refused in one line.
c10::Device target_device(const std::string& device) {
  std::optional<c10::Device> target;
  try {
    target.emplace(device);
  } catch (const c10::Error&) {
    TORCH_CHECK(false, "fastsafetensors: cannot load to device '", device,
                "': not a device name (use 'cpu', 'cuda' or 'cuda:N')");
  }
  TORCH_CHECK(target->is_cpu() || target->is_cuda(), "fastsafetensors: cannot load to device '", device,
              "' (only cpu and cuda)");
  // torch accepts "cpu:1" but there is one CPU device; safetensors refuses it too.
  TORCH_CHECK(!target->is_cpu() || target->index() <= 0, "fastsafetensors: cannot load to device '", device,
              "': there is one CPU device, 'cpu'");
  return *target;
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

// One file's tensors as first wrapped: views of the file's buffer, unless marked otherwise.
struct FileTensors {
  std::vector<std::string> names;
  std::vector<at::Tensor> tensors;
  std::vector<bool> views;  // shares the file's buffer (else: copied, or empty)

  void add(const rs::TensorSpec& spec, at::Tensor tensor) {
    names.emplace_back(spec.name);
    tensors.push_back(std::move(tensor));
    views.push_back(spec.aligned && spec.nbytes > 0);
  }
};

// Adds a file's tensors to `out`, cast to `dtype` where the cast rule says so. A buffer
// outlives the call only if every tensor of its file is still a view of it: once one was
// cast, the others are copied out (when `release` allows), so that the whole buffer is freed
// as soon as the caller drops its own reference, instead of staying alive for a few small
// uncast tensors beside the cast copies.
void add_file(FileTensors&& file, std::optional<at::ScalarType> dtype, bool release, TensorDict& out) {
  std::vector<at::Tensor> results;
  bool any_cast = false;
  for (const auto& t : file.tensors) {
    results.push_back(cast(t, dtype));
    any_cast = any_cast || !results.back().is_same(t);
  }
  for (size_t k = 0; k < results.size(); ++k) {
    if (any_cast && release && file.views[k] && results[k].is_same(file.tensors[k])) {
      results[k] = results[k].clone();
    }
    out.insert(file.names[k], std::move(results[k]));
  }
}

Loaded load_to_host(const std::vector<std::string>& files, const std::string& reader,
                    std::optional<at::ScalarType> dtype) {
  auto paths = to_rust(files);
  auto planned = call_rust([&] { return rs::plan_files(paths); });
  check_torch_types(*planned);
  std::vector<Buffer> buffers;
  std::vector<FileTensors> by_file;
  std::vector<std::string> read_paths;
  {
    auto loaded = call_rust([&] { return rs::read_to_host(std::move(planned), reader); });
    read_paths = from_rust(loaded->read_paths());
    for (size_t i = 0; i < loaded->buffer_count(); ++i) {
      buffers.push_back(std::make_shared<::rust::Box<rs::BufferRef>>(loaded->buffer(i)));
    }
    by_file.resize(buffers.size());
    for (const auto& spec : loaded->tensors()) {
      by_file[spec.buffer].add(spec, wrap_host(spec, buffers[spec.buffer]));
    }
  }  // From here on, only the tensors and `buffers` keep the files' memory.
  TensorDict tensors;
  for (size_t i = 0; i < by_file.size(); ++i) {
    // A zero-copy mapping holds page cache, not memory of its own: its views stay views.
    add_file(std::move(by_file[i]), dtype, read_paths[i] != "mmap", tensors);
    buffers[i].reset();
  }
  return {std::move(tensors), std::move(read_paths)};
}

// Torch's CUDA hooks, reached through the device-guard registry: the extension links none of
// torch's CUDA libraries, so that it still loads under a CPU-only torch.
const c10::impl::DeviceGuardImplInterface& cuda_hooks() {
  return *c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
}

// An event recorded on torch's current stream of a device once the file buffers are
// allocated: the caching allocator may hand out memory that work queued there still uses,
// so the loader orders its copies after it. Destroyed with this object.
class ReadyEvent {
 public:
  explicit ReadyEvent(const c10::Device& device) : index_(device.index()) {
    const auto& hooks = cuda_hooks();
    hooks.record(&event_, hooks.getStream(device), index_, c10::EventFlag::PYTORCH_DEFAULT);
  }
  ReadyEvent(const ReadyEvent&) = delete;
  ReadyEvent& operator=(const ReadyEvent&) = delete;
  ~ReadyEvent() {
    if (event_ != nullptr) cuda_hooks().destroyEvent(event_, index_);
  }
  uint64_t handle() const { return reinterpret_cast<uint64_t>(event_); }

 private:
  c10::DeviceIndex index_;
  void* event_ = nullptr;
};

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
  check_torch_types(*planned);
  // Plain "cuda" is torch's current device, also when there is nothing to load.
  const c10::Device device = target.has_index() ? target : cuda_hooks().getDevice();
  const int32_t gds = nogds.has_value() ? static_cast<int32_t>(*nogds) : -1;
  const size_t count = planned->file_count();
  // Without a cast every tensor stays a view of its file's buffer, and all files are read in
  // one go, overlapping. With one, file by file: each file's buffer is freed (its tensors
  // cast or copied out) before the next one is allocated.
  std::vector<std::vector<size_t>> groups(dtype && count > 0 ? count : 1);
  for (size_t i = 0; i < count; ++i) groups[dtype ? i : 0].push_back(i);
  std::vector<FileTensors> by_file(count);
  std::vector<std::string> read_paths(count);
  TensorDict tensors;
  for (const auto& group : groups) {
    // Destination memory comes from torch's caching allocator, so torch's memory statistics
    // (which vLLM sizes its KV cache from) count it.
    std::vector<at::Tensor> buffers;
    ::rust::Vec<size_t> indices;
    ::rust::Vec<uint64_t> bases;
    for (const size_t i : group) {
      const auto len = static_cast<int64_t>(planned->device_alloc_len(i));
      buffers.push_back(at::empty({len}, at::TensorOptions(at::kByte).device(device)));
      indices.push_back(i);
      bases.push_back(reinterpret_cast<uint64_t>(buffers.back().data_ptr()));
    }
    std::optional<ReadyEvent> ready;
    if (!group.empty()) ready.emplace(device);
    const auto copies = call_rust([&] {
      return planned->copy_to_cuda(device.index(), indices, bases, reader, gds, ready ? ready->handle() : 0);
    });
    ready.reset();
    for (size_t k = 0; k < group.size(); ++k) {
      read_paths[group[k]] = std::string(copies[k].path);
    }
    for (const auto& spec : planned->tensors()) {
      const auto k = std::find(group.begin(), group.end(), spec.buffer);
      if (k == group.end()) continue;
      const auto at = static_cast<size_t>(k - group.begin());
      by_file[spec.buffer].add(spec, wrap_device(spec, buffers[at], static_cast<int64_t>(copies[at].offset)));
    }
    buffers.clear();  // From here on, only the tensors keep the files' memory.
    for (const size_t i : group) add_file(std::move(by_file[i]), dtype, true, tensors);
  }
  return {std::move(tensors), std::move(read_paths)};
}

Loaded load_with_report(std::vector<std::string> files, std::string device,
                        std::optional<at::ScalarType> dtype, std::optional<std::string> reader,
                        std::optional<bool> nogds) {
  const auto target = target_device(device);
  check_cast_target(dtype);
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

// Frees the pinned staging buffers kept for later CUDA loads; returns how many were freed.
int64_t release_staging_buffers() { return static_cast<int64_t>(rs::release_staging_buffers()); }

std::string check_device(std::string device) {
  return target_device(device).str();
}

// The files `path` (a file, checkpoint directory or index) stands for, the index they come
// from, and every problem between them and the index.
std::tuple<std::vector<std::string>, std::optional<std::string>, std::vector<std::string>> checkpoint(
    std::string path) {
  const auto c = call_rust([&] { return rs::checkpoint(path); });
  std::optional<std::string> index;
  if (!c.index.empty()) index = std::string(c.index);
  return {from_rust(c.files), index, from_rust(c.problems)};
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
  m.def("check_device(str device) -> str");
  m.def("checkpoint(str path) -> (str[] files, str? index, str[] problems)");
  m.def("resident_fraction(str file) -> float");
  m.def("release_staging_buffers() -> int");
  m.def("metadata(str file) -> Dict(str, str)?");
  m.def("describe(str file) -> (str[] names, str[] dtypes, int[][] shapes, Dict(str, str)? metadata)");
}

TORCH_LIBRARY_IMPL(fastsafetensors, CompositeExplicitAutograd, m) {
  m.impl("load", TORCH_FN(load));
  m.impl("load_with_report", TORCH_FN(load_with_report));
  m.impl("keys", TORCH_FN(keys));
  m.impl("check_device", TORCH_FN(check_device));
  m.impl("checkpoint", TORCH_FN(checkpoint));
  m.impl("resident_fraction", TORCH_FN(resident_fraction));
  m.impl("release_staging_buffers", TORCH_FN(release_staging_buffers));
  m.impl("metadata", TORCH_FN(metadata));
  m.impl("describe", TORCH_FN(describe));
}

}  // namespace fastsafetensors
