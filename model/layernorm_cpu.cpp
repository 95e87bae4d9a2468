// CustomLayerNorm's CPU kernels: the same forward and hand-derived backward as model/norms.py's reference path
// (the derivation is in CustomLayerNorm's docstring), written as loops over raw rows and wrapped in a C++
// torch::autograd::Function.
//
// Why C++ when Inductor already fuses the math into one kernel per direction: at training shapes
// (~1000 rows x 128) a LayerNorm is so small that the Python around the kernels costs more than the
// kernels: the torch.autograd.Function, the compiled graph's wrapper, reshapes. torch.nn.LayerNorm pays
// none of that, since its autograd node and kernels are C++. This file gives the hand-written LayerNorm
// the same plumbing, so the comparison comes down to the kernels.
//
// Layout: x contiguous, of any shape whose trailing dims hold the M normalized elements, read as N = numel / M
// rows (no reshape, so no extra autograd view nodes); weight, bias M elements each, or None.
// Saved for backward: x, mean (N,), rstd (N,) = 1 / sqrt(var + eps), weight. xhat is recomputed.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// Every inner loop is a `#pragma omp simd` loop (built with -fopenmp-simd, no OpenMP runtime involved): the
// pragma allows the reductions to be split across vector lanes, which plain -O3 may not do for floats since
// it reorders additions (-ffast-math would allow it everywhere, and more than we want).

// Rows per parallel task: small inputs stay on one thread (an OpenMP region costs more than it saves on
// a few hundred rows), like ATen's own grain size of 32768 elements.
// (Measured at 32 x {16,32,64} x 128: serial kernels ran 1.1-1.2x torch's time, these parallel ones ~1.0x.)
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

// dx for rows [r0, r1); the rows' dweight/dbias contributions are *added* into dw_part/db_part (may be null).
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
    // sum(g) and sum(g * xhat) with g = dy * weight
    T sg = 0, sgx = 0;
#pragma omp simd reduction(+ : sg, sgx)
    for (int64_t k = 0; k < M; ++k) {
      const T g = HasW ? dyr[k] * w[k] : dyr[k];
      sg += g;
      sgx += g * ((xr[k] - mu) * rs);
    }
    const T mg = sg * inv_m, mgx = sgx * inv_m;
    // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)); dweight += dy * xhat; dbias += dy (one pass; the
    // dweight/dbias partial rows are this task's own, M elements, so they stay in L1)
    if (dw_part != nullptr && db_part != nullptr) {
#pragma omp simd
      for (int64_t k = 0; k < M; ++k) {
        const T xhat = (xr[k] - mu) * rs;
        const T g = HasW ? dyr[k] * w[k] : dyr[k];
        dxr[k] = rs * (g - mg - xhat * mgx);
        dw_part[k] += dyr[k] * xhat;
        db_part[k] += dyr[k];
      }
    } else {
#pragma omp simd
      for (int64_t k = 0; k < M; ++k) {
        const T g = HasW ? dyr[k] * w[k] : dyr[k];
        dxr[k] = rs * (g - mg - ((xr[k] - mu) * rs) * mgx);
      }
      if (dw_part != nullptr)
#pragma omp simd
        for (int64_t k = 0; k < M; ++k) dw_part[k] += dyr[k] * ((xr[k] - mu) * rs);
      if (db_part != nullptr)
#pragma omp simd
        for (int64_t k = 0; k < M; ++k) db_part[k] += dyr[k];
    }
  }
}

void check_inputs(const at::Tensor& x, int64_t M, const c10::optional<at::Tensor>& w,
                  const c10::optional<at::Tensor>& b) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && M > 0 && x.numel() % M == 0,
              "layer_norm: x must be a contiguous CPU tensor whose trailing dims hold M elements");
  for (const auto& t : {w, b})
    if (t.has_value() && t->defined())
      TORCH_CHECK(t->is_contiguous() && t->numel() == M && t->scalar_type() == x.scalar_type(),
                  "layer_norm: weight and bias must be contiguous, with M elements of x's dtype");
}

template <typename T>
const T* data_or_null(const c10::optional<at::Tensor>& t) {
  return (t.has_value() && t->defined()) ? t->data_ptr<T>() : nullptr;
}

std::vector<at::Tensor> ln_forward(const at::Tensor& x, int64_t M, const c10::optional<at::Tensor>& w,
                                   const c10::optional<at::Tensor>& b, double eps) {
  check_inputs(x, M, w, b);
  const int64_t N = x.numel() / M;
  auto y = at::empty_like(x);
  auto mean = at::empty({N}, x.options());
  auto rstd = at::empty({N}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "normlab_layer_norm_forward", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = data_or_null<scalar_t>(w);
    const scalar_t* bp = data_or_null<scalar_t>(b);
    scalar_t *yp = y.data_ptr<scalar_t>(), *mp = mean.data_ptr<scalar_t>(), *rp = rstd.data_ptr<scalar_t>();
    at::parallel_for(0, N, row_grain(M), [&](int64_t r0, int64_t r1) {
      forward_rows<scalar_t>(xp, wp, bp, yp, mp, rp, r0, r1, M, static_cast<scalar_t>(eps));
    });
  });
  return {y, mean, rstd};
}

