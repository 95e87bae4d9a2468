// NormLab's CPU kernels (built and loaded by model/cpu_kernels.py; why C++ is explained there):
//   1. layer_norm: CustomLayerNorm's "cpp" path, the same forward and hand-derived backward as model/norms.py's
//      reference path (the derivation is in CustomLayerNorm's docstring), as loops over raw rows.
//   2. dropout: modeling_normlab.Dropout's kernel, a counter-based random mask that the backward regenerates
//      (and, with an explicit seed, the kernel of the normlab::dropout op that torch.compile sees).
//   3. weight snapshot: common/metrics.StabilityProbe's copy of the block weights before an optimizer step and
//      their squared distance after it, one pass each.
// Each op's autograd node is a C++ torch::autograd::Function, like torch's own: no Python runs between kernels.
//
// ---- 1. LayerNorm ----
// Layout: x contiguous, of any shape whose trailing dims hold the M normalized elements, read as N = numel / M
// rows (no reshape, so no extra autograd view nodes); weight, bias M elements each, or None.
// Saved for backward: x, mean (N,), rstd (N,) = 1 / sqrt(var + eps), weight. xhat is recomputed.
#include <torch/extension.h>

#include <ATen/CPUGeneratorImpl.h>
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
    // sum(g) and sum(g * (x - mean)) with g = dy * weight (centered: no cancellation when |mean| >> std)
    T sg = 0, sgd = 0;
#pragma omp simd reduction(+ : sg, sgd)
    for (int64_t k = 0; k < M; ++k) {
      const T g = HasW ? dyr[k] * w[k] : dyr[k];
      sg += g;
      sgd += g * (xr[k] - mu);
    }
    // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) = rs * g + B * (x - mean) + C, with the row constants
    // B = -rs^3 * mean(g * (x - mean)) and C = -rs * mean(g) folded once per row (5 ops per element, not 7)
    const T B = -(rs * rs * rs) * (sgd * inv_m), C = -rs * (sg * inv_m);
    // ... and dweight += dy * xhat, dbias += dy in the same pass (the dweight/dbias partial rows are this
    // task's own, M elements, so they stay in L1)
    if (dw_part != nullptr && db_part != nullptr) {
#pragma omp simd
      for (int64_t k = 0; k < M; ++k) {
        const T d = xr[k] - mu;
        const T g = HasW ? dyr[k] * w[k] : dyr[k];
        dxr[k] = rs * g + B * d + C;
        dw_part[k] += dyr[k] * (d * rs);
        db_part[k] += dyr[k];
      }
    } else {
#pragma omp simd
      for (int64_t k = 0; k < M; ++k) {
        const T g = HasW ? dyr[k] * w[k] : dyr[k];
        dxr[k] = rs * g + B * (xr[k] - mu) + C;
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

// ---- 2. Dropout ----
// keep element i  <=>  h(i) >= p * 2^32, with h a keyed 32-bit integer hash of the element's flat index
// (two rounds of Wellons' lowbias32 mixer, keyed with the two halves of the splitmix64 hash of a 64-bit seed, so
// that nearby seeds give unrelated masks). The mask is a pure
// function of (seed, i): the backward regenerates it instead of saving it (one byte per element less memory),
// every thread count gives the same mask, and the kernel vectorizes (8 hashes per AVX2 instruction sequence),
// where torch's CPU bernoulli_ draws its numbers one by one from a shared Mersenne Twister.
// The seed is drawn from torch's default CPU generator, so torch.manual_seed and a restored RNG state
// (accelerate's checkpoints) reproduce every mask.

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

template <typename T>
void dropout_range(const T* __restrict__ x, T* __restrict__ y, int64_t i0, int64_t i1, uint32_t k0, uint32_t k1,
                   uint32_t threshold, T scale) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) {
    const uint32_t h = mix32(mix32(static_cast<uint32_t>(i) ^ k0) + k1);
    y[i] = x[i] * (h >= threshold ? scale : T(0));  // x * mask * scale, as torch's; branch-free: vectorizes
  }
}

// y = x * mask(seed) / (1 - p), x contiguous
at::Tensor dropout_apply(const at::Tensor& x, uint64_t seed, double p) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "dropout: x must be a contiguous CPU tensor");
  TORCH_CHECK(p >= 0.0 && p < 1.0, "dropout: p must be in [0, 1)");
  TORCH_CHECK(x.numel() <= (int64_t(1) << 32), "dropout: more than 2^32 elements");
  auto y = at::empty_like(x);
  const uint32_t threshold = static_cast<uint32_t>(std::min(std::llround(p * 4294967296.0), 4294967295LL));
  uint64_t z = seed + 0x9E3779B97F4A7C15ULL;  // splitmix64 finalizer: every seed bit reaches both keys
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  const uint32_t k0 = static_cast<uint32_t>(z), k1 = static_cast<uint32_t>(z >> 32);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "normlab_dropout", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const scalar_t scale = static_cast<scalar_t>(1.0 / (1.0 - p));
    at::parallel_for(0, x.numel(), 32768, [&](int64_t i0, int64_t i1) {
      dropout_range<scalar_t>(xp, yp, i0, i1, k0, k1, threshold, scale);
    });
  });
  return y;
}

