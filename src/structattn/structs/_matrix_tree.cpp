// The LU path of the matrix-tree theorem for non-projective trees (_lu_path in
// nonprojective.py: read the comments there), in ATen with the batch split into one chunk
// per thread. The inverse of the Laplacians is either LAPACK's (LU, then a solve with the
// identity: a sequential loop of small calls over the batch) or Gauss-Jordan elimination
// with the same partial pivoting, written here for kLanes matrices at once, one in each
// lane of a SIMD vector (so every matrix size vectorises the same way), faster than the
// LAPACK calls for a batch of small matrices (measured: benchmarks/README.md, "Figures
// behind the thresholds in structs/").
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "_kernels.h"

// GCC and clang vector extensions; on x86-64 Linux with GCC >= 12 the elimination is
// compiled for AVX-512, AVX2 and baseline x86-64 and the loader picks one for the CPU
#if defined(__GNUC__)
#define STRUCTATTN_GAUSS_JORDAN 1  // STRUCTATTN_CLONES: _kernels.h
#endif

namespace structattn {
namespace {

using at::Tensor;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

#ifdef STRUCTATTN_GAUSS_JORDAN
constexpr int64_t kLanes = 8;
// kLanes doubles, one per matrix (one AVX-512 register, two AVX2 ones); aligned(8): loads
// and stores may not assume 64-byte alignment (the AVX-512 clone crashed without it)
typedef double Lanes __attribute__((vector_size(kLanes * sizeof(double)), aligned(8)));

// x[lane] <-> y[lane] (clang binds no reference to a vector element, so no std::swap)
inline void swap_lane(Lanes& x, Lanes& y, int64_t lane) {
  const double t = x[lane];
  x[lane] = y[lane];
  y[lane] = t;
}

// In place, kLanes matrices a[i * n + j][lane] -> their inverses by Gauss-Jordan elimination
// with partial pivoting (the pivots an LU with partial pivoting chooses, the same as
// LAPACK's but for rounding near ties; their log-magnitudes are added to logdet[lane]);
// swaps [n * kLanes] is scratch. A zero pivot (a singular matrix) leaves inf or NaN
// entries, which the caller's condition-number test rejects.
// The row operations compute on the kLanes lanes as kLanes / P native vectors of P doubles
// (P = 8 on x86-64-v4, 4 on x86-64-v3, 2 on baseline x86-64: one instantiation per target,
// below), each a register: on a Lanes (512 bits) without AVX-512, GCC moved every result
// through the stack and stored it back in 16-byte pieces, which made the v3 and baseline
// clones about twice as slow as the v4 clone (#42; the fused Eisner loops had the same
// trouble: _eisner.cpp, Pack).
template <int P>
__attribute__((always_inline)) inline void gauss_jordan_lanes(Lanes* a, int64_t n,
                                                              double* logdet, int64_t* swaps) {
  typedef double Part __attribute__((vector_size(P * sizeof(double)), aligned(8)));
  constexpr int kParts = kLanes / P;
  // part q of element e of the matrix (a vector of doubles may alias the doubles of a Lanes:
  // GCC's and clang's vector types take the alias set of their element type)
  double* base = reinterpret_cast<double*>(a);
  auto part = [base](int64_t e, int q) -> Part& {
    return *reinterpret_cast<Part*>(base + e * kLanes + q * P);
  };
  for (int64_t k = 0; k < n; ++k) {
    Lanes* row = a + k * n;
    for (int64_t lane = 0; lane < kLanes; ++lane) {  // pivot: largest |a[i][k]|, i >= k
      int64_t p = k;
      double best = std::abs(row[k][lane]);
      for (int64_t i = k + 1; i < n; ++i) {
        const double v = std::abs(a[i * n + k][lane]);
        if (v > best) {
          best = v;
          p = i;
        }
      }
      swaps[k * kLanes + lane] = p;
      for (int64_t j = 0; p != k && j < n; ++j) swap_lane(row[j], a[p * n + j], lane);
      logdet[lane] += std::log(std::abs(row[k][lane]));
    }
    const int64_t pivot = k * n;  // row k's first element
    Part scale[kParts];
#pragma GCC unroll 8
    for (int q = 0; q < kParts; ++q) {
      scale[q] = 1.0 / part(pivot + k, q);
      part(pivot + k, q) = Part{} + 1.0;  // the pivot's column becomes that of the inverse
    }
    for (int64_t j = 0; j < n; ++j) {
#pragma GCC unroll 8
      for (int q = 0; q < kParts; ++q) part(pivot + j, q) *= scale[q];
    }
    for (int64_t i = 0; i < n; ++i) {
      if (i == k) continue;
      const int64_t other = i * n;
      Part factor[kParts];
#pragma GCC unroll 8
      for (int q = 0; q < kParts; ++q) {
        factor[q] = part(other + k, q);
        part(other + k, q) = Part{};
      }
      for (int64_t j = 0; j < n; ++j) {
#pragma GCC unroll 8
        for (int q = 0; q < kParts; ++q) part(other + j, q) -= factor[q] * part(pivot + j, q);
      }
    }
  }
  for (int64_t k = n - 1; k >= 0; --k) {  // the row swaps become column swaps of the inverse
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const int64_t p = swaps[k * kLanes + lane];
      for (int64_t i = 0; p != k && i < n; ++i) swap_lane(a[i * n + k], a[i * n + p], lane);
    }
  }
}

// gauss_jordan_lanes with the width of the target the CPU runs (_kernels.h)
STRUCTATTN_PER_TARGET(gauss_jordan, (Lanes * a, int64_t n, double* logdet, int64_t* swaps),
                      (a, n, logdet, swaps))

// The Laplacians of ``weights`` [B, N, n] (as in _laplacian of nonprojective.py; ``padding``
// [B, n] or nullptr: 1 at padding words), inverted kLanes at a time (the last group padded
// with identities) in the calling thread: writes inverse [B, n, n] float64, logdet [B]
// (log|det L|) and cond [B] (the 1-norm condition number bound ||L^-1||_1 * max column sum)
template <typename scalar_t>
void laplacian_inverse(const scalar_t* weights, const bool* padding, int64_t batch, int64_t n,
                       bool multiroot, double* inverse, double* logdet, double* cond) {
  const int64_t area = n * n, stride = (n + 1) * n;  // one item of inverse, of weights
  std::vector<Lanes> a(area);
  std::vector<int64_t> swaps(n * kLanes);
  for (int64_t first = 0; first < batch; first += kLanes) {
    const int64_t count = std::min(kLanes, batch - first);
    double norm[kLanes] = {}, sums[kLanes] = {};
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      if (lane >= count) {  // an identity
        for (int64_t e = 0; e < area; ++e) a[e][lane] = (e % (n + 1) == 0);
        continue;
      }
      const scalar_t* w = weights + (first + lane) * stride;  // w[h * n + m]: h -> word m + 1
      const bool* pad = padding ? padding + (first + lane) * n : nullptr;
      for (int64_t h = 1; h <= n; ++h) {
        for (int64_t m = 0; m < n; ++m) a[(h - 1) * n + m][lane] = -double(w[h * n + m]);
      }
      for (int64_t m = 0; m < n; ++m) {  // the diagonal: column sums (a self loop weighs 0)
        double incoming = pad && pad[m] ? 1.0 : 0.0;
        for (int64_t h = multiroot ? 0 : 1; h <= n; ++h) incoming += double(w[h * n + m]);
        a[m * n + m][lane] += incoming;
        norm[lane] = std::max(norm[lane], multiroot ? incoming : incoming + double(w[m]));
      }
      if (!multiroot) {
        for (int64_t m = 0; m < n; ++m) a[m][lane] = double(w[m]);  // first row := rho
      }
    }
    gauss_jordan(a.data(), n, sums, swaps.data());
    for (int64_t lane = 0; lane < count; ++lane) {
      double* out = inverse + (first + lane) * area;
      for (int64_t e = 0; e < area; ++e) out[e] = a[e][lane];
      double largest = 0.0;  // ||L^-1||_1: the largest column sum of |L^-1| (NaN/inf if singular)
      for (int64_t m = 0; m < n; ++m) {
        double column = 0.0;
        for (int64_t h = 0; h < n; ++h) column += std::abs(out[h * n + m]);
        largest = std::isnan(column) || std::isnan(largest) ? kNaN : std::max(largest, column);
      }
      logdet[first + lane] = sums[lane];
      cond[first + lane] = largest * norm[lane];
    }
  }
}
#endif

