// Semi-Markov CRF (semi_markov.py): the log-semiring forward pass keeping its local
// probabilities, the marginals (the derivative of log Z, one sweep positions down) and the
// Hessian-vector product of log Z (the tangents positions up, then one more sweep down), one
// item at a time in plain loops in double precision (for float32 and float64 scores), the
// batch split into one chunk per thread (for_chunks in _kernels.h). The same recurrences as
// _forward_pass, _outside and _hvp in semi_markov.py (read the comments there), with the
// local probabilities in the same layout (_Probs: "window order", index j of the segments
// that end at t is the one of length K - j), so that either side's backward runs on the
// other's forward pass. An item of n positions touches only positions t < n (the rest of
// its outputs stays 0); a node with no allowed path (-inf) has probability 0 for all its
// terms. Transitions are [C, C] (shared, or a [B, C, C] view expanded from one: read in
// place) or [B, C, C]. Registered as torch operators ``torch.ops.structattn_semi_markov.*``
// (no Python binding of their own), which semi_markov.py uses where they are registered.
// Built on first use by _extension.py.
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

// N positions, K segment lengths, C labels.
struct Dims {
  int64_t size, width, labels;
};

// One item's local probabilities (double): seg [N, K, C] in window order (seg[(t K + j) C + c]
// = exp(beta(t - k, c) + s(t - k, k, c) - alpha(t, c)), j = K - 1 - k), trans [N - 1, C, C]
// (trans[(t C + a) C + c] = exp(alpha(t, a) + T(a, c) - beta(t + 1, c))), root [C] (softmax
// of alpha(n - 1)), n the item's length.
struct ItemProbs {
  const double* seg;
  const double* trans;
  const double* root;
  int64_t n;
};

// Transitions [C, C] per item: a shared matrix (stride 0) or one per item.
Tensor shared_or_batched(const Tensor& t, int64_t batch, int64_t labels, const char* what) {
  TORCH_CHECK((t.dim() == 2 || (t.dim() == 3 && t.size(0) == batch)) &&
                  t.size(-1) == labels && t.size(-2) == labels,
              "semi_markov: ", what, " must be [C, C] or [B, C, C]");
  if (t.dim() == 3 && t.stride(0) == 0 && batch > 0) return t.select(0, 0).contiguous();
  return t.contiguous();
}

// y = logsumexp_i x_i over ``count`` terms; ``x`` is overwritten with the softmax (all 0 when
// every term is -inf, and then y = -inf; all NaN and y = NaN when a term is NaN; all NaN and
// y = +inf when a term is +inf, as torch.logsumexp and the PyTorch path give).
inline double softmax_in_place(double* x, int64_t count) {
  double top = -kInf;
  bool nan = false;
  for (int64_t i = 0; i < count; ++i) {
    top = x[i] > top ? x[i] : top;
    nan = nan || std::isnan(x[i]);
  }
  if (nan || top == -kInf || top == kInf) {
    const double fill = top == -kInf && !nan ? 0.0 : std::numeric_limits<double>::quiet_NaN();
    for (int64_t i = 0; i < count; ++i) x[i] = fill;
    return nan ? fill : top;
  }
  double total = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    x[i] = std::exp(x[i] - top);
    total += x[i];
  }
  const double inverse = 1.0 / total;
  for (int64_t i = 0; i < count; ++i) x[i] *= inverse;
  return top + std::log(total);
}

// Below this, the largest term of a factorised transition step may have lost a term that
// underflowed (transition_step computes that column term by term instead).
constexpr double kTiny = 1e-280;

// A transition matrix's half of the factorised step: top[c] = max_a T(a, c) and
// factor[a C + c] = exp(T(a, c) - top[c]) (0 in a column that is all -inf), [C] and [C, C].
template <typename scalar_t>
void factor_transitions(const scalar_t* transitions, int64_t C, double* top, double* factor) {
  for (int64_t c = 0; c < C; ++c) {
    double column = -kInf;
    for (int64_t a = 0; a < C; ++a) {
      const double v = static_cast<double>(transitions[a * C + c]);
      column = v > column ? v : column;
    }
    top[c] = column;
    for (int64_t a = 0; a < C; ++a) {
      const double v = static_cast<double>(transitions[a * C + c]);
      factor[a * C + c] = column == -kInf ? 0.0 : std::exp(v - column);
    }
  }
}

