// The Python module of structattn's C++ kernels (see _extension.py).
#include "_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def(
      "set_parallel_work",
      [](double work) { return structattn::parallel_work().exchange(work); },
      "the work below which a batch runs as one chunk; returns the previous value",
      pybind11::arg("work"));
  structattn::bind_eisner(m);
  structattn::bind_matrix_tree(m);
  structattn::bind_chain(m);
}