c10::optional<Tensor> narrow(const c10::optional<Tensor>& x, int64_t start, int64_t length) {
  if (!x) return c10::nullopt;
  return x->narrow(0, start, length);
}

// (inverse [B, n, n] float64, log|det| [B], condition bound [B]) of the Laplacians of
// ``weights`` [B, N, n] by LAPACK: an LU, then a solve with the identity
std::tuple<Tensor, Tensor, Tensor> lapack_inverse(const Tensor& weights,
                                                  const c10::optional<Tensor>& real,
                                                  bool multiroot) {
  const int64_t words = weights.size(2);
  Tensor lap = weights.narrow(1, 1, words)
                   .to(at::kDouble, false, true, at::MemoryFormat::Contiguous)
                   .neg_();  // [B, n, n]
  Tensor incoming = (multiroot ? weights : weights.narrow(1, 1, words))
                        .sum({1}, false, at::kDouble);  // [B, n]
  if (real) incoming.add_(real->narrow(1, 1, words).logical_not());
  lap.diagonal(0, 1, 2).add_(incoming);
  if (!multiroot) lap.select(1, 0).copy_(weights.select(1, 0));  // first row := rho
  auto [factor, pivots, info] = at::linalg_lu_factor_ex(lap);
  Tensor eye = at::eye(words, lap.options());
  Tensor inverse = at::linalg_lu_solve(factor, pivots, eye.expand_as(lap));
  Tensor logdet = factor.diagonal(0, 1, 2).abs().log_().sum(-1);
  Tensor norm = multiroot ? incoming : incoming + weights.select(1, 0);
  Tensor cond = inverse.abs().sum(1).amax(-1).mul_(norm.amax(-1));  // NaN/inf if singular
  return {inverse, logdet, cond};
}

