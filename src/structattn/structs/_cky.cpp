// CKY over binary bracketings (constituency.py): the inside pass, the outside pass (span
// marginals) and the Hessian-vector product of log Z, one item at a time in plain loops
// (double precision inside, for float32 and float64 inputs), the batch split into one chunk
// per thread (for_chunks in _kernels.h). The same recurrences as _cky_charts, _cky_outside
// and _cky_hvp in constituency.py (read the comments there); an item of n words touches only
// its own spans [i, j], j < n (the rest of its charts stays 0). Registered as torch
// operators ``torch.ops.structattn_cky.*`` (no Python binding of their own), which
// constituency.py uses where they are registered. Built on first use by _extension.py.
// (Issue 39: checked in a standalone build with the extension's flags against the PyTorch
// path: log Z, marginals and HVP equal to 1e-16 in float64, 3e-7 in float32.) Labelled
// scores [B, N, N, L]: the label passes at the end (label_*: the labels' log-sum-exp that the
// CKY reads, the labelled marginals, the labelled Hessian-vector product), used by
// constituency.py's _CKYLabelledLogPartition and _CKYLabelledMarginals.
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "_kernels.h"

namespace structattn {
namespace {

using at::Tensor;

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---- exp of arrays ------------------------------------------------------------------------
// Every exp below is of a term minus the log-sum-exp or the largest term of its sum (<= 0;
// -inf for a forbidden span or label), taken over many sums at once (every split of every
// span of one width of an item; every label of the spans of one row of an item): with GCC /
// clang vector extensions kLanes at a time by an exp of its own (as _eisner.cpp's fused
// path; with GCC >= 12 on x86-64 Linux compiled for AVX-512, AVX2 and baseline x86-64:
// STRUCTATTN_CLONES, _kernels.h), else by std::exp. (One call per sum of 10 terms took
// longer than std::exp's scalar loop: the polynomial's latency, with one or two vectors in
// flight; over a width's or a row's terms at once it took a third of std::exp's time.)
#if defined(__GNUC__)
constexpr int64_t kLanes = 8;
// aligned(8): loaded and stored by memcpy, no 64-byte alignment assumed
typedef double Lanes __attribute__((vector_size(kLanes * sizeof(double)), aligned(8)));
typedef int64_t ILanes __attribute__((vector_size(kLanes * sizeof(int64_t)), aligned(8)));
constexpr double kMagic = 0x1.8p52;  // adding it rounds a double to an integer
constexpr int64_t kMagicBits = 0x4338000000000000;  // the bits of kMagic

inline Lanes splat(double x) { return Lanes{} + x; }

// exp(x) for x <= 0 (-inf and x < -708 give 0, NaN stays NaN): a Cody-Waite reduction
// x = n log 2 + r, |r| <= log(2) / 2, and the Taylor polynomial of degree 13 (relative
// error below 1e-16 + rounding); 2^n from the bits of n + kMagic (integers in [-2^51, 2^51]
// have the bits of bits(kMagic) + n: no conversion instructions, which not every clone has).
__attribute__((always_inline)) inline Lanes exp_lanes(const Lanes& x) {
  const Lanes floor = splat(-708.0);
  const Lanes xc = x < floor ? floor : x;
  const Lanes magic = splat(kMagic);
  const Lanes shifted = xc * 1.4426950408889634 + magic;  // n + magic, n in [-1022, 0]
  const Lanes n = shifted - magic;
  const Lanes r = (xc - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
  Lanes p = splat(1.0 / 6227020800.0);  // 1/13!
  const double coef[] = {1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
                         1.0 / 362880.0,    1.0 / 40320.0,    1.0 / 5040.0,
                         1.0 / 720.0,       1.0 / 120.0,      1.0 / 24.0,
                         1.0 / 6.0,         0.5,              1.0,
                         1.0};
  for (double c : coef) p = p * r + c;
  const ILanes bits = ((ILanes)shifted + (1023 - kMagicBits)) << 52;  // 2^n
  const Lanes out = p * (Lanes)bits;
  return x < floor ? splat(0.0) : out;
}

// x[k] = exp(x[k] - shift) for k < n (shift finite); returns their sum.
STRUCTATTN_CLONES double exp_shifted(double* x, int64_t n, double shift) {
  Lanes total = splat(0.0);
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    Lanes v;
    std::memcpy(&v, x + k, sizeof(v));
    v = exp_lanes(v - shift);
    std::memcpy(x + k, &v, sizeof(v));
    total += v;
  }
  if (k < n) {  // the last n - k terms; the other lanes exp(-inf) = 0
    const int64_t rest = n - k;
    Lanes v = splat(0.0);
    std::memcpy(&v, x + k, rest * sizeof(double));
    v -= shift;
    for (int64_t l = rest; l < kLanes; ++l) v[l] = -kInf;
    v = exp_lanes(v);
    std::memcpy(x + k, &v, rest * sizeof(double));
    total += v;
  }
  double sum = 0.0;
  for (int64_t l = 0; l < kLanes; ++l) sum += total[l];
  return sum;
}
#else
inline double exp_shifted(double* x, int64_t n, double shift) {
  double sum = 0.0;
  for (int64_t k = 0; k < n; ++k) sum += (x[k] = std::exp(x[k] - shift));
  return sum;
}
#endif

// Charts of one item, [N, N] row-major double: inside I, inner (-inf -> 0) and, for the
// children of a split, I by column (IT[j * N + k] = I[k * N + j]) for contiguous loops.
struct ItemCharts {
  const double* inside;
  const double* inner;
  const double* inside_t;
  int64_t size;
};

// The inside pass of one item, widths up; ``terms`` scratch [N * N], ``tops`` [N].
template <typename scalar_t>
void inside_item(const scalar_t* scores, int64_t size, int64_t n, double* inside,
                 double* inner, double* inside_t, double* terms, double* tops) {
  for (int64_t i = 0; i < n; ++i) {
    const double s = static_cast<double>(scores[i * size + i]);
    inside[i * size + i] = s;
    inside_t[i * size + i] = s;
  }
  for (int64_t w = 2; w <= n; ++w) {
    const int64_t splits = w - 1, spans = n - w + 1;
    for (int64_t i = 0; i < spans; ++i) {  // the terms minus their largest, every span
      const int64_t j = i + w - 1;
      const double* left = inside + i * size + i;         // I(i, i + k)
      const double* right = inside_t + j * size + i + 1;  // I(i + k + 1, j)
      double* t = terms + i * splits;
      double top = -kInf;
      for (int64_t k = 0; k < splits; ++k) {
        t[k] = left[k] + right[k];
        top = t[k] > top ? t[k] : top;
      }
      tops[i] = top;
      const double shift = top > -kInf ? top : 0.0;  // every term -inf: exp 0
      for (int64_t k = 0; k < splits; ++k) t[k] -= shift;
    }
    exp_shifted(terms, spans * splits, 0.0);
    for (int64_t i = 0; i < spans; ++i) {
      const int64_t j = i + w - 1;
      const double* t = terms + i * splits;
      double value = -kInf;
      if (tops[i] > -kInf) {
        double total = 0.0;
        for (int64_t k = 0; k < splits; ++k) total += t[k];
        value = tops[i] + std::log(total);
      }
      inner[i * size + j] = value > -kInf ? value : 0.0;
      const double s = static_cast<double>(scores[i * size + j]);
      const double v = s + value;
      inside[i * size + j] = v;
      inside_t[j * size + i] = v;
    }
  }
}

// p_k(i, j) = exp(I(i, i + k) + I(i + k + 1, j) - inner(i, j)), the probability of each
// split k of each span [i, j] of width w (i < spans), into probs [spans * (w - 1)].
inline void split_probs(const ItemCharts& c, int64_t w, int64_t spans, double* probs) {
  const int64_t size = c.size, splits = w - 1;
  for (int64_t i = 0; i < spans; ++i) {
    const int64_t j = i + w - 1;
    const double norm = c.inner[i * size + j];
    const double* left = c.inside + i * size + i;
    const double* right = c.inside_t + j * size + i + 1;
    double* p = probs + i * splits;
    for (int64_t k = 0; k < splits; ++k) p[k] = left[k] + right[k] - norm;
  }
  exp_shifted(probs, spans * splits, 0.0);
}

// Widths down: a span passes its marginal times each split's probability to the split's two
// children. ``marginal`` [N, N] and (when ``hvp``) the adjoint of <marginals, direction>
// with respect to I, with ``tangent`` and ``d_inner`` the tangents of the inside pass.
// ``probs``: scratch [N * N].
void outside_item(const ItemCharts& c, int64_t n, double* marginal, const double* tangent,
                  const double* d_inner, double* adjoint, double* probs) {
  const int64_t size = c.size;
  marginal[n - 1] = 1.0;  // the whole sentence
  for (int64_t w = n; w >= 2; --w) {
    const int64_t splits = w - 1, spans = n - w + 1;
    split_probs(c, w, spans, probs);
    for (int64_t i = 0; i < spans; ++i) {
      const int64_t j = i + w - 1;
      const double mu = marginal[i * size + j];
      const double g = adjoint != nullptr ? adjoint[i * size + j] : 0.0;
      if (mu == 0.0 && g == 0.0) continue;
      const double* pk = probs + i * splits;
      for (int64_t k = 0; k < splits; ++k) {
        const double p = pk[k];
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

// Tangents of the inside pass along ``direction``: dot I and dot inner, [N, N]; ``probs``:
// scratch [N * N].
template <typename scalar_t>
void tangent_item(const ItemCharts& c, const scalar_t* direction, int64_t n, double* tangent,
                  double* tangent_t, double* d_inner, double* probs) {
  const int64_t size = c.size;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(direction[i * size + i]);
    tangent[i * size + i] = d;
    tangent_t[i * size + i] = d;
  }
  for (int64_t w = 2; w <= n; ++w) {
    const int64_t splits = w - 1, spans = n - w + 1;
    split_probs(c, w, spans, probs);
    for (int64_t i = 0; i < spans; ++i) {
      const int64_t j = i + w - 1;
      const double* pk = probs + i * splits;
      const double* d_left = tangent + i * size + i;
      const double* d_right = tangent_t + j * size + i + 1;
      double total = 0.0;
      for (int64_t k = 0; k < splits; ++k) total += pk[k] * (d_left[k] + d_right[k]);
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
      std::vector<double> terms(static_cast<size_t>(size * size)), tops(size);
      for (int64_t b = start; b < start + length; ++b) {
        const int64_t off = b * size * size;
        const int64_t n = lp[b] + 1;
        inside_item(sp + off, size, n, ip + off, np + off, tp + off, terms.data(), tops.data());
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
    std::vector<double> probs(static_cast<size_t>(size * size));
    for (int64_t b = start; b < start + length; ++b) {
      if (!std::isfinite(zp[b])) continue;  // no tree: zero marginals
      const int64_t off = b * size * size;
      const ItemCharts c{inside.data_ptr<double>() + off, inner.data_ptr<double>() + off,
                         inside_t.data_ptr<double>() + off, size};
      outside_item(c, lp[b] + 1, mp + off, nullptr, nullptr, nullptr, probs.data());
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
      std::vector<double> probs(static_cast<size_t>(size * size));
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
        tangent_item(c, dp + off, n, tangent, tangent_t, d_inner, probs.data());
        outside_item(c, n, marginal, tangent, d_inner, hp + off, probs.data());
      }
    });
  });
  return hvp;
}

// ---- labels ([B, N, N, L] scores: a labelled tree gives each span one label) -------------
// The labels factor: the CKY reads per span the log-sum-exp of its labels' scores, and a
// span-label's marginal is the span's marginal times the softmax of the span's labels. These
// passes read (and write) only each item's own spans [i, j], i <= j < n: NaN padding below
// the diagonal and past the length is never read (the outputs are 0 there).

void check_labelled(const Tensor& scores, const Tensor& last) {
  TORCH_CHECK(scores.dim() == 4 && scores.size(1) == scores.size(2),
              "cky: labelled scores must be [B, N, N, L]");
  TORCH_CHECK(last.dim() == 1 && last.size(0) == scores.size(0), "cky: last must be [B]");
}

// Calls fn(b, span, count) for every row i < n of every item b of a chunk: its spans
// [i, i .. n - 1] are the ``count`` = n - i entries from the flat index ``span`` = (b N + i)
// N + i on, their labels the count L scores from span L on (contiguous).
template <typename F>
void each_row(const int64_t* lp, int64_t size, int64_t start, int64_t length, const F& fn) {
  for (int64_t b = start; b < start + length; ++b) {
    const int64_t n = lp[b] + 1;
    for (int64_t i = 0; i < n; ++i) fn(b, (b * size + i) * size + i, n - i);
  }
}

// p(l | span) = exp(x[l] - lse) for ``count`` spans (x [count, L], lse [count]) into buf
// [count L]; every label 0 for a span whose labels are all -inf (its lse -inf, shifted by 0).
template <typename scalar_t>
void label_probs(const scalar_t* x, const double* lse, int64_t count, int64_t labels,
                 double* buf) {
  for (int64_t s = 0; s < count; ++s) {
    const double norm = lse[s] > -kInf ? lse[s] : 0.0;
    for (int64_t l = 0; l < labels; ++l)
      buf[s * labels + l] = static_cast<double>(x[s * labels + l]) - norm;
  }
  exp_shifted(buf, count * labels, 0.0);
}

// The label log-sum-exp of each span, [B, N, N] double (0 outside the items' spans): per
// span log Σ_l exp(x[l]), -inf when every label is -inf, NaN where one is NaN.
Tensor cky_label_logsumexp(const Tensor& scores_in, const Tensor& last_in) {
  check_labelled(scores_in, last_in);
  const Tensor scores = scores_in.contiguous();
  const Tensor last = last_in.to(at::kLong).contiguous();
  const int64_t batch = scores.size(0), size = scores.size(1), labels = scores.size(3);
  Tensor spans = at::zeros({batch, size, size}, scores.options().dtype(at::kDouble));
  const int64_t* lp = last.data_ptr<int64_t>();
  double* out = spans.data_ptr<double>();
  const double work = static_cast<double>(batch) * size * size * labels;
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "cky_label_logsumexp", [&] {
    const scalar_t* xp = scores.data_ptr<scalar_t>();
    for_chunks(chunk_starts(batch, work), [&](int64_t, int64_t start, int64_t length) {
      std::vector<double> buf(static_cast<size_t>(size * labels)), tops(size);
      each_row(lp, size, start, length, [&](int64_t, int64_t span, int64_t count) {
        const scalar_t* x = xp + span * labels;
        for (int64_t s = 0; s < count; ++s) {  // the labels minus their largest
          double top = -kInf;
          bool nan = false;
          for (int64_t l = 0; l < labels; ++l) {
            const double v = static_cast<double>(x[s * labels + l]);
            nan = nan || std::isnan(v);
            top = v > top ? v : top;
          }
          tops[s] = nan ? std::numeric_limits<double>::quiet_NaN() : top;
          const double shift = std::isfinite(top) ? top : 0.0;
          for (int64_t l = 0; l < labels; ++l)
            buf[s * labels + l] = static_cast<double>(x[s * labels + l]) - shift;
        }
        exp_shifted(buf.data(), count * labels, 0.0);
        for (int64_t s = 0; s < count; ++s) {
          const double top = tops[s];
          if (!std::isfinite(top)) {  // -inf (every label), +inf, NaN
            out[span + s] = top;
            continue;
          }
          double total = 0.0;
          for (int64_t l = 0; l < labels; ++l) total += buf[s * labels + l];
          out[span + s] = top + std::log(total);
        }
      });
    });
  });
  return spans;
}

// scale[b] * marginals[b, i, j] * p(l | [i, j]) [B, N, N, L] in the scores' dtype: the
// labelled marginals (times the gradient of log Z when scale is it), 0 outside the spans.
Tensor cky_label_marginals(const Tensor& scores_in, const Tensor& spans_in,
                           const Tensor& marginals_in, const Tensor& scale_in,
                           const Tensor& last_in) {
  check_labelled(scores_in, last_in);
  const Tensor scores = scores_in.contiguous();
  const Tensor spans = spans_in.to(at::kDouble).contiguous();
  const Tensor marginals = marginals_in.to(at::kDouble).contiguous();
  const Tensor scale = scale_in.to(at::kDouble).contiguous();
  const Tensor last = last_in.to(at::kLong).contiguous();
  const int64_t batch = scores.size(0), size = scores.size(1), labels = scores.size(3);
  TORCH_CHECK(spans.numel() == batch * size * size && marginals.numel() == spans.numel() &&
                  scale.numel() == batch,
              "cky: label_marginals got charts of the wrong size");
  Tensor out = at::zeros_like(scores);
  const int64_t* lp = last.data_ptr<int64_t>();
  const double* sp = spans.data_ptr<double>();
  const double* mp = marginals.data_ptr<double>();
  const double* cp = scale.data_ptr<double>();
  const double work = static_cast<double>(batch) * size * size * labels;
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "cky_label_marginals", [&] {
    const scalar_t* xp = scores.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_chunks(chunk_starts(batch, work), [&](int64_t, int64_t start, int64_t length) {
      std::vector<double> buf(static_cast<size_t>(size * labels));
      each_row(lp, size, start, length, [&](int64_t b, int64_t span, int64_t count) {
        label_probs(xp + span * labels, sp + span, count, labels, buf.data());
        for (int64_t s = 0; s < count; ++s) {
          const double mu = mp[span + s] * cp[b];
          if (mu == 0.0) continue;  // 0 (also where a label's p is NaN)
          scalar_t* o = op + (span + s) * labels;
          for (int64_t l = 0; l < labels; ++l)
            o[l] = static_cast<scalar_t>(mu * buf[s * labels + l]);
        }
      });
    });
  });
  return out;
}

// Σ_l p(l | [i, j]) grad[b, i, j, l], [B, N, N] double (0 outside the spans): the direction
// of the span-level Hessian-vector product in the backward of the labelled marginals.
Tensor cky_label_contract(const Tensor& scores_in, const Tensor& spans_in,
                          const Tensor& grad_in, const Tensor& last_in) {
  check_labelled(scores_in, last_in);
  const Tensor scores = scores_in.contiguous();
  const Tensor spans = spans_in.to(at::kDouble).contiguous();
  const Tensor grad = grad_in.to(scores.scalar_type()).contiguous();
  const Tensor last = last_in.to(at::kLong).contiguous();
  const int64_t batch = scores.size(0), size = scores.size(1), labels = scores.size(3);
  TORCH_CHECK(grad.sizes() == scores.sizes(), "cky: label_contract: grad of the wrong shape");
  Tensor out = at::zeros({batch, size, size}, scores.options().dtype(at::kDouble));
  const int64_t* lp = last.data_ptr<int64_t>();
  const double* sp = spans.data_ptr<double>();
  double* op = out.data_ptr<double>();
  const double work = static_cast<double>(batch) * size * size * labels;
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "cky_label_contract", [&] {
    const scalar_t* xp = scores.data_ptr<scalar_t>();
    const scalar_t* gp = grad.data_ptr<scalar_t>();
    for_chunks(chunk_starts(batch, work), [&](int64_t, int64_t start, int64_t length) {
      std::vector<double> buf(static_cast<size_t>(size * labels));
      each_row(lp, size, start, length, [&](int64_t, int64_t span, int64_t count) {
        label_probs(xp + span * labels, sp + span, count, labels, buf.data());
        const scalar_t* g = gp + span * labels;
        for (int64_t s = 0; s < count; ++s) {
          double total = 0.0;
          for (int64_t l = 0; l < labels; ++l) {
            const double p = buf[s * labels + l];
            if (p != 0.0) total += p * static_cast<double>(g[s * labels + l]);
          }
          op[span + s] = total;
        }
      });
    });
  });
  return out;
}

// The backward of the labelled marginals M[i, j, l] = mu[i, j] p(l | [i, j]) along grad G:
// scale[b] p_l (mu (G_l - contracted) + hvp), with contracted = Σ_l p_l G_l
// (cky_label_contract) and hvp the span-level Hessian of log Z times it; [B, N, N, L] in the
// scores' dtype, 0 outside the spans.
Tensor cky_label_backward(const Tensor& scores_in, const Tensor& spans_in,
                          const Tensor& grad_in, const Tensor& contracted_in,
                          const Tensor& marginals_in, const Tensor& hvp_in,
                          const Tensor& scale_in, const Tensor& last_in) {
  check_labelled(scores_in, last_in);
  const Tensor scores = scores_in.contiguous();
  const Tensor spans = spans_in.to(at::kDouble).contiguous();
  const Tensor grad = grad_in.to(scores.scalar_type()).contiguous();
  const Tensor contracted = contracted_in.to(at::kDouble).contiguous();
  const Tensor marginals = marginals_in.to(at::kDouble).contiguous();
  const Tensor hvp = hvp_in.to(at::kDouble).contiguous();
  const Tensor scale = scale_in.to(at::kDouble).contiguous();
  const Tensor last = last_in.to(at::kLong).contiguous();
  const int64_t batch = scores.size(0), size = scores.size(1), labels = scores.size(3);
  TORCH_CHECK(grad.sizes() == scores.sizes() && spans.numel() == batch * size * size &&
                  contracted.numel() == spans.numel() && marginals.numel() == spans.numel() &&
                  hvp.numel() == spans.numel() && scale.numel() == batch,
              "cky: label_backward got charts of the wrong size");
  Tensor out = at::zeros_like(scores);
  const int64_t* lp = last.data_ptr<int64_t>();
  const double* sp = spans.data_ptr<double>();
  const double* kp = contracted.data_ptr<double>();
  const double* mp = marginals.data_ptr<double>();
  const double* hp = hvp.data_ptr<double>();
  const double* cp = scale.data_ptr<double>();
  const double work = static_cast<double>(batch) * size * size * labels;
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "cky_label_backward", [&] {
    const scalar_t* xp = scores.data_ptr<scalar_t>();
    const scalar_t* gp = grad.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_chunks(chunk_starts(batch, work), [&](int64_t, int64_t start, int64_t length) {
      std::vector<double> buf(static_cast<size_t>(size * labels));
      each_row(lp, size, start, length, [&](int64_t b, int64_t span, int64_t count) {
        label_probs(xp + span * labels, sp + span, count, labels, buf.data());
        const double c = cp[b];
        for (int64_t s = 0; s < count; ++s) {
          const int64_t e = span + s;
          const double mu = mp[e], mean = kp[e], h = hp[e];
          const scalar_t* g = gp + e * labels;
          scalar_t* o = op + e * labels;
          for (int64_t l = 0; l < labels; ++l) {
            const double p = buf[s * labels + l];
            if (p != 0.0)
              o[l] = static_cast<scalar_t>(c * p * (mu * (static_cast<double>(g[l]) - mean) + h));
          }
        }
      });
    });
  });
  return out;
}

}  // namespace

}  // namespace structattn

