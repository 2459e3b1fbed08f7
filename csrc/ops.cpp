// The torch ops of fastsafetensors. A translation layer only: the Rust loader decides what to
// read, where it goes and what becomes of each tensor (a view, a copy, a cast); this file
// allocates device memory through torch, wraps the buffers as tensors, carries out those
// decisions with ATen ops, and registers the ops.
//
// Written against torch_api.h, which is either LibTorch's stable ABI (one library for every
// torch from 2.11) or ATen (one torch release): the same ops and schemas either way. The
// stable ABI has no Dict returns and no custom classes, so results are lists (names beside
// tensors; metadata keys beside values) and a stream is an integer handle.
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

#include "torch_api.h"

#include "rust/cxx.h"
#include "fastsafetensors/rust/bridge.rs.h"

namespace fastsafetensors {
namespace {

using tt::ScalarType;
using tt::Tensor;
using Strings = std::vector<std::string>;
// Names and tensors in read order (and how each file was read).
using NamedTensors = std::tuple<Strings, std::vector<Tensor>>;
using LoadResult = std::tuple<Strings, std::vector<Tensor>, Strings>;
// A header's metadata as keys and values; both None where it has no `__metadata__`.
using Metadata = std::tuple<std::optional<Strings>, std::optional<Strings>>;

// Calls into Rust, turning its errors into torch errors (RuntimeError in Python).
template <class F>
auto call_rust(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const ::rust::Error& e) {
    tt::fail(e.what());
  }
}

std::string_view view(const ::rust::String& s) { return {s.data(), s.size()}; }
uint64_t address(const Tensor& t) { return reinterpret_cast<uint64_t>(tt::data_ptr(t)); }

// torch's dtype of a safetensors dtype name (Rust has refused the names torch lacks), and
// torch's name of a dtype ("" for none): Rust holds the one table between them.
ScalarType scalar_type(std::string_view dtype) {
  return static_cast<ScalarType>(call_rust([&] { return rs::torch_scalar_type({dtype.data(), dtype.size()}); }));
}

std::string dtype_name(std::optional<ScalarType> dtype) {
  return dtype ? std::string(rs::torch_dtype_name(static_cast<int32_t>(*dtype))) : "";
}

// One buffer of the Rust loader (a host buffer, or kept device memory), shared by the tensors
// in it: each tensor's storage holds a count (its context), which costs no allocation per
// tensor (checkpoints of 100k tensors).
template <class Ref>
class Shared {
 public:
  // The buffer, with one count held by the returned handle.
  static std::unique_ptr<Shared, void (*)(Shared*)> take(::rust::Box<Ref> ref) {
    return {new Shared(std::move(ref)), [](Shared* b) { release(b); }};
  }

  uint8_t* base() const { return base_; }

  // A count for one more tensor, as a storage context released by `release`.
  void* acquire() {
    refs_.fetch_add(1, std::memory_order_relaxed);
    return this;
  }

