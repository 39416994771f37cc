// CKY over binary bracketings (constituency.py): the inside pass, the outside pass (span
// marginals) and the Hessian-vector product of log Z, one item at a time in plain loops
// (double precision inside, for float32 and float64 inputs), the batch split into one chunk
// per thread (for_chunks in _kernels.h). The same recurrences as _cky_charts, _cky_outside
// and _cky_hvp in constituency.py (read the comments there); an item of n words touches only
// its own spans [i, j], j < n (the rest of its charts stays 0). Registered as torch
// operators ``torch.ops.structattn_cky.*`` (no Python binding of their own), which
// constituency.py uses where they are registered. Built on first use by _extension.py.
// (Issue 39: checked in a standalone build with the extension's flags against the PyTorch
// path: log Z, marginals and HVP equal to 1e-16 in float64, 3e-7 in float32.)
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "_kernels.h"

namespace structattn {
namespace {

using at::Tensor;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Charts of one item, [N, N] row-major double: inside I, inner (-inf -> 0) and, for the
// children of a split, I by column (IT[j * N + k] = I[k * N + j]) for contiguous loops.
struct ItemCharts {
  const double* inside;
  const double* inner;
  const double* inside_t;
  int64_t size;
};

template <typename scalar_t>
void inside_item(const scalar_t* scores, int64_t size, int64_t n, double* inside,
                 double* inner, double* inside_t) {
  for (int64_t i = 0; i < n; ++i) {
    const double s = static_cast<double>(scores[i * size + i]);
    inside[i * size + i] = s;
    inside_t[i * size + i] = s;
  }
  std::vector<double> terms(static_cast<size_t>(n));
  for (int64_t w = 2; w <= n; ++w) {
    for (int64_t i = 0; i + w <= n; ++i) {
      const int64_t j = i + w - 1;
      const double* left = inside + i * size + i;           // I(i, i + k)
      const double* right = inside_t + j * size + i + 1;    // I(i + k + 1, j)
      double top = -kInf;
      for (int64_t k = 0; k < w - 1; ++k) {
        terms[k] = left[k] + right[k];
        top = terms[k] > top ? terms[k] : top;
      }
      double value = -kInf;
      if (top > -kInf) {
        double total = 0.0;
        for (int64_t k = 0; k < w - 1; ++k) total += std::exp(terms[k] - top);
        value = top + std::log(total);
      }
      inner[i * size + j] = value > -kInf ? value : 0.0;
      const double s = static_cast<double>(scores[i * size + j]);
      const double v = s + value;
      inside[i * size + j] = v;
      inside_t[j * size + i] = v;
    }
  }
}

// Widths down: a span passes its marginal times each split's probability to the split's two
// children. ``marginal`` [N, N] and (when ``hvp``) the adjoint of <marginals, direction>
// with respect to I, with ``tangent`` and ``d_inner`` the tangents of the inside pass.
void outside_item(const ItemCharts& c, int64_t n, double* marginal, const double* tangent,
                  const double* d_inner, double* adjoint) {
  const int64_t size = c.size;
  marginal[n - 1] = 1.0;  // the whole sentence
  for (int64_t w = n; w >= 2; --w) {
    for (int64_t i = 0; i + w <= n; ++i) {
      const int64_t j = i + w - 1;
      const double mu = marginal[i * size + j];
      const double g = adjoint != nullptr ? adjoint[i * size + j] : 0.0;
      if (mu == 0.0 && g == 0.0) continue;
      const double norm = c.inner[i * size + j];
      const double* left = c.inside + i * size + i;
      const double* right = c.inside_t + j * size + i + 1;
      for (int64_t k = 0; k < w - 1; ++k) {
        const double p = std::exp(left[k] + right[k] - norm);
        const double q = p * mu;
        const int64_t a = i * size + i + k;       // the left child [i, i + k]
        const int64_t b = (i + k + 1) * size + j;  // the right child [i + k + 1, j]
        marginal[a] += q;
        marginal[b] += q;
        if (adjoint != nullptr) {
          const double t = p * g + q * (tangent[a] + tangent[b] - d_inner[i * size + j]);
          adjoint[a] += t;
          adjoint[b] += t;
        }
      }
    }
  }
}

// Tangents of the inside pass along ``direction``: dot I and dot inner, [N, N].
template <typename scalar_t>
void tangent_item(const ItemCharts& c, const scalar_t* direction, int64_t n, double* tangent,
                  double* tangent_t, double* d_inner) {
  const int64_t size = c.size;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(direction[i * size + i]);
    tangent[i * size + i] = d;
    tangent_t[i * size + i] = d;
  }
  for (int64_t w = 2; w <= n; ++w) {
    for (int64_t i = 0; i + w <= n; ++i) {
      const int64_t j = i + w - 1;
      const double norm = c.inner[i * size + j];
      const double* left = c.inside + i * size + i;
      const double* right = c.inside_t + j * size + i + 1;
      const double* d_left = tangent + i * size + i;
      const double* d_right = tangent_t + j * size + i + 1;
      double total = 0.0;
      for (int64_t k = 0; k < w - 1; ++k)
        total += std::exp(left[k] + right[k] - norm) * (d_left[k] + d_right[k]);
      d_inner[i * size + j] = total;
      const double v = static_cast<double>(direction[i * size + j]) + total;
      tangent[i * size + j] = v;
      tangent_t[j * size + i] = v;
    }
  }
}

void check_scores(const Tensor& scores, const Tensor& last) {
  TORCH_CHECK(scores.dim() == 3 && scores.size(1) == scores.size(2),
              "cky: scores must be [B, N, N]");
  TORCH_CHECK(last.dim() == 1 && last.size(0) == scores.size(0), "cky: last must be [B]");
}

// (inside [B, N, N], inner [B, N, N], inside by column [B, N, N], all double; log Z [B])
std::tuple<Tensor, Tensor, Tensor, Tensor> cky_inside(const Tensor& scores_in,
                                                      const Tensor& last_in) {
  check_scores(scores_in, last_in);
  const Tensor scores = scores_in.contiguous();
  const Tensor last = last_in.to(at::kLong).contiguous();
  const int64_t batch = scores.size(0), size = scores.size(1);
  const auto options = scores.options().dtype(at::kDouble);
  Tensor inside = at::zeros({batch, size, size}, options);
  Tensor inner = at::zeros({batch, size, size}, options);
  Tensor inside_t = at::zeros({batch, size, size}, options);
  Tensor logz = at::empty({batch}, options);
  const int64_t* lp = last.data_ptr<int64_t>();
  double* ip = inside.data_ptr<double>();
  double* np = inner.data_ptr<double>();
  double* tp = inside_t.data_ptr<double>();
  double* zp = logz.data_ptr<double>();
  const double work = static_cast<double>(batch) * size * size * size / 6.0;
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "cky_inside", [&] {
    const scalar_t* sp = scores.data_ptr<scalar_t>();
    for_chunks(chunk_starts(batch, work), [&](int64_t, int64_t start, int64_t length) {
      for (int64_t b = start; b < start + length; ++b) {
        const int64_t off = b * size * size;
        const int64_t n = lp[b] + 1;
        inside_item(sp + off, size, n, ip + off, np + off, tp + off);
        zp[b] = ip[off + n - 1];
      }
    });
  });
  return {inside, inner, inside_t, logz};
}