// beta(t + 1, c) = logsumexp_a alpha(t, a) + T(a, c) and its softmax over a (trans_t [C, C],
// zeroed by the caller), factorised: exp(alpha(a) + T(a, c) - m - top[c]) = exp(alpha(a) - m)
// factor[a C + c] with m = max_a alpha(a), so a step takes C exponentials instead of C^2. A
// column whose largest product is below kTiny (a term that underflowed could matter: scores
// of very different magnitudes), or with NaN, is computed term by term (softmax_in_place).
template <typename scalar_t>
void transition_step(const double* alpha, const scalar_t* transitions, const double* top,
                     const double* factor, int64_t C, double* beta_next, double* trans_t,
                     double* e_alpha, double* terms) {
  double m = -kInf;
  bool nan = false;
  for (int64_t a = 0; a < C; ++a) {
    m = alpha[a] > m ? alpha[a] : m;
    nan = nan || std::isnan(alpha[a]);
  }
  if (m == -kInf && !nan) {  // no path reaches position t
    for (int64_t c = 0; c < C; ++c) beta_next[c] = -kInf;
    return;
  }
  for (int64_t a = 0; a < C; ++a) e_alpha[a] = std::exp(alpha[a] - m);
  for (int64_t c = 0; c < C; ++c) {
    double total = 0.0, largest = 0.0;
    for (int64_t a = 0; a < C; ++a) {
      const double v = e_alpha[a] * factor[a * C + c];
      total += v;
      largest = v > largest ? v : largest;
    }
    if (largest >= kTiny && !nan && std::isfinite(total)) {
      beta_next[c] = m + top[c] + std::log(total);
      const double inverse = 1.0 / total;
      for (int64_t a = 0; a < C; ++a) trans_t[a * C + c] = e_alpha[a] * factor[a * C + c] * inverse;
      continue;
    }
    for (int64_t a = 0; a < C; ++a) {
      terms[a] = alpha[a] + static_cast<double>(transitions[a * C + c]);
    }
    beta_next[c] = softmax_in_place(terms, C);
    for (int64_t a = 0; a < C; ++a) trans_t[a * C + c] = terms[a];
  }
}

// The forward pass of one item (n positions) writing seg, trans and root (zeroed by the
// caller); returns log Z. ``top`` and ``factor`` come from factor_transitions; ``beta``
// [N, C], ``alpha`` and ``e_alpha`` [C] and ``terms`` [max(K, C)] are scratch.
//   alpha(t, c) = logsumexp_{k <= min(K - 1, t)} beta(t - k, c) + s(t - k, k, c)
//   beta(t + 1, c) = logsumexp_a alpha(t, a) + T(a, c),   beta(0, c) = 0
//   log Z = logsumexp_c alpha(n - 1, c)
template <typename scalar_t>
double forward_item(const scalar_t* scores, const scalar_t* transitions, const double* top,
                    const double* factor, int64_t n, const Dims& d, double* seg, double* trans,
                    double* root, double* beta, double* alpha, double* e_alpha, double* terms) {
  const int64_t K = d.width, C = d.labels;
  std::fill(beta, beta + C, 0.0);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t count = std::min(K - 1, t) + 1;
    double* seg_t = seg + t * K * C;
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t k = 0; k < count; ++k) {
        terms[k] = beta[(t - k) * C + c] +
                   static_cast<double>(scores[((t - k) * K + k) * C + c]);
      }
      alpha[c] = softmax_in_place(terms, count);
      for (int64_t k = 0; k < count; ++k) seg_t[(K - 1 - k) * C + c] = terms[k];
    }
    if (t + 1 < n) {
      transition_step(alpha, transitions, top, factor, C, beta + (t + 1) * C, trans + t * C * C,
                      e_alpha, terms);
    }
  }
  for (int64_t c = 0; c < C; ++c) terms[c] = alpha[c];
  const double logz = softmax_in_place(terms, C);
  for (int64_t c = 0; c < C; ++c) root[c] = terms[c];
  return logz;
}

