// NormLab's C++ CPU attention: the CPU implementation of the operators normlab::attention and
// normlab::attention_backward (defined, with their reference math, in normlab/kernels/attention.py; built and
// registered by normlab/kernels/cpu.py). Same contract as the reference:
//   forward(q, k, v, bias, seed, p, scale) -> out, probs
//     q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv), bias broadcastable to (B, H, L, S) or none;
//     probs = softmax(q k^T * scale + bias) (B, H, L, S), out = dropout(probs, seed, p) v (B, H, L, Dv);
//     computed in float64 for float64 inputs, float32 otherwise; out in q's dtype, probs in the compute dtype.
//   backward(grad_out, q, k, v, probs, seed, p, scale) -> dq, dk, dv (in q's, k's and v's dtypes)
// The matmuls are torch's batched GEMM; what lies between them is fused here, once per row of the (L, S) scores:
// the dropout (normlab::dropout's hashed mask, so nothing is drawn and nothing but probs is saved) and, in the
// backward, the dropout's and the softmax's gradients together. torch's SDPA on CPU does none of this when it
// drops: with dropout it runs its unfused math path (a dozen ops and their autograd nodes, Mersenne-Twister
// dropout).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>

#include "cpu_kernels.h"
#include "dropout_hash.h"

namespace {

using at::Tensor;
using c10::optional;

at::ScalarType compute_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// Rows of the scores per parallel task: about ATen's grain of 32768 elements.
inline int64_t row_grain(int64_t S) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(S, 1)); }

void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "normlab::attention (cpp): q, k, v must be CPU tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "normlab::attention: q, k, v must be (B, H, L, D)");
  TORCH_CHECK(k.sizes().slice(0, 2) == q.sizes().slice(0, 2) && v.sizes().slice(0, 3) == k.sizes().slice(0, 3) &&
                  k.size(3) == q.size(3),
              "normlab::attention: shapes q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), " do not match");
}

// dropped[i] = probs[i] * mask(seed)_i / (1 - p): normlab::dropout on the probabilities' flat index.
template <typename T>
void drop_rows(const T* __restrict__ probs, T* __restrict__ dropped, int64_t i0, int64_t i1,
               const normlab::DropoutKey key, T scale) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) dropped[i] = probs[i] * (key.keep(i) ? scale : T(0));
}

std::tuple<Tensor, Tensor> forward(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                   const optional<Tensor>& bias, const Tensor& seed, double p, double scale) {
  check_inputs(q_in, k_in, v_in);
  TORCH_CHECK(seed.numel() == 1 && seed.scalar_type() == at::kLong, "normlab::attention: seed must be one int64");
  TORCH_CHECK(p >= 0.0 && p < 1.0, "normlab::attention: p must be in [0, 1), got ", p);
  const auto ct = compute_type(q_in.scalar_type());
  const int64_t B = q_in.size(0), H = q_in.size(1), L = q_in.size(2), D = q_in.size(3), S = k_in.size(2),
                Dv = v_in.size(3);
  TORCH_CHECK(B * H * L * S <= (int64_t(1) << 32), "normlab::attention: more than 2^32 attention weights");
  const Tensor q = q_in.to(ct).reshape({B * H, L, D}), k = k_in.to(ct).reshape({B * H, S, D});
  const Tensor v = v_in.to(ct).reshape({B * H, S, Dv});
  Tensor scores = at::bmm(q, k.transpose(1, 2)).view({B, H, L, S});
  scores.mul_(scale);  // (q k^T) * scale + bias, rounded in the reference's order
  if (bias.has_value() && bias->defined()) scores.add_(bias->to(ct));
  const Tensor probs = at::_softmax(scores, -1, false);  // torch's vectorized softmax: the reference's kernel
  Tensor dropped = probs;
  if (p > 0.0) {
    dropped = at::empty_like(probs);
    const normlab::DropoutKey key(seed.item<int64_t>(), p);
    AT_DISPATCH_FLOATING_TYPES(ct, "normlab_attention_dropout", [&] {
      const scalar_t* pp = probs.data_ptr<scalar_t>();
      scalar_t* dp = dropped.data_ptr<scalar_t>();
      const scalar_t keep_scale = static_cast<scalar_t>(1.0 / (1.0 - p));
      at::parallel_for(0, probs.numel(), 32768,
                       [&](int64_t i0, int64_t i1) { drop_rows<scalar_t>(pp, dp, i0, i1, key, keep_scale); });
    });
  }
  const Tensor out = at::bmm(dropped.view({B * H, L, S}), v).view({B, H, L, Dv});
  return {out.to(q_in.scalar_type()), probs};
}

// One row of the backward, in place on g (the gradient of the dropped probabilities on entry):
//   d = g * mask * scale;  g <- probs * (d - sum(d * probs))  (softmax's gradient);  dropped <- probs * mask * scale
template <typename T>
void backward_row(const T* __restrict__ probs, T* __restrict__ g, T* __restrict__ dropped, int64_t base, int64_t S,
                  const normlab::DropoutKey key, T keep_scale) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < S; ++j) {
    const T m = key.keep(base + j) ? keep_scale : T(0);
    const T d = g[j] * m;
    g[j] = d;
    dropped[j] = probs[j] * m;
    acc += d * probs[j];
  }
#pragma omp simd
  for (int64_t j = 0; j < S; ++j) g[j] = probs[j] * (g[j] - acc);
}

