// Forward-backward and its Hessian-vector product for linear chains with few labels: the
// log-space form of linear_chain.py (read the comments there), with
//   K_i(a, c) = p(z_i = a | z_{i+1} = c) = exp(alpha_i(a) + pairwise_i(a, c) - pre_{i+1}(c)),
//   â = V = 1, and β̂_i = p(z_i) (the backward sweep of the conditionals from ω = p(z_{L-1})),
// written as one sequential loop per chain (every position's C^2 terms in registers) instead
// of a few batched tensor operations per position, which dominate at small C and N (the
// segmentation heads of a Transformer: thousands of two-state chains of length ~20). Exact
// for any potentials (-inf included: alpha is kept shifted to max 0, as in _log_pass), in
// double precision inside for float32 and float64 inputs. The batch is split into one chunk
// per thread (for_chunks in _kernels.h). Built on first use by _extension.py.
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "_kernels.h"

namespace structattn {
namespace {

using at::Tensor;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kLn2 = 0.6931471805599453094;

// Strides of the transitions [B, N-1, C, C] (0 where they are shared).
struct Strides {
  int64_t b, i, a, c;
};

enum class Outcome { kDone, kDead, kLogSpace };

// Scratch of one chunk: alpha, next, e [C] each, and the exponentials of the last step's
// transitions (memo: items and steps with equal transitions, such as a shared matrix or one
// per attention head, reuse them).
template <typename scalar_t>
struct Scratch {
  std::vector<double> buf;
  double *alpha, *next, *e;  // alpha_i - m_i (log space) or â_i; the next position's; terms
  std::vector<scalar_t> raw;  // the transitions [C, C] whose exponentials are in ``exps``
  std::vector<double> exps;   // exp(raw - shift)
  double shift = 0.0;
  bool valid = false;