  static void release(void* ctx) {
    auto* self = static_cast<Shared*>(ctx);
    if (self->refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete self;
  }

 private:
  explicit Shared(::rust::Box<Ref> ref) : ref_(std::move(ref)), base_(reinterpret_cast<uint8_t*>(ref_->address())) {}

  ::rust::Box<Ref> ref_;
  uint8_t* base_;
  std::atomic<size_t> refs_{1};
};

using SharedBuffer = Shared<rs::BufferRef>;
using Buffer = std::unique_ptr<SharedBuffer, void (*)(SharedBuffer*)>;

std::vector<int64_t> shape_of(const rs::TensorSpec& t) { return {t.shape.begin(), t.shape.end()}; }

// A tensor over the bytes of `t` in a host buffer: a view keeping the buffer alive, or a copy.
Tensor wrap_host(const rs::TensorSpec& t, SharedBuffer& buffer) {
  const auto type = scalar_type(view(t.dtype));
  if (t.nbytes == 0) return tt::empty(shape_of(t), type, -1);
  auto* data = buffer.base() + t.offset;
  if (!t.copy) return tt::view_of<&SharedBuffer::release>(data, shape_of(t), type, buffer.acquire());
  // Copied as bytes into fresh, aligned memory, then reinterpreted.
  return tt::reinterpret(tt::clone(tt::bytes_at(data, static_cast<int64_t>(t.nbytes))), type, shape_of(t));
}

// A tensor over the bytes of `t` in a device buffer whose byte 0 is at `start`: a view, so the
// buffer (owned by torch's caching allocator) is freed when the last tensor into it dies, or
// a copy on the device.
Tensor wrap_device(const rs::TensorSpec& t, const Tensor& buffer, int64_t start) {
  const auto type = scalar_type(view(t.dtype));
  if (t.nbytes == 0) return tt::empty(shape_of(t), type, tt::device_index(buffer));
  auto bytes = tt::narrow(buffer, start + static_cast<int64_t>(t.offset), static_cast<int64_t>(t.nbytes));
  return tt::reinterpret(t.copy ? tt::clone(bytes) : bytes, type, shape_of(t));
}

// Adds a wrapped tensor, cast where Rust says so (on the tensor's device).
void add(NamedTensors& out, const rs::TensorSpec& spec, Tensor t) {
  std::get<0>(out).emplace_back(spec.name.data(), spec.name.size());
  std::get<1>(out).push_back(spec.cast.empty() ? std::move(t) : tt::cast(t, scalar_type(view(spec.cast))));
}

::rust::Vec<::rust::String> to_rust(const Strings& strings) {
  ::rust::Vec<::rust::String> out;
  out.reserve(strings.size());
  for (const auto& s : strings) out.push_back(::rust::String(s));
  return out;
}

Strings from_rust(const ::rust::Vec<::rust::String>& strings) { return Strings(strings.begin(), strings.end()); }

// Which tensors to load: all, or those `tensor_filter` selects in `mode`.
rs::TensorSelection selection(const std::optional<Strings>& tensor_filter, const std::string& mode) {
  rs::TensorSelection out{tensor_filter.has_value(), {}, ::rust::String(mode)};
  if (tensor_filter) out.patterns = to_rust(*tensor_filter);
  return out;
}

// The tensors of host buffers, as Rust specified them; `to`: a CUDA device to move each to
// before its cast (-1: none). The loader gives up its references first, and each buffer's
// handle here goes once its tensors are made (buffer by buffer): a buffer whose tensors were
// copied or cast is freed first.
NamedTensors host_tensors(rs::LoadedFiles& loaded, int32_t to = -1) {
  std::vector<Buffer> buffers;
  for (size_t i = 0; i < loaded.buffer_count(); ++i) buffers.push_back(SharedBuffer::take(loaded.take_buffer(i)));
  NamedTensors out;
  const auto& specs = loaded.tensors();
  for (size_t k = 0; k < specs.size(); ++k) {
    const auto& spec = specs[k];
    auto t = wrap_host(spec, *buffers[spec.buffer]);
    add(out, spec, to >= 0 ? tt::to_cuda(t, to) : t);
    if (k + 1 == specs.size() || specs[k + 1].buffer != spec.buffer) buffers[spec.buffer].reset();
  }
  return out;
}

// The CUDA device Rust parsed; index -1 is torch's current device.
int32_t cuda_device(const rs::DeviceSpec& spec) {
  return spec.index < 0 ? tt::current_cuda_device() : static_cast<int32_t>(spec.index);
}

// An event recorded on torch's current stream once the buffers are allocated: the caching
// allocator may hand out memory that work queued there still uses, so the copies are ordered
// after it. Rust's driver layer makes and records it; torch lends only its stream.
class ReadyEvent {
 public:
  explicit ReadyEvent(int32_t device)
      : event_(call_rust([&] { return rs::record_ready(static_cast<size_t>(device), tt::current_cuda_stream(device)); })) {}
  uint64_t handle() const { return event_->handle(); }

