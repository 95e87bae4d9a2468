// NormLab's C++ CPU LayerNorm: the CPU implementation of the operators normlab::layer_norm and
// normlab::layer_norm_backward (defined, with their reference math, in model/layer_norm_op.py;
// built and registered by normlab/kernels/cpu.py). Same contract as the reference:
//   forward(x, weight, bias, eps) -> y, mean, rstd
//     x (..., M) normalized over its last dim; computed in float64 for float64 inputs, float32 otherwise;
//     y in x's dtype, contiguous; mean, rstd = 1 / sqrt(var + eps) of shape x.shape[:-1] in the compute dtype.
//   backward(dy, x, weight, mean, rstd) -> dx (x's dtype), dweight, dbias (M, compute dtype)
// The autograd formula stays the operator's (Python, model/layer_norm_op.py): these are plain kernels over raw
// rows, registered for the CPU dispatch key at the bottom of this file.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "cpu_kernels.h"

namespace {

using at::Tensor;
using c10::optional;

// Every inner loop is a `#pragma omp simd` loop: the pragma allows the reductions to be split across vector
// lanes, which plain -O3 may not do for floats since it reorders additions (-ffast-math would allow it
// everywhere, and more than we want).

// Rows per parallel task: small inputs stay on one thread (an OpenMP region costs more than it saves on
// a few hundred rows), like ATen's own grain size of 32768 elements.
inline int64_t row_grain(int64_t M) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(M, 1)); }

template <typename T>
void forward_rows(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
                  T* __restrict__ mean_out, T* __restrict__ rstd_out, int64_t r0, int64_t r1, int64_t M, T eps) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* __restrict__ xr = x + r * M;
    T* __restrict__ yr = y + r * M;
    // pass 1: mean
    T s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < M; ++k) s += xr[k];
    const T mean = s / static_cast<T>(M);
    // pass 2: biased variance of the centered row (two passes: no cancellation from E[x^2] - E[x]^2)
    T ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t k = 0; k < M; ++k) ss += (xr[k] - mean) * (xr[k] - mean);
    const T rstd = T(1) / std::sqrt(ss / static_cast<T>(M) + eps);  // eps inside the square root
    // pass 3: y = xhat * weight + bias
    if (w != nullptr && b != nullptr) {
#pragma omp simd
      for (int64_t k = 0; k < M; ++k) yr[k] = (xr[k] - mean) * rstd * w[k] + b[k];
    } else {
      for (int64_t k = 0; k < M; ++k) {
        T v = (xr[k] - mean) * rstd;
        if (w != nullptr) v *= w[k];
        if (b != nullptr) v += b[k];
        yr[k] = v;
      }
    }
    mean_out[r] = mean;
    rstd_out[r] = rstd;
  }
}

// dx for rows [r0, r1); the rows' dweight/dbias contributions are *added* into dw_part/db_part.
// __restrict__ and the HasW template keep every inner loop branch-free and free of possible aliasing, so the
// compiler vectorizes them.
template <typename T, bool HasW>
void backward_rows(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ mean,
                   const T* __restrict__ rstd, const T* __restrict__ w, T* __restrict__ dx,
                   T* __restrict__ dw_part, T* __restrict__ db_part, int64_t r0, int64_t r1, int64_t M) {
  const T inv_m = T(1) / static_cast<T>(M);
  for (int64_t r = r0; r < r1; ++r) {
    const T* __restrict__ dyr = dy + r * M;
    const T* __restrict__ xr = x + r * M;
    T* __restrict__ dxr = dx + r * M;
    const T mu = mean[r], rs = rstd[r];
    // sum(g) and sum(g * (x - mean)) with g = dy * weight (centered: no cancellation when |mean| >> std)
    T sg = 0, sgd = 0;
#pragma omp simd reduction(+ : sg, sgd)
    for (int64_t k = 0; k < M; ++k) {
      const T g = HasW ? dyr[k] * w[k] : dyr[k];
      sg += g;
      sgd += g * (xr[k] - mu);
    }
    // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) = rs * g + B * (x - mean) + C, with the row constants
    // B = -rs^3 * mean(g * (x - mean)) and C = -rs * mean(g) folded once per row (5 ops per element, not 7);
    // dweight += dy * xhat and dbias += dy in the same pass (this task's own partial rows: they stay in L1)
    const T B = -(rs * rs * rs) * (sgd * inv_m), C = -rs * (sg * inv_m);
#pragma omp simd
    for (int64_t k = 0; k < M; ++k) {
      const T d = xr[k] - mu;
      const T g = HasW ? dyr[k] * w[k] : dyr[k];
      dxr[k] = rs * g + B * d + C;
      dw_part[k] += dyr[k] * (d * rs);
      db_part[k] += dyr[k];
    }
  }
}

