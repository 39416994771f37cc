// Viterbi for linear chains (LinearChainCRF.argmax and max_score): the best label sequence of
// each item and its score, the max-plus forward pass and the backtrack in one loop per item
// (the batch split into one chunk per thread: for_chunks in _kernels.h), in the potentials'
// own precision. The same operations in the same order as chain_kbest(k = 1) in
// linear_chain.py, so the same sequence and (bitwise) the same score:
//   alpha_0 = unary_0,
//   best_{i+1}(d) = max_a alpha_i(a) + pairwise_i(a, d),  ptr_i(d) = the first a reaching it,
//   alpha_{i+1}(d) = best_{i+1}(d) + unary_{i+1}(d),
//   score = max_d alpha_{L-1}(d) (the first d), labels by following ptr back from it.
// Ties go to the lower label at every max (torch.max's first index: the rule that makes
// chain_kbest's rank 0 the same sequence for every k, #41); a NaN beats every number and the
// first NaN wins, as in torch.max. Items whose score is -inf (no valid sequence) get labels
// -1, and so do the positions beyond an item's length. ``pairwise`` is [C, C] (shared) or
// [B, N-1, C, C] with any strides (an expanded view is read in place; a step matrix whose
// rows are not contiguous is copied once per distinct matrix). Registered as the torch
// operator ``torch.ops.structattn_viterbi.viterbi`` (no Python binding of its own), which
// linear_chain.py uses where it is registered. Built on first use by _extension.py.
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "_kernels.h"

namespace structattn {
namespace {

using at::Tensor;

// Strides of the transitions [B, N-1, C, C] (0 where they are shared).
struct Strides {
  int64_t b, i, a, c;
};

// One max-plus step, vectorised over the target label d (the rows of P are contiguous):
//   best[d] = max_a alpha[a] + P[a * C + d] (then + unary[d]), arg[d] = the first such a.
// ``take``: v replaces b when larger, or when v is the first NaN (torch.max's rule). The
// pointer has the width of the scores, so that both blend in lanes of one size.
template <typename T, typename I>
inline void max_step_body(const T* alpha, const T* P, const T* unary, int64_t C, T* best,
                          I* arg) {
  for (int64_t d = 0; d < C; ++d) {
    best[d] = alpha[0] + P[d];
    arg[d] = 0;
  }
  for (int64_t a = 1; a < C; ++a) {
    const T x = alpha[a];
    const T* row = P + a * C;
    const I ia = static_cast<I>(a);
#pragma omp simd
    for (int64_t d = 0; d < C; ++d) {
      const T v = x + row[d];
      const T b = best[d];
      const bool take = (v > b) | ((v != v) & (b == b));
      best[d] = take ? v : b;
      arg[d] = take ? ia : arg[d];
    }
  }
  for (int64_t d = 0; d < C; ++d) best[d] += unary[d];
}

STRUCTATTN_CLONES void max_step_f32(const float* alpha, const float* P, const float* unary,
                                    int64_t C, float* best, int32_t* arg) {
  max_step_body(alpha, P, unary, C, best, arg);
}

STRUCTATTN_CLONES void max_step_f64(const double* alpha, const double* P, const double* unary,
                                    int64_t C, double* best, int64_t* arg) {
  max_step_body(alpha, P, unary, C, best, arg);
}

inline void max_step(const float* alpha, const float* P, const float* unary, int64_t C,
                     float* best, int32_t* arg) {
  max_step_f32(alpha, P, unary, C, best, arg);
}

inline void max_step(const double* alpha, const double* P, const double* unary, int64_t C,
                     double* best, int64_t* arg) {
  max_step_f64(alpha, P, unary, C, best, arg);
}

template <typename T>
using Pointer = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;

// Scratch of one chunk: alpha and the next position's [C], the back pointers [N-1, C] and a
// contiguous copy of the last strided step matrix read (``copied``: its source).
template <typename T>
struct Scratch {
  std::vector<T> alpha, next, matrix;
  std::vector<Pointer<T>> ptr;
  const T* copied = nullptr;

