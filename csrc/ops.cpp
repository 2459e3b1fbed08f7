// The torch ops of fastsafetensors. A translation layer only: the Rust loader decides what to
// read, where it goes and what becomes of each tensor (a view, a copy, a cast); this file
// allocates device memory through torch, wraps the buffers as at::Tensors, carries out those
// decisions with ATen ops, and registers the ops.
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
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "rust/cxx.h"
#include "fastsafetensors/rust/bridge.rs.h"

namespace fastsafetensors {
namespace {

using TensorDict = c10::Dict<std::string, at::Tensor>;
using Metadata = std::optional<c10::Dict<std::string, std::string>>;
// Names and tensors in read order (and how each file was read).
using NamedTensors = std::tuple<std::vector<std::string>, std::vector<at::Tensor>>;
using LoadResult = std::tuple<std::vector<std::string>, std::vector<at::Tensor>, std::vector<std::string>>;

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

// The torch dtype of a safetensors dtype name (Rust has refused the names torch lacks).
at::ScalarType scalar_type(std::string_view dtype) {
  static const std::unordered_map<std::string_view, at::ScalarType> table = {
      {"BOOL", at::kBool}, {"U8", at::kByte}, {"I8", at::kChar}, {"I16", at::kShort}, {"U16", at::kUInt16},
      {"I32", at::kInt}, {"U32", at::kUInt32}, {"I64", at::kLong}, {"U64", at::kUInt64}, {"F16", at::kHalf},
      {"BF16", at::kBFloat16}, {"F32", at::kFloat}, {"F64", at::kDouble}, {"C64", at::kComplexFloat},
      {"F8_E4M3", at::kFloat8_e4m3fn}, {"F8_E5M2", at::kFloat8_e5m2}, {"F8_E4M3FNUZ", at::kFloat8_e4m3fnuz},
      {"F8_E5M2FNUZ", at::kFloat8_e5m2fnuz}, {"F8_E8M0", at::kFloat8_e8m0fnu}, {"F4", at::kFloat4_e2m1fn_x2},
  };
  auto it = table.find(dtype);
  TORCH_CHECK(it != table.end(), "fastsafetensors: internal error: no torch dtype for ", std::string(dtype));
  return it->second;
}

// torch's name for `dtype=` ("bfloat16"), or "" for none: Rust decides what it casts.
std::string dtype_name(std::optional<at::ScalarType> dtype) {
  return dtype ? std::string(c10::getDtypeNames(*dtype).first) : std::string();
}

// One host buffer of the Rust loader, shared by the tensors in it: each tensor's DataPtr holds
// a count (its context), which costs no allocation per tensor (checkpoints of 100k tensors).
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

std::vector<int64_t> shape_of(const rs::TensorSpec& t) { return {t.shape.begin(), t.shape.end()}; }

// A tensor over the bytes of `t` in a host buffer: a view keeping the buffer alive, or a copy.
at::Tensor wrap_host(const rs::TensorSpec& t, SharedBuffer& buffer) {
  const auto type = scalar_type(view(t.dtype));
  const auto options = at::TensorOptions().dtype(type).device(at::kCPU);
  if (t.nbytes == 0) return at::empty(shape_of(t), options);
  auto* data = buffer.base() + t.offset;
  if (!t.copy) {
    return at::for_blob(data, shape_of(t)).context(buffer.acquire(), &SharedBuffer::release).options(options).make_tensor();
  }
  // Copied as bytes into fresh, aligned memory, then reinterpreted.
  auto bytes = at::from_blob(data, {static_cast<int64_t>(t.nbytes)}, at::TensorOptions(at::kByte));
  return bytes.clone().view(type).view(shape_of(t));
}

// A tensor over the bytes of `t` in a device buffer whose byte 0 is at `start`: a view, so the
// buffer (owned by torch's caching allocator) is freed when the last tensor into it dies, or
// a copy on the device.
at::Tensor wrap_device(const rs::TensorSpec& t, const at::Tensor& buffer, int64_t start) {
  const auto type = scalar_type(view(t.dtype));
  if (t.nbytes == 0) return at::empty(shape_of(t), buffer.options().dtype(type));
  auto bytes = buffer.narrow(0, start + static_cast<int64_t>(t.offset), static_cast<int64_t>(t.nbytes));
  return (t.copy ? bytes.clone() : bytes).view(type).view(shape_of(t));
}

// Adds a wrapped tensor, cast where Rust says so (on the tensor's device).
void add(NamedTensors& out, const rs::TensorSpec& spec, at::Tensor t) {
  std::get<0>(out).emplace_back(spec.name.data(), spec.name.size());
  std::get<1>(out).push_back(spec.cast.empty() ? std::move(t) : t.to(scalar_type(view(spec.cast))));
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

// Which tensors to load: all, or those `tensor_filter` selects in `mode`.
rs::TensorSelection selection(const std::optional<std::vector<std::string>>& tensor_filter, const std::string& mode) {
  rs::TensorSelection out{tensor_filter.has_value(), {}, ::rust::String(mode)};
  if (tensor_filter) out.patterns = to_rust(*tensor_filter);
  return out;
}

TensorDict to_dict(NamedTensors&& named) {
  auto& [names, tensors] = named;
  TensorDict out;
  out.reserve(names.size());
  for (size_t i = 0; i < names.size(); ++i) out.insert(std::move(names[i]), std::move(tensors[i]));
  return out;
}

// The tensors of host buffers, as Rust specified them; `to`: a device to move each to before its
// cast. The loader gives up its references first, and each buffer's handle here goes once its
// tensors are made (buffer by buffer): a buffer whose tensors were copied or cast is freed first.
NamedTensors host_tensors(rs::LoadedFiles& loaded, const std::optional<c10::Device>& to = std::nullopt) {
  std::vector<Buffer> buffers;
  for (size_t i = 0; i < loaded.buffer_count(); ++i) buffers.push_back(SharedBuffer::take(loaded.take_buffer(i)));
  NamedTensors out;
  const auto& specs = loaded.tensors();
  for (size_t k = 0; k < specs.size(); ++k) {
    const auto& spec = specs[k];
    auto t = wrap_host(spec, *buffers[spec.buffer]);
    add(out, spec, to ? t.to(*to) : t);
    if (k + 1 == specs.size() || specs[k + 1].buffer != spec.buffer) buffers[spec.buffer].reset();
  }
  return out;
}

// Torch's CUDA hooks, reached through the device-guard registry: the extension links none of
// torch's CUDA libraries, so that it still loads under a CPU-only torch.
const c10::impl::DeviceGuardImplInterface& cuda_hooks() {
  return *c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
}

// The CUDA device Rust parsed; index -1 is torch's current device.
c10::Device cuda_device(const rs::DeviceSpec& spec) {
  return spec.index < 0 ? cuda_hooks().getDevice() : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(spec.index));
}

// An event recorded on torch's current stream once the buffers are allocated: the caching allocator
// may hand out memory that work queued there still uses, so the copies are ordered after it.
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

at::Tensor device_bytes(int64_t len, const c10::Device& device) {
  return at::empty({len}, at::TensorOptions(at::kByte).device(device));
}

// Whole files copied to the device, group by group as Rust groups them, into memory from torch's
// caching allocator, so that torch's memory statistics (which vLLM sizes its KV cache from) count it.
LoadResult load_to_cuda(const rs::PlannedFiles& planned, const std::string& reader, std::optional<bool> nogds) {
  const c10::Device device = cuda_device(planned.target());
  const int32_t gds = nogds.has_value() ? static_cast<int32_t>(*nogds) : -1;
  std::vector<std::string> read_paths(planned.file_count());
  NamedTensors tensors;
  for (size_t g = 0; g < planned.device_group_count(); ++g) {
    const auto files = planned.device_group_files(g);
    std::vector<at::Tensor> buffers;
    ::rust::Vec<uint64_t> bases;
    for (const size_t i : files) {
      buffers.push_back(device_bytes(static_cast<int64_t>(planned.device_alloc_len(i)), device));
      bases.push_back(reinterpret_cast<uint64_t>(buffers.back().data_ptr()));
    }
    std::optional<ReadyEvent> ready;
    if (!files.empty()) ready.emplace(device);
    const auto copies = call_rust([&] {
      return planned.copy_to_cuda(device.index(), files, bases, reader, gds, ready ? ready->handle() : 0);
    });
    ready.reset();
    for (size_t k = 0; k < files.size(); ++k) read_paths[files[k]] = std::string(copies[k].path);
    for (const auto& spec : planned.device_group_specs(g)) {
      const auto at = spec.buffer;
      add(tensors, spec, wrap_device(spec, buffers[at], static_cast<int64_t>(copies[at].offset)));
    }
  }  // each group's buffers: from here on, only its tensors keep them
  auto& [names, list] = tensors;
  return {std::move(names), std::move(list), std::move(read_paths)};
}

// The selected tensors of `files` on `device`, in read order, and how each file was read.
LoadResult load_named(
    std::vector<std::string> files, std::string device, std::optional<at::ScalarType> dtype,
    std::optional<std::string> reader, std::optional<bool> nogds,
    std::optional<std::vector<std::string>> tensor_filter, std::string tensor_name_match_mode, int64_t handle) {
  const auto paths = to_rust(files);
  const auto chosen = selection(tensor_filter, tensor_name_match_mode);
  auto planned = call_rust([&] { return rs::plan_load(paths, chosen, device, dtype_name(dtype), handle); });
  const std::string how = reader.value_or("");
  if (planned->route() == rs::Route::Device) return load_to_cuda(*planned, how, nogds);
  std::optional<c10::Device> to;
  if (planned->route() == rs::Route::HostThenDevice) to = cuda_device(planned->target());
  auto files_read = call_rust([&] { return rs::read_to_host(std::move(planned), how); });
  auto [names, tensors] = host_tensors(*files_read, to);
  return {std::move(names), std::move(tensors), from_rust(files_read->read_paths())};
}

using Loaded = std::tuple<TensorDict, std::vector<std::string>>;

Loaded load_with_report(std::vector<std::string> files, std::string device, std::optional<at::ScalarType> dtype,
                        std::optional<std::string> reader, std::optional<bool> nogds,
                        std::optional<std::vector<std::string>> tensor_filter, std::string tensor_name_match_mode) {
  auto [names, tensors, read_paths] = load_named(std::move(files), std::move(device), dtype, std::move(reader), nogds,
                                                 std::move(tensor_filter), std::move(tensor_name_match_mode), -1);
  return {to_dict(NamedTensors{std::move(names), std::move(tensors)}), std::move(read_paths)};
}

TensorDict load(std::vector<std::string> files, std::string device, std::optional<at::ScalarType> dtype,
                std::optional<std::string> reader, std::optional<bool> nogds,
                std::optional<std::vector<std::string>> tensor_filter, std::string tensor_name_match_mode) {
  return std::get<0>(load_with_report(std::move(files), std::move(device), dtype, std::move(reader), nogds,
                                      std::move(tensor_filter), std::move(tensor_name_match_mode)));
}

// Rows [start, stop) of tensor `name`, reading only their bytes.
at::Tensor load_rows(std::string file, std::string name, int64_t start, int64_t stop, std::optional<std::string> reader,
                     int64_t handle) {
  auto loaded = call_rust([&] { return rs::load_rows(file, name, start, stop, reader.value_or(""), handle); });
  auto tensors = std::get<1>(host_tensors(*loaded));
  TORCH_CHECK(tensors.size() == 1, "fastsafetensors: internal error: ", tensors.size(), " tensors for one row range");
  return tensors.front();
}

// Names of the tensors a filter selects, in read order, from the headers alone.
std::vector<std::string> selected(std::vector<std::string> files, std::optional<std::vector<std::string>> tensor_filter,
                                  std::string tensor_name_match_mode, int64_t handle) {
  auto paths = to_rust(files);
  const auto chosen = selection(tensor_filter, tensor_name_match_mode);
  return from_rust(call_rust([&] { return rs::selected_names(paths, chosen, handle); }));
}

// A load shared by `world` ranks, as JSON (see rs::share_load): each byte read by one rank.
std::string share_load(std::vector<std::string> files, std::optional<at::ScalarType> dtype,
                       std::optional<std::vector<std::string>> tensor_filter, std::string mode, int64_t world,
                       std::optional<std::string> max_memory, int64_t chunk, int64_t handle) {
  const auto chosen = selection(tensor_filter, mode);
  const auto paths = to_rust(files);
  const auto cast = dtype_name(dtype), budget = max_memory.value_or("");
  return std::string(call_rust([&] {
    return rs::share_load(paths, chosen, cast, world, max_memory.has_value(), budget, chunk, handle);
  }));
}

// Fills `out` (contiguous bytes on the CPU or a CUDA device) from `file` at `offset`; says how.
std::string read_range(std::string file, int64_t offset, at::Tensor out, std::optional<std::string> reader,
                       int64_t handle) {
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous(), "invalid argument: out: contiguous uint8");
  std::optional<ReadyEvent> ready;
  if (out.is_cuda()) ready.emplace(out.device());
  const auto address = reinterpret_cast<uint64_t>(out.data_ptr());
  const int64_t ordinal = out.is_cuda() ? out.device().index() : -1;
  const uint64_t event = ready ? ready->handle() : 0;
  return std::string(call_rust([&] {
    return rs::read_range(file, offset, address, out.numel(), ordinal, reader.value_or(""), handle, event);
  }));
}

// A streaming load: `next()` returns the next group of tensors, in read order, as soon as its
// bytes have arrived, while the reads of later groups go on in the background. Each tensor keeps
// the buffer of its group alive; dropping the stream stops its reads. To the CPU, groups are
// read into host buffers within the memory budget. To a CUDA device, each group gets an
// allocation of its own from torch's caching allocator (so torch's memory statistics count it),
// and the copies Rust says to submit ahead run through the pinned ring while the caller works.
class TensorStream : public torch::CustomClassHolder {
 public:
  explicit TensorStream(::rust::Box<rs::TensorStream> stream) : target_(c10::kCPU), host_(std::move(stream)) {}