  explicit Scratch(int64_t c) : buf(3 * c), raw(c * c), exps(c * c) {
    alpha = buf.data();
    next = alpha + c;
    e = next + c;
  }
};

// Probability space (Rabiner's scaling, normalised at every position, double precision):
//   â_0 = U_0 / n_0,  â_{i+1}(d) = Σ_a â_i(a) E_i(a, d) U_{i+1}(d) / n_{i+1},  n = the sum,
//   K_i(a, d) = â_i(a) E_i(a, d) / Σ_a' â_i(a') E_i(a', d),
//   log Z = Σ_{i<L} (t_i + log n_i) + Σ_{i<L-1} m_i,
// with U_i = exp(unary_i - t_i), t_i the largest unary, and E_i = exp(pairwise_i - m_i), m_i
// the largest transition. Exact when every step's transitions are finite and spread at most
// ``bound`` (_scaled_steps in linear_chain.py with one step between normalisations: nothing
// that matters can underflow); otherwise kLogSpace (nothing written but K's first steps).
// On kDone, ω = â_{L-1} is in s.next.
template <typename scalar_t, int kC>
Outcome scaled_chain(const scalar_t* u, const scalar_t* p, Strides ps, int64_t len, int64_t c,
                     double bound, Scratch<scalar_t>& s, double* K, double& logz) {
  const int64_t C = kC > 0 ? kC : c;
  double* alpha = s.alpha;
  double* e = s.e;
  // U_i into e, its top t_i into top; false if every label is -inf
  auto potentials = [&](const scalar_t* un, double& top) {
    top = -kInf;
    int64_t arg = 0;
    for (int64_t d = 0; d < C; ++d)
      if (un[d] > top) top = un[d], arg = d;
    if (top == -kInf) return false;
    for (int64_t d = 0; d < C; ++d) e[d] = d == arg ? 1.0 : std::exp(un[d] - top);
    return true;
  };
  double top = 0.0, sum = 0.0;
  if (!potentials(u, top)) return Outcome::kDead;
  double total = top;
  for (int64_t a = 0; a < C; ++a) sum += e[a];
  for (int64_t a = 0; a < C; ++a) alpha[a] = e[a] / sum;
  double scale = sum;  // Π n_i = scale 2^power
  int power = 0;
  for (int64_t i = 0; i + 1 < len; ++i) {
    const scalar_t* pi = p + i * ps.i;
    bool same = s.valid;  // a matrix shared by every item and step (strides 0): no compare
    for (int64_t a = 0; a < C && same && (ps.b != 0 || ps.i != 0); ++a)
      for (int64_t d = 0; d < C; ++d) same = same && pi[a * ps.a + d * ps.c] == s.raw[a * C + d];
    if (!same) {  // E_i = exp(pairwise_i - m_i)
      double hi = -kInf, lo = kInf;
      for (int64_t a = 0; a < C; ++a)
        for (int64_t d = 0; d < C; ++d) {
          const double x = pi[a * ps.a + d * ps.c];
          hi = std::max(hi, x);
          lo = std::min(lo, x);
          s.raw[a * C + d] = pi[a * ps.a + d * ps.c];
        }
      s.valid = hi - lo <= bound;  // false for -inf, inf and NaN
      if (!s.valid) return Outcome::kLogSpace;
      s.shift = hi;
      for (int64_t k = 0; k < C * C; ++k) s.exps[k] = std::exp(s.raw[k] - hi);
    }
    if (!potentials(u + (i + 1) * C, top)) return Outcome::kDead;
    total += top + s.shift;
    double* Ki = K + i * C * C;
    const double* E = s.exps.data();
    sum = 0.0;
    for (int64_t d = 0; d < C; ++d) {
      double t = 0.0;
      for (int64_t a = 0; a < C; ++a) t += alpha[a] * E[a * C + d];
      const double inv = t > 0.0 ? 1.0 / t : 0.0;
      for (int64_t a = 0; a < C; ++a) Ki[a * C + d] = alpha[a] * E[a * C + d] * inv;
      sum += (s.next[d] = t * e[d]);
    }
    if (!(sum > 0.0)) return Outcome::kDead;
    const double inv = 1.0 / sum;
    for (int64_t d = 0; d < C; ++d) alpha[d] = s.next[d] * inv;
    int exponent = 0;
    scale = std::frexp(scale * sum, &exponent);
    power += exponent;
  }
  logz = total + std::log(scale) + power * kLn2;
  for (int64_t a = 0; a < C; ++a) s.next[a] = alpha[a];
  return Outcome::kDone;
}

// Log space (_log_pass in linear_chain.py: any potentials): alpha_0 = unary_0 - m_0,
//   pre_{i+1}(d) = log Σ_a exp(alpha_i(a) + pairwise_i(a, d)),  K_i(a, d) = softmax_a,
//   alpha_{i+1} = pre_{i+1} + unary_{i+1} - m_{i+1} (max 0),  log Z = Σ m_i + log Σ exp(alpha).
// On kDone, ω = p(z_{L-1}) is in s.next.
template <typename scalar_t, int kC>
Outcome log_chain(const scalar_t* u, const scalar_t* p, Strides ps, int64_t len, int64_t c,
                  Scratch<scalar_t>& s, double* K, double& logz) {
  const int64_t C = kC > 0 ? kC : c;
  double* alpha = s.alpha;
  double* next = s.next;
  double* e = s.e;
  double top = -kInf;
  for (int64_t a = 0; a < C; ++a) top = std::max(top, static_cast<double>(u[a]));
  if (top == -kInf) return Outcome::kDead;
  double total = top;
  for (int64_t a = 0; a < C; ++a) alpha[a] = u[a] - top;
  for (int64_t i = 0; i + 1 < len; ++i) {
    const scalar_t* pi = p + i * ps.i;
    const scalar_t* un = u + (i + 1) * C;
    double* Ki = K + i * C * C;
    top = -kInf;
    for (int64_t d = 0; d < C; ++d) {
      double best = -kInf;
      int64_t arg = 0;
      for (int64_t a = 0; a < C; ++a) {
        e[a] = alpha[a] + pi[a * ps.a + d * ps.c];
        if (e[a] > best) best = e[a], arg = a;
      }
      if (best == -kInf) {  // no label reaches d: K(., d) = 0, alpha = -inf
        for (int64_t a = 0; a < C; ++a) Ki[a * C + d] = 0.0;
        next[d] = -kInf;
        continue;
      }
      double rest = 0.0;  // Σ of the exps but the largest (which is 1)
      for (int64_t a = 0; a < C; ++a) {
        e[a] = a == arg ? 1.0 : std::exp(e[a] - best);
        if (a != arg) rest += e[a];
      }
      const double inv = 1.0 / (1.0 + rest);
      for (int64_t a = 0; a < C; ++a) Ki[a * C + d] = e[a] * inv;
      next[d] = best + std::log1p(rest) + un[d];
      top = std::max(top, next[d]);
    }
    if (top == -kInf) return Outcome::kDead;
    total += top;
    for (int64_t d = 0; d < C; ++d) alpha[d] = next[d] - top;
  }
  double sum = 0.0;
  for (int64_t a = 0; a < C; ++a) sum += (e[a] = std::exp(alpha[a]));
  logz = total + std::log(sum);
  for (int64_t a = 0; a < C; ++a) next[a] = e[a] / sum;
  return Outcome::kDone;
}

// The first of ``steps`` transition matrices (p + i * ps.i, [C, C] strided) holding a NaN, or
// ``steps`` if none does (one look when ps.i is 0: one matrix for every step).
template <typename scalar_t>
int64_t first_nan_step(const scalar_t* p, Strides ps, int64_t steps, int64_t C) {
  for (int64_t i = 0; i < steps; ++i) {
    bool bad = false;
    for (int64_t a = 0; a < C; ++a)
      for (int64_t d = 0; d < C; ++d) bad |= std::isnan(p[i * ps.i + a * ps.a + d * ps.c]);
    if (bad) return i;
    if (ps.i == 0) break;
  }
  return steps;
}

// Forward pass and backward sweep of the chains start .. start + length (kC > 0: C known at
// compile time, the loops unrolled; 0: C = c): log Z [B], p(z_i) [B, N, C] and K
// [B, N-1, C, C] (double; 0 at padding and for items without a valid sequence; outputs
// start zeroed), and, unless ``edge_sum`` is null, each item's edge marginals summed over
// its positions, Σ_i p(z_i = a, z_{i+1} = d) [B, C, C] (the gradient of log Z for a shared
// transition matrix, without the [B, N-1, C, C] edge marginals). Each item in probability
// space where that is exact, else in log space. An item whose used potentials (its unary
// [len, C], its transitions of steps 0 .. len-2) hold a NaN gets NaN log Z, p(z_i) (i < len),
// K and edge sums, as the PyTorch code does (the passes would skip NaN terms, #37.10): one
// scan of its inputs (of the batch's transitions once when they are shared).
template <typename scalar_t, int kC>
void forward_chunk(const scalar_t* unary, const scalar_t* pairwise, Strides ps,
                   const int64_t* last, int64_t n, int64_t c, int64_t start, int64_t length,
                   double bound, scalar_t* logz, scalar_t* node, double* trans,
                   scalar_t* edge_sum) {
  const int64_t C = kC > 0 ? kC : c;
  Scratch<scalar_t> s(C);
  std::vector<double> sum(edge_sum ? C * C : 0);
  // transitions shared by the batch (stride 0): the first step with a NaN, looked up once
  const int64_t shared_nan = ps.b == 0 ? first_nan_step(pairwise, ps, n - 1, C) : -1;
  for (int64_t b = start; b < start + length; ++b) {
    const scalar_t* u = unary + b * n * C;
    const scalar_t* p = pairwise + b * ps.b;
    double* K = trans + b * (n - 1) * C * C;
    scalar_t* nd = node + b * n * C;
    const int64_t len = last[b] + 1;
    bool nan = (ps.b == 0 ? shared_nan : first_nan_step(p, ps, len - 1, C)) < len - 1;
    for (int64_t k = 0; k < len * C; ++k) nan |= std::isnan(u[k]);
    if (nan) {
      const double q = std::numeric_limits<double>::quiet_NaN();
      logz[b] = static_cast<scalar_t>(q);
      std::fill(nd, nd + len * C, static_cast<scalar_t>(q));
      std::fill(K, K + (len - 1) * C * C, q);
      if (edge_sum) std::fill(edge_sum + b * C * C, edge_sum + (b + 1) * C * C, scalar_t(q));
      continue;
    }
    double total = 0.0;
    Outcome outcome = scaled_chain<scalar_t, kC>(u, p, ps, len, C, bound, s, K, total);
    if (outcome == Outcome::kLogSpace) outcome = log_chain<scalar_t, kC>(u, p, ps, len, C, s, K, total);
    if (outcome == Outcome::kDead) {  // no valid label sequence: log Z = -inf, all 0
      logz[b] = -std::numeric_limits<scalar_t>::infinity();
      std::fill(K, K + (n - 1) * C * C, 0.0);
      if (edge_sum) std::fill(edge_sum + b * C * C, edge_sum + (b + 1) * C * C, scalar_t(0));
      continue;
    }
    logz[b] = static_cast<scalar_t>(total);
    // β̂_i(a) = p(z_i = a) = Σ_d K_i(a, d) p(z_{i+1} = d), from ω in s.next
    double* cur = s.next;
    double* prev = s.alpha;
    if (edge_sum) std::fill(sum.begin(), sum.end(), 0.0);
    for (int64_t i = len - 1;; --i) {
      for (int64_t a = 0; a < C; ++a) nd[i * C + a] = static_cast<scalar_t>(cur[a]);
      if (i == 0) break;
      const double* Ki = K + (i - 1) * C * C;
      if (edge_sum) {  // p(z_{i-1} = a, z_i = d) = K_{i-1}(a, d) p(z_i = d), summed
        for (int64_t a = 0; a < C; ++a) {
          double t = 0.0;
          for (int64_t d = 0; d < C; ++d) {
            const double v = Ki[a * C + d] * cur[d];
            sum[a * C + d] += v;
            t += v;
          }
          prev[a] = t;
        }
      } else {
        for (int64_t a = 0; a < C; ++a) {
          double t = 0.0;
          for (int64_t d = 0; d < C; ++d) t += Ki[a * C + d] * cur[d];
          prev[a] = t;
        }
      }
      std::swap(cur, prev);
    }
    if (edge_sum)
      for (int64_t k = 0; k < C * C; ++k) edge_sum[b * C * C + k] = static_cast<scalar_t>(sum[k]);
  }
}

// The Hessian-vector product of log Z (_hvp in linear_chain.py with â = V = 1) for the chains
// start .. start + length: writes d_unary [B, N, C] and d_pair [B, N-1, C, C] (or adds into
// the shared [C, C] sum ``pair_sum``); outputs start zeroed. g_node [B, N, C] / g_edge
// [B, N-1, C, C] may be null (zero). With X_i = p(z_{i+1}):
//   dot = Σ_i <p(z_i), g_i> + Σ_i <K_i ⊙ X_i, g_edge_i>
//   q_0 = g_0,  q_{i+1}(d) = Σ_a (q_i(a) + g_edge_i(a, d)) K_i(a, d) + g_{i+1}(d)
//   r_{L-1} = 0,  r_i(a) = Σ_d K_i(a, d) (r_{i+1}(d) + X_i(d) (g_{i+1}(d) + g_edge_i(a, d)))
//   d_unary_i = p(z_i) ⊙ (q_i - dot) + r_i
//   d_pair_i(a, d) = K_i(a, d) (q_i(a) X_i(d) + r_{i+1}(d) + X_i(d) (g_{i+1}(d) - dot
//                    + g_edge_i(a, d)))
template <typename scalar_t, int kC>
void hvp_chunk(const double* trans, const scalar_t* node, const int64_t* last,
               const scalar_t* g_node, const scalar_t* g_edge, int64_t n, int64_t c,
               int64_t start, int64_t length, scalar_t* d_unary, scalar_t* d_pair,
               double* pair_sum) {
  const int64_t C = kC > 0 ? kC : c;
  std::vector<double> q(n * C), r(n * C);
  for (int64_t b = start; b < start + length; ++b) {
    const double* K = trans + b * (n - 1) * C * C;
    const scalar_t* nd = node + b * n * C;
    const scalar_t* g = g_node ? g_node + b * n * C : nullptr;
    const scalar_t* ge = g_edge ? g_edge + b * (n - 1) * C * C : nullptr;
    scalar_t* du = d_unary + b * n * C;
    scalar_t* dp = d_pair ? d_pair + b * (n - 1) * C * C : nullptr;
    const int64_t len = last[b] + 1;
    double dot = 0.0;
    if (g)
      for (int64_t k = 0; k < len * C; ++k) dot += static_cast<double>(nd[k]) * g[k];
    if (ge)
      for (int64_t i = 0; i + 1 < len; ++i)
        for (int64_t a = 0; a < C; ++a)
          for (int64_t d = 0; d < C; ++d)
            dot += K[(i * C + a) * C + d] * nd[(i + 1) * C + d] * ge[(i * C + a) * C + d];
    for (int64_t a = 0; a < C; ++a) q[a] = g ? g[a] : 0.0;
    for (int64_t i = 0; i + 1 < len; ++i) {
      const double* Ki = K + i * C * C;
      for (int64_t d = 0; d < C; ++d) {
        double s = g ? g[(i + 1) * C + d] : 0.0;
        for (int64_t a = 0; a < C; ++a)
          s += (q[i * C + a] + (ge ? ge[(i * C + a) * C + d] : 0.0)) * Ki[a * C + d];
        q[(i + 1) * C + d] = s;
      }
    }
    for (int64_t a = 0; a < C; ++a) r[(len - 1) * C + a] = 0.0;
    for (int64_t i = len - 2; i >= 0; --i) {
      const double* Ki = K + i * C * C;
      for (int64_t a = 0; a < C; ++a) {
        double s = 0.0;
        for (int64_t d = 0; d < C; ++d) {
          const double x = nd[(i + 1) * C + d];
          const double gd = (g ? g[(i + 1) * C + d] : 0.0) + (ge ? ge[(i * C + a) * C + d] : 0.0);
          s += Ki[a * C + d] * (r[(i + 1) * C + d] + x * gd);
        }
        r[i * C + a] = s;
      }
    }
    for (int64_t k = 0; k < len * C; ++k)
      du[k] = static_cast<scalar_t>(nd[k] * (q[k] - dot) + r[k]);
    for (int64_t i = 0; i + 1 < len; ++i) {
      const double* Ki = K + i * C * C;
      for (int64_t a = 0; a < C; ++a)
        for (int64_t d = 0; d < C; ++d) {
          const int64_t at = (i * C + a) * C + d;
          const double x = nd[(i + 1) * C + d];
          const double gd = (g ? g[(i + 1) * C + d] : 0.0) - dot + (ge ? ge[at] : 0.0);
          const double v = Ki[a * C + d] * (q[i * C + a] * x + r[(i + 1) * C + d] + x * gd);
          if (dp)
            dp[at] = static_cast<scalar_t>(v);
          else
            pair_sum[a * C + d] += v;
        }
    }
  }
}

// fn.template operator()<kC>() with kC = C for C in 2..4, else 0 (C at run time)
template <typename F>
void dispatch_labels(int64_t c, const F& fn) {
  switch (c) {
    case 2:
      fn(std::integral_constant<int, 2>());
      break;
    case 3:
      fn(std::integral_constant<int, 3>());
      break;
    case 4:
      fn(std::integral_constant<int, 4>());
      break;
    default:
      fn(std::integral_constant<int, 0>());
  }
}

}  // namespace

// (log Z [B], p(z_i) [B, N, C], edge marginals, K [B, N-1, C, C] float64 for chain_hvp), the
// edge marginals by ``edges``: 0 none (empty), 1 p(z_i, z_{i+1}) [B, N-1, C, C], 2 their sum
// over each item's positions [B, C, C]. ``pairwise`` [B, N-1, C, C], any strides (a shared
// [C, C] expanded); ``last`` [B] the index of each item's last real position.
std::tuple<Tensor, Tensor, Tensor, Tensor> chain_forward_backward(const Tensor& unary,
                                                                  const Tensor& pairwise,
                                                                  const Tensor& last,
                                                                  int64_t edges) {
  TORCH_CHECK(edges >= 0 && edges <= 2, "edges: 0 (none), 1 (per position) or 2 (summed)");
  TORCH_CHECK(unary.dim() == 3 && pairwise.dim() == 4, "unary [B, N, C], pairwise [B, N-1, C, C]");
  const int64_t batch = unary.size(0), n = unary.size(1), c = unary.size(2);
  TORCH_CHECK(pairwise.size(0) == batch && pairwise.size(1) == n - 1 && pairwise.size(2) == c &&
                  pairwise.size(3) == c,
              "pairwise must be [B, N-1, C, C]");
  TORCH_CHECK(pairwise.scalar_type() == unary.scalar_type(), "unary and pairwise: one dtype");
  const Tensor u = unary.contiguous();
  const Tensor ends = last.to(at::kLong).contiguous();
  Tensor logz = at::empty({batch}, unary.options());
  Tensor node = at::zeros({batch, n, c}, unary.options());
  Tensor trans = at::zeros({batch, std::max<int64_t>(n - 1, 0), c, c},
                           unary.options().dtype(at::kDouble));
  const Strides ps{pairwise.stride(0), pairwise.stride(1), pairwise.stride(2), pairwise.stride(3)};
  // largest spread of an item's transitions for the probability-space pass (double: the
  // bound of _scaled_steps with one step between normalisations)
  const double bound = 0.3 * -std::log(std::numeric_limits<double>::min()) - std::log(c);
  Tensor edge = edges == 2 ? at::empty({batch, c, c}, unary.options())
                           : at::empty({0}, unary.options());
  AT_DISPATCH_FLOATING_TYPES(unary.scalar_type(), "chain_forward_backward", [&] {
    const scalar_t* up = u.data_ptr<scalar_t>();
    const scalar_t* pp = pairwise.data_ptr<scalar_t>();
    const int64_t* lp = ends.data_ptr<int64_t>();
    scalar_t* zp = logz.data_ptr<scalar_t>();
    scalar_t* np = node.data_ptr<scalar_t>();
    double* kp = trans.data_ptr<double>();
    scalar_t* ep = edges == 2 ? edge.data_ptr<scalar_t>() : nullptr;
    dispatch_labels(c, [&](auto labels) {
      constexpr int kC = decltype(labels)::value;
      for_chunks(chunk_starts(batch), [&](int64_t, int64_t start, int64_t length) {
        forward_chunk<scalar_t, kC>(up, pp, ps, lp, n, c, start, length, bound, zp, np, kp, ep);
      });
    });
  });
  if (edges == 1)  // p(z_i = a, z_{i+1} = d) = K_i(a, d) p(z_{i+1} = d)
    edge = (trans * node.narrow(1, 1, n - 1).unsqueeze(2)).to(unary.scalar_type());
  return {logz, node, edge, trans};
}

// Hessian of log Z times (g_node [B, N, C], g_edge [B, N-1, C, C]; either may be None):
// (d_unary [B, N, C], d_pair [B, N-1, C, C], or [C, C] summed over the batch if ``shared``).
std::tuple<Tensor, Tensor> chain_hvp(const Tensor& trans, const Tensor& node, const Tensor& last,
                                     const std::optional<Tensor>& g_node,
                                     const std::optional<Tensor>& g_edge, bool shared) {
  TORCH_CHECK(trans.scalar_type() == at::kDouble && trans.is_contiguous(),
              "trans must come from chain_forward_backward");
  const int64_t batch = node.size(0), n = node.size(1), c = node.size(2);
  const Tensor nd = node.contiguous();
  const Tensor ends = last.to(at::kLong).contiguous();
  const Tensor gn = g_node ? g_node->to(node.scalar_type()).contiguous() : Tensor();
  const Tensor ge = g_edge ? g_edge->to(node.scalar_type()).contiguous() : Tensor();
  Tensor d_unary = at::zeros({batch, n, c}, node.options());
  Tensor d_pair = shared ? Tensor() : at::zeros({batch, std::max<int64_t>(n - 1, 0), c, c},
                                                node.options());
  const std::vector<int64_t> starts = chunk_starts(batch);
  const int64_t chunks = static_cast<int64_t>(starts.size()) - 1;
  std::vector<double> sums(shared ? chunks * c * c : 0, 0.0);  // per chunk [C, C]
  AT_DISPATCH_FLOATING_TYPES(node.scalar_type(), "chain_hvp", [&] {
    const scalar_t* gnp = gn.defined() ? gn.data_ptr<scalar_t>() : nullptr;
    const scalar_t* gep = ge.defined() ? ge.data_ptr<scalar_t>() : nullptr;
    scalar_t* dpp = shared ? nullptr : d_pair.data_ptr<scalar_t>();
    dispatch_labels(c, [&](auto labels) {
      constexpr int kC = decltype(labels)::value;
      for_chunks(starts, [&](int64_t i, int64_t start, int64_t length) {
        hvp_chunk<scalar_t, kC>(trans.data_ptr<double>(), nd.data_ptr<scalar_t>(),
                                ends.data_ptr<int64_t>(), gnp, gep, n, c, start, length,
                                d_unary.data_ptr<scalar_t>(), dpp,
                                shared ? sums.data() + i * c * c : nullptr);
      });
    });
  });
  if (shared) {
    Tensor total = at::zeros({c, c}, node.options().dtype(at::kDouble));
    double* tp = total.data_ptr<double>();
    for (int64_t i = 0; i < chunks; ++i)
      for (int64_t k = 0; k < c * c; ++k) tp[k] += sums[i * c * c + k];
    d_pair = total.to(node.scalar_type());
  }
  return {d_unary, d_pair};
}

void bind_chain(pybind11::module& m) {
  m.def("chain_forward_backward", &chain_forward_backward,
        "(log Z [B], p(z_i) [B, N, C], edge marginals (edges: 0 none, 1 [B, N-1, C, C], 2 "
        "summed over positions [B, C, C]), K [B, N-1, C, C] float64)",
        pybind11::arg("unary"), pybind11::arg("pairwise"), pybind11::arg("last"),
        pybind11::arg("edges"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("chain_hvp", &chain_hvp,
        "Hessian of log Z times (g_node, g_edge): (d_unary, d_pair or its [C, C] sum)",
        pybind11::arg("trans"), pybind11::arg("node"), pybind11::arg("last"),
        pybind11::arg("g_node"), pybind11::arg("g_edge"), pybind11::arg("shared"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace structattn