// -> dx, dweight (undefined unless need_dw), dbias (undefined unless need_db)
std::vector<at::Tensor> ln_backward(const at::Tensor& dy, const at::Tensor& x, int64_t M, const at::Tensor& mean,
                                    const at::Tensor& rstd, const c10::optional<at::Tensor>& w, bool need_dw,
                                    bool need_db) {
  const int64_t N = mean.numel();
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.is_contiguous(), "layer_norm backward: dy must match x");
  auto dx = at::empty_like(x);
  // Each task sums dweight/dbias over its own rows into its own buffer; the buffers are summed at the end
  // (no shared writes, and the same task split - hence the same result - for a given size and thread count).
  const int64_t grain = row_grain(M);
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (N + grain - 1) / grain));
  const int64_t rows_per_task = (N + tasks - 1) / tasks;
  // Partial sums live in plain buffers, summed by hand: no extra ATen ops (zeros, sum, views) per call.
  at::Tensor dw, db;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "normlab_layer_norm_backward", [&] {
    std::vector<scalar_t> dw_parts(need_dw ? tasks * M : 0, scalar_t(0)), db_parts(need_db ? tasks * M : 0, scalar_t(0));
    const scalar_t *dyp = dy.data_ptr<scalar_t>(), *xp = x.data_ptr<scalar_t>();
    const scalar_t *mp = mean.data_ptr<scalar_t>(), *rp = rstd.data_ptr<scalar_t>();
    const scalar_t* wp = data_or_null<scalar_t>(w);
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    auto run_task = [&](int64_t t) {
      const int64_t r0 = t * rows_per_task, r1 = std::min(N, r0 + rows_per_task);
      if (r0 >= r1) return;
      scalar_t* dw_t = need_dw ? dw_parts.data() + t * M : nullptr;
      scalar_t* db_t = need_db ? db_parts.data() + t * M : nullptr;
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
    const std::vector<int64_t> shape = (w.has_value() && w->defined()) ? w->sizes().vec() : std::vector<int64_t>{M};
    auto reduce = [&](const std::vector<scalar_t>& parts) {
      at::Tensor out = at::empty(shape, x.options());
      scalar_t* o = out.data_ptr<scalar_t>();
      std::copy(parts.begin(), parts.begin() + M, o);
      for (int64_t t = 1; t < tasks; ++t)
        for (int64_t k = 0; k < M; ++k) o[k] += parts[t * M + k];
      return out;
    };
    if (need_dw) dw = reduce(dw_parts);
    if (need_db) db = reduce(db_parts);
  });
  return {dx, dw, db};
}

// The autograd node lives in C++ too, like torch.nn.LayerNorm's: no Python runs between the kernels.
struct LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t M,
                            const c10::optional<at::Tensor>& w, const c10::optional<at::Tensor>& b, double eps) {
    auto out = ln_forward(x, M, w, b, eps);
    const bool has_w = w.has_value() && w->defined(), has_b = b.has_value() && b->defined();
    ctx->saved_data["M"] = M;
    ctx->saved_data["has_w"] = has_w;
    ctx->saved_data["has_b"] = has_b;
    ctx->save_for_backward({x, out[1], out[2], has_w ? *w : at::Tensor()});
    return out[0];
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // The kernels are not differentiable themselves: refuse a double backward instead of silently
    // returning gradients without a graph (the "reference" path supports it).
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "CustomLayerNorm impl='cpp' does not support double backward (create_graph=True); use impl='reference'");
    // needs_input_grad counts tensor inputs only (x, w, b); the returned list has one slot per forward argument.
    auto saved = ctx->get_saved_variables();
    const bool has_w = ctx->saved_data["has_w"].toBool(), has_b = ctx->saved_data["has_b"].toBool();
    c10::optional<at::Tensor> w = has_w ? c10::optional<at::Tensor>(saved[3]) : c10::nullopt;
    auto r = ln_backward(grads[0].contiguous(), saved[0], ctx->saved_data["M"].toInt(), saved[1], saved[2], w,
                         has_w && ctx->needs_input_grad(1), has_b && ctx->needs_input_grad(2));
    return {r[0], at::Tensor(), r[1], r[2], at::Tensor()};
  }
};

at::Tensor layer_norm(const at::Tensor& x, int64_t M, const c10::optional<at::Tensor>& w,
                      const c10::optional<at::Tensor>& b, double eps) {
  return LayerNormFunction::apply(x, M, w, b, eps);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("layer_norm", &layer_norm, "layer_norm(x, M, weight, bias, eps): LayerNorm of x's rows of M elements, differentiable");
}