  TensorStream(::rust::Box<rs::DeviceTensorStream> stream, c10::Device target)
      : target_(target), device_(std::move(stream)) {}

  // The next group's names and tensors; None after the last.
  std::optional<NamedTensors> next() {
    std::lock_guard<std::mutex> lock(mutex_);
    return host_ ? next_host() : next_device();
  }

  // How the last group was read: "direct", "buffered", "mmap" or "mmap-fallback" ("" before
  // the first), and the index (-1 before the first) and path of its file.
  std::string read_path() { return on_stream([](auto& s) { return std::string(s.group_read_path()); }); }
  int64_t file_index() { return on_stream([](auto& s) { return s.group_file(); }); }
  std::string file_path() { return on_stream([](auto& s) { return std::string(s.group_path()); }); }
  int64_t tensor_count() { return on_stream([](auto& s) { return static_cast<int64_t>(s.tensor_count()); }); }
  int64_t byte_count() { return on_stream([](auto& s) { return static_cast<int64_t>(s.byte_count()); }); }

 private:
  template <class F>
  auto on_stream(F&& f) -> std::invoke_result_t<F, rs::TensorStream&> {
    std::lock_guard<std::mutex> lock(mutex_);
    return host_ ? f(**host_) : f(**device_);
  }

  std::optional<NamedTensors> next_host() {
    auto& stream = *host_;
    if (!call_rust([&] { return stream->next_group(); })) return std::nullopt;
    auto buffer = SharedBuffer::take(call_rust([&] { return stream->group_buffer(); }));
    NamedTensors out;
    for (const auto& spec : stream->group_tensors()) add(out, spec, wrap_host(spec, *buffer));
    return out;
  }

