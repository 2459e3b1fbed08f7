// The little of torch that ops.cpp uses, behind one interface with two implementations:
//
//   torch_api_stable.h  LibTorch's stable ABI (torch/csrc/stable, C functions only): the
//                       library built with it loads under every torch from 2.11 on. Chosen
//                       by FASTSAFETENSORS_STABLE_ABI (setup.py: torch >= 2.11 at build time).
//   torch_api_aten.h    ATen and torch/library.h: tied to the torch release it was compiled
//                       against (the source build for torch 2.8 to 2.10).
//
// Both give the same ops with the same schemas, so Python, TorchScript and C++ callers see one
// interface whichever library is installed. Each implementation defines, in namespace
// fastsafetensors::tt:
//
//   Tensor, ScalarType
//   [[noreturn]] fail(message)               raises RuntimeError(message) in Python
//   view_of<Release>(data, shape, type, ctx, cuda=-1)
//                                            a tensor over `data` (CPU, or CUDA device `cuda`);
//                                            Release(ctx) when it dies
//   bytes_at(data, len)                      a CPU uint8 tensor over `data` (not owning it)
//   empty(shape, type, cuda)                 new memory; cuda < 0: CPU, else that CUDA device
//   narrow(t, start, len)                    rows [start, start + len) of dimension 0 (a view)
//   clone(t), reinterpret(t, type, shape)    a copy; the bytes of t viewed as type and shape
//   cast(t, type), to_cuda(t, index)         .to(type), .to("cuda:index")
//   data_ptr, numel, is_cuda, device_index, scalar_type, is_contiguous, contiguous, sizes, strides
//   current_cuda_device()                    torch's current CUDA device
// and the registration macros FST_LIBRARY(m), FST_LIBRARY_IMPL(m) and FST_KERNEL(function).
#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <string>

#ifdef FASTSAFETENSORS_STABLE_ABI
#include "torch_api_stable.h"
#else
#include "torch_api_aten.h"
#endif

namespace fastsafetensors::tt {

// The cudaStream_t of torch's current stream on CUDA device `index`, as a CUstream for the
// Rust driver layer. Neither ABI offers it in a form that loads under a CPU-only torch: the
// stable ABI's Stream::nativeHandle() (torch_stream_native_handle) is new in 2.13, and
// c10::cuda::getCurrentCUDAStream is in libtorch_cuda, which this library does not link so
// that it loads where torch has no CUDA. So it is looked up at run time in libtorch_cuda: its
// C shim `aoti_torch_get_current_cuda_stream`, part of the same stable C surface (declared in
// torch/csrc/inductor/aoti_torch/c/shim.h under USE_CUDA, present in every torch from 2.8).
inline uint64_t current_cuda_stream(int32_t index) {
  using Fn = int32_t (*)(int32_t, void**);  // AOTITorchError (0: success)
  static const Fn get = []() -> Fn {
    void* lib = dlopen("libtorch_cuda.so", RTLD_LAZY | RTLD_NOLOAD);
    return lib == nullptr ? nullptr : reinterpret_cast<Fn>(dlsym(lib, "aoti_torch_get_current_cuda_stream"));
  }();
  if (get == nullptr) fail("fastsafetensors: this torch has no CUDA support (libtorch_cuda.so is not loaded)");
  void* stream = nullptr;
  if (get(index, &stream) != 0) {
    fail("fastsafetensors: torch's current stream on cuda:" + std::to_string(index) + " is unavailable");
  }
  return reinterpret_cast<uint64_t>(stream);
}

}  // namespace fastsafetensors::tt