 private:
  ::rust::Box<rs::ReadyEvent> event_;
};

Tensor device_bytes(int64_t len, int32_t device) { return tt::empty({len}, ScalarType::Byte, device); }

// Whole files copied to the device, group by group as Rust groups them, into memory from torch's
// caching allocator, so that torch's memory statistics (which vLLM sizes its KV cache from) count it.
LoadResult load_to_cuda(const rs::PlannedFiles& planned, const std::string& reader, std::optional<bool> nogds) {
  const int32_t device = cuda_device(planned.target());
  const int32_t gds = nogds.has_value() ? static_cast<int32_t>(*nogds) : -1;
  Strings read_paths(planned.file_count());
  NamedTensors tensors;
  for (size_t g = 0; g < planned.device_group_count(); ++g) {
    const auto files = planned.device_group_files(g);
    std::vector<Tensor> buffers;
    ::rust::Vec<uint64_t> bases;
    for (const size_t i : files) {
      buffers.push_back(device_bytes(static_cast<int64_t>(planned.device_alloc_len(i)), device));
      bases.push_back(address(buffers.back()));
    }
    std::optional<ReadyEvent> ready;
    if (!files.empty()) ready.emplace(device);
    const auto copies = call_rust([&] {
      return planned.copy_to_cuda(static_cast<size_t>(device), files, bases, reader, gds, ready ? ready->handle() : 0);
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

// Every file's tensors in kept memory on a CUDA device (read-only once shared: docs/keep.md),
// each a view holding it, cast or copied out where Rust says.
LoadResult kept_cuda_tensors(const rs::PlannedFiles& planned, ::rust::Box<rs::KeptDevice> kept) {
  const int32_t device = cuda_device(planned.target());
  const auto copies = kept->file_copies();
  auto memory = Shared<rs::KeptDevice>::take(std::move(kept));
  Strings read_paths;
  for (const auto& c : copies) read_paths.emplace_back(c.path);
  NamedTensors tensors;
  for (size_t g = 0; g < planned.device_group_count(); ++g) {
    const auto files = planned.device_group_files(g);
    for (const auto& spec : planned.device_group_specs(g)) {
      const auto type = scalar_type(view(spec.dtype));
      auto* data = memory->base() + copies[files[spec.buffer]].offset + spec.offset;
      using Memory = Shared<rs::KeptDevice>;
      const auto bytes = static_cast<int64_t>(spec.nbytes);
      Tensor t = spec.nbytes == 0 ? tt::empty(shape_of(spec), type, device)
                 : spec.copy ? tt::reinterpret(tt::clone(tt::view_of<&Memory::release>(
                                                   data, {bytes}, ScalarType::Byte, memory->acquire(), device)),
                                               type, shape_of(spec))
                             : tt::view_of<&Memory::release>(data, shape_of(spec), type, memory->acquire(), device);
      add(tensors, spec, std::move(t));
    }
  }
  auto& [names, list] = tensors;
  return {std::move(names), std::move(list), std::move(read_paths)};
}

// The selected tensors of `files` on `device`, in read order, and how each file was read;
// `keep`: the bytes kept between processes (Rust decides where they come from).
LoadResult load_files(Strings files, std::string device, std::optional<ScalarType> dtype,
                      std::optional<std::string> reader, std::optional<bool> nogds,
                      std::optional<Strings> tensor_filter, std::string tensor_name_match_mode, int64_t handle,
                      bool keep) {
  const auto paths = to_rust(files);
  const auto chosen = selection(tensor_filter, tensor_name_match_mode);
  auto planned = call_rust([&] { return rs::plan_load(paths, chosen, device, dtype_name(dtype), handle); });
  const std::string how = reader.value_or("");
  if (planned->route() == rs::Route::Device) {
    if (keep) {
      const auto on = static_cast<size_t>(cuda_device(planned->target()));
      auto kept = call_rust([&] { return planned->copy_to_cuda_kept(on, how); });
      if (kept->kept()) return kept_cuda_tensors(*planned, std::move(kept));
    }
    return load_to_cuda(*planned, how, nogds);
  }
  const int32_t to = planned->route() == rs::Route::HostThenDevice ? cuda_device(planned->target()) : -1;
  auto files_read = call_rust([&] {
    return keep ? rs::read_to_host_kept(std::move(planned), how) : rs::read_to_host(std::move(planned), how);
  });
  auto [names, tensors] = host_tensors(*files_read, to);
  return {std::move(names), std::move(tensors), from_rust(files_read->read_paths())};
}

LoadResult load_named(Strings files, std::string device, std::optional<ScalarType> dtype,
                      std::optional<std::string> reader, std::optional<bool> nogds,
                      std::optional<Strings> tensor_filter, std::string tensor_name_match_mode, int64_t handle) {
  return load_files(std::move(files), std::move(device), dtype, std::move(reader), nogds, std::move(tensor_filter),
                    std::move(tensor_name_match_mode), handle, false);
}

// `load_named` with the bytes kept between processes (see docs/keep.md).
LoadResult load_kept(Strings files, std::string device, std::optional<ScalarType> dtype,
                     std::optional<std::string> reader, std::optional<bool> nogds,
                     std::optional<Strings> tensor_filter, std::string tensor_name_match_mode, int64_t handle) {
  return load_files(std::move(files), std::move(device), dtype, std::move(reader), nogds, std::move(tensor_filter),
                    std::move(tensor_name_match_mode), handle, true);
}

// A command to the running keeper ("list", "drop" with `path`, "stop"): its answer as JSON,
// "" when none runs.
std::string keep_command(std::string command, std::string path) {
  return std::string(call_rust([&] { return rs::keep_command(command, path); }));
}

LoadResult load_with_report(Strings files, std::string device, std::optional<ScalarType> dtype,
                            std::optional<std::string> reader, std::optional<bool> nogds,
                            std::optional<Strings> tensor_filter, std::string tensor_name_match_mode) {
  return load_named(std::move(files), std::move(device), dtype, std::move(reader), nogds, std::move(tensor_filter),
                    std::move(tensor_name_match_mode), -1);
}

NamedTensors load(Strings files, std::string device, std::optional<ScalarType> dtype, std::optional<std::string> reader,
                  std::optional<bool> nogds, std::optional<Strings> tensor_filter, std::string tensor_name_match_mode) {
  auto [names, tensors, read_paths] = load_with_report(std::move(files), std::move(device), dtype, std::move(reader),
                                                       nogds, std::move(tensor_filter), std::move(tensor_name_match_mode));
  return {std::move(names), std::move(tensors)};
}

// Rows [start, stop) of tensor `name`, reading only their bytes.
Tensor load_rows(std::string file, std::string name, int64_t start, int64_t stop, std::optional<std::string> reader,
                 int64_t handle) {
  auto loaded = call_rust([&] { return rs::load_rows(file, name, start, stop, reader.value_or(""), handle); });
  return std::get<1>(host_tensors(*loaded)).at(0);  // Rust plans exactly one
}

// Names of the tensors a filter selects, in read order, from the headers alone.
Strings selected(Strings files, std::optional<Strings> tensor_filter, std::string tensor_name_match_mode,
                 int64_t handle) {
  auto paths = to_rust(files);
  const auto chosen = selection(tensor_filter, tensor_name_match_mode);
  return from_rust(call_rust([&] { return rs::selected_names(paths, chosen, handle); }));
}

// A load shared by `world` ranks, as JSON (see rs::share_load): each byte read by one rank.
std::string share_load(Strings files, std::optional<ScalarType> dtype, std::optional<Strings> tensor_filter,
                       std::string mode, int64_t world, std::optional<std::string> max_memory, int64_t chunk,
                       int64_t handle) {
  const auto chosen = selection(tensor_filter, mode);
  const auto paths = to_rust(files);
  const auto cast = dtype_name(dtype), budget = max_memory.value_or("");
  return std::string(call_rust([&] {
    return rs::share_load(paths, chosen, cast, world, max_memory.has_value(), budget, chunk, handle);
  }));
}

// Fills `out` (contiguous bytes on the CPU or a CUDA device) from `file` at `offset`; says how.
std::string read_range(std::string file, int64_t offset, Tensor out, std::optional<std::string> reader,
                       int64_t handle) {
  if (tt::scalar_type(out) != ScalarType::Byte || !tt::is_contiguous(out)) {
    tt::fail("invalid argument: out: contiguous uint8");
  }
  const bool cuda = tt::is_cuda(out);
  std::optional<ReadyEvent> ready;
  if (cuda) ready.emplace(tt::device_index(out));
  const int64_t ordinal = cuda ? tt::device_index(out) : -1;
  const uint64_t event = ready ? ready->handle() : 0;
  return std::string(call_rust([&] {
    return rs::read_range(file, offset, address(out), tt::numel(out), ordinal, reader.value_or(""), handle, event);
  }));
}

bool check_range(std::string file, int64_t offset, Tensor data, int64_t handle) {
  if (tt::scalar_type(data) != ScalarType::Byte || !tt::is_contiguous(data) || tt::is_cuda(data)) {
    tt::fail("invalid argument: data: contiguous uint8 in host memory");
  }
  call_rust([&] { rs::check_range(file, offset, address(data), tt::numel(data), handle); });
  return true;
}

bool check_finish(std::string file, int64_t handle) {
  call_rust([&] { rs::check_finish(file, handle); });
  return true;
}

// A streaming load: `next()` returns the next group of tensors, in read order, as soon as its
// bytes have arrived, while the reads of later groups go on in the background. Each tensor keeps
// the buffer of its group alive; destroying the stream stops its reads. To the CPU, groups are
// read into host buffers within the memory budget. To a CUDA device, each group gets an
// allocation of its own from torch's caching allocator (so torch's memory statistics count it),
// and the copies Rust says to submit ahead run through the pinned ring while the caller works.
class TensorStream {
 public:
  explicit TensorStream(::rust::Box<rs::TensorStream> stream) : host_(std::move(stream)) {}

  TensorStream(::rust::Box<rs::DeviceTensorStream> stream, int32_t target)
      : target_(target), device_(std::move(stream)) {}

  // The next group's names and tensors (never none of them); nullopt after the last.
  std::optional<NamedTensors> next() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (;;) {
      auto group = host_ ? next_host() : next_device();
      if (!group || !std::get<0>(*group).empty()) return group;
    }
  }

  // How the last group was read: "direct", "buffered", "mmap" or "mmap-fallback" ("" before
  // the first), the index (-1 before the first) and path of its file; the tensors and bytes
  // the stream hands out in all.
  std::tuple<std::string, int64_t, std::string, int64_t, int64_t> info() {
    std::lock_guard<std::mutex> lock(mutex_);
    auto of = [](auto& s) -> std::tuple<std::string, int64_t, std::string, int64_t, int64_t> {
      return {std::string(s.group_read_path()), s.group_file(), std::string(s.group_path()),
              static_cast<int64_t>(s.tensor_count()), static_cast<int64_t>(s.byte_count())};
    };
    return host_ ? of(**host_) : of(**device_);
  }

 private:
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
    Tensor buffer;
    std::unique_ptr<ReadyEvent> ready;
  };

  void submit(size_t k) {
    auto& stream = *device_;
    const auto len = static_cast<int64_t>(call_rust([&] { return stream->alloc_len(k); }));
    Submitted s{device_bytes(len, target_), std::make_unique<ReadyEvent>(target_)};
    call_rust([&] { return stream->submit(k, address(s.buffer), s.ready->handle()); });
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
      const Tensor buffer = std::move(submitted_.extract(k).mapped().buffer);
      NamedTensors out;
      for (const auto& spec : specs) add(out, spec, wrap_device(spec, buffer, static_cast<int64_t>(landed.offset)));
      return out;
    } catch (...) {
      next_ = stream->group_count();  // a stream stops at its first error, as the host one does
      throw;
    }
  }

  std::mutex mutex_;
  int32_t target_ = -1;
  size_t next_ = 0;
  // Declared before the streams, so destroyed after them: the copier has stopped (its running
  // copy done) before the memory it copies into is given back to torch.
  std::unordered_map<size_t, Submitted> submitted_;
  std::optional<::rust::Box<rs::TensorStream>> host_;
  std::optional<::rust::Box<rs::DeviceTensorStream>> device_;
};

// The open streams, by the handle `open_stream` returned (from 1 on). A stream leaves with
// `close_stream`, or once `stream_next` has found its end.
class Streams {
 public:
  int64_t add(std::shared_ptr<TensorStream> stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t handle = next_++;
    open_.emplace(handle, std::move(stream));
    return handle;
  }

  std::shared_ptr<TensorStream> get(int64_t handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = open_.find(handle);
    if (it == open_.end()) {
      tt::fail("invalid argument: stream " + std::to_string(handle) + " is not open (closed, or read to its end)");
    }
    return it->second;
  }

  // Whether it was open. Its reads stop here, unless another thread is in its `next`: then
  // when that returns (the stream is destroyed outside the lock).
  bool remove(int64_t handle) {
    std::shared_ptr<TensorStream> gone;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto node = open_.extract(handle);
      if (node.empty()) return false;
      gone = std::move(node.mapped());
    }
    return true;
  }

 private:
  std::mutex mutex_;
  int64_t next_ = 1;
  std::unordered_map<int64_t, std::shared_ptr<TensorStream>> open_;
};

Streams& streams() {
  static Streams* all = new Streams();  // never destroyed: streams may outlive static destruction
  return *all;
}

int64_t open_stream(Strings files, std::string device, std::optional<ScalarType> dtype,
                    std::optional<std::string> reader, std::optional<Strings> tensor_filter,
                    std::string tensor_name_match_mode, std::optional<std::string> max_memory, int64_t handle) {
  const auto cast = dtype_name(dtype);
  const auto target = call_rust([&] { return rs::check_target(device, cast); });
  auto paths = to_rust(files);
  const auto chosen = selection(tensor_filter, tensor_name_match_mode);
  const std::string how = reader.value_or(""), budget = max_memory.value_or("");
  if (!target.cuda) {
    return streams().add(std::make_shared<TensorStream>(
        call_rust([&] { return rs::open_stream(paths, how, chosen, budget, cast, handle); })));
  }
  const int32_t on = cuda_device(target);
  auto stream = call_rust([&] {
    return rs::open_device_stream(paths, how, chosen, budget, cast, static_cast<size_t>(on), handle);
  });
  return streams().add(std::make_shared<TensorStream>(std::move(stream), on));
}

// The next group of stream `stream`: names and tensors, both empty after the last (the
// stream is closed then).
NamedTensors stream_next(int64_t stream) {
  auto group = streams().get(stream)->next();
  if (group) return std::move(*group);
  streams().remove(stream);
  return {};
}

std::tuple<std::string, int64_t, std::string, int64_t, int64_t> stream_info(int64_t stream) {
  return streams().get(stream)->info();
}

bool close_stream(int64_t stream) { return streams().remove(stream); }

// Tensor names, dtypes and shapes in offset order, and the metadata, without reading data.
std::tuple<Strings, Strings, std::vector<std::vector<int64_t>>, std::optional<Strings>, std::optional<Strings>>
describe(std::string file, int64_t handle) {
  const auto h = call_rust([&] { return rs::read_header(file, handle); });
  Strings names, dtypes;
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& t : h.tensors) {
    names.emplace_back(t.name);
    dtypes.emplace_back(t.dtype);
    shapes.emplace_back(t.shape.begin(), t.shape.end());
  }
  std::optional<Strings> keys, values;
  if (h.has_metadata) keys = from_rust(h.metadata_keys), values = from_rust(h.metadata_values);
  return {std::move(names), std::move(dtypes), std::move(shapes), std::move(keys), std::move(values)};
}

// Frees the pinned staging buffers kept for later CUDA loads; returns how many were freed.
int64_t release_staging_buffers() { return static_cast<int64_t>(rs::release_staging_buffers()); }

std::string check_device(std::string device) { return std::string(call_rust([&] { return rs::parse_device(device); }).name); }

// The files `path` (a file, checkpoint directory or index) stands for, the index they come
// from, and every problem between them and the index.
std::tuple<Strings, std::optional<std::string>, Strings> checkpoint(std::string path) {
  const auto c = call_rust([&] { return rs::checkpoint(path); });
  std::optional<std::string> index;
  if (!c.index.empty()) index = std::string(c.index);
  return {from_rust(c.files), index, from_rust(c.problems)};
}

double resident_fraction(std::string file) { return call_rust([&] { return rs::resident_fraction(file); }); }

// A handle on `files`, opened now: the ops taking it read those, whatever becomes of the paths.
Strings verify_tree(std::string dir, std::string verify) {
  return from_rust(call_rust([&] { return rs::verify_tree(dir, verify); }));
}

int64_t open_handle(Strings files, std::optional<std::string> cache_dir, std::optional<std::string> verify) {
  return call_rust([&] { return rs::open_handle(to_rust(files), cache_dir.value_or(""), verify.value_or("")); });
}
bool close_handle(int64_t handle) { return rs::close_handle(handle); }
bool cancel_handle(int64_t handle) { return rs::cancel_handle(handle); }

Strings keys(std::string file) {
  auto names = std::get<0>(describe(std::move(file), -1));
  std::sort(names.begin(), names.end());
  return names;
}

// The tensors handed to a save as Rust takes them, each made contiguous on its own device
// first (the copies live as long as this), and the event torch's stream records for CUDA ones.
class SaveTensors {
 public:
  SaveTensors(const Strings& names, const std::vector<Tensor>& tensors) {
    if (names.size() != tensors.size()) tt::fail("fastsafetensors: save: names and tensors differ in number");
    for (size_t i = 0; i < tensors.size(); ++i) {
      const Tensor& t = tensors[i];
      std::string dtype;
      try {
        dtype = dtype_name(tt::scalar_type(t));
      } catch (const std::exception&) {  // the stable ABI names no quantized, bits or sub-byte dtype
        tt::fail("tensor '" + names[i] + "' cannot be saved: safetensors has no dtype for its torch dtype " +
                 "(a quantized, bits or sub-byte integer type)");
      }
      const int32_t device = tt::is_cuda(t) ? tt::device_index(t) : -1;
      if (device >= 0 && !ready_) ready_.emplace(device);
      contiguous_.push_back(tt::contiguous(t));  // t itself where it is contiguous
      rs::SaveTensorSpec spec{names[i], dtype, {}, {}, address(contiguous_.back()), address(t), device};
      for (const int64_t d : tt::sizes(t)) spec.shape.push_back(d);
      for (const int64_t s : tt::strides(t)) spec.strides.push_back(s);
      specs_.push_back(std::move(spec));
    }
  }
  const ::rust::Vec<rs::SaveTensorSpec>& specs() const { return specs_; }
  uint64_t ready() const { return ready_ ? ready_->handle() : 0; }