  // A group's allocation and the event its copy is ordered after, kept until it has landed.
  struct Submitted {
    at::Tensor buffer;
    std::unique_ptr<ReadyEvent> ready;
  };

  void submit(size_t k) {
    auto& stream = *device_;
    const auto len = static_cast<int64_t>(call_rust([&] { return stream->alloc_len(k); }));
    Submitted s{device_bytes(len, target_), std::make_unique<ReadyEvent>(target_)};
    const auto base = reinterpret_cast<uint64_t>(s.buffer.data_ptr());
    call_rust([&] { return stream->submit(k, base, s.ready->handle()); });
    submitted_.emplace(k, std::move(s));
  }

  std::optional<NamedTensors> next_device() {
    auto& stream = *device_;
    if (next_ >= stream->group_count()) return std::nullopt;
    const size_t k = next_++;
    try {
      for (const size_t j : stream->submissions(k)) submit(j);
      const auto specs = call_rust([&] { return stream->group_specs(k); });
      const auto landed = call_rust([&] { return stream->wait(k); });
      // Its copy done, the group's event goes; from here on only its tensors keep its memory.
      const at::Tensor buffer = std::move(submitted_.extract(k).mapped().buffer);
      NamedTensors out;
      for (const auto& spec : specs) add(out, spec, wrap_device(spec, buffer, static_cast<int64_t>(landed.offset)));
      return out;
    } catch (...) {
      next_ = stream->group_count();  // a stream stops at its first error, as the host one does
      throw;
    }
  }