std::tuple<Tensor, Tensor, Tensor> backward(const Tensor& grad_out, const Tensor& q_in, const Tensor& k_in,
                                            const Tensor& v_in, const Tensor& probs_in, const Tensor& seed, double p,
                                            double scale) {
  check_inputs(q_in, k_in, v_in);
  const auto ct = compute_type(q_in.scalar_type());
  const int64_t B = q_in.size(0), H = q_in.size(1), L = q_in.size(2), D = q_in.size(3), S = k_in.size(2),
                Dv = v_in.size(3);
  const Tensor q = q_in.to(ct).reshape({B * H, L, D}), k = k_in.to(ct).reshape({B * H, S, D});
  const Tensor v = v_in.to(ct).reshape({B * H, S, Dv}), dout = grad_out.to(ct).reshape({B * H, L, Dv});
  const Tensor probs = probs_in.to(ct).contiguous();
  Tensor g = at::bmm(dout, v.transpose(1, 2));  // (B*H, L, S): gradient of the dropped probabilities
  Tensor dropped = at::empty_like(g);
  const normlab::DropoutKey key(seed.item<int64_t>(), p);
  AT_DISPATCH_FLOATING_TYPES(ct, "normlab_attention_backward", [&] {
    const scalar_t* pp = probs.data_ptr<scalar_t>();
    scalar_t* gp = g.data_ptr<scalar_t>();
    scalar_t* dp = dropped.data_ptr<scalar_t>();
    const scalar_t keep_scale = static_cast<scalar_t>(1.0 / (1.0 - p));
    at::parallel_for(0, B * H * L, row_grain(S), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) backward_row<scalar_t>(pp + r * S, gp + r * S, dp + r * S, r * S, S, key,
                                                               keep_scale);
    });
  });
  const Tensor dv = at::bmm(dropped.transpose(1, 2), dout);
  const Tensor dq = at::bmm(g, k).mul_(scale), dk = at::bmm(g.transpose(1, 2), q).mul_(scale);
  return {dq.view({B, H, L, D}).to(q_in.scalar_type()), dk.view({B, H, S, D}).to(k_in.scalar_type()),
          dv.view({B, H, S, Dv}).to(v_in.scalar_type())};
}

// The operators' autograd formula (normlab/kernels/attention.py) once more, as a C++ autograd node: the Python one
// costs a Python autograd.Function per call (layer_norm_cpu.cpp says more). The mask is a constant: its gradient
// is not computed, and a bias that requires one is refused rather than silently left without.
using ForwardSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const optional<Tensor>&,
                                              const Tensor&, double, double);
using BackwardSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                       const Tensor&, const Tensor&, double, double);

struct AttentionFunction : public torch::autograd::Function<AttentionFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& q,
                                                const Tensor& k, const Tensor& v, const optional<Tensor>& bias,
                                                const Tensor& seed, double p, double scale) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("normlab::attention", "").typed<ForwardSig>();
    TORCH_CHECK(!(bias.has_value() && bias->defined() && bias->requires_grad()),
                "normlab::attention: the bias (attention mask) must not require grad");
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // on to the CPU kernel (or a tracer's fake one)
    auto [out, probs] = op.call(q, k, v, bias, seed, p, scale);
    ctx->save_for_backward({q, k, v, probs, seed});
    ctx->saved_data["p"] = p;
    ctx->saved_data["scale"] = scale;
    ctx->mark_non_differentiable({probs});  // saved for the backward, not an output to train through
    ctx->set_materialize_grads(false);
    return {out, probs};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("normlab::attention_backward", "").typed<BackwardSig>();
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    c10::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;  // as layer_norm_cpu.cpp's backward
    if (!at::GradMode::is_enabled()) below_autograd.emplace();
    const auto s = ctx->get_saved_variables();
    auto [dq, dk, dv] = op.call(grads[0], s[0], s[1], s[2], s[3], s[4], ctx->saved_data["p"].toDouble(),
                                ctx->saved_data["scale"].toDouble());
    return {dq, dk, dv, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> forward_with_autograd(const Tensor& q, const Tensor& k, const Tensor& v,
                                                 const optional<Tensor>& bias, const Tensor& seed, double p,
                                                 double scale) {
  // Contiguous before the node, so the (B*H, L, D) views the kernels take are free in the forward and in the
  // backward (which would otherwise copy the saved strided q, k, v once more).
  auto out = AttentionFunction::apply(q.contiguous(), k.contiguous(), v.contiguous(), bias, seed, p, scale);
  return {out[0], out[1]};
}

// Registered for the CPU dispatch keys from here, as the LayerNorm's; destroying these objects unregisters them.
std::unique_ptr<torch::Library> kernels, autograd;

}  // namespace

void normlab::register_attention() {
  if (kernels) return;
  kernels = std::make_unique<torch::Library>(torch::Library::IMPL, "normlab", c10::DispatchKey::CPU, __FILE__,
                                             __LINE__);
  kernels->impl("attention", TORCH_FN(forward));
  kernels->impl("attention_backward", TORCH_FN(backward));
  autograd = std::make_unique<torch::Library>(torch::Library::IMPL, "normlab", c10::DispatchKey::AutogradCPU,
                                              __FILE__, __LINE__);
  autograd->impl("attention", TORCH_FN(forward_with_autograd));
}

void normlab::unregister_attention() {
  autograd.reset();
  kernels.reset();
}