uint64_t draw_seed() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
}

struct DropoutFunction : public torch::autograd::Function<DropoutFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, double p) {
    const uint64_t seed = draw_seed();
    ctx->saved_data["seed"] = static_cast<int64_t>(seed);
    ctx->saved_data["p"] = p;
    return dropout_apply(x.contiguous(), seed, p);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "NormLab's C++ dropout does not support double backward (create_graph=True)");
    const auto seed = static_cast<uint64_t>(ctx->saved_data["seed"].toInt());
    return {dropout_apply(grads[0].contiguous(), seed, ctx->saved_data["p"].toDouble()), at::Tensor()};
  }
};

at::Tensor dropout(const at::Tensor& x, double p) { return DropoutFunction::apply(x, p); }


// ---- 3. Weight snapshot ----
// The update ratio ||w_after - w_before|| / ||w_before|| of a logged step needs a copy of the weights. With torch
// ops that is a cat into a buffer, a norm, another cat, a subtraction and a norm: five passes over the block
// weights (~3 MB here), ~2 ms of a ~45 ms step. These two functions make it one pass before the step (copy and
// sum of squares together) and one after it (sum of squared differences, nothing written).
// params: contiguous float32 CPU tensors; flat: float32, sum of their sizes, holding them back to back.
// Returns one float64 sum per tensor (float64 accumulation: ||dw||^2 is ~1e-6 of ||w||^2).

template <bool Copy>
at::Tensor snapshot_pass(const std::vector<at::Tensor>& params, const at::Tensor& flat) {
  TORCH_CHECK(flat.device().is_cpu() && flat.is_contiguous() && flat.scalar_type() == at::kFloat,
              "snapshot: flat must be a contiguous float32 CPU tensor");
  const int64_t P = static_cast<int64_t>(params.size());
  std::vector<int64_t> offsets(P + 1, 0);
  for (int64_t t = 0; t < P; ++t) {
    const at::Tensor& p = params[t];
    TORCH_CHECK(p.device().is_cpu() && p.is_contiguous() && p.scalar_type() == at::kFloat,
                "snapshot: parameters must be contiguous float32 CPU tensors");
    offsets[t + 1] = offsets[t] + p.numel();
  }
  TORCH_CHECK(offsets[P] == flat.numel(), "snapshot: flat must have exactly the parameters' total size");
  auto sums = at::empty({P}, flat.options().dtype(at::kDouble));
  double* out = sums.data_ptr<double>();
  float* base = flat.data_ptr<float>();
  // One task per tensor (an OpenMP region per tensor would cost more than its copy): each sum is one thread's,
  // so the result does not depend on the thread count.
  at::parallel_for(0, P, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* __restrict__ src = params[t].data_ptr<float>();
      float* __restrict__ dst = base + offsets[t];
      const int64_t n = offsets[t + 1] - offsets[t];
      double acc = 0.0;
      for (int64_t j = 0; j < n; j += 1024) {  // float sums over runs of 1024 (vectorized), added up in double
        const int64_t j1 = std::min(n, j + 1024);
        float s = 0.f;
        if (Copy) {
#pragma omp simd reduction(+ : s)
          for (int64_t i = j; i < j1; ++i) {
            dst[i] = src[i];
            s += src[i] * src[i];
          }
        } else {
#pragma omp simd reduction(+ : s)
          for (int64_t i = j; i < j1; ++i) {
            const float d = src[i] - dst[i];
            s += d * d;
          }
        }
        acc += static_cast<double>(s);
      }
      out[t] = acc;
    }
  });
  return sums;
}

// copies params into flat -> per-tensor sum of squares of the weights
at::Tensor snapshot_copy(const std::vector<at::Tensor>& params, const at::Tensor& flat) {
  return snapshot_pass<true>(params, flat);
}

// -> per-tensor sum of (param - snapshot)^2; flat is left as it is
at::Tensor snapshot_diff_sq(const std::vector<at::Tensor>& params, const at::Tensor& flat) {
  return snapshot_pass<false>(params, flat);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("layer_norm", &layer_norm, "layer_norm(x, M, weight, bias, eps): LayerNorm of x's rows of M elements, differentiable");
  m.def("snapshot_copy", &snapshot_copy, "snapshot_copy(params, flat): copy params into flat; per-tensor sum of squares (float64)");
  m.def("snapshot_diff_sq", &snapshot_diff_sq, "snapshot_diff_sq(params, flat): per-tensor sum of (param - snapshot)^2 (float64)");
  m.def("dropout", &dropout, "dropout(x, p): training-mode dropout, differentiable; seed from torch's CPU generator");
  m.def("dropout_with_seed", &dropout_apply, "dropout_with_seed(x, seed, p): x * mask(seed) / (1 - p), not differentiable (torch.compile's op)");
}