at::ScalarType compute_type(const Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// weight or bias as a contiguous tensor of M elements in the compute dtype (only its data is read); undefined
// when absent
Tensor param(const optional<Tensor>& t, at::ScalarType ct, int64_t M) {
  if (!t.has_value() || !t->defined()) return Tensor();
  TORCH_CHECK(t->numel() == M, "normlab::layer_norm: weight and bias must have M = x.shape[-1] elements");
  return t->to(ct).contiguous();
}

template <typename T>
const T* data_or_null(const Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

std::tuple<Tensor, Tensor, Tensor> forward(const Tensor& x_in, const optional<Tensor>& w_in,
                                           const optional<Tensor>& b_in, double eps) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() >= 1, "normlab::layer_norm (C++): x must be a CPU tensor (..., M)");
  const auto ct = compute_type(x_in);
  const Tensor x = x_in.to(ct).contiguous();  // no copy for contiguous float32/float64 inputs
  const int64_t M = x.size(-1);
  TORCH_CHECK(M > 0, "normlab::layer_norm: the normalized dim is empty");
  const int64_t N = x.numel() / M;
  const Tensor w = param(w_in, ct, M), b = param(b_in, ct, M);
  auto y = at::empty(x.sizes(), x.options());  // (x is contiguous: empty_like would add a dispatch)
  auto stats_shape = x.sizes().vec();
  stats_shape.pop_back();
  auto mean = at::empty(stats_shape, x.options());
  auto rstd = at::empty(stats_shape, x.options());
  AT_DISPATCH_FLOATING_TYPES(ct, "normlab_layer_norm_forward", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = data_or_null<scalar_t>(w);
    const scalar_t* bp = data_or_null<scalar_t>(b);
    scalar_t *yp = y.data_ptr<scalar_t>(), *mp = mean.data_ptr<scalar_t>(), *rp = rstd.data_ptr<scalar_t>();
    at::parallel_for(0, N, row_grain(M), [&](int64_t r0, int64_t r1) {
      forward_rows<scalar_t>(xp, wp, bp, yp, mp, rp, r0, r1, M, static_cast<scalar_t>(eps));
    });
  });
  return {y.to(x_in.scalar_type()), mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> backward(const Tensor& dy_in, const Tensor& x_in, const optional<Tensor>& w_in,
                                            const Tensor& mean_in, const Tensor& rstd_in) {
  const auto ct = mean_in.scalar_type();
  TORCH_CHECK(ct == at::kFloat || ct == at::kDouble, "normlab::layer_norm_backward: mean must be float32/float64");
  TORCH_CHECK(dy_in.sizes() == x_in.sizes(), "normlab::layer_norm_backward: dy must have x's shape");
  const Tensor dy = dy_in.to(ct).contiguous(), x = x_in.to(ct).contiguous();  // (sum().backward() gives a stride-0 dy)
  const Tensor mean = mean_in.contiguous(), rstd = rstd_in.to(ct).contiguous();
  const int64_t M = x.size(-1);
  const int64_t N = M > 0 ? x.numel() / M : 0;
  TORCH_CHECK(mean.numel() == N && rstd.numel() == N, "normlab::layer_norm_backward: one mean and rstd per row");
  const Tensor w = param(w_in, ct, M);
  auto dx = at::empty(x.sizes(), x.options());
  auto dw = at::empty({M}, x.options()), db = at::empty({M}, x.options());
  // Each task sums dweight/dbias over its own rows into its own buffer; the buffers are summed at the end
  // (no shared writes, and the same task split - hence the same result - for a given size and thread count).
  const int64_t grain = row_grain(M);
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (N + grain - 1) / grain));
  const int64_t rows_per_task = (N + tasks - 1) / tasks;
  AT_DISPATCH_FLOATING_TYPES(ct, "normlab_layer_norm_backward", [&] {
    // Partial sums live in one plain buffer, summed by hand: no extra ATen ops (zeros, sum, views) per call.
    // Each task's dweight and dbias rows start on a cache line of their own: were a line shared by two tasks,
    // every row's accumulation would bounce it between the cores (false sharing), which at training sizes
    // costs more than the second thread saves.
    constexpr int64_t line = 64 / sizeof(scalar_t);
    const int64_t stride = (M + line - 1) / line * line;  // one partial row, padded to whole cache lines
    std::vector<scalar_t> buffer(2 * tasks * stride + line, scalar_t(0));
    const auto misalign = reinterpret_cast<std::uintptr_t>(buffer.data()) % 64;
    scalar_t* dw_parts = buffer.data() + (misalign ? (64 - misalign) / sizeof(scalar_t) : 0);
    scalar_t* db_parts = dw_parts + tasks * stride;
    const scalar_t *dyp = dy.data_ptr<scalar_t>(), *xp = x.data_ptr<scalar_t>();
    const scalar_t *mp = mean.data_ptr<scalar_t>(), *rp = rstd.data_ptr<scalar_t>();
    const scalar_t* wp = data_or_null<scalar_t>(w);
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    auto run_task = [&](int64_t t) {
      const int64_t r0 = t * rows_per_task, r1 = std::min(N, r0 + rows_per_task);
      if (r0 >= r1) return;
      scalar_t *dw_t = dw_parts + t * stride, *db_t = db_parts + t * stride;
      if (wp != nullptr)
        backward_rows<scalar_t, true>(dyp, xp, mp, rp, wp, dxp, dw_t, db_t, r0, r1, M);
      else
        backward_rows<scalar_t, false>(dyp, xp, mp, rp, wp, dxp, dw_t, db_t, r0, r1, M);
    };
    if (tasks == 1) {
      run_task(0);
    } else {
      at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) run_task(t);
      });
    }
    // dweight/dbias: the tasks' partial rows summed in task order (deterministic for a given thread count)
    for (auto [parts, out] : {std::make_pair(dw_parts, &dw), std::make_pair(db_parts, &db)}) {
      scalar_t* o = out->data_ptr<scalar_t>();
      std::copy(parts, parts + M, o);
      for (int64_t t = 1; t < tasks; ++t)
        for (int64_t k = 0; k < M; ++k) o[k] += parts[t * stride + k];
    }
  });
  return {dx.to(x_in.scalar_type()), dw, db};
}