// Positions down, the linear recursion of reverse mode through the forward pass:
//   A(t, a) = src_alpha(t, a) + Σ_c P_trans(t, a, c) B(t + 1, c)
//   B(u, c) = Σ_k q(u, k, c),  q(u, k, c) = P_seg(u + k, k, c) A(u + k, c) + x_seg(u + k, k, c)
// (src_alpha: ``src_alpha`` [N, C], or root at n - 1 when null; x_seg [N, K, C] in window
// order, or 0 when null). Writes A and B [N, C] (zeroed by the caller), q by start into
// ``seg_out`` [N, K, C] and adds Σ_t P_trans(t, a, c) B(t + 1, c) to ``trans_acc`` [C, C].
// B(u) is complete once t passes u (its last term comes from t = u).
template <typename out_t>
void adjoint_item(const ItemProbs& p, const Dims& d, const double* src_alpha,
                  const double* x_seg, double* A, double* B, out_t* seg_out,
                  double* trans_acc) {
  const int64_t K = d.width, C = d.labels, n = p.n;
  for (int64_t t = n - 1; t >= 0; --t) {
    double* a_row = A + t * C;
    for (int64_t a = 0; a < C; ++a) {
      a_row[a] = src_alpha != nullptr ? src_alpha[t * C + a] : (t == n - 1 ? p.root[a] : 0.0);
    }
    if (t + 1 < n) {
      const double* b_next = B + (t + 1) * C;
      const double* trans_t = p.trans + t * C * C;
      for (int64_t a = 0; a < C; ++a) {
        const double* row = trans_t + a * C;
        double* acc = trans_acc + a * C;
        double total = 0.0;
        for (int64_t c = 0; c < C; ++c) {
          const double v = row[c] * b_next[c];
          total += v;
          acc[c] += v;
        }
        a_row[a] += total;
      }
    }
    const int64_t count = std::min(K - 1, t) + 1;
    for (int64_t k = 0; k < count; ++k) {
      const int64_t u = t - k;
      const int64_t j = (t * K + K - 1 - k) * C;
      const double* p_seg = p.seg + j;
      out_t* out = seg_out + (u * K + k) * C;
      double* b = B + u * C;
      for (int64_t c = 0; c < C; ++c) {
        double q = p_seg[c] * a_row[c];
        if (x_seg != nullptr) q += x_seg[j + c];
        out[c] = static_cast<out_t>(q);
        b[c] += q;
      }
    }
  }
}

// Scratch of the Hessian-vector product of one item: tangents dalpha, dbeta, the adjoints'
// sources and A, B of the second sweep, each [N, C], and x_seg [N, K, C].
struct HvpScratch {
  std::vector<double> data;
  double *d_alpha, *d_beta, *src_alpha, *a_bar, *b_bar, *x_seg;
  explicit HvpScratch(const Dims& d)
      : data(static_cast<size_t>(d.size * d.labels * (5 + d.width))) {
    const int64_t row = d.size * d.labels;
    d_alpha = data.data();
    d_beta = d_alpha + row;
    src_alpha = d_beta + row;
    a_bar = src_alpha + row;
    b_bar = a_bar + row;
    x_seg = b_bar + row;
  }
};