  std::mutex mutex_;
  c10::Device target_;
  size_t next_ = 0;
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
                                             std::optional<std::string> max_memory, int64_t handle) {
  const auto cast = dtype_name(dtype);
  const auto target = call_rust([&] { return rs::check_target(device, cast); });
  auto paths = to_rust(files);
  const auto chosen = selection(tensor_filter, tensor_name_match_mode);
  const std::string how = reader.value_or(""), budget = max_memory.value_or("");
  if (!target.cuda) {
    return c10::make_intrusive<TensorStream>(
        call_rust([&] { return rs::open_stream(paths, how, chosen, budget, cast, handle); }));
  }
  const c10::Device on = cuda_device(target);
  auto stream = call_rust([&] {
    return rs::open_device_stream(paths, how, chosen, budget, cast, static_cast<size_t>(on.index()), handle);
  });
  return c10::make_intrusive<TensorStream>(std::move(stream), on);
}

// Tensor names, dtypes and shapes in offset order, and the metadata, without reading data.
std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::vector<int64_t>>, Metadata> describe(
    std::string file, int64_t handle) {
  const auto h = call_rust([&] { return rs::read_header(file, handle); });
  std::vector<std::string> names, dtypes;
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& t : h.tensors) {
    names.emplace_back(t.name);
    dtypes.emplace_back(t.dtype);
    shapes.emplace_back(t.shape.begin(), t.shape.end());
  }
  Metadata metadata;
  if (h.has_metadata) metadata.emplace();
  for (const auto& e : h.metadata) metadata->insert(std::string(e.key), std::string(e.value));  // has_metadata
  return {std::move(names), std::move(dtypes), std::move(shapes), std::move(metadata)};
}

