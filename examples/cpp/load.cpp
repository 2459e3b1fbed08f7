// Loads .safetensors files from C++ through the fastsafetensors op, with no Python.
//
//   fst_load [--device DEV] [--dtype float32|float16|bfloat16] LIBRARY FILE...
//
// LIBRARY is fastsafetensors' compiled extension (`python -c "import fastsafetensors_rs;
// print(fastsafetensors_rs.LIBRARY_PATH)"`). Loading it registers the ops with the dispatcher
// (its static initialisers); the op is then found by name and called with the boxed calling
// convention, as TorchScript calls it. The same program works with either build of the
// library (the stable-ABI one or a per-torch one): the schemas are the same. One JSON line is printed per tensor:
// name, dtype, shape and the sum of its bytes (a checksum to compare with Python).
#include <dlfcn.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <cstdio>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace {

int usage(const char* argv0) {
  std::cerr << "usage: " << argv0
            << " [--device DEV] [--dtype float32|float16|bfloat16] LIBRARY FILE...\n";
  return 2;
}

std::optional<at::ScalarType> parse_dtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "float16") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  throw std::invalid_argument("unsupported --dtype " + name);
}

// Sum of the tensor's bytes in row-major order (works for every dtype, float8 included).
uint64_t byte_sum(const at::Tensor& t) {
  const auto bytes = t.contiguous().cpu().reshape({-1}).view(at::kByte);
  const auto* p = bytes.data_ptr<uint8_t>();
  uint64_t sum = 0;
  for (int64_t i = 0; i < bytes.numel(); ++i) sum += p[i];
  return sum;
}

std::string json_string(const std::string& s) {
  std::ostringstream out;
  out << '"';
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out << '\\' << c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out << buf;
    } else {
      out << c;
    }
  }
  out << '"';
  return out.str();
}

}  // namespace

int main(int argc, char** argv) {
  std::string device = "cpu";
  std::optional<at::ScalarType> dtype;
  int i = 1;
  try {
    for (; i < argc && std::string(argv[i]).rfind("--", 0) == 0; ++i) {
      const std::string flag = argv[i];
      if (i + 1 >= argc) return usage(argv[0]);
      if (flag == "--device") {
        device = argv[++i];
      } else if (flag == "--dtype") {
        dtype = parse_dtype(argv[++i]);
      } else {
        return usage(argv[0]);
      }
    }
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
  if (argc - i < 2) return usage(argv[0]);
  const char* library = argv[i++];
  std::vector<std::string> files(argv + i, argv + argc);

  // Registers torch.ops.fastsafetensors.* with this process's dispatcher.
  if (dlopen(library, RTLD_NOW | RTLD_LOCAL) == nullptr) {
    std::cerr << "cannot load " << library << ": " << dlerror() << "\n";
    return 1;
  }

  try {
    const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fastsafetensors::load", "");
    // load(str[] files, str device="cpu", ScalarType? dtype=None, str? reader=None, bool? nogds=None,
    //      str[]? tensor_filter=None, str tensor_name_match_mode="glob")
    // A boxed call passes every argument, defaults included.
    std::vector<c10::IValue> stack;
    stack.emplace_back(c10::List<std::string>(files));
    stack.emplace_back(device);
    stack.emplace_back(dtype ? c10::IValue(*dtype) : c10::IValue());
    stack.emplace_back();  // reader: the default policy (or $FASTSAFETENSORS_READER)
    stack.emplace_back();  // nogds: the default
    stack.emplace_back();  // tensor_filter: every tensor
    stack.emplace_back(std::string("glob"));  // tensor_name_match_mode
    op.callBoxed(&stack);
    // -> (str[] names, Tensor[] tensors): in read order, names[i] is tensors[i]'s.
    const auto names = stack.at(0).to<std::vector<std::string>>();
    const auto tensors = stack.at(1).toTensorVector();

    for (size_t i = 0; i < names.size(); ++i) {
      const std::string& name = names[i];
      const at::Tensor& t = tensors[i];
      std::cout << "{\"name\": " << json_string(name) << ", \"dtype\": \"" << t.scalar_type()
                << "\", \"device\": \"" << t.device() << "\", \"shape\": [";
      for (size_t d = 0; d < t.sizes().size(); ++d) std::cout << (d ? ", " : "") << t.sizes()[d];
      std::cout << "], \"byte_sum\": " << byte_sum(t) << "}\n";
    }
  } catch (const c10::Error& e) {
    // Loader errors (a bad file, a missing one) name the file: a c10::Error from a per-torch
    // build of the library, a std::runtime_error from the stable-ABI one.
    std::cerr << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