// How many leading items of a chunk of ``batch`` Laplacians of n words Gauss-Jordan inverts;
// the rest go to LAPACK. Method 1: all; 2: none; 0: every full group of kLanes, and the
// last, partial group if it holds at least 1 + n / 20 items (a group costs the same however
// many of its lanes are used: the break-even item counts are measured, see
// benchmarks/README.md), and none above n = 384 (there its 64 n^2 bytes, streamed once per
// pivot, outgrow the caches and LAPACK wins).
int64_t gauss_jordan_items(int64_t method, int64_t batch, int64_t n) {
#ifdef STRUCTATTN_GAUSS_JORDAN
  if (method != 0) return method == 1 ? batch : 0;
  if (n > 384) return 0;
  const int64_t full = batch / kLanes * kLanes;
  return batch - full >= std::min<int64_t>(kLanes, 1 + n / 20) ? batch : full;
#else
  TORCH_CHECK(method != 1, "Gauss-Jordan inversion is not compiled in (needs GCC or clang)");
  return 0;
#endif
}

// Up to this many words the weights and the marginals are formed in one loop each
// (shifted_scores, fused_marginals) instead of several ATen ops: faster for small n, slower
// from about n = 39 on (the loop reads Y by columns; timings in benchmarks/README.md);
// above it the ATen ops are kept
constexpr int64_t kFusedWords = 32;

// One pass over ``scores`` [B, N, N] (contiguous) for the weights before their exp: writes
// out [B, N, n] = the scores of the arcs into the words (-inf at self loops and at arcs
// touching padding, ``real`` [B, N] or nullptr) minus their column's largest value (NaN in a
// column: 0; +inf: the largest finite value; no arc: 0, as nan_to_num), and each item's sum
// of those shifts into shift_sum [B] (float64); the ATen ops of the unfused path, in one loop
template <typename scalar_t>
void shifted_scores(const scalar_t* scores, const bool* real, int64_t batch, int64_t size,
                    scalar_t* out, double* shift_sum) {
  const int64_t words = size - 1;
  const scalar_t neg_inf = -std::numeric_limits<scalar_t>::infinity();
  std::vector<scalar_t> shift(words);
  std::vector<char> nan(words);
  for (int64_t b = 0; b < batch; ++b) {
    const scalar_t* s = scores + b * size * size;
    const bool* r = real ? real + b * size : nullptr;
    scalar_t* w = out + b * size * words;
    std::fill(nan.begin(), nan.end(), 0);
    std::fill(shift.begin(), shift.end(), neg_inf);
    for (int64_t h = 0; h < size; ++h) {
      for (int64_t m = 0; m < words; ++m) {
        const bool arc = h != m + 1 && (!r || (r[h] && r[m + 1]));
        const scalar_t v = arc ? s[h * size + m + 1] : neg_inf;
        w[h * words + m] = v;
        if (std::isnan(v)) {
          nan[m] = 1;
        } else if (v > shift[m]) {
          shift[m] = v;
        }
      }
    }
    double total = 0.0;
    for (int64_t m = 0; m < words; ++m) {
      if (nan[m] || shift[m] == neg_inf) {
        shift[m] = 0;
      } else if (std::isinf(shift[m])) {
        shift[m] = std::numeric_limits<scalar_t>::max();
      }
      total += double(shift[m]);
    }
    for (int64_t h = 0; h < size; ++h) {
      for (int64_t m = 0; m < words; ++m) w[h * words + m] -= shift[m];
    }
    shift_sum[b] = total;
  }
}