 private:
  ::rust::Vec<rs::SaveTensorSpec> specs_;
  std::vector<Tensor> contiguous_;  // alive until the bytes are written
  std::optional<ReadyEvent> ready_;
};

// Saves `tensors` as bridge.rs `save` says (max_shard_size < 0: one file at `target`), each
// made contiguous on its own device first; copies off a CUDA device come after torch's stream.
Strings save(Strings names, std::vector<Tensor> tensors, std::string target, int64_t max_shard_size,
             std::optional<Strings> metadata_keys, std::optional<Strings> metadata_values, std::string max_memory) {
  const SaveTensors given(names, tensors);
  return from_rust(call_rust([&] {
    return rs::save(given.specs(), target, max_shard_size, metadata_keys.has_value(),
                    to_rust(metadata_keys.value_or(Strings{})), to_rust(metadata_values.value_or(Strings{})),
                    max_memory, given.ready());
  }));
}

// The steps of a group's save (bridge.rs `save_begin` ... `save_end`).
Strings save_begin(std::string spec) { return from_rust(call_rust([&] { return rs::save_begin(spec); })); }

int64_t save_write(int64_t handle, Strings locations, Strings names, std::vector<Tensor> tensors,
                   std::string max_memory) {
  const SaveTensors given(names, tensors);
  return static_cast<int64_t>(call_rust(
      [&] { return rs::save_write(handle, to_rust(locations), given.specs(), max_memory, given.ready()); }));
}

Strings save_commit(int64_t handle) { return from_rust(call_rust([&] { return rs::save_commit(handle); })); }
bool save_end(int64_t handle) { return rs::save_end(handle); }

Metadata metadata(std::string file) {
  auto described = describe(std::move(file), -1);
  return {std::move(std::get<3>(described)), std::move(std::get<4>(described))};
}

}  // namespace