TORCH_LIBRARY(structattn_cky, m) {
  m.def("inside(Tensor scores, Tensor last) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("outside(Tensor inside, Tensor inner, Tensor inside_t, Tensor logz, Tensor last) "
        "-> Tensor");
  m.def("hvp(Tensor inside, Tensor inner, Tensor inside_t, Tensor logz, Tensor last, "
        "Tensor direction) -> Tensor");
  m.def("label_logsumexp(Tensor scores, Tensor last) -> Tensor");
  m.def("label_marginals(Tensor scores, Tensor spans, Tensor marginals, Tensor scale, "
        "Tensor last) -> Tensor");
  m.def("label_contract(Tensor scores, Tensor spans, Tensor grad, Tensor last) -> Tensor");
  m.def("label_backward(Tensor scores, Tensor spans, Tensor grad, Tensor contracted, "
        "Tensor marginals, Tensor hvp, Tensor scale, Tensor last) -> Tensor");
}

TORCH_LIBRARY_IMPL(structattn_cky, CPU, m) {
  m.impl("inside", &structattn::cky_inside);
  m.impl("outside", &structattn::cky_outside);
  m.impl("hvp", &structattn::cky_hvp);
  m.impl("label_logsumexp", &structattn::cky_label_logsumexp);
  m.impl("label_marginals", &structattn::cky_label_marginals);
  m.impl("label_contract", &structattn::cky_label_contract);
  m.impl("label_backward", &structattn::cky_label_backward);
}