// The Hessian of log Z times the direction (d_seg [N, K, C] by start, d_trans [C, C]) for one
// item, with g_alpha, g_beta [N, C] the first-order adjoints (the marginals' sweep):
//   tangents up:  dbeta(t, c) = Σ_a P_trans(t - 1, a, c) (dalpha(t - 1, a) + dT(a, c)),
//                 dalpha(t, c) = Σ_k P_seg(t, k, c) (ds(t - k, k, c) + dbeta(t - k, c)),
//   then at each log-sum-exp node y (probabilities p_i, first-order adjoint g_y) the
//   second-order term x_i = p_i g_y (dx_i - dy), and the root log Z (g = 1), and one
//   adjoint sweep whose sources are these terms: hvp = P (A, B) + x.
template <typename scalar_t, typename out_t>
void hvp_item(const ItemProbs& p, const Dims& d, const double* g_alpha, const double* g_beta,
              const scalar_t* d_seg, const scalar_t* d_trans, HvpScratch& s, out_t* hvp_seg,
              double* trans_acc) {
  const int64_t K = d.width, C = d.labels, n = p.n;
  std::fill(s.data.begin(), s.data.end(), 0.0);
  for (int64_t t = 0; t < n; ++t) {
    double* db = s.d_beta + t * C;
    if (t > 0) {
      const double* trans_t = p.trans + (t - 1) * C * C;
      const double* da = s.d_alpha + (t - 1) * C;
      for (int64_t a = 0; a < C; ++a) {
        const double* row = trans_t + a * C;
        const scalar_t* dt = d_trans + a * C;
        for (int64_t c = 0; c < C; ++c) db[c] += row[c] * (da[a] + static_cast<double>(dt[c]));
      }
    }
    double* da = s.d_alpha + t * C;
    const int64_t count = std::min(K - 1, t) + 1;
    for (int64_t k = 0; k < count; ++k) {
      const double* p_seg = p.seg + (t * K + K - 1 - k) * C;
      const scalar_t* ds = d_seg + ((t - k) * K + k) * C;
      const double* db_start = s.d_beta + (t - k) * C;
      for (int64_t c = 0; c < C; ++c) {
        da[c] += p_seg[c] * (static_cast<double>(ds[c]) + db_start[c]);
      }
    }
  }
  const double* da_last = s.d_alpha + (n - 1) * C;
  double d_logz = 0.0;
  for (int64_t c = 0; c < C; ++c) d_logz += p.root[c] * da_last[c];
  for (int64_t c = 0; c < C; ++c) {
    s.src_alpha[(n - 1) * C + c] = p.root[c] * (da_last[c] - d_logz);
  }
  for (int64_t t = 0; t + 1 < n; ++t) {  // transitions: x = P_trans g_beta(t + 1) (...)
    const double* trans_t = p.trans + t * C * C;
    const double* gb = g_beta + (t + 1) * C;
    const double* da = s.d_alpha + t * C;
    const double* db = s.d_beta + (t + 1) * C;
    double* src = s.src_alpha + t * C;
    for (int64_t a = 0; a < C; ++a) {
      const double* row = trans_t + a * C;
      const scalar_t* dt = d_trans + a * C;
      double* acc = trans_acc + a * C;
      double total = 0.0;
      for (int64_t c = 0; c < C; ++c) {
        const double x = row[c] * gb[c] * (da[a] + static_cast<double>(dt[c]) - db[c]);
        total += x;
        acc[c] += x;
      }
      src[a] += total;
    }
  }
  for (int64_t t = 0; t < n; ++t) {  // segments: x = P_seg g_alpha(t) (...)
    const double* ga = g_alpha + t * C;
    const double* da = s.d_alpha + t * C;
    const int64_t count = std::min(K - 1, t) + 1;
    for (int64_t k = 0; k < count; ++k) {
      const int64_t j = (t * K + K - 1 - k) * C;
      const scalar_t* ds = d_seg + ((t - k) * K + k) * C;
      const double* db = s.d_beta + (t - k) * C;
      for (int64_t c = 0; c < C; ++c) {
        s.x_seg[j + c] = p.seg[j + c] * ga[c] * (db[c] + static_cast<double>(ds[c]) - da[c]);
      }
    }
  }
  adjoint_item(p, d, s.src_alpha, s.x_seg, s.a_bar, s.b_bar, hvp_seg, trans_acc);
}

void check_probs(const Tensor& seg, const Tensor& trans, const Tensor& root, const Tensor& last) {
  TORCH_CHECK(seg.dim() == 4 && seg.scalar_type() == at::kDouble && seg.is_contiguous(),
              "semi_markov: seg must be contiguous double [B, N, K, C]");
  const int64_t batch = seg.size(0), size = seg.size(1), labels = seg.size(3);
  TORCH_CHECK(trans.dim() == 4 && trans.size(0) == batch &&
                  trans.size(1) == std::max<int64_t>(size - 1, 0) && trans.size(2) == labels &&
                  trans.size(3) == labels && trans.scalar_type() == at::kDouble &&
                  trans.is_contiguous(),
              "semi_markov: trans must be contiguous double [B, N - 1, C, C]");
  TORCH_CHECK(root.dim() == 2 && root.size(0) == batch && root.size(1) == labels &&
                  root.scalar_type() == at::kDouble && root.is_contiguous(),
              "semi_markov: root must be contiguous double [B, C]");
  TORCH_CHECK(last.dim() == 1 && last.size(0) == batch, "semi_markov: last must be [B]");
}

// Lengths n = last + 1 [B], each checked in 1 .. N.
std::vector<int64_t> item_lengths(const Tensor& last_in, int64_t batch, int64_t size) {
  const Tensor last = last_in.to(at::kLong).contiguous();
  const int64_t* lp = last.data_ptr<int64_t>();
  std::vector<int64_t> lengths(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lp[b] >= 0 && lp[b] < size, "semi_markov: last must be in 0 .. N - 1");
    lengths[b] = lp[b] + 1;
  }
  return lengths;
}

ItemProbs item_probs(const Tensor& seg, const Tensor& trans, const Tensor& root, int64_t b,
                     int64_t n) {
  const int64_t size = seg.size(1), width = seg.size(2), labels = seg.size(3);
  return {seg.data_ptr<double>() + b * size * width * labels,
          trans.data_ptr<double>() + b * std::max<int64_t>(size - 1, 0) * labels * labels,
          root.data_ptr<double>() + b * labels, n};
}