// (log Z or an empty tensor, weights [B, N, n], inverse [B, n, n] float64, keep [B], the
// condition number bound [B] float64)
std::vector<Tensor> lu_path(const Tensor& scores, const c10::optional<Tensor>& real,
                            bool multiroot, double max_cond, bool need_logz, int64_t method) {
  const int64_t batch = scores.size(0), size = scores.size(1), words = size - 1;
  const auto dtype = at::promote_types(scores.scalar_type(), at::kFloat);
  Tensor weights = at::empty({batch, size, words}, scores.options().dtype(dtype));
  Tensor shift_sum = at::empty({batch}, scores.options().dtype(at::kDouble));
  if (scores.scalar_type() == dtype && words <= kFusedWords) {  // one fused pass
    const Tensor input = scores.contiguous();
    const Tensor mask = real ? real->contiguous() : Tensor();
    AT_DISPATCH_FLOATING_TYPES(dtype, "matrix_tree_weights", [&] {
      shifted_scores<scalar_t>(input.data_ptr<scalar_t>(), real ? mask.data_ptr<bool>() : nullptr,
                               batch, size, weights.data_ptr<scalar_t>(),
                               shift_sum.data_ptr<double>());
    });
  } else {  // the same in ATen ops (half precision scores, many words)
    weights.copy_(scores.narrow(2, 1, words));
    weights.diagonal(-1, 1, 2).fill_(kNegInf);  // self loops: weights[:, m, m - 1]
    if (real) {
      const Tensor& r = *real;
      weights.masked_fill_(
          (r.unsqueeze(-1) & r.narrow(1, 1, words).unsqueeze(1)).logical_not(), kNegInf);
    }
    Tensor shift = weights.amax({1}, true);  // [B, 1, n]
    shift.nan_to_num_(0.0, c10::nullopt, 0.0);
    weights.sub_(shift);
    shift_sum.copy_(shift.sum({1, 2}, false, at::kDouble));
  }
  weights.exp_();
  Tensor inverse = at::empty({batch, words, words}, scores.options().dtype(at::kDouble));
  Tensor logdet = at::empty({batch}, inverse.options());
  Tensor cond = at::empty({batch}, inverse.options());
  const int64_t split = gauss_jordan_items(method, batch, words);  // [0, split): Gauss-Jordan
#ifdef STRUCTATTN_GAUSS_JORDAN
  if (split > 0) {
    const Tensor padding =
        real ? real->narrow(1, 1, words).logical_not().contiguous() : Tensor();
    AT_DISPATCH_FLOATING_TYPES(dtype, "matrix_tree_lu", [&] {
      laplacian_inverse<scalar_t>(weights.data_ptr<scalar_t>(),
                                  real ? padding.data_ptr<bool>() : nullptr, split, words,
                                  multiroot, inverse.data_ptr<double>(),
                                  logdet.data_ptr<double>(), cond.data_ptr<double>());
    });
  }
#endif
  if (split < batch) {
    const int64_t rest = batch - split;
    auto [inv, det, bound] = lapack_inverse(
        weights.narrow(0, split, rest), narrow(real, split, rest), multiroot);
    inverse.narrow(0, split, rest).copy_(inv);
    logdet.narrow(0, split, rest).copy_(det);
    cond.narrow(0, split, rest).copy_(bound);
  }
  Tensor keep = cond.le(max_cond / 2);  // ||L||_1 <= 2 max column sum; NaN, inf: not kept
  Tensor logz = need_logz ? logdet.add_(shift_sum)
                          : at::empty({0}, inverse.options());
  return {logz, weights, inverse, keep, cond};
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

// marginals (below) in one loop: out [B, N, N] (contiguous, column 0 zeroed here) from
// weights [B, N, n] (contiguous), the inverse Y [B, n, n] and scale [B] or nullptr; each
// entry is W[h, m] * Phi*(Y^T)[h, m] as adjoint_coefficients defines it, the coefficient
// rounded to the weights' dtype before the product, as the unfused ops do
template <typename scalar_t>
void fused_marginals(const scalar_t* weights, const double* inverse, const scalar_t* scale,
                     int64_t batch, int64_t words, bool multiroot, scalar_t* out) {
  const int64_t size = words + 1;
  for (int64_t b = 0; b < batch; ++b) {
    const scalar_t* w = weights + b * size * words;
    const double* y = inverse + b * words * words;  // y[i * words + j] = Y_ij
    scalar_t* o = out + b * size * size;
    const double factor = scale ? double(scale[b]) : 1.0;
    for (int64_t h = 0; h < size; ++h) {
      o[h * size] = scalar_t(0);
      for (int64_t m = 0; m < words; ++m) {
        const double diag = y[m * words + m];
        double coef;
        if (h == 0) {
          coef = multiroot ? diag : y[m * words];  // root arcs: Y_mm or Y_m1
        } else if (!multiroot && h == 1) {
          coef = diag;  // one root: arcs from word 1 have no Y_mh term
        } else if (!multiroot && m == 0) {
          coef = (diag - y[h - 1]) - diag;  // one root, into word 1: Y_11 - Y_1h - Y_11
        } else {
          coef = diag - y[m * words + h - 1];  // arcs between words: Y_mm - Y_mh
        }
        if (scale) coef *= factor;
        o[h * size + m + 1] = w[h * words + m] * scalar_t(coef);
      }
    }
  }
}

// marginals [B, N, N] (times scale [B] if given) from the weights and the inverse
Tensor marginals(const Tensor& scores, const Tensor& weights, const Tensor& inverse,
                 bool multiroot, const c10::optional<Tensor>& scale) {
  const auto dtype = weights.scalar_type();
  const int64_t words = weights.size(2);
  if ((dtype == at::kFloat || dtype == at::kDouble) && scores.scalar_type() == dtype &&
      (!scale || scale->scalar_type() == dtype) && words <= kFusedWords) {  // one fused pass
    Tensor out = at::empty({weights.size(0), words + 1, words + 1}, scores.options());
    const Tensor w = weights.contiguous(), y = inverse.contiguous();
    const Tensor factor = scale ? scale->contiguous() : Tensor();
    AT_DISPATCH_FLOATING_TYPES(dtype, "matrix_tree_marginals", [&] {
      fused_marginals<scalar_t>(w.data_ptr<scalar_t>(), y.data_ptr<double>(),
                                scale ? factor.data_ptr<scalar_t>() : nullptr, w.size(0), words,
                                multiroot, out.data_ptr<scalar_t>());
    });
    return out;
  }
  Tensor coef = adjoint_coefficients(inverse, multiroot);
  if (scale) coef.mul_(scale->view({-1, 1, 1}));
  Tensor out = at::zeros_like(scores);
  Tensor arcs = out.narrow(2, 1, words);
  at::mul_out(arcs, weights, coef.to(weights.scalar_type()));
  return out;
}

// d loss / d scores = G * mu - W * Phi*((Y A Y)^T), A = Phi(G * W) (first order), computed
// in ``dtype`` (see _marginals_backward in nonprojective.py)
Tensor marginals_backward(const Tensor& grad, const Tensor& weights_in, const Tensor& inverse,
                          const Tensor& marginals, bool multiroot, at::ScalarType dtype) {
  const int64_t words = weights_in.size(2);
  const Tensor weights = weights_in.to(dtype);
  Tensor scaled = grad.narrow(2, 1, words).to(dtype) * weights;  // [B, N, n]
  Tensor lap = scaled.narrow(1, 1, words).neg();                 // [B, n, n]
  lap.diagonal(0, 1, 2).add_((multiroot ? scaled : scaled.narrow(1, 1, words)).sum(1));
  if (!multiroot && words > 0) lap.select(1, 0).copy_(scaled.select(1, 0));
  Tensor inv = inverse.to(dtype);
  Tensor coef = adjoint_coefficients(at::bmm(at::bmm(inv, lap), inv), multiroot);
  Tensor out = grad.to(dtype) * marginals.to(dtype);
  out.narrow(2, 1, words).sub_(coef.mul_(weights));
  return out.to(grad.scalar_type());
}

// The same in the weights' dtype, then again in float64 for the items marked ``precise``
// (ill-conditioned: float32 matmuls would lose about cond * 1e-8 of the gradient's scale)
Tensor marginals_backward_mixed(const Tensor& grad, const Tensor& weights, const Tensor& inverse,
                                const Tensor& marginals, bool multiroot,
                                const c10::optional<Tensor>& precise) {
  Tensor out =
      marginals_backward(grad, weights, inverse, marginals, multiroot, weights.scalar_type());
  if (!precise || weights.scalar_type() == at::kDouble) return out;
  const Tensor index = precise->nonzero().squeeze(1);
  if (index.numel() == 0) return out;
  const auto pick = [&](const Tensor& t) { return t.index_select(0, index); };
  return out.index_copy_(0, index, marginals_backward(pick(grad), pick(weights), pick(inverse),
                                                      pick(marginals), multiroot, at::kDouble));
}

// about the multiply-adds of an inversion per item, B n^3, for chunk_starts
double work(const Tensor& scores) {
  const double n = static_cast<double>(scores.size(1) - 1);
  return static_cast<double>(scores.size(0)) * n * n * n;
}

// ---- Chu-Liu-Edmonds (the heads of _max_arborescence in nonprojective.py) -------------------
// Arc weights are lexicographic (rank, score) pairs: rank counts penalties (a -inf arc, and a
// root child when one is required), score the arc scores; pairs add and subtract
// component-wise and compare rank first, so the best arborescence has the fewest penalties,
// then the best score (a totally ordered group: Edmonds' algorithm is exact on it).
struct Weight {
  int64_t rank = 0;
  double score = 0.0;
  bool operator<(const Weight& o) const {
    return rank < o.rank || (rank == o.rank && score < o.score);
  }
  Weight operator-(const Weight& o) const { return {rank - o.rank, score - o.score}; }
};

// Heads of the best arborescence rooted at node 0 over nodes 0..n-1, w[h * n + m] the weight
// of h -> m (m >= 1, h != m; every such arc exists). Recursive contraction of one cycle at a
// time: O(n^2) per level, at most n - 1 levels; a level frees its input before recursing.
std::vector<int64_t> arborescence(std::vector<Weight> w, int64_t n) {
  std::vector<int64_t> head(n, -1);
  for (int64_t m = 1; m < n; ++m) {  // the best incoming arc of every node (first on ties)
    int64_t best = 0;
    for (int64_t h = 1; h < n; ++h) {
      if (h != m && w[best * n + m] < w[h * n + m]) best = h;
    }
    head[m] = best;
  }
  std::vector<int64_t> mark(n, -1), cycle;  // one cycle of the greedy heads, if any
  for (int64_t start = 1; start < n && cycle.empty(); ++start) {
    int64_t v = start;
    while (v != 0 && mark[v] == -1) {
      mark[v] = start;
      v = head[v];
    }
    if (v != 0 && mark[v] == start) {  // came back into this walk: v is on a cycle
      int64_t u = v;
      do {
        cycle.push_back(u);
        u = head[u];
      } while (u != v);
    }
  }
  if (cycle.empty()) return head;
  // contract the cycle into one node: the other nodes keep their order, the cycle comes last
  std::vector<char> on(n, 0);
  for (int64_t v : cycle) on[v] = 1;
  std::vector<int64_t> node;  // contracted id -> original node (the cycle is id c)
  for (int64_t v = 0; v < n; ++v) {
    if (!on[v]) node.push_back(v);
  }
  const int64_t c = static_cast<int64_t>(node.size()), k = c + 1;
  std::vector<Weight> sub(k * k);
  std::vector<int64_t> enters(k, -1), leaves(k, -1);  // the cycle member behind each super-arc
  for (int64_t a = 0; a < c; ++a) {
    for (int64_t b = 1; b < c; ++b) {
      if (a != b) sub[a * k + b] = w[node[a] * n + node[b]];
    }
  }
  for (int64_t a = 0; a < c; ++a) {  // a -> cycle: the best w[a, v] - w[head[v], v]
    const int64_t u = node[a];
    for (int64_t v : cycle) {
      const Weight x = w[u * n + v] - w[head[v] * n + v];
      if (enters[a] < 0 || sub[a * k + c] < x) {
        sub[a * k + c] = x;
        enters[a] = v;
      }
    }
  }
  for (int64_t b = 1; b < c; ++b) {  // cycle -> b: the best w[v, b]
    const int64_t m = node[b];
    for (int64_t v : cycle) {
      if (leaves[b] < 0 || sub[c * k + b] < w[v * n + m]) {
        sub[c * k + b] = w[v * n + m];
        leaves[b] = v;
      }
    }
  }
  std::vector<Weight>().swap(w);  // not needed below: at most two levels' weights held
  const std::vector<int64_t> inner = arborescence(std::move(sub), k);
  std::vector<int64_t> out(head);  // cycle members keep their cycle arcs but one
  for (int64_t b = 1; b < c; ++b) {
    const int64_t h = inner[b];
    out[node[b]] = h == c ? leaves[b] : node[h];
  }
  const int64_t from = inner[c];  // the arc into the cycle replaces its member's cycle arc
  out[enters[from]] = node[from];
  return out;
}

// heads [B, N] (-1 at ROOT and padding) of _max_arborescence for (rank, score) [B, N, N]
// (read at the real positions only: h, m < length, h != m, m >= 1) and lengths [B]
template <typename scalar_t>
void max_arborescences(const int64_t* rank, const scalar_t* score, const int64_t* lengths,
                       int64_t batch, int64_t size, int64_t* heads) {
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = lengths[b], plane = b * size * size;
    int64_t* out = heads + b * size;
    std::fill(out, out + size, -1);
    if (n < 2) continue;
    std::vector<Weight> w(n * n);
    for (int64_t h = 0; h < n; ++h) {
      for (int64_t m = 1; m < n; ++m) {
        if (h != m) w[h * n + m] = {rank[plane + h * size + m], double(score[plane + h * size + m])};
      }
    }
    const std::vector<int64_t> head = arborescence(std::move(w), n);
    for (int64_t m = 1; m < n; ++m) out[m] = head[m];
  }
}

}  // namespace