// The span marginals [B, N, N] (double) from the charts of cky_inside.
Tensor cky_outside(const Tensor& inside, const Tensor& inner, const Tensor& inside_t,
                   const Tensor& logz, const Tensor& last_in) {
  const Tensor last = last_in.to(at::kLong).contiguous();
  const int64_t batch = inside.size(0), size = inside.size(1);
  Tensor marginals = at::zeros_like(inside);
  const int64_t* lp = last.data_ptr<int64_t>();
  const double* zp = logz.data_ptr<double>();
  double* mp = marginals.data_ptr<double>();
  const double work = static_cast<double>(batch) * size * size * size / 6.0;
  for_chunks(chunk_starts(batch, work), [&](int64_t, int64_t start, int64_t length) {
    for (int64_t b = start; b < start + length; ++b) {
      if (!std::isfinite(zp[b])) continue;  // no tree: zero marginals
      const int64_t off = b * size * size;
      const ItemCharts c{inside.data_ptr<double>() + off, inner.data_ptr<double>() + off,
                         inside_t.data_ptr<double>() + off, size};
      outside_item(c, lp[b] + 1, mp + off, nullptr, nullptr, nullptr);
    }
  });
  return marginals;
}

// The Hessian of log Z times ``direction`` [B, N, N] (double), from the charts of cky_inside.
Tensor cky_hvp(const Tensor& inside, const Tensor& inner, const Tensor& inside_t,
               const Tensor& logz, const Tensor& last_in, const Tensor& direction_in) {
  const Tensor last = last_in.to(at::kLong).contiguous();
  const Tensor direction = direction_in.contiguous();
  const int64_t batch = inside.size(0), size = inside.size(1);
  Tensor hvp = at::zeros_like(inside);
  const int64_t* lp = last.data_ptr<int64_t>();
  const double* zp = logz.data_ptr<double>();
  double* hp = hvp.data_ptr<double>();
  const double work = static_cast<double>(batch) * size * size * size / 2.0;
  AT_DISPATCH_FLOATING_TYPES(direction.scalar_type(), "cky_hvp", [&] {
    const scalar_t* dp = direction.data_ptr<scalar_t>();
    for_chunks(chunk_starts(batch, work), [&](int64_t, int64_t start, int64_t length) {
      std::vector<double> scratch(static_cast<size_t>(4 * size * size));
      for (int64_t b = start; b < start + length; ++b) {
        if (!std::isfinite(zp[b])) continue;  // no tree: the marginals are constant 0
        const int64_t off = b * size * size;
        std::fill(scratch.begin(), scratch.end(), 0.0);
        double* tangent = scratch.data();
        double* tangent_t = tangent + size * size;
        double* d_inner = tangent_t + size * size;
        double* marginal = d_inner + size * size;
        const ItemCharts c{inside.data_ptr<double>() + off, inner.data_ptr<double>() + off,
                           inside_t.data_ptr<double>() + off, size};
        const int64_t n = lp[b] + 1;
        tangent_item(c, dp + off, n, tangent, tangent_t, d_inner);
        outside_item(c, n, marginal, tangent, d_inner, hp + off);
      }
    });
  });
  return hvp;
}

}  // namespace

}  // namespace structattn

TORCH_LIBRARY(structattn_cky, m) {
  m.def("inside(Tensor scores, Tensor last) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("outside(Tensor inside, Tensor inner, Tensor inside_t, Tensor logz, Tensor last) "
        "-> Tensor");
  m.def("hvp(Tensor inside, Tensor inner, Tensor inside_t, Tensor logz, Tensor last, "
        "Tensor direction) -> Tensor");
}

TORCH_LIBRARY_IMPL(structattn_cky, CPU, m) {
  m.impl("inside", &structattn::cky_inside);
  m.impl("outside", &structattn::cky_outside);
  m.impl("hvp", &structattn::cky_hvp);
}
