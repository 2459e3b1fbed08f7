// The torch ops of fastsafetensors. A translation layer only: the Rust loader decides what
// to read and how; this file turns its buffers into at::Tensors and registers the ops.
#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
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
template <class Specs>
void check_torch_types(const Specs& specs) {
  for (const auto& spec : specs) {
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

// Which tensors to load: all, or those `tensor_filter` selects in `mode`.
rs::TensorSelection selection(const std::optional<std::vector<std::string>>& tensor_filter, const std::string& mode) {
  rs::TensorSelection out{tensor_filter.has_value(), {}, ::rust::String(mode)};
  if (tensor_filter) out.patterns = to_rust(*tensor_filter);
  return out;
}

const rs::TensorSelection& everything() {
  static const rs::TensorSelection all{false, {}, ::rust::String("glob")};
  return all;
}

TensorDict to_dict(NamedTensors&& named) {
  auto& [names, tensors] = named;
  TensorDict out;
  out.reserve(names.size());
  for (size_t i = 0; i < names.size(); ++i) out.insert(std::move(names[i]), std::move(tensors[i]));
  return out;
}

NamedTensors from_dict(const TensorDict& dict) {
  NamedTensors out;
  for (const auto& entry : dict) {
    std::get<0>(out).push_back(entry.key());
    std::get<1>(out).push_back(entry.value());
  }
  return out;
}

// One buffer's tensors as first wrapped: views of the buffer, unless marked otherwise.
struct BufferTensors {
  std::vector<std::string> names;
  std::vector<at::Tensor> tensors;
  std::vector<bool> views;  // shares the buffer (else: copied, or empty)

  void add(const rs::TensorSpec& spec, at::Tensor tensor) {
    names.emplace_back(spec.name.data(), spec.name.size());
    tensors.push_back(std::move(tensor));
    views.push_back(spec.aligned && spec.nbytes > 0);
  }
};

// Adds a buffer's tensors to `out`, cast to `dtype` where the cast rule says so. A buffer
// outlives the call only if every tensor in it is still a view of it: once one was cast, the
// others are copied out (when `release` allows), so that the whole buffer is freed as soon
// as the caller drops its own reference, instead of staying alive for a few small uncast
// tensors beside the cast copies.
void add_buffer(BufferTensors&& buffer, std::optional<at::ScalarType> dtype, bool release, NamedTensors& out) {
  auto& [names, tensors] = out;
  std::vector<at::Tensor> results;
  results.reserve(buffer.tensors.size());
  bool any_cast = false;
  for (const auto& t : buffer.tensors) {
    results.push_back(cast(t, dtype));
    any_cast = any_cast || !results.back().is_same(t);
  }
  for (size_t k = 0; k < results.size(); ++k) {
    if (any_cast && release && buffer.views[k] && results[k].is_same(buffer.tensors[k])) {
      results[k] = results[k].clone();
    }
    names.push_back(std::move(buffer.names[k]));
    tensors.push_back(std::move(results[k]));
  }
}

// A zero-copy mapping holds page cache, not memory of its own: its views stay views.
bool is_mapping(std::string_view read_path) { return read_path == "mmap" || read_path == "mmap-fallback"; }

// Host buffers and their tensors as first wrapped, before any cast.
struct Wrapped {
  std::vector<Buffer> buffers;
  std::vector<bool> mapped;
  std::vector<BufferTensors> by_buffer;
  size_t count = 0;

  void push(::rust::Box<rs::BufferRef> ref, bool is_mapped) {
    buffers.push_back(SharedBuffer::take(std::move(ref)));
    mapped.push_back(is_mapped);
    by_buffer.emplace_back();
  }

  template <class Specs>
  void add_tensors(const Specs& specs) {
    for (const auto& spec : specs) {
      by_buffer[spec.buffer].add(spec, wrap_host(spec, *buffers[spec.buffer]));
    }
    count += specs.size();
  }

  // The tensors, cast, in read order. The loader's own references must be gone by now, so
  // that a buffer whose tensors were all cast or copied out is freed here.
  NamedTensors finish(std::optional<at::ScalarType> dtype) && {
    NamedTensors out;
    std::get<0>(out).reserve(count);
    std::get<1>(out).reserve(count);
    for (size_t i = 0; i < by_buffer.size(); ++i) {
      add_buffer(std::move(by_buffer[i]), dtype, !mapped[i], out);
      buffers[i].reset();
    }
    return out;
  }
};

// Wraps the tensors of `loaded`, whose read paths are `read_paths`.
Wrapped wrap_loaded(const rs::LoadedFiles& loaded, const std::vector<std::string>& read_paths) {
  Wrapped w;
  for (size_t i = 0; i < loaded.buffer_count(); ++i) {
    w.push(loaded.buffer(i), is_mapping(read_paths[loaded.buffer_file(i)]));
  }
  w.add_tensors(loaded.tensors());
  return w;
}

std::tuple<NamedTensors, std::vector<std::string>> load_to_host(const std::vector<std::string>& files,
                                                                const std::string& reader,
                                                                const rs::TensorSelection& chosen,
                                                                std::optional<at::ScalarType> dtype) {
  auto paths = to_rust(files);
  auto planned = call_rust([&] { return rs::plan_files(paths, chosen); });
  check_torch_types(planned->tensors());
  std::vector<std::string> read_paths;
  Wrapped wrapped;
  {
    auto loaded = call_rust([&] { return rs::read_to_host(std::move(planned), reader); });
    read_paths = from_rust(loaded->read_paths());
    wrapped = wrap_loaded(*loaded, read_paths);
  }  // From here on, only the tensors and `wrapped` keep the buffers' memory.
  return {std::move(wrapped).finish(dtype), std::move(read_paths)};
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

// Our own check first: a clear error, at once, on machines without a driver or device.
void check_cuda(const c10::Device& target) {
  size_t devices = 0;
  try {
    devices = rs::cuda_device_count();
  } catch (const ::rust::Error& e) {
    TORCH_CHECK(false, "fastsafetensors: cannot load to ", target.str(), ": ", e.what());
  }
  TORCH_CHECK(devices > 0, "fastsafetensors: cannot load to ", target.str(), ": CUDA: no CUDA device is visible");
}

std::tuple<NamedTensors, std::vector<std::string>> load_to_cuda(const std::vector<std::string>& files,
                                                                const c10::Device& target, const std::string& reader,
                                                                std::optional<at::ScalarType> dtype,
                                                                std::optional<bool> nogds) {
  check_cuda(target);
  auto paths = to_rust(files);
  auto planned = call_rust([&] { return rs::plan_files(paths, everything()); });
  check_torch_types(planned->tensors());
  // Plain "cuda" is torch's current device, also when there is nothing to load.
  const c10::Device device = target.has_index() ? target : cuda_hooks().getDevice();
  const int32_t gds = nogds.has_value() ? static_cast<int32_t>(*nogds) : -1;
  const size_t count = planned->file_count();
  // Without a cast every tensor stays a view of its file's buffer, and all files are read in
  // one go, overlapping. With one, file by file: each file's buffer is freed (its tensors
  // cast or copied out) before the next one is allocated.
  std::vector<std::vector<size_t>> groups(dtype && count > 0 ? count : 1);
  for (size_t i = 0; i < count; ++i) groups[dtype ? i : 0].push_back(i);
  std::vector<BufferTensors> by_file(count);
  std::vector<std::string> read_paths(count);
  NamedTensors tensors;
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
    for (const size_t i : group) add_buffer(std::move(by_file[i]), dtype, true, tensors);
  }
  return {std::move(tensors), std::move(read_paths)};
}

// The selected tensors of `files` on `device`, in read order, and how each file was read.
std::tuple<std::vector<std::string>, std::vector<at::Tensor>, std::vector<std::string>> load_named(
    std::vector<std::string> files, std::string device, std::optional<at::ScalarType> dtype,
    std::optional<std::string> reader, std::optional<bool> nogds,
    std::optional<std::vector<std::string>> tensor_filter, std::string tensor_name_match_mode) {
  const auto target = target_device(device);
  check_cast_target(dtype);
  std::tuple<NamedTensors, std::vector<std::string>> loaded;
  if (target.is_cpu()) {
    loaded = load_to_host(files, reader.value_or(""), selection(tensor_filter, tensor_name_match_mode), dtype);
  } else if (!tensor_filter) {
    loaded = load_to_cuda(files, target, reader.value_or(""), dtype, nogds);
  } else {
    // A selection on CUDA: only the selected bytes are read, into host memory, then copied.
    check_cuda(target);
    loaded = load_to_host(files, reader.value_or(""), selection(tensor_filter, tensor_name_match_mode), std::nullopt);
    for (auto& t : std::get<1>(std::get<0>(loaded))) t = cast(t.to(target), dtype);
  }
  auto& [named_tensors, read_paths] = loaded;
  auto& [names, tensors] = named_tensors;
  return {std::move(names), std::move(tensors), std::move(read_paths)};
}

Loaded load_with_report(std::vector<std::string> files, std::string device, std::optional<at::ScalarType> dtype,
                        std::optional<std::string> reader, std::optional<bool> nogds,
                        std::optional<std::vector<std::string>> tensor_filter, std::string tensor_name_match_mode) {
  auto [names, tensors, read_paths] = load_named(std::move(files), std::move(device), dtype, std::move(reader), nogds,
                                                 std::move(tensor_filter), std::move(tensor_name_match_mode));
  return {to_dict(NamedTensors{std::move(names), std::move(tensors)}), std::move(read_paths)};
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
  std::vector<std::string> read_paths;
  Wrapped wrapped;
  {
    auto loaded = call_rust([&] {
      return rs::load_rows(file, name, static_cast<uint64_t>(start), static_cast<uint64_t>(stop), reader.value_or(""));
    });
    check_torch_types(loaded->tensors());
    read_paths = from_rust(loaded->read_paths());
    wrapped = wrap_loaded(*loaded, read_paths);
  }
  auto tensors = std::get<1>(std::move(wrapped).finish(std::nullopt));
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
//
// To the CPU, groups are read into host buffers within the memory budget. To a CUDA device,
// each group gets an allocation of its own from torch's caching allocator (so torch's memory
// statistics count it), and the copy of the next group, through the pinned staging ring,
// runs while the caller works on the current one.
class TensorStream : public torch::CustomClassHolder {
 public:
  TensorStream(::rust::Box<rs::TensorStream> stream, std::optional<at::ScalarType> dtype)
      : dtype_(dtype), target_(c10::kCPU), host_(std::move(stream)) {}

  TensorStream(::rust::Box<rs::DeviceTensorStream> stream, c10::Device target, std::optional<at::ScalarType> dtype)
      : dtype_(dtype), target_(target), device_(std::move(stream)) {}

  // The next group's names and tensors; None after the last.
  std::optional<NamedTensors> next() {
    std::lock_guard<std::mutex> lock(mutex_);
    return host_ ? next_host() : next_device();
  }

  // How the last group was read: "direct", "buffered", "mmap" or "mmap-fallback" ("" before
  // the first), and the index (-1 before the first) and path of its file.
  std::string read_path() {
    std::lock_guard<std::mutex> lock(mutex_);
    return host_ ? std::string((*host_)->group_read_path()) : last_path_;
  }

  int64_t file_index() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (host_) return (*host_)->group_file();
    return next_ == 0 ? -1 : call_rust([&] { return (*device_)->group_file(next_ - 1); });
  }

  std::string file_path() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (host_) return std::string((*host_)->group_path());
    return next_ == 0 ? std::string() : std::string(call_rust([&] { return (*device_)->group_path(next_ - 1); }));
  }

  int64_t tensor_count() {
    return static_cast<int64_t>(host_ ? (*host_)->tensor_count() : (*device_)->tensor_count());
  }

  int64_t byte_count() { return static_cast<int64_t>(host_ ? (*host_)->byte_count() : (*device_)->byte_count()); }

 private:
  std::optional<NamedTensors> next_host() {
    auto& stream = *host_;
    if (!call_rust([&] { return stream->next_group(); })) return std::nullopt;
    check_torch_types(stream->group_tensors());
    Wrapped wrapped;
    wrapped.push(call_rust([&] { return stream->group_buffer(); }), is_mapping(view_str(stream->group_read_path())));
    wrapped.add_tensors(stream->group_tensors());
    return std::move(wrapped).finish(dtype_);
  }

  // A group's allocation and the event its copy is ordered after, kept until it has landed.
  struct Submitted {
    at::Tensor buffer;
    std::unique_ptr<ReadyEvent> ready;
  };

  void submit(size_t k) {
    auto& stream = *device_;
    const auto len = static_cast<int64_t>(call_rust([&] { return stream->alloc_len(k); }));
    Submitted s{at::empty({len}, at::TensorOptions(at::kByte).device(target_)), nullptr};
    s.ready = std::make_unique<ReadyEvent>(target_);
    const auto base = reinterpret_cast<uint64_t>(s.buffer.data_ptr());
    call_rust([&] { return stream->submit(k, base, s.ready->handle()); });
    submitted_.emplace(k, std::move(s));
    in_flight_ += static_cast<uint64_t>(len);
    ahead_ = k + 1;
  }

  std::optional<NamedTensors> next_device() {
    const size_t count = (*device_)->group_count();
    if (next_ >= count) return std::nullopt;
    const size_t k = next_++;
    try {
      return group_on_device(k, count);
    } catch (...) {
      next_ = count;  // a stream stops at its first error, as the host one does
      throw;
    }
  }

  NamedTensors group_on_device(size_t k, size_t count) {
    auto& stream = *device_;
    if (k >= ahead_) submit(k);
    // Later groups are copied while the caller works on this one: as many as the budget
    // allows, at least the next.
    const uint64_t budget = stream->budget();
    while (ahead_ < count &&
           (ahead_ == k + 1 || in_flight_ + call_rust([&] { return stream->alloc_len(ahead_); }) <= budget)) {
      submit(ahead_);
    }
    const auto specs = call_rust([&] { return stream->group_specs(k); });
    check_torch_types(specs);
    const auto landed = call_rust([&] { return stream->wait(k); });
    last_path_ = std::string(landed.path);
    auto node = submitted_.extract(k);
    at::Tensor buffer = std::move(node.mapped().buffer);
    in_flight_ -= static_cast<uint64_t>(buffer.numel());
    node.mapped().ready.reset();
    BufferTensors group;
    for (const auto& spec : specs) {
      group.add(spec, wrap_device(spec, buffer, static_cast<int64_t>(landed.offset)));
    }
    buffer.reset();  // from here on, only the tensors keep the group's memory
    NamedTensors out;
    add_buffer(std::move(group), dtype_, true, out);
    return out;
  }

  static std::string_view view_str(::rust::Str s) { return {s.data(), s.size()}; }

  std::mutex mutex_;
  std::optional<at::ScalarType> dtype_;
  c10::Device target_;
  size_t next_ = 0;
  // Groups below `ahead_` have been submitted, in order; `in_flight_` bytes are allocated for
  // those not handed out yet.
  size_t ahead_ = 0;
  uint64_t in_flight_ = 0;
  std::string last_path_;
  // Declared before the streams, so destroyed after them: the copier has stopped (its running
  // copy done) before the memory it copies into is given back to torch.
  std::unordered_map<size_t, Submitted> submitted_;
  std::optional<::rust::Box<rs::TensorStream>> host_;
  std::optional<::rust::Box<rs::DeviceTensorStream>> device_;
};

c10::intrusive_ptr<TensorStream> open_stream(std::vector<std::string> files, std::string device,
                                             std::optional<at::ScalarType> dtype, std::optional<std::string> reader,
                                             std::optional<std::vector<std::string>> tensor_filter,
                                             std::string tensor_name_match_mode,
                                             std::optional<std::string> max_memory) {
  const auto target = target_device(device);
  check_cast_target(dtype);
  auto paths = to_rust(files);
  const auto chosen = selection(tensor_filter, tensor_name_match_mode);
  if (target.is_cpu()) {
    auto stream =
        call_rust([&] { return rs::open_stream(paths, reader.value_or(""), chosen, max_memory.value_or("")); });
    return c10::make_intrusive<TensorStream>(std::move(stream), dtype);
  }
  check_cuda(target);
  // Plain "cuda" is torch's current device.
  const c10::Device on = target.has_index() ? target : cuda_hooks().getDevice();
  auto stream = call_rust([&] {
    return rs::open_device_stream(paths, reader.value_or(""), chosen, max_memory.value_or(""),
                                  static_cast<size_t>(on.index()));
  });
  return c10::make_intrusive<TensorStream>(std::move(stream), on, dtype);
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
  m.class_<TensorStream>("TensorStream")
      .def("next", &TensorStream::next)
      .def("read_path", &TensorStream::read_path)
      .def("file_index", &TensorStream::file_index)
      .def("file_path", &TensorStream::file_path)
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
  m.impl("load_named", TORCH_FN(load_named));
  m.impl("load_rows", TORCH_FN(load_rows));
  m.impl("open_stream", TORCH_FN(open_stream));
  m.impl("selected", TORCH_FN(selected));
  m.impl("keys", TORCH_FN(keys));
  m.impl("check_device", TORCH_FN(check_device));
  m.impl("checkpoint", TORCH_FN(checkpoint));
  m.impl("resident_fraction", TORCH_FN(resident_fraction));
  m.impl("release_staging_buffers", TORCH_FN(release_staging_buffers));
  m.impl("metadata", TORCH_FN(metadata));
  m.impl("describe", TORCH_FN(describe));
}

}  // namespace fastsafetensors