// (log Z [B], root [B, C], seg [B, N, K, C], trans [B, N - 1, C, C]), all double: the fields
// of _Probs in semi_markov.py.
std::tuple<Tensor, Tensor, Tensor, Tensor> semi_markov_forward(const Tensor& scores_in,
                                                               const Tensor& transitions_in,
                                                               const Tensor& last_in) {
  TORCH_CHECK(scores_in.dim() == 4, "semi_markov: segment_scores must be [B, N, K, C]");
  const Tensor scores = scores_in.contiguous();
  const int64_t batch = scores.size(0), size = scores.size(1), width = scores.size(2),
                labels = scores.size(3);
  TORCH_CHECK(size >= 1 && width >= 1 && labels >= 1, "semi_markov: empty segment_scores");
  const Tensor transitions =
      shared_or_batched(transitions_in, batch, labels, "transitions").to(scores.scalar_type());
  const int64_t trans_stride = transitions.dim() == 3 ? labels * labels : 0;
  const std::vector<int64_t> lengths = item_lengths(last_in, batch, size);
  const auto options = scores.options().dtype(at::kDouble);
  Tensor logz = at::empty({batch}, options);
  Tensor root = at::zeros({batch, labels}, options);
  Tensor seg = at::zeros({batch, size, width, labels}, options);
  Tensor trans = at::zeros({batch, size - 1, labels, labels}, options);
  double* zp = logz.data_ptr<double>();
  double* seg_p = seg.data_ptr<double>();
  double* trans_p = trans.data_ptr<double>();
  double* root_p = root.data_ptr<double>();
  const Dims d{size, width, labels};
  const double work = static_cast<double>(batch) * size * labels * (width + labels);
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "semi_markov_forward", [&] {
    const scalar_t* sp = scores.data_ptr<scalar_t>();
    const scalar_t* tp = transitions.data_ptr<scalar_t>();
    for_chunks(chunk_starts(batch, work), [&](int64_t, int64_t start, int64_t length) {
      std::vector<double> scratch(
          static_cast<size_t>((size + 4) * labels + labels * labels + width));
      double* beta = scratch.data();
      double* alpha = beta + size * labels;
      double* e_alpha = alpha + labels;
      double* top = e_alpha + labels;
      double* factor = top + labels;
      double* terms = factor + labels * labels;  // [max(K, C)]
      for (int64_t b = start; b < start + length; ++b) {
        const scalar_t* tb = tp + b * trans_stride;
        if (b == start || trans_stride != 0) factor_transitions(tb, labels, top, factor);
        zp[b] = forward_item(sp + b * size * width * labels, tb, top, factor, lengths[b], d,
                             seg_p + b * size * width * labels,
                             trans_p + b * (size - 1) * labels * labels, root_p + b * labels,
                             beta, alpha, e_alpha, terms);
      }
    });
  });
  return {logz, root, seg, trans};
}

// (g_alpha [B, N, C], g_beta [B, N, C] double: the derivatives of log Z with respect to
// alpha and beta; segment marginals [B, N, K, C] by start and transition marginals
// [B, C, C] in ``dtype``) from the forward pass's probabilities.
std::tuple<Tensor, Tensor, Tensor, Tensor> semi_markov_marginals(const Tensor& seg,
                                                                 const Tensor& trans,
                                                                 const Tensor& root,
                                                                 const Tensor& last_in,
                                                                 at::ScalarType dtype) {
  check_probs(seg, trans, root, last_in);
  const int64_t batch = seg.size(0), size = seg.size(1), width = seg.size(2),
                labels = seg.size(3);
  const std::vector<int64_t> lengths = item_lengths(last_in, batch, size);
  Tensor g_alpha = at::zeros({batch, size, labels}, root.options());
  Tensor g_beta = at::zeros({batch, size, labels}, root.options());
  Tensor segments = at::zeros(seg.sizes(), seg.options().dtype(dtype));
  Tensor pairs_acc = at::zeros({batch, labels, labels}, root.options());
  const Dims d{size, width, labels};
  const double work = static_cast<double>(batch) * size * labels * (width + labels);
  AT_DISPATCH_FLOATING_TYPES(dtype, "semi_markov_marginals", [&] {
    scalar_t* op = segments.data_ptr<scalar_t>();
    for_chunks(chunk_starts(batch, work), [&](int64_t, int64_t start, int64_t length) {
      for (int64_t b = start; b < start + length; ++b) {
        const ItemProbs p = item_probs(seg, trans, root, b, lengths[b]);
        const int64_t rows = b * size * labels;
        adjoint_item(p, d, nullptr, nullptr, g_alpha.data_ptr<double>() + rows,
                     g_beta.data_ptr<double>() + rows, op + rows * width,
                     pairs_acc.data_ptr<double>() + b * labels * labels);
      }
    });
  });
  return {g_alpha, g_beta, segments, pairs_acc.to(dtype)};
}

