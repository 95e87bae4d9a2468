// The Python module of the C++ CPU backend (normlab/kernels/cpu.py builds it from the files listed there): the
// one file that includes torch's pybind11 bindings of tensors (their own header, not torch/extension.h, which adds
// all of torch's C++ API to compile; docs/kernels.md).
#include <torch/csrc/utils/pybind.h>

#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &normlab::layer_norm_forward,
        "forward(x, weight, bias, eps) -> y, mean, rstd: LayerNorm over x's last dim");
  m.def("backward", &normlab::layer_norm_backward, "backward(dy, x, weight, mean, rstd) -> dx, dweight, dbias");
  m.def("register_layer_norm", &normlab::register_layer_norm, "register forward/backward as the operators' CPU kernels");
  m.def("unregister_layer_norm", &normlab::unregister_layer_norm, "unregister them: the reference implementation runs again");
  m.def("dropout", &normlab::dropout, "dropout(x, seed, p) -> x * mask(seed) / (1 - p): the kernel, no autograd");
  m.def("register_dropout", &normlab::register_dropout, "register the kernel as normlab::dropout's CPU kernel");
  m.def("unregister_dropout", &normlab::unregister_dropout, "unregister it: the reference implementation runs");
  m.def("register_attention", &normlab::register_attention, "register the kernels as normlab::attention's");
  m.def("unregister_attention", &normlab::unregister_attention, "unregister them: the reference runs again");
}
