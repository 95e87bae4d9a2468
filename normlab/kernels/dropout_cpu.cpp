// NormLab's C++ CPU dropout: the CPU implementation of the operator normlab::dropout (defined, with its reference
// math, in normlab/kernels/dropout.py; built and registered by normlab/kernels/cpu.py). Same contract:
//   dropout(x, seed, p) -> x * mask(seed) / (1 - p), contiguous, x's dtype and shape; seed a 0-dim int64 tensor.
//
// keep element i  <=>  h(i) >= p * 2^32, with h a keyed 32-bit integer hash of the element's flat index
// (dropout_hash.h). The mask is a pure function of (seed, i): the backward is the same operator on
// the gradient (no mask saved: one byte per element less memory), every thread count gives the same mask, and the
// loop vectorizes (8 hashes per AVX2 instruction sequence), where torch's CPU dropout draws one Mersenne-Twister
// number per element, one after the other.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "cpu_kernels.h"
#include "dropout_hash.h"

namespace {

using at::Tensor;

template <typename T>
void dropout_range(const T* __restrict__ x, T* __restrict__ y, int64_t i0, int64_t i1, const normlab::DropoutKey key,
                   T scale) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) y[i] = x[i] * (key.keep(i) ? scale : T(0));  // x * (mask * scale), as torch's
}

Tensor dropout(const Tensor& x_in, const Tensor& seed, double p) {
  TORCH_CHECK(x_in.device().is_cpu(), "normlab::dropout (cpp): x must be a CPU tensor");
  TORCH_CHECK(seed.numel() == 1 && seed.scalar_type() == at::kLong, "normlab::dropout: seed must be one int64");
  TORCH_CHECK(p >= 0.0 && p < 1.0, "normlab::dropout: p must be in [0, 1), got ", p);
  TORCH_CHECK(x_in.numel() <= (int64_t(1) << 32), "normlab::dropout: more than 2^32 elements");
  const Tensor x = x_in.contiguous();
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const normlab::DropoutKey key(seed.item<int64_t>(), p);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "normlab_dropout", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const scalar_t scale = static_cast<scalar_t>(1.0 / (1.0 - p));
    at::parallel_for(0, x.numel(), 32768, [&](int64_t i0, int64_t i1) {
      dropout_range<scalar_t>(xp, yp, i0, i1, key, scale);
    });
  });
  return y;
}

// The operator's autograd formula (normlab/kernels/dropout.py) once more, as a C++ autograd node: the Python one
// costs a Python autograd.Function per call. The backward is the operator itself on the gradient, with the same
// seed, so a double backward works too (the operator is linear in x).
using DropoutSig = Tensor(const Tensor&, const Tensor&, double);

const c10::TypedOperatorHandle<DropoutSig>& dropout_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("normlab::dropout", "").typed<DropoutSig>();
  return op;
}

struct DropoutFunction : public torch::autograd::Function<DropoutFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& seed, double p) {
    ctx->save_for_backward({seed});
    ctx->saved_data["p"] = p;
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // on to the CPU kernel (or a tracer's fake one)
    return dropout_op().call(x, seed, p);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const Tensor seed = ctx->get_saved_variables()[0];
    return {dropout_op().call(grads[0], seed, ctx->saved_data["p"].toDouble()), Tensor(), Tensor()};
  }
};

Tensor dropout_with_autograd(const Tensor& x, const Tensor& seed, double p) {
  return DropoutFunction::apply(x, seed, p);
}

// Registered for the CPU dispatch keys from here (as the LayerNorm is: layer_norm_cpu.cpp); destroying these
// objects unregisters the kernel and the operator's reference implementation runs again.
std::unique_ptr<torch::Library> kernels, autograd;

}  // namespace

void normlab::register_dropout() {
  if (kernels) return;
  kernels = std::make_unique<torch::Library>(torch::Library::IMPL, "normlab", c10::DispatchKey::CPU, __FILE__,
                                             __LINE__);
  kernels->impl("dropout", TORCH_FN(dropout));
  autograd = std::make_unique<torch::Library>(torch::Library::IMPL, "normlab", c10::DispatchKey::AutogradCPU,
                                              __FILE__, __LINE__);
  autograd->impl("dropout", TORCH_FN(dropout_with_autograd));
}

void normlab::unregister_dropout() {
  autograd.reset();
  kernels.reset();
}

// the kernel as the Python module binds it (cpu_module.cpp)
at::Tensor normlab::dropout(const Tensor& x, const Tensor& seed, double p) { return ::dropout(x, seed, p); }