FST_LIBRARY(m) {
  // The arguments of every bulk load. `int handle`, here and below: the files an `open_handle`
  // holds open, which the op reads instead of opening `files` (-1: none).
#define LOAD_ARGS                                                                                       \
  "(str[] files, str device=\"cpu\", ScalarType? dtype=None, str? reader=None, bool? nogds=None," \
  " str[]? tensor_filter=None, str tensor_name_match_mode=\"glob\""
  m.def("load" LOAD_ARGS ") -> (str[] names, Tensor[] tensors)");
  m.def("load_with_report" LOAD_ARGS ") -> (str[] names, Tensor[] tensors, str[] read_paths)");
  m.def("load_named" LOAD_ARGS ", int handle=-1) -> (str[] names, Tensor[] tensors, str[] read_paths)");
  m.def("load_kept" LOAD_ARGS ", int handle=-1) -> (str[] names, Tensor[] tensors, str[] read_paths)");
#undef LOAD_ARGS
  m.def("load_rows(str file, str name, int start, int stop, str? reader=None, int handle=-1) -> Tensor");
  m.def(
      "open_stream(str[] files, str device=\"cpu\", ScalarType? dtype=None, str? reader=None,"
      " str[]? tensor_filter=None, str tensor_name_match_mode=\"glob\", str? max_memory=None, int handle=-1)"
      " -> int");
  m.def("stream_next(int stream) -> (str[] names, Tensor[] tensors)");
  m.def("stream_info(int stream)"
        " -> (str read_path, int file_index, str file_path, int tensor_count, int byte_count)");
  m.def("close_stream(int stream) -> bool");
  m.def("selected(str[] files, str[]? tensor_filter=None, str tensor_name_match_mode=\"glob\", int handle=-1)"
        " -> str[]");
  m.def("share_load(str[] files, ScalarType? dtype, str[]? tensor_filter, str tensor_name_match_mode, int world,"
        " str? max_memory=None, int chunk=0, int handle=-1) -> str");
  m.def("read_range(str file, int offset, Tensor(a!) out, str? reader=None, int handle=-1) -> str");
  m.def("check_range(str file, int offset, Tensor data, int handle) -> bool");
  m.def("check_finish(str file, int handle) -> bool");
  m.def("keys(str file) -> str[]");
  m.def("check_device(str device) -> str");
  m.def("checkpoint(str path) -> (str[] files, str? index, str[] problems)");
  m.def("resident_fraction(str file) -> float");
  m.def("release_staging_buffers() -> int");
  m.def("metadata(str file) -> (str[]? keys, str[]? values)");
  m.def("describe(str file, int handle=-1)"
        " -> (str[] names, str[] dtypes, int[][] shapes, str[]? metadata_keys, str[]? metadata_values)");
  m.def("open_handle(str[] files, str? cache_dir=None, str? verify=None) -> int");
  m.def("close_handle(int handle) -> bool");
  m.def("verify_tree(str dir, str verify) -> str[]");
  m.def("keep_command(str command, str path=\"\") -> str");
  m.def("cancel_handle(int handle) -> bool");
  m.def("save(str[] names, Tensor[] tensors, str target, int max_shard_size=-1, str[]? metadata_keys=None,"
        " str[]? metadata_values=None, str max_memory=\"\") -> str[]");
  m.def("save_begin(str spec) -> str[]");
  m.def("save_write(int handle, str[] locations, str[] names, Tensor[] tensors, str max_memory=\"\") -> int");
  m.def("save_commit(int handle) -> str[]");
  m.def("save_end(int handle) -> bool");
}