// Frees the pinned staging buffers kept for later CUDA loads; returns how many were freed.
int64_t release_staging_buffers() { return static_cast<int64_t>(rs::release_staging_buffers()); }

std::string check_device(std::string device) { return std::string(call_rust([&] { return rs::parse_device(device); }).name); }

// The files `path` (a file, checkpoint directory or index) stands for, the index they come
// from, and every problem between them and the index.
std::tuple<std::vector<std::string>, std::optional<std::string>, std::vector<std::string>> checkpoint(
    std::string path) {
  const auto c = call_rust([&] { return rs::checkpoint(path); });
  std::optional<std::string> index;
  if (!c.index.empty()) index = std::string(c.index);
  return {from_rust(c.files), index, from_rust(c.problems)};
}

double resident_fraction(std::string file) { return call_rust([&] { return rs::resident_fraction(file); }); }

// A handle on `files`, opened now: the ops taking it read those, whatever becomes of the paths.
int64_t open_handle(std::vector<std::string> files, std::optional<std::string> cache_dir) {
  return call_rust([&] { return rs::open_handle(to_rust(files), cache_dir.value_or("")); });
}
bool close_handle(int64_t handle) { return rs::close_handle(handle); }

std::vector<std::string> keys(std::string file) {
  auto names = std::get<0>(describe(std::move(file), -1));
  std::sort(names.begin(), names.end());
  return names;
}