  Scratch(int64_t n, int64_t c, bool strided)
      : alpha(c), next(c), matrix(strided ? c * c : 0), ptr(std::max<int64_t>(n - 1, 0) * c) {}
};

// The best sequence of one item of length ``len``: its score, and its labels written into
// ``labels`` [N] (which holds -1 on entry).
template <typename T>
T viterbi_item(const T* u, const T* p, Strides ps, int64_t len, int64_t C, Scratch<T>& s,
               int64_t* labels) {
  const bool strided = !(ps.a == C && ps.c == 1);
  T* alpha = s.alpha.data();
  T* next = s.next.data();
  std::copy(u, u + C, alpha);
  for (int64_t i = 0; i + 1 < len; ++i) {
    const T* P = p + i * ps.i;
    if (strided) {  // a transposed or otherwise strided matrix: one contiguous copy
      if (P != s.copied) {
        for (int64_t a = 0; a < C; ++a)
          for (int64_t d = 0; d < C; ++d) s.matrix[a * C + d] = P[a * ps.a + d * ps.c];
        s.copied = P;
      }
      P = s.matrix.data();
    }
    max_step(alpha, P, u + (i + 1) * C, C, next, s.ptr.data() + i * C);
    std::swap(alpha, next);
  }
  T top = alpha[0];
  int64_t arg = 0;
  for (int64_t d = 1; d < C; ++d) {
    const T v = alpha[d];
    if ((v > top) | ((v != v) & (top == top))) top = v, arg = d;
  }
  if (top == -std::numeric_limits<T>::infinity()) return top;  // no valid sequence: all -1
  labels[len - 1] = arg;
  for (int64_t i = len - 2; i >= 0; --i) labels[i] = s.ptr[i * C + labels[i + 1]];
  return top;
}

// (score [B] in the dtype of ``unary``, labels LongTensor [B, N]) of the best label sequence
// of every item: ``unary`` [B, N, C], ``pairwise`` [C, C] or [B, N-1, C, C] (any strides,
// the dtype of ``unary``), ``last`` [B] the index of each item's last real position.
std::tuple<Tensor, Tensor> chain_viterbi(const Tensor& unary_in, const Tensor& pairwise,
                                         const Tensor& last_in) {
  TORCH_CHECK(unary_in.dim() == 3, "viterbi: unary must be [B, N, C]");
  const int64_t batch = unary_in.size(0), n = unary_in.size(1), c = unary_in.size(2);
  TORCH_CHECK(pairwise.scalar_type() == unary_in.scalar_type(),
              "viterbi: unary and pairwise must have one dtype");
  TORCH_CHECK(unary_in.scalar_type() == at::kFloat || unary_in.scalar_type() == at::kDouble,
              "viterbi: float32 or float64 potentials");
  const bool shared = pairwise.dim() == 2;
  TORCH_CHECK((shared && pairwise.size(0) == c && pairwise.size(1) == c) ||
                  (pairwise.dim() == 4 && pairwise.size(0) == batch &&
                   pairwise.size(1) == std::max<int64_t>(n - 1, 0) && pairwise.size(2) == c &&
                   pairwise.size(3) == c),
              "viterbi: pairwise must be [C, C] or [B, N-1, C, C]");
  TORCH_CHECK(last_in.dim() == 1 && last_in.size(0) == batch, "viterbi: last must be [B]");
  const Tensor unary = unary_in.contiguous();
  const Tensor last = last_in.to(at::kLong).contiguous();
  const int64_t* lp = last.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(lp[b] >= 0 && lp[b] < n, "viterbi: lengths must lie in 1..N");
  Tensor score = at::empty({batch}, unary.options());
  Tensor labels = at::full({batch, n}, -1, unary.options().dtype(at::kLong));
  if (batch == 0 || n == 0 || c == 0) return {score.fill_(-INFINITY), labels};
  const Strides ps = shared ? Strides{0, 0, pairwise.stride(0), pairwise.stride(1)}
                            : Strides{pairwise.stride(0), pairwise.stride(1), pairwise.stride(2),
                                      pairwise.stride(3)};
  const bool strided = !(ps.a == c && ps.c == 1);
  int64_t* out = labels.data_ptr<int64_t>();
  const double work = static_cast<double>(batch) * n * c * c;
  AT_DISPATCH_FLOATING_TYPES(unary.scalar_type(), "chain_viterbi", [&] {
    const scalar_t* up = unary.data_ptr<scalar_t>();
    const scalar_t* pp = pairwise.data_ptr<scalar_t>();
    scalar_t* sp = score.data_ptr<scalar_t>();
    for_chunks(chunk_starts(batch, work), [&](int64_t, int64_t start, int64_t length) {
      Scratch<scalar_t> s(n, c, strided);
      for (int64_t b = start; b < start + length; ++b)
        sp[b] = viterbi_item<scalar_t>(up + b * n * c, pp + b * ps.b, ps, lp[b] + 1, c, s,
                                       out + b * n);
    });
  });
  return {score, labels};
}

}  // namespace
}  // namespace structattn

TORCH_LIBRARY(structattn_viterbi, m) {
  m.def("viterbi(Tensor unary, Tensor pairwise, Tensor last) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(structattn_viterbi, CPU, m) {
  m.impl("viterbi", &structattn::chain_viterbi);
}
