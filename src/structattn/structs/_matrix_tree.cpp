// The LU path of the matrix-tree theorem for non-projective trees (_lu_path in
// nonprojective.py: read the comments there), in ATen with the batch split into one chunk
// per thread: the batched LU and inverse are a sequential loop of small LAPACK calls over
// the batch, so independent chunks are what uses the cores.
#include <limits>
#include <tuple>
#include <vector>

#include "_kernels.h"

namespace structattn {
namespace {

using at::Tensor;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// (log Z or an empty tensor, weights [B, N, n], inverse [B, n, n] float64, keep [B])
std::vector<Tensor> lu_path(const Tensor& scores, const c10::optional<Tensor>& real,
                            bool multiroot, double max_cond, bool need_logz) {
  const int64_t size = scores.size(1), words = size - 1;
  const auto dtype = at::promote_types(scores.scalar_type(), at::kFloat);
  Tensor weights = at::empty({scores.size(0), size, words}, scores.options().dtype(dtype));
  weights.copy_(scores.narrow(2, 1, words));
  weights.diagonal(-1, 1, 2).fill_(kNegInf);  // self loops: weights[:, m, m - 1]
  if (real) {
    const Tensor& r = *real;
    weights.masked_fill_((r.unsqueeze(-1) & r.narrow(1, 1, words).unsqueeze(1)).logical_not(),
                         kNegInf);
  }
  Tensor shift = weights.amax({1}, true);  // [B, 1, n]
  shift.nan_to_num_(0.0, c10::nullopt, 0.0);
  weights.sub_(shift).exp_();
  Tensor lap = weights.narrow(1, 1, words).to(at::kDouble, false, true, at::MemoryFormat::Contiguous).neg_();  // [B, n, n]
  Tensor incoming = (multiroot ? weights : weights.narrow(1, 1, words))
                        .sum({1}, false, at::kDouble);  // [B, n]
  if (real) incoming.add_(real->narrow(1, 1, words).logical_not());
  lap.diagonal(0, 1, 2).add_(incoming);
  if (!multiroot) lap.select(1, 0).copy_(weights.select(1, 0));  // first row := rho
  auto [factor, pivots, info] = at::linalg_lu_factor_ex(lap);
  Tensor eye = at::eye(words, lap.options());
  Tensor inverse = at::linalg_lu_solve(factor, pivots, eye.expand_as(lap));
  Tensor norm = multiroot ? incoming : incoming + weights.select(1, 0);
  Tensor keep = inverse.abs().sum(1).amax(-1).mul_(norm.amax(-1)).le(max_cond / 2);
  Tensor logz = need_logz ? factor.diagonal(0, 1, 2).abs().log_().add_(shift.squeeze(1)).sum(-1)
                          : at::empty({0}, lap.options());
  return {logz, weights, inverse, keep};
}

// Phi*(Y^T) [B, N, n] (see _adjoint_coefficients in nonprojective.py)
Tensor adjoint_coefficients(const Tensor& inverse, bool multiroot) {
  const int64_t words = inverse.size(1);
  Tensor trans = inverse.transpose(1, 2);
  Tensor diag = inverse.diagonal(0, 1, 2).unsqueeze(1);  // [B, 1, n]
  Tensor coef = at::empty({inverse.size(0), words + 1, words}, inverse.options());
  Tensor between = coef.narrow(1, 1, words);
  at::sub_out(between, diag, trans);  // arcs between words: Y_mm - Y_mh
  if (multiroot) {
    coef.select(1, 0).copy_(diag.select(1, 0));  // root arcs: Y_mm
  } else if (words > 0) {
    coef.select(1, 0).copy_(trans.select(1, 0));  // root arcs: Y_m1
    coef.select(1, 1).copy_(diag.select(1, 0));   // arcs from word 1: no Y_mh term
    coef.narrow(1, 2, words - 1).select(2, 0).sub_(diag.select(2, 0));  // into word 1
  }
  return coef;
}

// marginals [B, N, N] (times scale [B] if given) from the weights and the inverse
Tensor marginals(const Tensor& scores, const Tensor& weights, const Tensor& inverse,
                 bool multiroot, const c10::optional<Tensor>& scale) {
  Tensor coef = adjoint_coefficients(inverse, multiroot);
  if (scale) coef.mul_(scale->view({-1, 1, 1}));
  Tensor out = at::zeros_like(scores);
  Tensor words = out.narrow(2, 1, weights.size(2));
  at::mul_out(words, weights, coef.to(weights.scalar_type()));
  return out;
}

// d loss / d scores = G * mu - W * Phi*((Y A Y)^T), A = Phi(G * W) (first order)
Tensor marginals_backward(const Tensor& grad, const Tensor& weights, const Tensor& inverse,
                          const Tensor& marginals, bool multiroot) {
  const int64_t words = weights.size(2);
  Tensor scaled = grad.narrow(2, 1, words) * weights;  // [B, N, n]
  Tensor lap = scaled.narrow(1, 1, words).neg();       // [B, n, n]
  lap.diagonal(0, 1, 2).add_((multiroot ? scaled : scaled.narrow(1, 1, words)).sum(1));
  if (!multiroot && words > 0) lap.select(1, 0).copy_(scaled.select(1, 0));
  Tensor inv = inverse.to(weights.scalar_type());
  Tensor coef = adjoint_coefficients(at::bmm(at::bmm(inv, lap), inv), multiroot);
  Tensor out = grad * marginals;
  out.narrow(2, 1, words).sub_(coef.mul_(weights));
  return out;
}

c10::optional<Tensor> narrow(const c10::optional<Tensor>& x, int64_t start, int64_t length) {
  if (!x) return c10::nullopt;
  return x->narrow(0, start, length);
}

}  // namespace

Tensor matrix_tree_marginals(const Tensor& scores, const Tensor& weights, const Tensor& inverse,
                             bool multiroot, const c10::optional<Tensor>& scale) {
  return chunked(chunk_starts(scores.size(0)), [&](int64_t, int64_t start, int64_t length) {
    return marginals(scores.narrow(0, start, length), weights.narrow(0, start, length),
                     inverse.narrow(0, start, length), multiroot, narrow(scale, start, length));
  });
}

Tensor matrix_tree_marginals_backward(const Tensor& grad, const Tensor& weights,
                                      const Tensor& inverse, const Tensor& marginals,
                                      bool multiroot) {
  return chunked(chunk_starts(grad.size(0)), [&](int64_t, int64_t start, int64_t length) {
    return marginals_backward(grad.narrow(0, start, length), weights.narrow(0, start, length),
                              inverse.narrow(0, start, length),
                              marginals.narrow(0, start, length), multiroot);
  });
}

std::vector<Tensor> matrix_tree_lu(const Tensor& scores, const c10::optional<Tensor>& real,
                                   bool multiroot, double max_cond, bool need_logz) {
  TORCH_CHECK(scores.dim() == 3 && scores.size(1) == scores.size(2), "scores must be [B, N, N]");
  const std::vector<int64_t> starts = chunk_starts(scores.size(0));
  std::vector<std::vector<Tensor>> parts(starts.size() - 1);
  for_chunks(starts, [&](int64_t i, int64_t start, int64_t length) {
    parts[i] = lu_path(scores.narrow(0, start, length), narrow(real, start, length), multiroot,
                       max_cond, need_logz);
  });
  std::vector<Tensor> out;
  for (size_t k = 0; k < 4; ++k) {
    std::vector<Tensor> pieces;
    for (const auto& p : parts) pieces.push_back(p[k]);
    out.push_back(k == 0 && !need_logz ? pieces[0] : cat_chunks(pieces));
  }
  return out;
}

void bind_matrix_tree(pybind11::module& m) {
  m.def("matrix_tree_lu", &matrix_tree_lu,
        "(log Z or empty, weights, inverse, keep): the LU path of nonprojective.py",
        pybind11::arg("scores"), pybind11::arg("real"), pybind11::arg("multiroot"),
        pybind11::arg("max_cond"), pybind11::arg("need_logz"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("matrix_tree_marginals", &matrix_tree_marginals,
        "marginals [B, N, N] (times scale [B]) from the weights and inverse Laplacian",
        pybind11::arg("scores"), pybind11::arg("weights"), pybind11::arg("inverse"),
        pybind11::arg("multiroot"), pybind11::arg("scale"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("matrix_tree_marginals_backward", &matrix_tree_marginals_backward,
        "first-order backward of the marginals (closed form, two batched matmuls)",
        pybind11::arg("grad"), pybind11::arg("weights"), pybind11::arg("inverse"),
        pybind11::arg("marginals"), pybind11::arg("multiroot"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace structattn
