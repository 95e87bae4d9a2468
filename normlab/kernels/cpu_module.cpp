// The Python module of the C++ CPU backend (normlab/kernels/cpu.py builds it from the files listed there).
#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  normlab::bind_layer_norm(m);
  normlab::bind_dropout(m);
  normlab::bind_attention(m);
}
