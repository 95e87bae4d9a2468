// The C++ CPU backend is one extension (one build, one cache entry) made of one file per operator family; each
// file registers its kernels on its operators and binds its functions into the extension's Python module
// (cpu_module.cpp).
#pragma once
#include <torch/extension.h>

namespace normlab {
void register_layer_norm();
void unregister_layer_norm();
void bind_layer_norm(pybind11::module& m);
void register_dropout();
void unregister_dropout();
void bind_dropout(pybind11::module& m);
void register_attention();
void unregister_attention();
void bind_attention(pybind11::module& m);
}  // namespace normlab