// The Hessian of log Z times the direction (d_seg [B, N, K, C] by start, d_trans [B, C, C] or
// [C, C]): (hvp_seg [B, N, K, C], hvp_trans [B, C, C]) in ``dtype``.
std::tuple<Tensor, Tensor> semi_markov_hvp(const Tensor& seg, const Tensor& trans,
                                           const Tensor& root, const Tensor& last_in,
                                           const Tensor& g_alpha, const Tensor& g_beta,
                                           const Tensor& d_seg_in, const Tensor& d_trans_in,
                                           at::ScalarType dtype) {
  check_probs(seg, trans, root, last_in);
  const int64_t batch = seg.size(0), size = seg.size(1), width = seg.size(2),
                labels = seg.size(3);
  TORCH_CHECK(g_alpha.sizes() == at::IntArrayRef({batch, size, labels}) &&
                  g_beta.sizes() == g_alpha.sizes() && g_alpha.scalar_type() == at::kDouble &&
                  g_beta.scalar_type() == at::kDouble && g_alpha.is_contiguous() &&
                  g_beta.is_contiguous(),
              "semi_markov: g_alpha and g_beta must be contiguous double [B, N, C]");
  TORCH_CHECK(d_seg_in.sizes() == seg.sizes(), "semi_markov: d_seg must be [B, N, K, C]");
  const Tensor d_seg = d_seg_in.contiguous();
  const Tensor d_trans = shared_or_batched(d_trans_in, batch, labels, "d_trans")
                             .to(d_seg.scalar_type());
  const int64_t d_trans_stride = d_trans.dim() == 3 ? labels * labels : 0;
  const std::vector<int64_t> lengths = item_lengths(last_in, batch, size);
  Tensor hvp_seg = at::zeros(seg.sizes(), seg.options().dtype(dtype));
  Tensor trans_acc = at::zeros({batch, labels, labels}, root.options());
  const Dims d{size, width, labels};
  const double work = 3.0 * batch * size * labels * (width + labels);
  AT_DISPATCH_FLOATING_TYPES(d_seg.scalar_type(), "semi_markov_hvp", [&] {
    using in_t = scalar_t;
    const in_t* dsp = d_seg.data_ptr<in_t>();
    const in_t* dtp = d_trans.data_ptr<in_t>();
    AT_DISPATCH_FLOATING_TYPES(dtype, "semi_markov_hvp_out", [&] {
      scalar_t* hp = hvp_seg.data_ptr<scalar_t>();
      for_chunks(chunk_starts(batch, work), [&](int64_t, int64_t start, int64_t length) {
        HvpScratch scratch(d);
        for (int64_t b = start; b < start + length; ++b) {
          const ItemProbs p = item_probs(seg, trans, root, b, lengths[b]);
          const int64_t rows = b * size * labels;
          hvp_item(p, d, g_alpha.data_ptr<double>() + rows, g_beta.data_ptr<double>() + rows,
                   dsp + rows * width, dtp + b * d_trans_stride, scratch, hp + rows * width,
                   trans_acc.data_ptr<double>() + b * labels * labels);
        }
      });
    });
  });
  return {hvp_seg, trans_acc.to(dtype)};
}

}  // namespace

}  // namespace structattn

TORCH_LIBRARY(structattn_semi_markov, m) {
  m.def("forward(Tensor segment_scores, Tensor transitions, Tensor last) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("marginals(Tensor seg, Tensor trans, Tensor root, Tensor last, ScalarType dtype) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("hvp(Tensor seg, Tensor trans, Tensor root, Tensor last, Tensor g_alpha, "
        "Tensor g_beta, Tensor d_seg, Tensor d_trans, ScalarType dtype) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(structattn_semi_markov, CPU, m) {
  m.impl("forward", &structattn::semi_markov_forward);
  m.impl("marginals", &structattn::semi_markov_marginals);
  m.impl("hvp", &structattn::semi_markov_hvp);
}
