// torch_api.h over ATen and torch/library.h: the library is tied to the torch release it was
// compiled against (torch 2.8 to 2.10, which lack the stable ABI's from_blob with a deleter,
// or any torch with FASTSAFETENSORS_ABI=torch). ATen/ATen.h and torch/library.h, not the
// all-in-one extension header (3x slower to compile).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <string>
#include <vector>

namespace fastsafetensors::tt {

using Tensor = at::Tensor;
using ScalarType = at::ScalarType;

[[noreturn]] inline void fail(const std::string& message) { TORCH_CHECK(false, message); }

// A tensor over `data` (on the CPU, or CUDA device `cuda` >= 0), whose storage calls
// Release(ctx) when it is freed: the context costs no allocation per tensor (checkpoints of
// 100k tensors).
template <void (*Release)(void*)>
Tensor view_of(void* data, const std::vector<int64_t>& shape, ScalarType type, void* ctx, int32_t cuda = -1) {
  auto options = at::TensorOptions(type);
  if (cuda >= 0) options = options.device(c10::kCUDA, static_cast<c10::DeviceIndex>(cuda));
  return at::for_blob(data, shape).context(ctx, Release).options(options).make_tensor();
}

inline Tensor bytes_at(void* data, int64_t len) { return at::from_blob(data, {len}, at::TensorOptions(at::kByte)); }

inline Tensor empty(const std::vector<int64_t>& shape, ScalarType type, int32_t cuda) {
  const auto options = at::TensorOptions(type);
  return at::empty(shape, cuda < 0 ? options : options.device(c10::kCUDA, static_cast<c10::DeviceIndex>(cuda)));
}

inline Tensor narrow(const Tensor& t, int64_t start, int64_t len) { return t.narrow(0, start, len); }
inline Tensor clone(const Tensor& t) { return t.clone(); }
inline Tensor reinterpret(const Tensor& t, ScalarType type, const std::vector<int64_t>& shape) {
  return t.view(type).view(shape);
}
inline Tensor cast(const Tensor& t, ScalarType type) { return t.to(type); }
inline Tensor to_cuda(const Tensor& t, int32_t index) {
  return t.to(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index)));
}

inline void* data_ptr(const Tensor& t) { return t.data_ptr(); }
inline int64_t numel(const Tensor& t) { return t.numel(); }
inline bool is_cuda(const Tensor& t) { return t.is_cuda(); }
inline int32_t device_index(const Tensor& t) { return t.device().index(); }
inline ScalarType scalar_type(const Tensor& t) { return t.scalar_type(); }
inline bool is_contiguous(const Tensor& t) { return t.is_contiguous(); }
inline Tensor contiguous(const Tensor& t) { return t.contiguous(); }
inline std::vector<int64_t> sizes(const Tensor& t) { return t.sizes().vec(); }
inline std::vector<int64_t> strides(const Tensor& t) { return t.strides().vec(); }

// Through the device-guard registry: the library links none of torch's CUDA libraries, so
// that it still loads under a CPU-only torch.
inline int32_t current_cuda_device() { return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index(); }

}  // namespace fastsafetensors::tt

#define FST_LIBRARY(m) TORCH_LIBRARY(fastsafetensors, m)
#define FST_LIBRARY_IMPL(m) TORCH_LIBRARY_IMPL(fastsafetensors, CompositeExplicitAutograd, m)
#define FST_KERNEL(function) TORCH_FN(function)