// The operators' autograd formula once more, for CPU tensors: the one of model/layer_norm_op.py (save x, weight,
// mean and rstd; the backward is the backward operator), as a C++ autograd node like torch.nn.LayerNorm's. The Python
// formula wraps every call in a Python autograd.Function, which at training shapes costs more than the kernels
// themselves (README, What runs where). A double backward (create_graph=True) fails in both alike: the backward
// operator has no derivative.
using ForwardSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const optional<Tensor>&, const optional<Tensor>&,
                                                      double);
using BackwardSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const optional<Tensor>&,
                                                       const Tensor&, const Tensor&);

struct LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& x,
                                                const optional<Tensor>& w, const optional<Tensor>& b, double eps) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("normlab::layer_norm", "").typed<ForwardSig>();
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // on to the CPU kernel (or a tracer's fake one)
    auto [y, mean, rstd] = op.call(x, w, b, eps);
    const bool has_w = w.has_value() && w->defined();
    ctx->saved_data["has_w"] = has_w;
    ctx->saved_data["has_b"] = b.has_value() && b->defined();
    ctx->save_for_backward({x, has_w ? *w : Tensor(), mean, rstd});
    ctx->mark_non_differentiable({mean, rstd});  // statistics for the backward, not outputs to train through
    ctx->set_materialize_grads(false);  // their gradients are never used: no zero tensors made for them
    return {y, mean, rstd};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("normlab::layer_norm_backward", "").typed<BackwardSig>();
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};  // (y had no gradient)
    // Outside create_graph the engine runs this with grad mode off, and the backward operator's autograd kernel
    // (custom_op's Python wrapper) would only pass the call on, for the GIL and several Python calls - more than
    // the kernel takes at training sizes on 2 threads: go straight to the CPU kernel. Under create_graph it stays
    // on the way, so a double backward raises its "no autograd formula" error.
    c10::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) below_autograd.emplace();
    const auto saved = ctx->get_saved_variables();
    const bool has_w = ctx->saved_data["has_w"].toBool(), has_b = ctx->saved_data["has_b"].toBool();
    auto [dx, dw, db] = op.call(grads[0], saved[0], has_w ? optional<Tensor>(saved[1]) : c10::nullopt, saved[2],
                                saved[3]);
    return {dx, has_w ? dw : Tensor(), has_b ? db : Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> forward_with_autograd(const Tensor& x, const optional<Tensor>& w,
                                                         const optional<Tensor>& b, double eps) {
  auto out = LayerNormFunction::apply(x, w, b, eps);
  return {out[0], out[1], out[2]};
}

// The kernels (and the node above) are registered on the operators -- defined in Python, model/layer_norm_op.py --
// for the CPU dispatch keys from here, so a call dispatches straight to C++: a Python kernel would add its wrapper
// calls to every one of the many small LayerNorms of a training step. The registrations live in these objects:
// destroying them unregisters the kernels, and the operators' reference implementation runs again.
std::unique_ptr<torch::Library> kernels, autograd;

}  // namespace

void normlab::register_layer_norm() {
  if (kernels) return;
  kernels = std::make_unique<torch::Library>(torch::Library::IMPL, "normlab", c10::DispatchKey::CPU, __FILE__,
                                             __LINE__);
  kernels->impl("layer_norm", TORCH_FN(forward));
  kernels->impl("layer_norm_backward", TORCH_FN(backward));
  autograd = std::make_unique<torch::Library>(torch::Library::IMPL, "normlab", c10::DispatchKey::AutogradCPU,
                                              __FILE__, __LINE__);
  autograd->impl("layer_norm", TORCH_FN(forward_with_autograd));
}

void normlab::unregister_layer_norm() {
  autograd.reset();
  kernels.reset();
}

// the kernels as the Python module binds them (cpu_module.cpp)
std::tuple<Tensor, Tensor, Tensor> normlab::layer_norm_forward(const Tensor& x, const optional<Tensor>& w,
                                                               const optional<Tensor>& b, double eps) {
  return ::forward(x, w, b, eps);
}

std::tuple<Tensor, Tensor, Tensor> normlab::layer_norm_backward(const Tensor& dy, const Tensor& x,
                                                                const optional<Tensor>& w, const Tensor& mean,
                                                                const Tensor& rstd) {
  return ::backward(dy, x, w, mean, rstd);
}
