// The C++ CPU backend is one extension (one build, one cache entry) made of one file per operator family; each
// file registers its kernels on its operators, and cpu_module.cpp binds these functions into the extension's
// Python module. No file includes torch/extension.h (all of torch's C++ API and its Python bindings, most of the
// build's time in every file that includes it; docs/kernels.md): the kernel files include ATen and the dispatcher's
// headers alone.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace normlab {
void register_layer_norm();
void unregister_layer_norm();
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward(const at::Tensor& x,
                                                                  const std::optional<at::Tensor>& weight,
                                                                  const std::optional<at::Tensor>& bias, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(const at::Tensor& dy, const at::Tensor& x,
                                                                   const std::optional<at::Tensor>& weight,
                                                                   const at::Tensor& mean, const at::Tensor& rstd);
void register_dropout();
void unregister_dropout();
at::Tensor dropout(const at::Tensor& x, const at::Tensor& seed, double p);
void register_attention();
void unregister_attention();
}  // namespace normlab