Metadata metadata(std::string file) { return std::get<3>(describe(std::move(file), -1)); }

}  // namespace

TORCH_LIBRARY(fastsafetensors, m) {
  m.class_<TensorStream>("TensorStream")
      .def("next", &TensorStream::next)
      .def("read_path", &TensorStream::read_path)
      .def("file_index", &TensorStream::file_index)
      .def("file_path", &TensorStream::file_path)
      .def("tensor_count", &TensorStream::tensor_count)
      .def("byte_count", &TensorStream::byte_count);
  // The arguments of every bulk load. `int handle`, here and below: the files an `open_handle`
  // holds open, which the op reads instead of opening `files` (-1: none).
#define LOAD_ARGS                                                                                       \
  "(str[] files, str device=\"cpu\", ScalarType? dtype=None, str? reader=None, bool? nogds=None," \
  " str[]? tensor_filter=None, str tensor_name_match_mode=\"glob\""
  m.def("load" LOAD_ARGS ") -> Dict(str, Tensor)");
  m.def("load_with_report" LOAD_ARGS ") -> (Dict(str, Tensor), str[])");
  m.def("load_named" LOAD_ARGS ", int handle=-1) -> (str[] names, Tensor[] tensors, str[] read_paths)");
#undef LOAD_ARGS
  m.def("load_rows(str file, str name, int start, int stop, str? reader=None, int handle=-1) -> Tensor");
  m.def(
      "open_stream(str[] files, str device=\"cpu\", ScalarType? dtype=None, str? reader=None,"
      " str[]? tensor_filter=None, str tensor_name_match_mode=\"glob\", str? max_memory=None, int handle=-1)"
      " -> __torch__.torch.classes.fastsafetensors.TensorStream");
  m.def("selected(str[] files, str[]? tensor_filter=None, str tensor_name_match_mode=\"glob\", int handle=-1)"
        " -> str[]");
  m.def("share_load(str[] files, ScalarType? dtype, str[]? tensor_filter, str tensor_name_match_mode, int world,"
        " str? max_memory=None, int chunk=0, int handle=-1) -> str");
  m.def("read_range(str file, int offset, Tensor(a!) out, str? reader=None, int handle=-1) -> str");
  m.def("keys(str file) -> str[]");
  m.def("check_device(str device) -> str");
  m.def("checkpoint(str path) -> (str[] files, str? index, str[] problems)");
  m.def("resident_fraction(str file) -> float");
  m.def("release_staging_buffers() -> int");
  m.def("metadata(str file) -> Dict(str, str)?");
  m.def("describe(str file, int handle=-1) -> (str[] names, str[] dtypes, int[][] shapes, Dict(str, str)? metadata)");
  m.def("open_handle(str[] files, str? cache_dir=None) -> int");
  m.def("close_handle(int handle) -> bool");
}

TORCH_LIBRARY_IMPL(fastsafetensors, CompositeExplicitAutograd, m) {
  m.impl("load", TORCH_FN(load));
  m.impl("load_with_report", TORCH_FN(load_with_report));
  m.impl("load_named", TORCH_FN(load_named));
  m.impl("load_rows", TORCH_FN(load_rows));
  m.impl("open_stream", TORCH_FN(open_stream));
  m.impl("selected", TORCH_FN(selected));
  m.impl("share_load", TORCH_FN(share_load));
  m.impl("read_range", TORCH_FN(read_range));
  m.impl("keys", TORCH_FN(keys));
  m.impl("check_device", TORCH_FN(check_device));
  m.impl("checkpoint", TORCH_FN(checkpoint));
  m.impl("resident_fraction", TORCH_FN(resident_fraction));
  m.impl("release_staging_buffers", TORCH_FN(release_staging_buffers));
  m.impl("metadata", TORCH_FN(metadata));
  m.impl("describe", TORCH_FN(describe));
  m.impl("open_handle", TORCH_FN(open_handle));
  m.impl("close_handle", TORCH_FN(close_handle));
}

}  // namespace fastsafetensors