Tensor max_arborescence(const Tensor& rank, const Tensor& score, const Tensor& lengths) {
  TORCH_CHECK(rank.dim() == 3 && rank.size(1) == rank.size(2) && rank.sizes() == score.sizes(),
              "rank and score must be [B, N, N]");
  TORCH_CHECK(rank.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong,
              "rank and lengths must be int64");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == rank.size(0), "lengths must be [B]");
  TORCH_CHECK(rank.device().is_cpu(), "max_arborescence: CPU tensors only");
  const int64_t batch = rank.size(0), size = rank.size(1);
  const Tensor r = rank.contiguous(), ends = lengths.contiguous();
  TORCH_CHECK(batch == 0 || (ends.min().item<int64_t>() >= 0 && ends.max().item<int64_t>() <= size),
              "lengths must be in 0..N");
  const Tensor sc = score.scalar_type() == at::kFloat ? score.contiguous()
                                                       : score.to(at::kDouble).contiguous();
  Tensor heads = at::empty({batch, size}, r.options());
  const std::vector<int64_t> starts = chunk_starts(batch, work(rank));  // O(n^3) per item at worst
  for_chunks(starts, [&](int64_t, int64_t start, int64_t length) {
    AT_DISPATCH_FLOATING_TYPES(sc.scalar_type(), "max_arborescence", [&] {
      max_arborescences<scalar_t>(r.data_ptr<int64_t>() + start * size * size,
                                  sc.data_ptr<scalar_t>() + start * size * size,
                                  ends.data_ptr<int64_t>() + start, length, size,
                                  heads.data_ptr<int64_t>() + start * size);
    });
  });
  return heads;
}

