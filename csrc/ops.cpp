// The torch ops of fastsafetensors. A translation layer only: the Rust loader decides what
// to read and how; this file turns its buffers into at::Tensors and registers the ops.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "rust/cxx.h"
#include "fastsafetensors/rust/bridge.rs.h"

namespace fastsafetensors {
namespace {

using TensorDict = c10::Dict<std::string, at::Tensor>;
// Names and tensors in read order.
using NamedTensors = std::tuple<std::vector<std::string>, std::vector<at::Tensor>>;

// Calls into Rust, turning its errors into torch errors (RuntimeError in Python).
template <class F>
auto call_rust(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const ::rust::Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

std::string_view view(const ::rust::String& s) { return {s.data(), s.size()}; }

// The torch dtype of a safetensors dtype name.
at::ScalarType scalar_type(const rs::TensorSpec& t) {
  static const std::unordered_map<std::string_view, at::ScalarType> table = {
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
  auto it = table.find(view(t.dtype));
  TORCH_CHECK(it != table.end(), "tensor '", std::string(t.name), "': dtype ", std::string(t.dtype),
              " has no torch equivalent");
  return it->second;
}

// The torch shape: torch packs F4 two per element (float4_e2m1fn_x2), halving the last dim.
std::vector<int64_t> torch_shape(const rs::TensorSpec& t) {
  std::vector<int64_t> shape(t.shape.begin(), t.shape.end());
  if (view(t.dtype) == "F4") {
    TORCH_CHECK(!shape.empty() && shape.back() % 2 == 0, "tensor '", std::string(t.name),
                "': F4 needs an even last dimension to load as torch.float4_e2m1fn_x2");
    shape.back() /= 2;
  }
  return shape;
}

// One host buffer of the Rust loader, shared by the tensors in it. Each tensor's DataPtr
// holds one count (its context), so the Rust buffer is released with the last tensor into
// it. A count per tensor, rather than a std::function deleter holding a shared_ptr, costs no
// allocation per tensor: what matters for checkpoints of 100k small tensors.
class SharedBuffer {
 public:
  // The buffer, with one count held by the returned handle.
  static std::unique_ptr<SharedBuffer, void (*)(SharedBuffer*)> take(::rust::Box<rs::BufferRef> ref) {
    return {new SharedBuffer(std::move(ref)), [](SharedBuffer* b) { release(b); }};
  }

  uint8_t* base() const { return base_; }

  // A count for one more tensor, as a DataPtr context released by `release`.
  void* acquire() {
    refs_.fetch_add(1, std::memory_order_relaxed);
    return this;
  }

  static void release(void* ctx) {
    auto* self = static_cast<SharedBuffer*>(ctx);
    if (self->refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete self;
  }

 private:
  explicit SharedBuffer(::rust::Box<rs::BufferRef> ref)
      : ref_(std::move(ref)), base_(reinterpret_cast<uint8_t*>(ref_->address())) {}

  ::rust::Box<rs::BufferRef> ref_;
  uint8_t* base_;
  std::atomic<size_t> refs_{1};
};

using Buffer = std::unique_ptr<SharedBuffer, void (*)(SharedBuffer*)>;

// A tensor over the bytes of `t` in a host buffer, keeping the buffer alive.
at::Tensor wrap_host(const rs::TensorSpec& t, SharedBuffer& buffer) {
  const auto type = scalar_type(t);
  const auto shape = torch_shape(t);
  const auto options = at::TensorOptions().dtype(type).device(at::kCPU);
  if (t.nbytes == 0) {
    return at::empty(shape, options);
  }
  auto* data = buffer.base() + t.offset;
  if (t.aligned) {
    return at::for_blob(data, shape).context(buffer.acquire(), &SharedBuffer::release).options(options).make_tensor();
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

// Which tensors to load: all, or those `tensor_filter` selects in `mode`.
rs::TensorSelection selection(const std::optional<std::vector<std::string>>& tensor_filter, const std::string& mode) {
  rs::TensorSelection out{tensor_filter.has_value(), {}, ::rust::String(mode)};
  if (tensor_filter) out.patterns = to_rust(*tensor_filter);
  return out;
}

NamedTensors named(std::vector<std::string> names, std::vector<at::Tensor> tensors) {
  return {std::move(names), std::move(tensors)};
}

TensorDict to_dict(NamedTensors&& loaded) {
  auto& [names, tensors] = loaded;
  TensorDict out;
  out.reserve(names.size());
  for (size_t i = 0; i < names.size(); ++i) out.insert(std::move(names[i]), std::move(tensors[i]));
  return out;
}

// Wraps every tensor of `specs`, whose buffers are `buffers`, in order.
template <class Specs>
NamedTensors wrap_all(const Specs& specs, const std::vector<Buffer>& buffers, std::optional<at::ScalarType> dtype) {
  std::vector<std::string> names;
  std::vector<at::Tensor> tensors;
  names.reserve(specs.size());
  tensors.reserve(specs.size());
  for (const auto& spec : specs) {
    names.emplace_back(spec.name.data(), spec.name.size());
    tensors.push_back(cast(wrap_host(spec, *buffers[spec.buffer]), dtype));
  }
  return named(std::move(names), std::move(tensors));
}

std::tuple<NamedTensors, std::vector<std::string>> load_to_host(const std::vector<std::string>& files,
                                                                const std::string& reader,
                                                                const rs::TensorSelection& chosen,
                                                                std::optional<at::ScalarType> dtype) {
  auto paths = to_rust(files);
  auto loaded = call_rust([&] { return rs::load_files(paths, reader, chosen); });
  std::vector<Buffer> buffers;
  buffers.reserve(loaded->buffer_count());
  for (size_t i = 0; i < loaded->buffer_count(); ++i) {
    buffers.push_back(SharedBuffer::take(loaded->buffer(i)));
  }
  return {wrap_all(loaded->tensors(), buffers, dtype), from_rust(loaded->read_paths())};
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

// The selected tensors of `files` on `device`, in read order, and how each file was read.
std::tuple<std::vector<std::string>, std::vector<at::Tensor>, std::vector<std::string>> load_named(
    std::vector<std::string> files, std::string device, std::optional<at::ScalarType> dtype,
    std::optional<std::string> reader, std::optional<bool> nogds,
    std::optional<std::vector<std::string>> tensor_filter, std::string tensor_name_match_mode) {
  const c10::Device target(device);
  TORCH_CHECK(target.is_cpu() || target.is_cuda(), "fastsafetensors: cannot load to device '", device,
              "' (only cpu and cuda)");
  const auto chosen = selection(tensor_filter, tensor_name_match_mode);
  if (target.is_cuda() && !tensor_filter) {
    auto [dict, read_paths] = load_to_cuda(files, target, reader.value_or(""), dtype, nogds);
    std::vector<std::string> names;
    std::vector<at::Tensor> tensors;
    for (const auto& entry : dict) {
      names.push_back(entry.key());
      tensors.push_back(entry.value());
    }
    return {std::move(names), std::move(tensors), std::move(read_paths)};
  }
  // A selection on CUDA: only the selected bytes are read, into host memory, then copied.
  auto [loaded, read_paths] = load_to_host(files, reader.value_or(""), chosen, target.is_cuda() ? std::nullopt : dtype);
  auto& [names, tensors] = loaded;
  if (target.is_cuda()) {
    for (auto& t : tensors) t = cast(t.to(target), dtype);
  }
  return {std::move(names), std::move(tensors), std::move(read_paths)};
}

Loaded load_with_report(std::vector<std::string> files, std::string device, std::optional<at::ScalarType> dtype,
                        std::optional<std::string> reader, std::optional<bool> nogds,
                        std::optional<std::vector<std::string>> tensor_filter, std::string tensor_name_match_mode) {
  auto [names, tensors, read_paths] = load_named(std::move(files), std::move(device), dtype, std::move(reader), nogds,
                                                 std::move(tensor_filter), std::move(tensor_name_match_mode));
  return {to_dict(named(std::move(names), std::move(tensors))), std::move(read_paths)};
}

TensorDict load(std::vector<std::string> files, std::string device, std::optional<at::ScalarType> dtype,
                std::optional<std::string> reader, std::optional<bool> nogds,
                std::optional<std::vector<std::string>> tensor_filter, std::string tensor_name_match_mode) {
  return std::get<0>(load_with_report(std::move(files), std::move(device), dtype, std::move(reader), nogds,
                                      std::move(tensor_filter), std::move(tensor_name_match_mode)));
}

// Rows [start, stop) of tensor `name`, reading only their bytes.
at::Tensor load_rows(std::string file, std::string name, int64_t start, int64_t stop, std::optional<std::string> reader) {
  TORCH_CHECK(start >= 0 && stop >= 0, "fastsafetensors: rows [", start, ", ", stop, ") of '", name,
              "': negative row index");
  auto loaded = call_rust([&] {
    return rs::load_rows(file, name, static_cast<uint64_t>(start), static_cast<uint64_t>(stop), reader.value_or(""));
  });
  std::vector<Buffer> buffers;
  for (size_t i = 0; i < loaded->buffer_count(); ++i) buffers.push_back(SharedBuffer::take(loaded->buffer(i)));
  auto [names, tensors] = wrap_all(loaded->tensors(), buffers, std::nullopt);
  TORCH_CHECK(tensors.size() == 1, "fastsafetensors: internal error: ", tensors.size(), " tensors for one row range");
  return tensors.front();
}

// Names of the tensors a filter selects, in read order, from the headers alone.
std::vector<std::string> selected(std::vector<std::string> files, std::optional<std::vector<std::string>> tensor_filter,
                                  std::string tensor_name_match_mode) {
  auto paths = to_rust(files);
  const auto chosen = selection(tensor_filter, tensor_name_match_mode);
  return from_rust(call_rust([&] { return rs::selected_names(paths, chosen); }));
}

// A streaming load: `next()` returns the next group of tensors, in read order, as soon as
// its bytes have arrived, while the reads of later groups go on in the background. Each
// tensor keeps the buffer of its group alive; dropping the stream stops its reads.
class TensorStream : public torch::CustomClassHolder {
 public:
  TensorStream(::rust::Box<rs::TensorStream> stream, c10::Device target, std::optional<at::ScalarType> dtype)
      : stream_(std::move(stream)), target_(target), dtype_(dtype) {}

  // The next group's names and tensors; None after the last.
  std::optional<NamedTensors> next() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!call_rust([&] { return stream_->next_group(); })) return std::nullopt;
    std::vector<Buffer> buffer;
    buffer.push_back(SharedBuffer::take(call_rust([&] { return stream_->group_buffer(); })));
    auto group = wrap_all(stream_->group_tensors(), buffer, target_.is_cuda() ? std::nullopt : dtype_);
    if (target_.is_cuda()) {
      for (auto& t : std::get<1>(group)) t = cast(t.to(target_), dtype_);
    }
    return group;
  }

  // How the last group was read: "direct", "buffered", "mmap" or "mmap-fallback" ("" before
  // the first), and the index of its file (-1 before the first).
  std::string read_path() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::string(stream_->group_read_path());
  }

  int64_t file_index() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stream_->group_file();
  }

  int64_t tensor_count() { return static_cast<int64_t>(stream_->tensor_count()); }
  int64_t byte_count() { return static_cast<int64_t>(stream_->byte_count()); }

 private:
  std::mutex mutex_;
  ::rust::Box<rs::TensorStream> stream_;
  c10::Device target_;
  std::optional<at::ScalarType> dtype_;
};

c10::intrusive_ptr<TensorStream> open_stream(std::vector<std::string> files, std::string device,
                                             std::optional<at::ScalarType> dtype, std::optional<std::string> reader,
                                             std::optional<std::vector<std::string>> tensor_filter,
                                             std::string tensor_name_match_mode,
                                             std::optional<std::string> max_memory) {
  const c10::Device target(device);
  TORCH_CHECK(target.is_cpu() || target.is_cuda(), "fastsafetensors: cannot load to device '", device,
              "' (only cpu and cuda)");
  auto paths = to_rust(files);
  const auto chosen = selection(tensor_filter, tensor_name_match_mode);
  auto stream =
      call_rust([&] { return rs::open_stream(paths, reader.value_or(""), chosen, max_memory.value_or("")); });
  return c10::make_intrusive<TensorStream>(std::move(stream), target, dtype);
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
  m.class_<TensorStream>("TensorStream")
      .def("next", &TensorStream::next)
      .def("read_path", &TensorStream::read_path)
      .def("file_index", &TensorStream::file_index)
      .def("tensor_count", &TensorStream::tensor_count)
      .def("byte_count", &TensorStream::byte_count);
  m.def(
      "load(str[] files, str device=\"cpu\", ScalarType? dtype=None, str? reader=None, bool? nogds=None,"
      " str[]? tensor_filter=None, str tensor_name_match_mode=\"glob\") -> Dict(str, Tensor)");
  m.def(
      "load_with_report(str[] files, str device=\"cpu\", ScalarType? dtype=None, str? reader=None,"
      " bool? nogds=None, str[]? tensor_filter=None, str tensor_name_match_mode=\"glob\")"
      " -> (Dict(str, Tensor), str[])");
  m.def(
      "load_named(str[] files, str device=\"cpu\", ScalarType? dtype=None, str? reader=None, bool? nogds=None,"
      " str[]? tensor_filter=None, str tensor_name_match_mode=\"glob\")"
      " -> (str[] names, Tensor[] tensors, str[] read_paths)");
  m.def("load_rows(str file, str name, int start, int stop, str? reader=None) -> Tensor");
  m.def(
      "open_stream(str[] files, str device=\"cpu\", ScalarType? dtype=None, str? reader=None,"
      " str[]? tensor_filter=None, str tensor_name_match_mode=\"glob\", str? max_memory=None)"
      " -> __torch__.torch.classes.fastsafetensors.TensorStream");
  m.def("selected(str[] files, str[]? tensor_filter=None, str tensor_name_match_mode=\"glob\") -> str[]");
  m.def("keys(str file) -> str[]");
  m.def("resident_fraction(str file) -> float");
  m.def("metadata(str file) -> Dict(str, str)?");
  m.def("describe(str file) -> (str[] names, str[] dtypes, int[][] shapes, Dict(str, str)? metadata)");
}

TORCH_LIBRARY_IMPL(fastsafetensors, CompositeExplicitAutograd, m) {
  m.impl("load", TORCH_FN(load));
  m.impl("load_with_report", TORCH_FN(load_with_report));
  m.impl("load_named", TORCH_FN(load_named));
  m.impl("load_rows", TORCH_FN(load_rows));
  m.impl("open_stream", TORCH_FN(open_stream));
  m.impl("selected", TORCH_FN(selected));
  m.impl("keys", TORCH_FN(keys));
  m.impl("resident_fraction", TORCH_FN(resident_fraction));
  m.impl("metadata", TORCH_FN(metadata));
  m.impl("describe", TORCH_FN(describe));
}

}  // namespace fastsafetensors
