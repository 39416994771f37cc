// The Python module of structattn's C++ kernels (see _extension.py).
#include "_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  structattn::bind_eisner(m);
  structattn::bind_matrix_tree(m);
  structattn::bind_chain(m);
}