Tensor matrix_tree_marginals(const Tensor& scores, const Tensor& weights, const Tensor& inverse,
                             bool multiroot, const c10::optional<Tensor>& scale) {
  const std::vector<int64_t> starts = chunk_starts(scores.size(0), work(scores));
  return chunked(starts, [&](int64_t, int64_t start, int64_t length) {
    return marginals(scores.narrow(0, start, length), weights.narrow(0, start, length),
                     inverse.narrow(0, start, length), multiroot, narrow(scale, start, length));
  });
}

Tensor matrix_tree_marginals_backward(const Tensor& grad, const Tensor& weights,
                                      const Tensor& inverse, const Tensor& marginals,
                                      bool multiroot, const c10::optional<Tensor>& precise) {
  const std::vector<int64_t> starts = chunk_starts(grad.size(0), work(grad));
  return chunked(starts, [&](int64_t, int64_t start, int64_t length) {
    return marginals_backward_mixed(
        grad.narrow(0, start, length), weights.narrow(0, start, length),
        inverse.narrow(0, start, length), marginals.narrow(0, start, length), multiroot,
        narrow(precise, start, length));
  });
}

// (log Z or empty, weights, inverse, keep, precise = keep & (cond > precise_cond), every item
// kept, any item precise): the flags are read here, so that Python needs no host sync
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, bool, bool> matrix_tree_lu(
    const Tensor& scores, const c10::optional<Tensor>& real, bool multiroot, double max_cond,
    bool need_logz, int64_t method, double precise_cond) {
  TORCH_CHECK(scores.dim() == 3 && scores.size(1) == scores.size(2), "scores must be [B, N, N]");
  TORCH_CHECK(method >= 0 && method <= 2, "method must be 0 (auto), 1 or 2");
  TORCH_CHECK(scores.device().is_cpu(), "matrix_tree_lu: CPU tensors only");
  TORCH_CHECK(!real || (real->scalar_type() == at::kBool && real->dim() == 2 &&
                        real->size(0) == scores.size(0) && real->size(1) == scores.size(1)),
              "real must be a bool mask [B, N] like the scores' first two dimensions");
  const std::vector<int64_t> starts = chunk_starts(scores.size(0), work(scores));
  std::vector<std::vector<Tensor>> parts(starts.size() - 1);
  for_chunks(starts, [&](int64_t i, int64_t start, int64_t length) {
    parts[i] = lu_path(scores.narrow(0, start, length), narrow(real, start, length), multiroot,
                       max_cond, need_logz, method);
  });
  std::vector<Tensor> out;
  for (size_t k = 0; k < 5; ++k) {
    std::vector<Tensor> pieces;
    for (const auto& p : parts) pieces.push_back(p[k]);
    out.push_back(k == 0 && !need_logz ? pieces[0] : cat_chunks(pieces));
  }
  const Tensor keep = out[3].contiguous(), cond = out[4].contiguous();
  Tensor precise = at::empty_like(keep);
  const bool* kept = keep.data_ptr<bool>();
  const double* bound = cond.data_ptr<double>();
  bool* fine = precise.data_ptr<bool>();
  bool all_kept = true, any_precise = false;
  for (int64_t b = 0; b < keep.numel(); ++b) {
    fine[b] = kept[b] && bound[b] > precise_cond;
    all_kept = all_kept && kept[b];
    any_precise = any_precise || fine[b];
  }
  return {out[0], out[1], out[2], keep, precise, all_kept, any_precise};
}

