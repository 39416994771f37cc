// The Python module of structattn's C++ kernels (see _extension.py).
#include "_kernels.h"

namespace {

#define STRUCTATTN_STRING2(x) #x
#define STRUCTATTN_STRING(x) STRUCTATTN_STRING2(x)

// The target the vector loops run for in this process: the clone the loader picks
// (STRUCTATTN_CLONES: function multiversioning with the same targets and priorities), or the
// one target of a STRUCTATTN_ONE_TARGET build.
#ifdef STRUCTATTN_HAS_CLONES
__attribute__((target("default"))) const char* simd_target() { return "x86-64"; }
__attribute__((target("arch=x86-64-v3"))) const char* simd_target() { return "x86-64-v3"; }
__attribute__((target("arch=x86-64-v4"))) const char* simd_target() { return "x86-64-v4"; }
const char* simd_build() { return "clones"; }
#elif defined(STRUCTATTN_ONE_TARGET)
const char* simd_target() { return STRUCTATTN_STRING(STRUCTATTN_ONE_TARGET); }
const char* simd_build() { return "one target"; }
#else
const char* simd_target() { return "compiler default"; }
const char* simd_build() { return "no clones"; }
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def(
      "set_parallel_work",
      [](double work) { return structattn::parallel_work().exchange(work); },
      "the work below which a batch runs as one chunk; returns the previous value",
      pybind11::arg("work"));
  m.def(
      "simd_target", [] { return std::string(simd_target()); },
      "the target the vector loops run for here: x86-64-v4, x86-64-v3 or x86-64 (the clone "
      "the loader picked, or the one target of the build)");
  m.def(
      "simd_build", [] { return std::string(simd_build()); },
      "'clones' (one clone per target, picked at load), 'one target' or 'no clones'");
  structattn::bind_eisner(m);
  structattn::bind_matrix_tree(m);
  structattn::bind_chain(m);
}