FST_LIBRARY_IMPL(m) {
  m.impl("load", FST_KERNEL(load));
  m.impl("load_with_report", FST_KERNEL(load_with_report));
  m.impl("load_named", FST_KERNEL(load_named));
  m.impl("load_kept", FST_KERNEL(load_kept));
  m.impl("keep_command", FST_KERNEL(keep_command));
  m.impl("load_rows", FST_KERNEL(load_rows));
  m.impl("open_stream", FST_KERNEL(open_stream));
  m.impl("stream_next", FST_KERNEL(stream_next));
  m.impl("stream_info", FST_KERNEL(stream_info));
  m.impl("close_stream", FST_KERNEL(close_stream));
  m.impl("selected", FST_KERNEL(selected));
  m.impl("share_load", FST_KERNEL(share_load));
  m.impl("read_range", FST_KERNEL(read_range));
  m.impl("keys", FST_KERNEL(keys));
  m.impl("check_device", FST_KERNEL(check_device));
  m.impl("checkpoint", FST_KERNEL(checkpoint));
  m.impl("resident_fraction", FST_KERNEL(resident_fraction));
  m.impl("release_staging_buffers", FST_KERNEL(release_staging_buffers));
  m.impl("metadata", FST_KERNEL(metadata));
  m.impl("describe", FST_KERNEL(describe));
  m.impl("open_handle", FST_KERNEL(open_handle));
  m.impl("verify_tree", FST_KERNEL(verify_tree));
  m.impl("check_range", FST_KERNEL(check_range));
  m.impl("check_finish", FST_KERNEL(check_finish));
  m.impl("close_handle", FST_KERNEL(close_handle));
  m.impl("cancel_handle", FST_KERNEL(cancel_handle));
  m.impl("save", FST_KERNEL(save));
  m.impl("save_begin", FST_KERNEL(save_begin));
  m.impl("save_write", FST_KERNEL(save_write));
  m.impl("save_commit", FST_KERNEL(save_commit));
  m.impl("save_end", FST_KERNEL(save_end));
}

}  // namespace fastsafetensors