void bind_matrix_tree(pybind11::module& m) {
  m.def("matrix_tree_lu", &matrix_tree_lu,
        "(log Z or empty, weights, inverse, keep, precise, all kept, any precise): the LU path "
        "of nonprojective.py",
        pybind11::arg("scores"), pybind11::arg("real"), pybind11::arg("multiroot"),
        pybind11::arg("max_cond"), pybind11::arg("need_logz"), pybind11::arg("method") = 0,
        pybind11::arg("precise_cond") = std::numeric_limits<double>::infinity(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("max_arborescence", &max_arborescence,
        "heads [B, N] of the best arborescence for lexicographic (rank, score) arc weights "
        "(Chu-Liu-Edmonds per item; -1 at ROOT and padding)",
        pybind11::arg("rank"), pybind11::arg("score"), pybind11::arg("lengths"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("matrix_tree_marginals", &matrix_tree_marginals,
        "marginals [B, N, N] (times scale [B]) from the weights and inverse Laplacian",
        pybind11::arg("scores"), pybind11::arg("weights"), pybind11::arg("inverse"),
        pybind11::arg("multiroot"), pybind11::arg("scale"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("matrix_tree_marginals_backward", &matrix_tree_marginals_backward,
        "first-order backward of the marginals (closed form, two batched matmuls; float64 for "
        "the items marked precise)",
        pybind11::arg("grad"), pybind11::arg("weights"), pybind11::arg("inverse"),
        pybind11::arg("marginals"), pybind11::arg("multiroot"), pybind11::arg("precise"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace structattn
