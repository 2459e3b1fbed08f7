// torch_api.h over LibTorch's stable ABI: only the headers of torch/csrc/stable and
// torch/headeronly, which call torch's C shims (aoti_torch_*, torch_*) and ATen ops through
// the dispatcher. Built with TORCH_TARGET_VERSION set to 2.11 (setup.py), so that the headers
// use nothing a torch 2.11 lacks; 2.11 is the first with torch_from_blob taking a deleter,
// which every tensor view of a loaded buffer needs.
#pragma once

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <array>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

// A failed torch call raises: with torch's own message where the headers can ask for it (the
// newer headers' check, through torch_exception_get_what at run time from torch 2.13); with
// the call's name where they cannot (building against torch 2.11 to 2.13).
#ifdef STABLE_TORCH_ERROR_CODE_CHECK
#define FST_CHECK_CALL(call) STABLE_TORCH_ERROR_CODE_CHECK(call)
#else
#define FST_CHECK_CALL(call) TORCH_ERROR_CODE_CHECK(call)
#endif

namespace fastsafetensors::tt {

using Tensor = torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;

// torch turns a std::exception thrown by a kernel into a RuntimeError carrying its message.
[[noreturn]] inline void fail(const std::string& message) { throw std::runtime_error(message); }

namespace detail {

inline int32_t shim_dtype(ScalarType type) {
  return torch::stable::detail::to<int32_t>(torch::stable::detail::from(type));
}

inline std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * std::max<int64_t>(shape[d], 1);
  return strides;
}

inline torch::stable::Device device(int32_t cuda) {
  using torch::headeronly::DeviceType;
  return cuda < 0 ? torch::stable::Device(DeviceType::CPU) : torch::stable::Device(DeviceType::CUDA, cuda);
}

}  // namespace detail

// A tensor over `data` (on the CPU, or CUDA device `cuda` >= 0), whose storage calls
// Release(ctx) when it is freed.
template <void (*Release)(void*)>
Tensor view_of(void* data, const std::vector<int64_t>& shape, ScalarType type, void* ctx, int32_t cuda = -1) {
  const auto strides = detail::contiguous_strides(shape);
  const int32_t device_type = cuda < 0 ? aoti_torch_device_type_cpu() : aoti_torch_device_type_cuda();
  AtenTensorHandle out = nullptr;
  FST_CHECK_CALL(torch_from_blob(data, static_cast<int64_t>(shape.size()), shape.data(),
                                 strides.data(), 0, detail::shim_dtype(type), device_type, cuda < 0 ? -1 : cuda,
                                 &out, aoti_torch_layout_strided(), nullptr, 0,
                                 [](void*, void* context) { Release(context); }, ctx));
  return Tensor(out);
}

inline Tensor bytes_at(void* data, int64_t len) {
  return torch::stable::from_blob(data, {len}, {1}, detail::device(-1), ScalarType::Byte);
}

inline Tensor empty(const std::vector<int64_t>& shape, ScalarType type, int32_t cuda) {
  return torch::stable::empty(shape, type, std::nullopt, detail::device(cuda));
}

inline Tensor narrow(Tensor t, int64_t start, int64_t len) { return torch::stable::narrow(t, 0, start, len); }
inline Tensor clone(const Tensor& t) { return torch::stable::clone(t); }
// aten::view.dtype through the dispatcher (torch::stable::view(t, dtype) is only in the headers
// of torch 2.14 and later; the op runs under every torch).
inline Tensor reinterpret(const Tensor& t, ScalarType type, const std::vector<int64_t>& shape) {
  std::array<StableIValue, 2> stack{torch::stable::detail::from(t), torch::stable::detail::from(type)};
  FST_CHECK_CALL(torch_call_dispatcher("aten::view", "dtype", stack.data(), TORCH_ABI_VERSION));
  return torch::stable::view(torch::stable::detail::to<Tensor>(stack[0]), shape);
}
inline Tensor cast(const Tensor& t, ScalarType type) { return torch::stable::to(t, std::optional<ScalarType>(type)); }
inline Tensor to_cuda(const Tensor& t, int32_t index) { return torch::stable::to(t, detail::device(index)); }

inline void* data_ptr(const Tensor& t) { return t.data_ptr(); }
inline int64_t numel(const Tensor& t) { return t.numel(); }
inline bool is_cuda(const Tensor& t) { return t.is_cuda(); }
inline int32_t device_index(const Tensor& t) { return t.get_device_index(); }
inline ScalarType scalar_type(const Tensor& t) { return t.scalar_type(); }
inline bool is_contiguous(const Tensor& t) { return t.is_contiguous(); }
inline Tensor contiguous(const Tensor& t) { return torch::stable::contiguous(t); }
inline std::vector<int64_t> sizes(const Tensor& t) { return {t.sizes().begin(), t.sizes().end()}; }
inline std::vector<int64_t> strides(const Tensor& t) { return {t.strides().begin(), t.strides().end()}; }

inline int32_t current_cuda_device() { return torch::stable::accelerator::getCurrentDeviceIndex(); }

}  // namespace fastsafetensors::tt

#define FST_LIBRARY(m) STABLE_TORCH_LIBRARY(fastsafetensors, m)
#define FST_LIBRARY_IMPL(m) STABLE_TORCH_LIBRARY_IMPL(fastsafetensors, CompositeExplicitAutograd, m)
#define FST_KERNEL(function) TORCH_BOX(&function)
