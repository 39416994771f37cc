// Eisner's inside pass, outside pass and Hessian-vector product for projective dependency
// trees (log semiring), the same algorithm and chart layout as the PyTorch code in
// dependency.py (read the comments there), written against ATen so that
//   * the ~90 small tensor operations per span width pay no Python overhead, and
//   * the batch is split into one chunk per thread, each chunk running all span widths on
//     its own (the per-width tensors are too small for ATen's intra-op threads).
// Small problems (dependency.py decides: _FUSED_SIZE) instead run the whole dynamic program
// in fused loops on eight trees at once (the "fused path" below).
// Built on first use by structattn.structs._extension (torch.utils.cpp_extension.load).
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "_kernels.h"

namespace structattn {
namespace {

using at::Tensor;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Strided views of one chart [B, 6, N, N] for the spans of width w (see _Layout in
// dependency.py). All charts of a chunk are fresh contiguous tensors (storage offset 0).
struct Layout {
  int64_t batch, size, b, d, r;

  explicit Layout(const Tensor& chart)
      : batch(chart.size(0)),
        size(chart.size(3)),
        b(chart.stride(0)),
        d(chart.stride(1)),
        r(chart.stride(2)) {}

  // the views of the first k items only
  Layout first_items(int64_t k) const {
    Layout out = *this;
    out.batch = k;
    return out;
  }

  Tensor first(const Tensor& x, int64_t w) const {
    return x.as_strided({batch, 3, w, size - w}, {b, d, r, 1}, 0);
  }
  Tensor second(const Tensor& x, int64_t w) const {
    return x.as_strided({batch, 3, w, size - w}, {b, d, r, 1}, 3 * d + (size - w) * r + w);
  }
  Tensor inc(const Tensor& x, int64_t w) const {
    const int64_t n = size - w;
    return x.as_strided({batch, 2, n}, {b, 5 * d + (n - w + 1) * r + w, 1}, (w - 1) * r);
  }
  Tensor comp(const Tensor& x, int64_t w) const {
    const int64_t n = size - w;
    return x.as_strided({batch, 2, 2, n}, {b, 2 * d + (n - 1 - w) * r + w, d, 1}, d + w * r);
  }
  // first + second, [B, 3, w, n], stored split-major ([w, B, 3, n] in memory)
  Tensor terms(const Tensor& x, int64_t w) const {
    Tensor out = at::empty({w, batch, 3, size - w}, x.options()).permute({1, 2, 0, 3});
    return at::add_out(out, first(x, w), second(x, w));
  }
};

// [B, 2, n]: (arc s -> s+w, arc s+w -> s) of a contiguous [B, N, N] tensor
Tensor arcs_of_width(const Tensor& arcs, int64_t w) {
  const int64_t size = arcs.size(1), n = size - w;
  return arcs.as_strided({arcs.size(0), 2, n}, {size * size, w * size - w, size + 1},
                         arcs.storage_offset() + w);
}

// [B, 3, n] in the group order (right, inner, left) from [B, 2, n] and [B, 1, n]
Tensor groups(const Tensor& comp, const Tensor& inner) {
  return at::cat({comp.narrow(1, 0, 1), inner, comp.narrow(1, 1, 1)}, 1);
}

Tensor even_groups(const Tensor& x) { return x.slice(1, 0, 3, 2); }  // groups 0 and 2

double lowest(const Tensor& x) {
  return x.scalar_type() == at::kDouble ? std::numeric_limits<double>::lowest()
                                        : std::numeric_limits<float>::lowest();
}

// Split weights (P [B, 3, w, n], r [B, 2, n]) from e = exp(terms - top) (or the terms when
// top is undefined), overwritten; see _weights in dependency.py.
std::pair<Tensor, Tensor> split_weights_from(Tensor e, const Tensor& top, const Tensor& sums,
                                             const Tensor& inc, const Tensor& open_root) {
  Tensor norms = sums.clamp_min(lowest(sums));
  Tensor p = top.defined() ? e.mul_((top - norms.unsqueeze(2)).exp_())
                           : e.sub_(norms.unsqueeze(2)).exp_();
  Tensor r = (inc - even_groups(norms)).exp_();
  if (open_root.defined()) {
    p.select(1, 0).select(2, 0).masked_fill_(open_root.unsqueeze(-1), 0.0);
    r.select(1, 0).select(1, 0).masked_fill_(open_root, 0.0);
  }
  return {p, r};
}

// ---- fused loops over the small per-width quantities ([B, 2|3, n]: one pass instead of
// about ten tiny tensor operations each; the [B, 3, w, n] work stays in ATen) ---------------

template <typename F>
void for_spans(int64_t batch, int64_t n, const F& fn) {  // fn(b, s) for every item and start
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t s = 0; s < n; ++s) fn(b, s);
}

template <typename T>
T log_add_exp(T a, T b) {  // as ATen's logaddexp
  if (std::isinf(a) && a == b) return a;
  return std::max(a, b) + std::log1p(std::exp(-std::abs(a - b)));
}

// Inside pass, weights kept, from top [B, 3, 1, n] and esum [B, 3, n] (the sums over the
// split of e = exp(terms - top)): writes I(s, w) = inner + arc and C(s, w) (both copies)
// into the chart views, and returns (scale [B, 3, 1, n], r [B, 2, n]) with P = e * scale.
std::pair<Tensor, Tensor> inside_width(const Tensor& top, const Tensor& esum, const Tensor& arcs,
                                       const Tensor& inc, const Tensor& comp,
                                       const Tensor& last, bool multiroot, int64_t w) {
  const int64_t batch = esum.size(0), n = esum.size(2);
  Tensor scale = at::empty({batch, 3, 1, n}, esum.options());
  Tensor r = at::empty({batch, 2, n}, esum.options());
  const Tensor ends = last.to(at::kLong).contiguous();
  AT_DISPATCH_FLOATING_TYPES(esum.scalar_type(), "inside_width", [&] {
    auto tp = top.accessor<scalar_t, 4>();
    auto es = esum.accessor<scalar_t, 3>();
    auto ar = arcs.accessor<scalar_t, 3>();
    auto in = inc.accessor<scalar_t, 3>();
    auto cm = comp.accessor<scalar_t, 4>();
    auto sc = scale.accessor<scalar_t, 4>();
    auto rr = r.accessor<scalar_t, 3>();
    auto ls = ends.accessor<int64_t, 1>();
    const scalar_t lo = std::numeric_limits<scalar_t>::lowest();
    const scalar_t neg_inf = -std::numeric_limits<scalar_t>::infinity();
    for (int64_t b = 0; b < batch; ++b) {
      const bool open = !multiroot && ls[b] != w;  // ROOT's span stays open
      for (int64_t s = 0; s < n; ++s) {
        scalar_t sums[3];
        for (int g = 0; g < 3; ++g) sums[g] = std::log(es[b][g][s]) + tp[b][g][0][s];
        const scalar_t i_span[2] = {sums[1] + ar[b][0][s], sums[1] + ar[b][1][s]};
        scalar_t c_span[2] = {log_add_exp(sums[0], i_span[0]), log_add_exp(sums[2], i_span[1])};
        const scalar_t norm[3] = {std::max(c_span[0], lo), std::max(sums[1], lo),
                                  std::max(c_span[1], lo)};
        for (int g = 0; g < 3; ++g) sc[b][g][0][s] = std::exp(tp[b][g][0][s] - norm[g]);
        for (int k = 0; k < 2; ++k) rr[b][k][s] = std::exp(i_span[k] - norm[2 * k]);
        if (open && s == 0) {
          sc[b][0][0][0] = 0;
          rr[b][0][0] = 0;
          c_span[0] = neg_inf;
        }
        for (int k = 0; k < 2; ++k) {
          in[b][k][s] = i_span[k];
          cm[b][0][k][s] = c_span[k];
          cm[b][1][k][s] = c_span[k];
        }
      }
    }
  });
  return {scale, r};
}

// Outside pass: g(I) += r g(C) in place (g(C) = the sum of the two copies' gradients);
// returns the gradients of the three sums, [B, 3, 1, n].
Tensor outside_width(const Tensor& comp, const Tensor& inc, const Tensor& r) {
  const int64_t batch = inc.size(0), n = inc.size(2);
  Tensor parent = at::empty({batch, 3, 1, n}, inc.options());
  AT_DISPATCH_FLOATING_TYPES(inc.scalar_type(), "outside_width", [&] {
    auto cm = comp.accessor<scalar_t, 4>();
    auto in = inc.accessor<scalar_t, 3>();
    auto rr = r.accessor<scalar_t, 3>();
    auto gp = parent.accessor<scalar_t, 4>();
    for_spans(batch, n, [&](int64_t b, int64_t s) {
      scalar_t g_inc = 0;
      for (int k = 0; k < 2; ++k) {
        const scalar_t g_comp = cm[b][0][k][s] + cm[b][1][k][s];
        const scalar_t g_i = in[b][k][s] + rr[b][k][s] * g_comp;
        in[b][k][s] = g_i;
        g_inc += g_i;
        gp[b][2 * k][0][s] = g_comp;
      }
      gp[b][1][0][s] = g_inc;
    });
  });
  return parent;
}

// Tangents of the inside pass: dot I = dot inner + direction, dot C = dot partial + r dot I,
// written into the tangent chart views; d_sums [B, 3, n] groups 0 and 2 become dot C.
void hvp_inside_width(const Tensor& d_sums, const Tensor& dirs, const Tensor& r,
                      const Tensor& inc, const Tensor& comp) {
  const int64_t batch = d_sums.size(0), n = d_sums.size(2);
  AT_DISPATCH_FLOATING_TYPES(d_sums.scalar_type(), "hvp_inside_width", [&] {
    auto ds = d_sums.accessor<scalar_t, 3>();
    auto dr = dirs.accessor<scalar_t, 3>();
    auto rr = r.accessor<scalar_t, 3>();
    auto in = inc.accessor<scalar_t, 3>();
    auto cm = comp.accessor<scalar_t, 4>();
    for_spans(batch, n, [&](int64_t b, int64_t s) {
      for (int k = 0; k < 2; ++k) {
        const scalar_t d_inc = ds[b][1][s] + dr[b][k][s];
        const scalar_t d_comp = ds[b][2 * k][s] + rr[b][k][s] * d_inc;
        in[b][k][s] = d_inc;
        ds[b][2 * k][s] = d_comp;
        cm[b][0][k][s] = d_comp;
        cm[b][1][k][s] = d_comp;
      }
    });
  });
}

// Tangents of the outside pass for the small quantities: dot g(I) += r ((dot I - dot C) g(C)
// + dot g(C)) in place; returns shift = dot g(P) - dot P g(P) [B, 3, 1, n] for the terms.
Tensor hvp_outside_width(const Tensor& dg_comp_view, const Tensor& d_inc, const Tensor& d_parent,
                         const Tensor& g_parent, const Tensor& r, const Tensor& dg_inc) {
  const int64_t batch = d_inc.size(0), n = d_inc.size(2);
  Tensor shift = at::empty({batch, 3, 1, n}, d_inc.options());
  AT_DISPATCH_FLOATING_TYPES(d_inc.scalar_type(), "hvp_outside_width", [&] {
    auto cm = dg_comp_view.accessor<scalar_t, 4>();
    auto di = d_inc.accessor<scalar_t, 3>();
    auto dp = d_parent.accessor<scalar_t, 4>();
    auto gp = g_parent.accessor<scalar_t, 4>();
    auto rr = r.accessor<scalar_t, 3>();
    auto dgi = dg_inc.accessor<scalar_t, 3>();
    auto sh = shift.accessor<scalar_t, 4>();
    for_spans(batch, n, [&](int64_t b, int64_t s) {
      scalar_t dg_i = 0;
      for (int k = 0; k < 2; ++k) {
        const scalar_t dg_comp = cm[b][0][k][s] + cm[b][1][k][s];
        const scalar_t g_comp = gp[b][2 * k][0][s], d_comp = dp[b][2 * k][0][s];
        const scalar_t direct = ((di[b][k][s] - d_comp) * g_comp + dg_comp) * rr[b][k][s];
        const scalar_t updated = dgi[b][k][s] + direct;
        dgi[b][k][s] = updated;
        dg_i += updated;
        sh[b][2 * k][0][s] = dg_comp - d_comp * g_comp;
      }
      sh[b][1][0][s] = dg_i - dp[b][1][0][s] * gp[b][1][0][s];
    });
  });
  return shift;
}

// One chunk of the batch: its inside charts and split weights (not changed after the inside
// pass: the outside passes keep what they need in their own Outside).
// Its items are sorted longest first, so that the items whose trees have spans of width w
// are the first active[w]: every pass narrows width w's work to them (a batch of mixed
// lengths costs the sum of its items' N^3, not the longest item's times the batch size).
struct Chunk {
  Tensor index;        // [B] the chunk's batch items, longest first
  int64_t first = -1;  // when they are first, first + 1, ...: first (views, no copies)
  int64_t size = 0;    // positions of its longest item: its charts are [B, 6, size, size]

  // the chunk's rows of a batch tensor x [B, ...]
  Tensor take(const Tensor& x) const {
    return first >= 0 ? x.narrow(0, first, index.size(0)) : x.index_select(0, index);
  }
  // the chunk's rows of x [B, N, N] cut to [k, size, size] (contiguous)
  Tensor take_square(const Tensor& x) const {
    const Tensor rows = take(x);
    if (rows.size(1) == size) return rows;
    return rows.narrow(1, 0, size).narrow(2, 0, size).contiguous();
  }
  // a chunk result [k, size, size] as [k, N, N] (zeros beyond the chunk's positions)
  Tensor pad_square(const Tensor& x, int64_t full) const {
    if (x.size(1) == full) return x;
    Tensor out = at::zeros({x.size(0), full, full}, x.options());
    out.narrow(1, 0, size).narrow(2, 0, size).copy_(x);
    return out;
  }
  Tensor chart;  // [B, 6, size, size]
  Tensor inner;  // [B, size, size] (empty when the weights are kept)
  Tensor last;   // [B]
  std::vector<int64_t> active;  // per width: the number of items at least that long
  bool multiroot = true;
  std::vector<std::pair<Tensor, Tensor>> weights;  // per width 1, 2, ... (active items), if kept

  Tensor open_root(int64_t w) const {
    return multiroot ? Tensor() : last.narrow(0, 0, active[w]).ne(w);
  }

  std::pair<Tensor, Tensor> split_weights(const Layout& full, int64_t w) const {
    if (w <= static_cast<int64_t>(weights.size())) return weights[w - 1];
    const int64_t n = full.size - w, k = active[w];
    const Layout lay = full.first_items(k);
    Tensor terms = lay.terms(chart, w);
    terms.select(1, 0).select(1, w - 1).fill_(kNegInf);  // the I(s, w) slots
    terms.select(1, 2).select(1, 0).fill_(kNegInf);
    Tensor sums = groups(lay.comp(chart, w).select(1, 0),
                         inner.narrow(0, 0, k).select(1, w).narrow(1, 0, n).unsqueeze(1));
    return split_weights_from(terms, Tensor(), sums, lay.inc(chart, w), open_root(w));
  }
};

// per width w < size: how many of the (longest first) lasts are >= w
std::vector<int64_t> active_counts(const Tensor& last, int64_t size) {
  const Tensor ends = last.to(at::kLong).contiguous();
  const int64_t* lp = ends.data_ptr<int64_t>();
  std::vector<int64_t> active(size, 0);
  for (int64_t i = 1; i < ends.size(0); ++i)  // the narrowing relies on it
    TORCH_CHECK(lp[i] <= lp[i - 1], "active_counts: items must come longest first");
  for (int64_t i = 0; i < ends.size(0); ++i)
    for (int64_t w = 0; w <= std::min(lp[i], size - 1); ++w) ++active[w];
  return active;
}

// keeps the split weights of widths 1 .. kept (the others are recomputed when needed)
void inside(Chunk& c, const Tensor& arcs, int64_t kept) {
  const int64_t batch = arcs.size(0), size = arcs.size(1);
  c.chart = at::full({batch, 6, size, size}, kNegInf, arcs.options());
  c.chart.narrow(1, 1, 2).select(2, 0).fill_(0.0);  // complete spans of width 0
  c.chart.narrow(1, 3, 2).select(2, size - 1).fill_(0.0);
  c.inner = kept >= size - 1 ? at::empty({0}, arcs.options())
                             : at::full({batch, size, size}, kNegInf, arcs.options());
  const Layout full(c.chart);
  const double floor = lowest(arcs);
  for (int64_t w = 1; w < size; ++w) {
    const int64_t n = size - w, k = c.active[w];
    if (k == 0) break;  // no item has spans this wide (nor wider)
    const Layout lay = full.first_items(k);
    const Tensor arcs_w = arcs_of_width(arcs.narrow(0, 0, k), w);
    Tensor terms = lay.terms(c.chart, w);
    Tensor inc = lay.inc(c.chart, w);
    if (w <= kept) {  // one exp of the terms gives the sums and the split weights
      Tensor top = terms.amax({2}, true).clamp_min_(floor);
      Tensor e = terms.sub_(top).exp_();
      auto [scale, r] = inside_width(top, e.sum({2}), arcs_w, inc, lay.comp(c.chart, w),
                                     c.last.narrow(0, 0, k), c.multiroot, w);
      c.weights.emplace_back(e.mul_(scale), r);
      continue;
    }
    Tensor sums = at::logsumexp(terms, {2});
    at::add_out(inc, sums.narrow(1, 1, 1), arcs_w);
    Tensor comp = at::logaddexp(even_groups(sums), inc);
    c.inner.narrow(0, 0, k).select(1, w).narrow(1, 0, n).copy_(sums.select(1, 1));
    Tensor open_root = c.open_root(w);
    if (open_root.defined()) comp.select(1, 0).select(1, 0).masked_fill_(open_root, kNegInf);
    lay.comp(c.chart, w).copy_(comp.unsqueeze(1));
  }
}

// [B, N, N] arc gradients from a gradient chart (see _arc_index in dependency.py)
Tensor arc_grads(const Tensor& grad) {
  const int64_t batch = grad.size(0), size = grad.size(3), plane = size * size;
  Tensor pos = at::arange(size, grad.options().dtype(at::kLong));
  Tensor h = pos.unsqueeze(1), m = pos.unsqueeze(0);
  Tensor left = 5 * plane + (size - (h - m)) * size + h;
  Tensor right = (m - h - 1) * size + h;
  Tensor unused = at::full_like(left, plane - 1);
  Tensor index = at::where(h > m, left, at::where(h < m, right, unused)).flatten();
  return grad.reshape({batch, 6 * plane}).index_select(1, index).view({batch, size, size});
}

// What the Hessian-vector product needs from one chunk's outside pass.
struct Outside {
  Tensor grad;                  // outside chart [B, 6, N, N]
  std::vector<Tensor> parents;  // gradients of the sums, widths N-1 .. 1 (if weights are kept)
};

// The outside pass: seed[b] * marginals [B, N, N]; fills ``keep`` if given.
Tensor outside(const Chunk& c, const Tensor& seed, Outside* keep) {
  Tensor grad = at::zeros_like(c.chart);
  grad.select(1, 1).select(2, 0).scatter_(1, c.last.unsqueeze(-1), seed.unsqueeze(-1));
  const Layout full(grad);
  const bool keep_parents = keep != nullptr && !c.weights.empty();
  for (int64_t w = full.size - 1; w > 0; --w) {
    if (c.active[w] == 0) continue;
    const Layout lay = full.first_items(c.active[w]);
    auto [p, r] = c.split_weights(full, w);
    Tensor g_parent = outside_width(lay.comp(grad, w), lay.inc(grad, w), r);  // [B, 3, 1, n]
    if (keep_parents) keep->parents.push_back(g_parent);
    lay.first(grad, w).addcmul_(p, g_parent);
    lay.second(grad, w).addcmul_(p, g_parent);
  }
  if (keep != nullptr) keep->grad = grad;
  return arc_grads(grad);
}

Tensor hvp(const Chunk& c, const Outside& o, const Tensor& direction) {
  Tensor tangent = at::zeros_like(c.chart);
  const Layout full(tangent);
  // widths 1 .. kept: their tangent sums kept for the outside part
  const int64_t kept = o.parents.empty() ? 0 : static_cast<int64_t>(c.weights.size());
  std::vector<std::pair<Tensor, Tensor>> sums;  // per width (dot terms, dot sums [B, 3, 1, n])
  for (int64_t w = 1; w < full.size; ++w) {
    const int64_t k = c.active[w];
    if (k == 0) break;
    const Layout lay = full.first_items(k);
    auto [p, r] = c.split_weights(full, w);
    Tensor d_terms = lay.terms(tangent, w);
    Tensor d_sums = (p * d_terms).sum(2);  // [B, 3, n]; groups 0, 2 become dot C below
    hvp_inside_width(d_sums, arcs_of_width(direction.narrow(0, 0, k), w), r,
                     lay.inc(tangent, w), lay.comp(tangent, w));
    if (w <= kept) sums.emplace_back(d_terms, d_sums.unsqueeze(2));
  }
  Tensor d_grad = at::zeros_like(tangent);
  for (int64_t w = full.size - 1; w > 0; --w) {
    if (c.active[w] == 0) continue;
    const Layout lay = full.first_items(c.active[w]);
    auto [p, r] = c.split_weights(full, w);
    Tensor d_terms, d_parent, g_parent;  // [B, 3, w, n], [B, 3, 1, n] (dot P), (g(P))
    if (w <= kept) {
      std::tie(d_terms, d_parent) = sums.back();
      sums.pop_back();
      g_parent = o.parents.at(o.parents.size() - w);  // widths longest .. 1
    } else {
      d_terms = lay.terms(tangent, w);
      Tensor d_inner = (p.select(1, 1) * d_terms.select(1, 1)).sum(1).unsqueeze(1);
      d_parent = groups(lay.comp(tangent, w).select(1, 0), d_inner).unsqueeze(2);
      Tensor g_comp = lay.comp(o.grad, w).sum(1);
      g_parent = groups(g_comp, lay.inc(o.grad, w).sum(1, true)).unsqueeze(2);
    }
    Tensor shift = hvp_outside_width(lay.comp(d_grad, w), lay.inc(tangent, w), d_parent,
                                     g_parent, r, lay.inc(d_grad, w));  // [B, 3, 1, n]
    Tensor t = at::addcmul(shift, d_terms, g_parent).mul_(p);
    lay.first(d_grad, w).add_(t);
    lay.second(d_grad, w).add_(t);
  }
  return arc_grads(d_grad);
}


// ---- fused path for small trees ---------------------------------------------------------
// Below kFusedSize positions the per-width ATen operations above cost more than their
// arithmetic (about 25 per width and pass; and ATen's exp takes a slow path on -inf and
// underflowing inputs, which Eisner's terms are full of). There the whole dynamic program
// runs in loops instead, on kTrees trees at once, one in each lane of a SIMD vector (GCC /
// clang vector extensions; with GCC >= 12 on x86-64 Linux compiled for AVX-512, AVX2 and
// baseline x86-64), in double precision, with its own exp. Charts [N, N] per kind, s <= t:
//   CR(s, t) right complete (head s), CL(s, t) left complete (head t),
//   IR(s, t) = inner(s, t) + arc[s][t], IL(s, t) = inner(s, t) + arc[t][s],
//   inner(s, t) = log Σ_{j<w} exp(CR(s, s+j) + CL(s+j+1, t))
//   CR(s, t)    = log Σ_{j<w} exp(IR(s, s+1+j) + CR(s+1+j, t))    (j = w-1: IR(s, t))
//   CL(s, t)    = log Σ_{j<w} exp(CL(s, s+j) + IL(s+j, t))        (j = 0: IL(s, t))
// (the same sums as the chart layout above, I(s, w) being the last / first term of the
// complete spans). The softmax weights of every sum's w terms are kept (packed by width and
// start) for the outside pass and the Hessian-vector product; single-root items close
// ROOT's right span only at their end (CR(0, t) = -inf, weights 0, for t != last).
#if defined(__GNUC__)
#define STRUCTATTN_FUSED_EISNER 1  // STRUCTATTN_CLONES: _kernels.h
#endif

#ifdef STRUCTATTN_FUSED_EISNER
constexpr int64_t kTrees = 8;
// kTrees doubles or integers, one per tree; aligned(8): no 64-byte alignment assumed
typedef double Vec __attribute__((vector_size(kTrees * sizeof(double)), aligned(8)));
typedef int64_t IVec __attribute__((vector_size(kTrees * sizeof(int64_t)), aligned(8)));

inline Vec splat(double x) { return Vec{} + x; }

// The fused loops compute on Pack<P>: the kTrees lanes of a Vec as kTrees / P vectors of P
// doubles, P the widest vector the clone computes in (8 on x86-64-v4, 4 on x86-64-v3, 2 on
// baseline x86-64: one instantiation per target, STRUCTATTN_PER_TARGET in _kernels.h).
// Without AVX-512, GCC keeps a Vec (512 bits) in memory, not registers, moves it through
// the stack between operations (mixed-width stores and loads that stall store forwarding)
// and does its comparisons and selects lane by lane with scalar code and branches: what
// made the x86-64-v3 and baseline clones of the fused path several times slower than the v4
// clone (#42). Each part of a Pack is a native vector in a register, loaded from and stored
// to the Vec charts (same layout) part by part.
// Only operations every clone has as vector instructions: no conversion between double and
// int64 lanes (AVX-512DQ only) and no arithmetic right shift of int64 lanes (AVX-512F
// only). Integers in [-2^51, 2^51] go between the two by the magic number 1.5 * 2^52: the
// double k + magic has the bits of the int64 bits(magic) + k. Bits move between the types
// by vector casts, which GCC and clang define as bit copies.
constexpr double kMagic = 0x1.8p52;
constexpr int64_t kMagicBits = 0x4338000000000000;  // the bits of kMagic

#define STRUCTATTN_INLINE __attribute__((always_inline)) inline
#define STRUCTATTN_PARTS _Pragma("GCC unroll 8") for (int k = 0; k < kTrees / P; ++k)

template <int P>
struct Pack {  // kTrees doubles
  typedef double Part __attribute__((vector_size(P * sizeof(double)), aligned(8)));
  Part v[kTrees / P];
  // (a vector of doubles may alias the doubles of a Vec: GCC's and clang's vector types
  // take the alias set of their element type)
  static STRUCTATTN_INLINE Pack load(const Vec* p) {
    Pack out;
    const double* x = reinterpret_cast<const double*>(p);
    STRUCTATTN_PARTS out.v[k] = *reinterpret_cast<const Part*>(x + k * P);
    return out;
  }
  STRUCTATTN_INLINE void store(Vec* p) const {
    double* x = reinterpret_cast<double*>(p);
    STRUCTATTN_PARTS *reinterpret_cast<Part*>(x + k * P) = v[k];
  }
  static STRUCTATTN_INLINE Pack splat(double x) {
    Pack out;
    STRUCTATTN_PARTS out.v[k] = Part{} + x;
    return out;
  }
};

template <int P>
struct IPack {  // kTrees int64 (comparison masks: all ones or zero; bits of doubles)
  typedef int64_t Part __attribute__((vector_size(P * sizeof(int64_t)), aligned(8)));
  Part v[kTrees / P];
  static STRUCTATTN_INLINE IPack splat(int64_t x) {
    IPack out;
    STRUCTATTN_PARTS out.v[k] = Part{} + x;
    return out;
  }
};

#define STRUCTATTN_PACK_OP(In, Out, op)                                               \
  template <int P>                                                                    \
  STRUCTATTN_INLINE Out<P> operator op(const In<P>& a, const In<P>& b) {              \
    Out<P> out;                                                                       \
    STRUCTATTN_PARTS out.v[k] = a.v[k] op b.v[k];                                     \
    return out;                                                                       \
  }
STRUCTATTN_PACK_OP(Pack, Pack, +)
STRUCTATTN_PACK_OP(Pack, Pack, -)
STRUCTATTN_PACK_OP(Pack, Pack, *)
STRUCTATTN_PACK_OP(Pack, Pack, /)
STRUCTATTN_PACK_OP(Pack, IPack, <)
STRUCTATTN_PACK_OP(Pack, IPack, >)
STRUCTATTN_PACK_OP(Pack, IPack, ==)
STRUCTATTN_PACK_OP(Pack, IPack, !=)
STRUCTATTN_PACK_OP(IPack, IPack, +)
STRUCTATTN_PACK_OP(IPack, IPack, -)
STRUCTATTN_PACK_OP(IPack, IPack, &)
STRUCTATTN_PACK_OP(IPack, IPack, |)
#undef STRUCTATTN_PACK_OP
template <int P>
STRUCTATTN_INLINE Pack<P> operator+(const Pack<P>& a, double b) { return a + Pack<P>::splat(b); }
template <int P>
STRUCTATTN_INLINE Pack<P> operator-(const Pack<P>& a, double b) { return a - Pack<P>::splat(b); }
template <int P>
STRUCTATTN_INLINE Pack<P> operator*(const Pack<P>& a, double b) { return a * Pack<P>::splat(b); }
template <int P>
STRUCTATTN_INLINE Pack<P> operator*(double a, const Pack<P>& b) { return Pack<P>::splat(a) * b; }
template <int P>
STRUCTATTN_INLINE Pack<P> operator/(double a, const Pack<P>& b) { return Pack<P>::splat(a) / b; }
template <int P>
STRUCTATTN_INLINE Pack<P>& operator+=(Pack<P>& a, const Pack<P>& b) { return a = a + b; }
template <int P>
STRUCTATTN_INLINE IPack<P> operator+(const IPack<P>& a, int64_t b) { return a + IPack<P>::splat(b); }
template <int P>
STRUCTATTN_INLINE IPack<P> operator-(const IPack<P>& a, int64_t b) { return a - IPack<P>::splat(b); }
template <int P>
STRUCTATTN_INLINE IPack<P> operator&(const IPack<P>& a, int64_t b) { return a & IPack<P>::splat(b); }
template <int P>
STRUCTATTN_INLINE IPack<P> operator|(const IPack<P>& a, int64_t b) { return a | IPack<P>::splat(b); }

// mask ? x : y, lane by lane
template <int P>
STRUCTATTN_INLINE Pack<P> select(const IPack<P>& mask, const Pack<P>& x, const Pack<P>& y) {
  Pack<P> out;
  STRUCTATTN_PARTS out.v[k] = mask.v[k] ? x.v[k] : y.v[k];
  return out;
}
template <int P>
STRUCTATTN_INLINE IPack<P> select(const IPack<P>& mask, const IPack<P>& x, const IPack<P>& y) {
  IPack<P> out;
  STRUCTATTN_PARTS out.v[k] = mask.v[k] ? x.v[k] : y.v[k];
  return out;
}
template <int P>
STRUCTATTN_INLINE IPack<P> bits_of(const Pack<P>& x) {  // the bits of doubles
  IPack<P> out;
  STRUCTATTN_PARTS out.v[k] = (typename IPack<P>::Part)x.v[k];
  return out;
}
template <int P>
STRUCTATTN_INLINE Pack<P> doubles_of(const IPack<P>& x) {  // doubles with these bits
  Pack<P> out;
  STRUCTATTN_PARTS out.v[k] = (typename Pack<P>::Part)x.v[k];
  return out;
}
template <int P>
STRUCTATTN_INLINE IPack<P> shift_left(const IPack<P>& x, int n) {
  IPack<P> out;
  STRUCTATTN_PARTS out.v[k] = x.v[k] << n;
  return out;
}
template <int P>
STRUCTATTN_INLINE IPack<P> shift_right_logical(const IPack<P>& x, int n) {
  typedef uint64_t U __attribute__((vector_size(P * sizeof(uint64_t)), aligned(8)));
  IPack<P> out;
  STRUCTATTN_PARTS out.v[k] = (typename IPack<P>::Part)((U)x.v[k] >> n);
  return out;
}

// (STRUCTATTN_PER_TARGET, _kernels.h: one function per target with its width P)

// exp(x) for x <= 0 (-inf and x < -708, where the result would be below 1e-307, give 0): a
// Cody-Waite reduction x = n log 2 + r, |r| <= log(2) / 2, and the Taylor polynomial of
// degree 13 (relative error below 1e-16 + rounding).
template <int P>
STRUCTATTN_INLINE Pack<P> exp_lanes(const Pack<P>& x) {
  using V = Pack<P>;
  const V floor = V::splat(-708.0);
  const IPack<P> under = x < floor;
  const V xc = select(under, floor, x);
  const V magic = V::splat(kMagic);  // adding it rounds to an integer
  const V shifted = xc * 1.4426950408889634 + magic;  // n + magic, n in [-1022, 0]
  const V n = shifted - magic;
  const V r = (xc - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
  V p = V::splat(1.0 / 6227020800.0);  // 1/13!
  const double coef[] = {1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
                         1.0 / 362880.0,    1.0 / 40320.0,    1.0 / 5040.0,
                         1.0 / 720.0,       1.0 / 120.0,      1.0 / 24.0,
                         1.0 / 6.0,         0.5,              1.0,
                         1.0};
#pragma GCC unroll 16
  for (double c : coef) p = p * r + c;
  const IPack<P> two_n = shift_left(bits_of(shifted) + (1023 - kMagicBits), 52);  // 2^n
  return select(under, V::splat(0.0), p * doubles_of(two_n));
}

// Memory of the fused path, recycled: on this VM a fresh multi-megabyte allocation pays its
// page faults at every call (glibc gives the freed memory back to the system), about half
// of the inside pass at N = 21. At most kPoolBytes are kept; the pool is never destroyed
// (buffers owned by Python objects may be released after static destructors ran).
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool;
    return *pool;
  }
  Vec* take(int64_t n) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      in_use_ += n;
      peak_ = std::max(peak_, in_use_);
      for (auto it = free_.begin(); it != free_.end(); ++it)
        if (it->first == n) {
          Vec* p = it->second;
          held_ -= n;
          free_.erase(it);
          return p;
        }
    }
    return new Vec[n];
  }
  // Kept for the next take of the same size; when the pool is full the oldest buffers held
  // make room (buffers of sizes no longer asked for, say the last batch's N, would
  // otherwise fill it for good, and every larger buffer after them would be freed and
  // allocated afresh, page faults included, at every call: 2-2.6x at N = 62 after
  // N = 61, #42).
  void give(Vec* p, int64_t n) {
    std::vector<std::pair<int64_t, Vec*>> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      in_use_ -= n;
      if (n * static_cast<int64_t>(sizeof(Vec)) <= kPoolBytes) {
        size_t first = 0;
        while ((held_ + n) * static_cast<int64_t>(sizeof(Vec)) > kPoolBytes) {
          held_ -= free_[first].first;
          evicted.push_back(free_[first++]);
        }
        free_.erase(free_.begin(), free_.begin() + static_cast<std::ptrdiff_t>(first));
        free_.emplace_back(n, p);
        held_ += n;
        p = nullptr;
      }
    }
    for (const auto& old : evicted) delete[] old.second;
    delete[] p;
  }
  // bytes in live buffers: (now, the most since the last reset_peak)
  std::pair<int64_t, int64_t> usage() {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t bytes = sizeof(Vec);
    return {in_use_ * bytes, peak_ * bytes};
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    peak_ = in_use_;
  }

 private:
  static constexpr int64_t kPoolBytes = int64_t{64} << 20;
  std::mutex mutex_;
  std::vector<std::pair<int64_t, Vec*>> free_;
  int64_t held_ = 0;    // vectors in free_
  int64_t in_use_ = 0;  // vectors in live buffers (what the profiler of PyTorch's allocator
  int64_t peak_ = 0;    // does not see; benchmarks/timing.py adds it)
};

// n vectors from the pool (uninitialised), given back on destruction
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(int64_t n) : data_(Pool::get().take(std::max<int64_t>(n, 1))), size_(std::max<int64_t>(n, 1)) {}
  Buffer(Buffer&& other) noexcept : data_(other.data_), size_(other.size_) {
    other.data_ = nullptr;
  }
  Buffer& operator=(Buffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (data_ != nullptr) Pool::get().give(data_, size_);
  }
  Vec* get() const { return data_; }
  Vec& operator[](int64_t i) const { return data_[i]; }
  Buffer& zero() {
    std::fill(data_, data_ + size_, splat(0.0));
    return *this;
  }

 private:
  Vec* data_ = nullptr;
  int64_t size_ = 0;
};

// Offsets of the packed weights: the w terms of the span (s, s + w) start at base[w] + s w.
std::vector<int64_t> term_bases(int64_t size) {
  std::vector<int64_t> base(size + 1, 0);
  for (int64_t w = 1; w < size; ++w) base[w + 1] = base[w] + w * (size - w);
  return base;
}

// Up to kTrees items of a chunk.
struct Group {
  std::vector<int64_t> items;  // its batch items, one per lane (lanes beyond: padding)
  int64_t span = 0;            // 1 + the largest last position: the passes stop there
  Vec last{};                  // index of each item's last position (padding lanes: span - 1)
  Buffer chart;    // CR, CL, IR, IL [4, N, N] (IR, IL: s < t only)
  int64_t kept = 0;  // the widths 1 .. kept keep their weights (the others are recomputed)
  Buffer weights;   // the three sums' softmax weights (inner, CR, CL) [3, T], if kept
  Buffer inner;     // inner(s, t) [N, N] when some weights are not kept
};

enum Kind : int64_t { kCR = 0, kCL = 1, kIR = 2, kIL = 3, kInner = 4 };

// The group of items[first .. first + kTrees) (longest first; ``lp``: every item's last
// position): its items, span and lanes' last positions, charts not yet allocated.
Group make_group(const std::vector<int64_t>& items, size_t first, const int64_t* lp) {
  Group g;
  g.items.assign(items.begin() + first, items.begin() + std::min(items.size(), first + kTrees));
  g.span = lp[g.items[0]] + 1;
  g.last = splat(static_cast<double>(g.span - 1));
  for (size_t l = 0; l < g.items.size(); ++l) g.last[l] = static_cast<double>(lp[g.items[l]]);
  return g;
}

// log(x) for x = 0 (-inf), NaN (NaN) or x >= 1 (a sum of exps whose largest is 1): x = 2^k m with
// m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(f), f = (m - 1) / (m + 1), |f| < 0.172, by its
// series to f^23 (relative error below 1e-17 + rounding).
template <int P>
STRUCTATTN_INLINE Pack<P> log_lanes(const Pack<P>& x) {
  using V = Pack<P>;
  const IPack<P> bits = bits_of(x);
  IPack<P> k = shift_right_logical(bits, 52) - 1023;  // x >= 0: no sign bit
  V m = doubles_of((bits & ((int64_t{1} << 52) - 1)) | (int64_t{1023} << 52));  // [1, 2)
  const IPack<P> high = m > V::splat(1.4142135623730951);
  m = select(high, m * 0.5, m);
  k = select(high, k + 1, k);
  const V f = (m - 1.0) / (m + 1.0), f2 = f * f;
  V series = V::splat(1.0 / 23.0);
#pragma GCC unroll 16
  for (int i = 21; i >= 1; i -= 2) series = series * f2 + 1.0 / i;
  const V k_real = doubles_of(k + kMagicBits) - kMagic;  // |k| <= 1075: (k + magic) - magic
  const V out = k_real * 0.6931471805599453 + 2.0 * f * series;
  const V zero = V::splat(0.0);
  return select(x > zero, out, select(x == zero, V::splat(kNegInf), x));  // NaN stays NaN
}

// log Σ exp(x[j]) over w terms per lane, x (with max m) replaced by the softmax weights.
template <int P>
STRUCTATTN_INLINE Pack<P> log_sum_exp(Vec* x, int64_t w, const Pack<P>& m) {
  using V = Pack<P>;
  const V zero = V::splat(0.0);
  const V shift = select(m == V::splat(kNegInf), zero, m);
  V sum = zero;
  for (int64_t j = 0; j < w; ++j) {
    const V e = exp_lanes(V::load(x + j) - shift);
    e.store(x + j);
    sum += e;
  }
  // a NaN term (a NaN score, #37.10) makes the sum, every weight and the log NaN, as
  // PyTorch's logsumexp and softmax do (the max m skips NaN)
  const IPack<P> positive = sum > zero;
  const V inv = select(positive, 1.0 / select(positive, sum, V::splat(1.0)),
                       select(sum == zero, zero, sum));
  for (int64_t j = 0; j < w; ++j) (V::load(x + j) * inv).store(x + j);
  return shift + log_lanes(sum);  // -inf if every term is
}

// the larger of a and m per lane (m where a is NaN: the running max skips NaN)
template <int P>
STRUCTATTN_INLINE Pack<P> max_of(const Pack<P>& a, const Pack<P>& m) {
  return select(a > m, a, m);
}

// Inside pass of one group: chart and weights from the arcs a[h * N + m].
template <int P>
STRUCTATTN_INLINE void fused_inside_lanes(Group& g, const Vec* a, int64_t size, bool multiroot,
                                          int64_t kept) {
  using V = Pack<P>;
  const int64_t nn = size * size;
  // (the spans s + w < span only: the weights are packed for the group's span, not the
  // charts' stride)
  const std::vector<int64_t> base = term_bases(g.span);
  g.chart = Buffer(4 * nn);  // every entry read is written first
  kept = g.kept = std::max<int64_t>(0, std::min(kept, g.span - 1));
  const int64_t stride = base[kept + 1];  // the kept weights of one sum
  if (kept > 0) g.weights = Buffer(3 * stride);
  if (kept < g.span - 1) g.inner = Buffer(nn);
  Buffer scratch = kept < g.span - 1 ? Buffer(3 * size) : Buffer();  // the others' weights
  Vec* ch = g.chart.get();
  Vec* cr = ch + kCR * nn;
  Vec* cl = ch + kCL * nn;
  Vec* ir = ch + kIR * nn;
  Vec* il = ch + kIL * nn;
  for (int64_t s = 0; s < size; ++s) cr[s * size + s] = cl[s * size + s] = splat(0.0);
  const V ninf = V::splat(kNegInf);
  const V last = V::load(&g.last);
  for (int64_t w = 1; w < g.span; ++w) {
    for (int64_t s = 0; s + w < g.span; ++s) {
      const int64_t t = s + w, st = s * size + t, off = base[w] + s * w;
      const bool keep = w <= kept;
      const int64_t terms = keep ? stride : size;
      Vec* p = keep ? g.weights.get() + off : scratch.get();  // inner
      V m = ninf;
      for (int64_t j = 0; j < w; ++j) {
        const V x = V::load(cr + s * size + s + j) + V::load(cl + (s + j + 1) * size + t);
        x.store(p + j);
        m = max_of(x, m);
      }
      const V inner = log_sum_exp(p, w, m);
      if (!keep) inner.store(g.inner.get() + st);
      (inner + V::load(a + st)).store(ir + st);
      (inner + V::load(a + t * size + s)).store(il + st);
      p += terms;  // CR
      m = ninf;
      for (int64_t j = 0; j < w; ++j) {
        const V x = V::load(ir + s * size + s + 1 + j) + V::load(cr + (s + 1 + j) * size + t);
        x.store(p + j);
        m = max_of(x, m);
      }
      V right = log_sum_exp(p, w, m);
      if (!multiroot && s == 0) {  // ROOT's right span closes only at the item's end
        const IPack<P> open = last != V::splat(static_cast<double>(t));
        right = select(open, ninf, right);
        for (int64_t j = 0; j < w; ++j)
          select(open, V::splat(0.0), V::load(p + j)).store(p + j);
      }
      right.store(cr + st);
      p += terms;  // CL
      m = ninf;
      for (int64_t j = 0; j < w; ++j) {
        const V x = V::load(cl + s * size + s + j) + V::load(il + (s + j) * size + t);
        x.store(p + j);
        m = max_of(x, m);
      }
      log_sum_exp(p, w, m).store(cl + st);
    }
  }
}
STRUCTATTN_PER_TARGET(fused_inside,
                      (Group & g, const Vec* a, int64_t size, bool multiroot, int64_t kept),
                      (g, a, size, multiroot, kept))

// exp(x - total): the softmax weight of a term x of a sum (0 where the sum is -inf)
template <int P>
STRUCTATTN_INLINE Pack<P> weight_of(const Pack<P>& x, const Pack<P>& total) {
  using V = Pack<P>;
  const V zero = V::splat(0.0);
  const V d = x - total;  // NaN where both are -inf: replaced below
  const V e = exp_lanes(select(d > zero, zero, d));
  return select(total == V::splat(kNegInf), zero, e);
}

// The softmax weights of span (s, s + w)'s three sums (inner, CR, CL), w each: in the kept
// weights, or recomputed from the inside chart into scratch [3 w] (one exp per term, where
// kept weights cost 24 w bytes of memory per span and lane).
struct SpanWeights {
  const Vec* inner;
  const Vec* cr;
  const Vec* cl;
};
template <int P>
STRUCTATTN_INLINE SpanWeights span_weights(const Group& g, int64_t size,
                                           const std::vector<int64_t>& base, int64_t w,
                                           int64_t s, Vec* scratch) {
  using V = Pack<P>;
  if (w <= g.kept) {
    const Vec* p = g.weights.get() + base[w] + s * w;
    const int64_t terms = base[g.kept + 1];
    return {p, p + terms, p + 2 * terms};
  }
  const int64_t nn = size * size, t = s + w, st = s * size + t;
  const Vec* ch = g.chart.get();
  const Vec* cr = ch + kCR * nn;
  const Vec* cl = ch + kCL * nn;
  const Vec* ir = ch + kIR * nn;
  const Vec* il = ch + kIL * nn;
  const V inner = V::load(g.inner.get() + st), right = V::load(cr + st), left = V::load(cl + st);
  for (int64_t j = 0; j < w; ++j) {
    weight_of(V::load(cr + s * size + s + j) + V::load(cl + (s + j + 1) * size + t), inner)
        .store(scratch + j);
    weight_of(V::load(ir + s * size + s + 1 + j) + V::load(cr + (s + 1 + j) * size + t), right)
        .store(scratch + w + j);
    weight_of(V::load(cl + s * size + s + j) + V::load(il + (s + j) * size + t), left)
        .store(scratch + 2 * w + j);
  }
  return {scratch, scratch + w, scratch + 2 * w};
}

// x[j] += p[j] * gp and y[j] += p[j] * gp (the two pieces of the terms of one sum)
template <int P>
STRUCTATTN_INLINE void add_weighted(const Vec* p, const Pack<P>& gp, Vec* x, Vec* y,
                                    int64_t y_stride, int64_t w) {
  using V = Pack<P>;
  for (int64_t j = 0; j < w; ++j) {
    const V v = V::load(p + j) * gp;
    (V::load(x + j) + v).store(x + j);
    (V::load(y + j * y_stride) + v).store(y + j * y_stride);
  }
}

// Outside pass of one group: grad [4, N, N] (zeroed, seeded at CR(0, last)) becomes the
// gradient of the seeded log Z with respect to every span.
template <int P>
STRUCTATTN_INLINE void fused_outside_lanes(const Group& g, Vec* grad, int64_t size) {
  using V = Pack<P>;
  const int64_t nn = size * size;
  const std::vector<int64_t> base = term_bases(g.span);
  Buffer scratch(3 * size);  // not std::vector<Vec>: a template argument drops aligned(8)
  Vec* cr = grad + kCR * nn;
  Vec* cl = grad + kCL * nn;
  Vec* ir = grad + kIR * nn;
  Vec* il = grad + kIL * nn;
  for (int64_t w = g.span - 1; w > 0; --w) {
    for (int64_t s = 0; s + w < g.span; ++s) {
      const int64_t t = s + w, st = s * size + t;
      const SpanWeights weights = span_weights<P>(g, size, base, w, s, scratch.get());
      // CR: its uses are all wider, final
      add_weighted(weights.cr, V::load(cr + st), ir + s * size + s + 1,
                   cr + (s + 1) * size + t, size, w);
      add_weighted(weights.cl, V::load(cl + st), cl + s * size + s, il + s * size + t, size,
                   w);  // CL
      // inner: IR(s, t) and IL(s, t) are final now
      add_weighted(weights.inner, V::load(ir + st) + V::load(il + st), cr + s * size + s,
                   cl + (s + 1) * size + t, size, w);
    }
  }
}
STRUCTATTN_PER_TARGET(fused_outside, (const Group& g, Vec* grad, int64_t size), (g, grad, size))

// Σ_j p[j] (x[j] + y[j * y_stride])
template <int P>
STRUCTATTN_INLINE Pack<P> weighted_sum(const Vec* p, const Vec* x, const Vec* y,
                                       int64_t y_stride, int64_t w) {
  using V = Pack<P>;
  V sum = V::splat(0.0);
  for (int64_t j = 0; j < w; ++j)
    sum += V::load(p + j) * (V::load(x + j) + V::load(y + j * y_stride));
  return sum;
}

// v = p[j] ((x[j] + y[j] - dp) gp + dgp) added to dx[j] and dy[j] (y, dy: every y_stride)
template <int P>
STRUCTATTN_INLINE void add_tangents(const Vec* p, const Vec* x, const Vec* y, const Pack<P>& dp,
                                    const Pack<P>& gp, const Pack<P>& dgp, Vec* dx, Vec* dy,
                                    int64_t y_stride, int64_t w) {
  using V = Pack<P>;
  for (int64_t j = 0; j < w; ++j) {
    const int64_t yj = j * y_stride;
    const V v = V::load(p + j) * ((V::load(x + j) + V::load(y + yj) - dp) * gp + dgp);
    (V::load(dx + j) + v).store(dx + j);
    (V::load(dy + yj) + v).store(dy + yj);
  }
}

// Hessian-vector product of one group: tangents of the inside pass (tan [5, N, N], zeroed),
// then of the outside pass (d_grad [4, N, N], zeroed), with grad the unit outside charts and
// d the direction d[h * N + m]. With p_j the weights of the terms A_j + B_j of a sum P:
//   dot P = Σ_j p_j (dot A_j + dot B_j),  dot g(A_j) += p_j ((dot A_j + dot B_j - dot P) g(P)
//   + dot g(P)) (the same for B_j); the arcs' entries are dot g(IR), dot g(IL).
template <int P>
STRUCTATTN_INLINE void fused_hvp_lanes(const Group& g, const Vec* grad, const Vec* d, Vec* tan,
                                       Vec* d_grad, int64_t size) {
  using V = Pack<P>;
  const int64_t nn = size * size;
  const std::vector<int64_t> base = term_bases(g.span);
  Buffer scratch(3 * size);  // not std::vector<Vec>: a template argument drops aligned(8)
  Vec* tcr = tan + kCR * nn;
  Vec* tcl = tan + kCL * nn;
  Vec* tir = tan + kIR * nn;
  Vec* til = tan + kIL * nn;
  Vec* tin = tan + kInner * nn;
  for (int64_t w = 1; w < g.span; ++w) {
    for (int64_t s = 0; s + w < g.span; ++s) {
      const int64_t t = s + w, st = s * size + t;
      const SpanWeights weights = span_weights<P>(g, size, base, w, s, scratch.get());
      const V inner =
          weighted_sum<P>(weights.inner, tcr + s * size + s, tcl + (s + 1) * size + t, size, w);
      inner.store(tin + st);
      (inner + V::load(d + st)).store(tir + st);
      (inner + V::load(d + t * size + s)).store(til + st);
      weighted_sum<P>(weights.cr, tir + s * size + s + 1, tcr + (s + 1) * size + t, size, w)
          .store(tcr + st);
      weighted_sum<P>(weights.cl, tcl + s * size + s, til + s * size + t, size, w)
          .store(tcl + st);
    }
  }
  const Vec* gcr = grad + kCR * nn;
  const Vec* gcl = grad + kCL * nn;
  const Vec* gir = grad + kIR * nn;
  const Vec* gil = grad + kIL * nn;
  Vec* dcr = d_grad + kCR * nn;
  Vec* dcl = d_grad + kCL * nn;
  Vec* dir = d_grad + kIR * nn;
  Vec* dil = d_grad + kIL * nn;
  for (int64_t w = g.span - 1; w > 0; --w) {
    for (int64_t s = 0; s + w < g.span; ++s) {
      const int64_t t = s + w, st = s * size + t;
      const SpanWeights weights = span_weights<P>(g, size, base, w, s, scratch.get());
      int64_t x = s * size + s + 1, y = (s + 1) * size + t;  // CR
      add_tangents(weights.cr, tir + x, tcr + y, V::load(tcr + st), V::load(gcr + st),
                   V::load(dcr + st), dir + x, dcr + y, size, w);
      x = s * size + s, y = s * size + t;  // CL
      add_tangents(weights.cl, tcl + x, til + y, V::load(tcl + st), V::load(gcl + st),
                   V::load(dcl + st), dcl + x, dil + y, size, w);
      x = s * size + s, y = (s + 1) * size + t;  // inner
      add_tangents(weights.inner, tcr + x, tcl + y, V::load(tin + st),
                   V::load(gir + st) + V::load(gil + st), V::load(dir + st) + V::load(dil + st),
                   dcr + x, dcl + y, size, w);
    }
  }
}
STRUCTATTN_PER_TARGET(fused_hvp,
                      (const Group& g, const Vec* grad, const Vec* d, Vec* tan, Vec* d_grad,
                       int64_t size),
                      (g, grad, d, tan, d_grad, size))

// The row stride of the fused path's [N, N] charts and lanes: N, or a little more where N
// rows of eight-tree vectors (64 bytes each) come to about a multiple of 4 KB (N mod 64 in
// {0, 1, 2}): there the column walks of the loops (one row per step) fell on the same cache
// sets and 4 KB store-to-load aliasing, and N = 64-66 took twice the time of N = 63 or 67
// (#42; benchmarks/README.md, "Wave 6"). The loops stop at each group's span, so the padding
// rows and columns cost memory only.
int64_t chart_stride(int64_t size) {
  int64_t ld = size;
  while (ld % 64 <= 2 && ld >= 64) ++ld;
  return ld;
}

// the [N, N] matrices src[item] (contiguous, float or double) of the given items into lanes
// [ld, ld] (ld: chart_stride(N); the padding zero)
template <typename scalar_t>
std::vector<Vec> to_lanes(const scalar_t* src, const std::vector<int64_t>& items, int64_t size,
                          int64_t ld) {
  const int64_t nn = size * size;
  std::vector<Vec> out(ld * ld, splat(0.0));
  for (size_t l = 0; l < items.size(); ++l)
    for (int64_t h = 0; h < size; ++h)
      for (int64_t m = 0; m < size; ++m) out[h * ld + m][l] = src[items[l] * nn + h * size + m];
  return out;
}

// The arcs' entries of charts [4, ld, ld] (IR(s, t) -> [s][t], IL(s, t) -> [t][s],
// t < span) into the [N, N] matrices dst[item] (contiguous, double, zeroed), times
// seed[item] if given.
void from_lanes(const Vec* charts, int64_t size, int64_t ld, int64_t span,
                const std::vector<int64_t>& items, const double* seed, double* dst) {
  const int64_t nn = size * size, area = ld * ld;
  const Vec* ir = charts + kIR * area;
  const Vec* il = charts + kIL * area;
  for (size_t l = 0; l < items.size(); ++l) {
    const int64_t item = items[l];
    const double scale = seed ? seed[item] : 1.0;
    for (int64_t s = 0; s < span; ++s)
      for (int64_t t = s + 1; t < span; ++t) {
        dst[item * nn + s * size + t] = ir[s * ld + t][l] * scale;
        dst[item * nn + t * size + s] = il[s * ld + t][l] * scale;
      }
  }
}

// The largest of x[j] + y[j * y_stride] over j < w per lane and its first j (ties: the
// first, as the PyTorch code's argmax).
template <int P>
STRUCTATTN_INLINE void best_split(const Vec* x, const Vec* y, int64_t y_stride, int64_t w,
                                  Pack<P>& m, Pack<P>& arg) {
  using V = Pack<P>;
  m = V::splat(kNegInf), arg = V::splat(0.0);
  for (int64_t j = 0; j < w; ++j) {
    const V v = V::load(x + j) + V::load(y + j * y_stride);
    const IPack<P> up = v > m;
    m = select(up, v, m);
    arg = select(up, V::splat(static_cast<double>(j)), arg);
  }
}

// MAP (max-plus) inside pass of one group, the same recurrences as fused_inside with max
// for log Σ exp: chart [4, N, N] and the best split j of every sum (inner, CR, CL) [3, N, N]
// (the first of tied splits, as the PyTorch code's argmax).
template <int P>
STRUCTATTN_INLINE void fused_max_lanes(Vec* ch, Vec* best, const Vec* a, const Vec& last,
                                       int64_t size, int64_t span, bool multiroot) {
  using V = Pack<P>;
  const int64_t nn = size * size;
  Vec* cr = ch + kCR * nn;
  Vec* cl = ch + kCL * nn;
  Vec* ir = ch + kIR * nn;
  Vec* il = ch + kIL * nn;
  Vec* b_in = best;
  Vec* b_cr = best + nn;
  Vec* b_cl = best + 2 * nn;
  for (int64_t s = 0; s < span; ++s) cr[s * size + s] = cl[s * size + s] = splat(0.0);
  const V ends = V::load(&last);
  for (int64_t w = 1; w < span; ++w) {
    for (int64_t s = 0; s + w < span; ++s) {
      const int64_t t = s + w, st = s * size + t;
      V m, arg;
      best_split(cr + s * size + s, cl + (s + 1) * size + t, size, w, m, arg);
      arg.store(b_in + st);
      (m + V::load(a + st)).store(ir + st);
      (m + V::load(a + t * size + s)).store(il + st);
      best_split(ir + s * size + s + 1, cr + (s + 1) * size + t, size, w, m, arg);
      if (!multiroot && s == 0)  // ROOT's right span closes only at the item's end
        m = select(ends != V::splat(static_cast<double>(t)), V::splat(kNegInf), m);
      m.store(cr + st);
      arg.store(b_cr + st);
      best_split(cl + s * size + s, il + s * size + t, size, w, m, arg);
      m.store(cl + st);
      arg.store(b_cl + st);
    }
  }
}
STRUCTATTN_PER_TARGET(fused_max,
                      (Vec * ch, Vec* best, const Vec* a, const Vec& last, int64_t size,
                       int64_t span, bool multiroot),
                      (ch, best, a, last, size, span, multiroot))

// The best tree of lane l from the best splits: heads[m] = h for its arcs (positions
// 1..last), by an explicit stack of spans (kind, s, t).
void fused_backtrack(const Vec* best, int64_t size, int64_t l, int64_t last, int64_t* heads) {
  const int64_t nn = size * size;
  std::vector<std::array<int64_t, 3>> stack{{kCR, 0, last}};
  while (!stack.empty()) {
    const auto [kind, s, t] = stack.back();
    stack.pop_back();
    if (s == t) continue;
    const int64_t st = s * size + t;
    if (kind == kCR) {
      const auto j = static_cast<int64_t>(best[nn + st][l]);
      stack.push_back({kIR, s, s + 1 + j});
      stack.push_back({kCR, s + 1 + j, t});
    } else if (kind == kCL) {
      const auto j = static_cast<int64_t>(best[2 * nn + st][l]);
      stack.push_back({kCL, s, s + j});
      stack.push_back({kIL, s + j, t});
    } else {
      if (kind == kIR) heads[t] = s;
      else heads[s] = t;
      const auto j = static_cast<int64_t>(best[st][l]);
      stack.push_back({kCR, s, s + j});
      stack.push_back({kCL, s + j + 1, t});
    }
  }
}
#endif  // STRUCTATTN_FUSED_EISNER
#ifdef STRUCTATTN_FUSED_EISNER
constexpr int64_t kFusedUnit = kTrees;  // the fused path's chunks hold whole groups
#else
constexpr int64_t kFusedUnit = 1;
#endif

// The batch items of each chunk (one chunk per thread), longest first: the items sorted by
// length (longest first, stable), taken in units of ``unit`` consecutive items (the fused
// path's groups of kTrees; 1 for the ATen path). A fused group costs its longest item's
// length^3 (its lanes run together); the groups are dealt to the chunks costliest first,
// each to the least loaded chunk (any group may go to any chunk: its lanes are gathered
// anyway). An ATen chunk runs every item over its longest item's charts, so it costs items
// x that length^3 (an upper bound: the items shorter than the first skip their finished
// widths); its items are cut into consecutive blocks so that the costliest chunk costs
// least, so each chunk's items have similar lengths, and a batch of equal lengths is cut
// into contiguous ranges of equal size (or fewer ranges than threads when that leaves the
// largest the same, e.g. 5 items on 4 threads: 2 + 2 + 1). Scores beyond an item's length
// are not read when its chunk's charts are cut shorter (nor in the fused path): NaN or inf
// there reaches its marginals or not depending on the chunking; the distributions mask the
// padding before they call.
std::vector<std::vector<int64_t>> chunk_items(const Tensor& last, int64_t unit) {
  const Tensor ends = last.to(at::kLong).contiguous();
  const int64_t batch = ends.size(0);
  const int64_t* lp = ends.data_ptr<int64_t>();
  std::vector<int64_t> order(batch);
  for (int64_t i = 0; i < batch; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return lp[a] > lp[b]; });
  double total = 0;  // the work of the batch's items (chunk_starts: one chunk if small)
  for (int64_t i = 0; i < batch; ++i) total += std::pow(static_cast<double>(lp[i] + 1), 3);
  const int64_t count = static_cast<int64_t>(chunk_starts(batch, total).size()) - 1;
  const int64_t units = (batch + unit - 1) / unit;
  std::vector<double> cube(units);  // per unit: its longest item's length^3
  for (int64_t u = 0; u < units; ++u)
    cube[u] = std::pow(static_cast<double>(lp[order[u * unit]] + 1), 3);
  if (unit > 1) {  // fused groups, costliest first, each to the least loaded chunk (e.g.
    // groups of length^3 64, 51, 33, 20 on two threads: 64 + 20 and 51 + 33, where
    // consecutive blocks could do no better than 64 and 51 + 33 + 20)
    std::vector<std::vector<int64_t>> items(std::max<int64_t>(count, 1));
    std::vector<double> load(items.size(), 0.0);
    for (int64_t u = 0; u < units; ++u) {
      const int64_t c = std::min_element(load.begin(), load.end()) - load.begin();
      load[c] += cube[u];
      for (int64_t i = u * unit; i < std::min(batch, (u + 1) * unit); ++i)
        items[c].push_back(order[i]);
    }
    while (items.size() > 1 && items.back().empty()) items.pop_back();
    return items;
  }
  // the ATen path (units are items): the first item of each chunk when no chunk may cost
  // more than ``limit``, a chunk from item a to item u costing (u - a + 1) x cube[a]
  const auto cut = [&](double limit) {
    std::vector<int64_t> firsts;
    for (int64_t u = 0; u < batch; ++u)
      if (firsts.empty() ||
          static_cast<double>(u - firsts.back() + 1) * cube[firsts.back()] > limit)
        firsts.push_back(u);
    return firsts;
  };
  double high = batch > 0 ? static_cast<double>(batch) * cube[0] : 0.0;  // one chunk
  double low = batch > 0 ? cube[0] : 0.0;  // no chunk costs less than its costliest item
  std::vector<int64_t> firsts = cut(high);
  if (count > 1) {
    for (int iter = 0; iter < 64 && high - low > 0.5; ++iter) {  // the least feasible limit
      const double mid = (low + high) / 2;
      if (static_cast<int64_t>(cut(mid).size()) <= count) {
        high = mid;
      } else {
        low = mid;
      }
    }
    firsts = cut(high);
  }
  std::vector<std::vector<int64_t>> items(std::max<size_t>(firsts.size(), 1));
  for (size_t c = 0; c < firsts.size(); ++c) {
    const int64_t to = c + 1 < firsts.size() ? firsts[c + 1] : batch;
    for (int64_t i = firsts[c]; i < to; ++i) items[c].push_back(order[i]);
  }
  return items;
}

Tensor index_tensor(const std::vector<int64_t>& items) {
  return at::tensor(at::ArrayRef<int64_t>(items), at::TensorOptions().dtype(at::kLong));
}

}  // namespace

// The state of one batch after the inside pass (read-only afterwards: any number of outside
// passes and HVPs, from any thread, may use it).
struct EisnerState {
  std::vector<Chunk> chunks;
  int64_t count = 0;      // chunks, one per thread (for_each_chunk)
  int64_t size_full = 0;  // N of the batch (ATen path: a chunk's charts may be smaller)
#ifdef STRUCTATTN_FUSED_EISNER
  std::vector<std::vector<Group>> fused;  // per chunk (fused path; chunks is then empty)
  Tensor logz;                            // [B] (fused path)
  int64_t size = 0;  // N of the batch
  int64_t ld = 0;    // the charts' row stride (chart_stride)
#endif

  // the chunks' results [k, ...] (their items in chunk order) in batch order: concatenated
  // when the chunks are consecutive ranges (no index copies)
  Tensor in_batch_order(const std::vector<Tensor>& parts) const {
    int64_t next = 0;
    bool ranges = true;
    for (const Chunk& c : chunks) {
      ranges = ranges && (c.first == next || c.index.size(0) == 0);
      next += c.index.size(0);
    }
    if (ranges) return cat_chunks(parts);
    std::vector<int64_t> shape = parts[0].sizes().vec();
    shape[0] = next;
    Tensor out = at::empty(shape, parts[0].options());
    for (size_t i = 0; i < chunks.size(); ++i) out.index_copy_(0, chunks[i].index, parts[i]);
    return out;
  }
};

// One outside pass's charts, kept for the HVP (owned by the marginals' autograd node).
struct EisnerOutside {
  std::vector<Outside> chunks;
#ifdef STRUCTATTN_FUSED_EISNER
  std::vector<std::vector<Buffer>> fused;  // per chunk and group: unit outside charts
#endif
};

// The inside pass; ``fused``: by the fused path (where it is compiled in), else by the ATen
// path; either keeps the split weights of the widths 1 .. ``kept_widths`` (the outside pass
// and the Hessian-vector product recompute the others: memory O(B N^2) instead of
// O(B N^3); dependency._kept_widths picks how many).
std::shared_ptr<EisnerState> eisner_inside(const Tensor& arc_scores, const Tensor& last,
                                           bool multiroot, int64_t kept_widths, bool fused) {
  TORCH_CHECK(arc_scores.dim() == 3 && arc_scores.size(1) == arc_scores.size(2),
              "arc_scores must be [B, N, N]");
  auto state = std::make_shared<EisnerState>();
  const std::vector<std::vector<int64_t>> items = chunk_items(last, fused ? kFusedUnit : 1);
  const int64_t count = static_cast<int64_t>(items.size());
  state->count = count;
  const Tensor arcs = arc_scores.contiguous();
  const int64_t size = arcs.size(1);
#ifdef STRUCTATTN_FUSED_EISNER
  if (fused) {
    const int64_t ld = chart_stride(size);
    state->size = size;
    state->ld = ld;
    state->fused.resize(count);
    const Tensor ends = last.to(at::kLong).contiguous();
    const int64_t* lp = ends.data_ptr<int64_t>();
    Tensor logz = at::empty({arcs.size(0)}, arcs.options().dtype(at::kDouble));
    double* zp = logz.data_ptr<double>();
    const Tensor arcs_d = arcs.to(at::kDouble).contiguous();
    const double* ap = arcs_d.data_ptr<double>();
    for_each_chunk(count, [&](int64_t i) {
      const std::vector<int64_t>& mine = items[i];
      for (size_t first = 0; first < mine.size(); first += kTrees) {
        Group g = make_group(mine, first, lp);
        const std::vector<Vec> a = to_lanes(ap, g.items, size, ld);
        fused_inside(g, a.data(), ld, multiroot, kept_widths);
        for (size_t l = 0; l < g.items.size(); ++l)  // CR(0, last)
          zp[g.items[l]] = g.chart[lp[g.items[l]]][l];
        state->fused[i].push_back(std::move(g));
      }
    });
    state->logz = logz.to(arcs.scalar_type());
    return state;
  }
#endif
  state->chunks.resize(count);
  state->size_full = size;
  for (int64_t i = 0; i < count; ++i) {
    Chunk& c = state->chunks[i];
    c.multiroot = multiroot;
    c.index = index_tensor(items[i]);
    bool consecutive = !items[i].empty();
    for (size_t j = 1; j < items[i].size(); ++j)
      consecutive = consecutive && items[i][j] == items[i][0] + static_cast<int64_t>(j);
    c.first = consecutive ? items[i][0] : -1;
    c.last = c.take(last);
    // the chunk's charts end at its longest item (items sorted longest first), so that
    // the chunks of shorter items skip the span starts beyond their ends
    c.size = items[i].empty() ? size : std::min(size, c.last[0].item<int64_t>() + 1);
    c.active = active_counts(c.last, c.size);
  }
  for_each_chunk(count, [&](int64_t i) {
    Chunk& c = state->chunks[i];
    inside(c, c.take_square(arcs), kept_widths);
  });
  return state;
}

Tensor eisner_log_partition(const EisnerState& state) {
#ifdef STRUCTATTN_FUSED_EISNER
  // a copy: the caller's autograd node owns the state, so an output the state also held
  // would keep that node (and every chart) alive forever (a reference cycle through C++)
  if (!state.fused.empty()) return state.logz.clone();
#endif
  std::vector<Tensor> parts;
  for (const Chunk& c : state.chunks)
    parts.push_back(c.chart.select(1, 1).select(2, 0).gather(1, c.last.unsqueeze(-1)).squeeze(-1));
  return state.in_batch_order(parts);
}

// seed[b] * marginals [B, N, N], and (if keep) the outside charts for eisner_hvp
std::pair<Tensor, std::shared_ptr<EisnerOutside>> outside_pass(const EisnerState& state,
                                                               const Tensor& seed, bool keep) {
  const int64_t count = state.count;
  std::shared_ptr<EisnerOutside> kept;
  if (keep) kept = std::make_shared<EisnerOutside>();
#ifdef STRUCTATTN_FUSED_EISNER
  if (!state.fused.empty()) {
    const int64_t size = state.size, ld = state.ld, nn = ld * ld;
    if (keep) kept->fused.resize(count);
    const Tensor seeds = seed.to(at::kDouble).contiguous();
    const double* sp = seeds.data_ptr<double>();
    Tensor out = at::zeros({seed.size(0), size, size}, seed.options().dtype(at::kDouble));
    double* op = out.data_ptr<double>();
    for_each_chunk(state.count, [&](int64_t i) {
      for (const Group& g : state.fused[i]) {
        Buffer grad = std::move(Buffer(4 * nn).zero());
        for (size_t l = 0; l < g.items.size(); ++l)  // d log Z / d CR(0, last) = 1
          grad[kCR * nn + static_cast<int64_t>(g.last[l])][l] = 1.0;
        fused_outside(g, grad.get(), ld);
        from_lanes(grad.get(), size, ld, g.span, g.items, sp, op);
        if (keep) kept->fused[i].push_back(std::move(grad));
      }
    });
    return {out.to(seed.scalar_type()), kept};
  }
#endif
  if (keep) kept->chunks.resize(count);
  std::vector<Tensor> parts(count);
  for_each_chunk(state.count, [&](int64_t i) {
    const Chunk& c = state.chunks[i];
    parts[i] = c.pad_square(outside(c, c.take(seed), keep ? &kept->chunks[i] : nullptr),
                            state.size_full);
  });
  return {state.in_batch_order(parts), kept};
}

Tensor eisner_outside(const EisnerState& state, const Tensor& seed) {
  return outside_pass(state, seed, false).first;
}

std::pair<Tensor, std::shared_ptr<EisnerOutside>> eisner_marginals(const EisnerState& state,
                                                                   const Tensor& seed) {
  return outside_pass(state, seed, true);
}

Tensor eisner_hvp(const EisnerState& state, const EisnerOutside& outside_charts,
                  const Tensor& direction) {
  const Tensor dirs = direction.contiguous();
#ifdef STRUCTATTN_FUSED_EISNER
  if (!state.fused.empty()) {
    TORCH_CHECK(outside_charts.fused.size() == state.fused.size(),
                "eisner_hvp: the outside charts come from another batch");
    const int64_t size = state.size, ld = state.ld, nn = ld * ld;
    Tensor out = at::zeros({dirs.size(0), size, size}, dirs.options().dtype(at::kDouble));
    double* op = out.data_ptr<double>();
    const Tensor dirs_d = dirs.to(at::kDouble).contiguous();
    const double* dp = dirs_d.data_ptr<double>();
    for_each_chunk(state.count, [&](int64_t i) {
      const std::vector<Group>& groups = state.fused[i];
      Buffer tan = std::move(Buffer(5 * nn).zero()), d_grad(4 * nn);  // tan: its diagonal stays 0
      for (size_t k = 0; k < groups.size(); ++k) {
        const Group& g = groups[k];
        const std::vector<Vec> d = to_lanes(dp, g.items, size, ld);
        d_grad.zero();
        fused_hvp(g, outside_charts.fused[i][k].get(), d.data(), tan.get(), d_grad.get(), ld);
        from_lanes(d_grad.get(), size, ld, g.span, g.items, nullptr, op);
      }
    });
    return out.to(dirs.scalar_type());
  }
#endif
  const int64_t count = static_cast<int64_t>(state.chunks.size());
  TORCH_CHECK(static_cast<int64_t>(outside_charts.chunks.size()) == count,
              "eisner_hvp: the outside charts come from another batch");
  std::vector<Tensor> parts(count);
  for_each_chunk(state.count, [&](int64_t i) {
    const Chunk& c = state.chunks[i];
    parts[i] = c.pad_square(hvp(c, outside_charts.chunks[i], c.take_square(dirs)),
                            state.size_full);
  });
  return state.in_batch_order(parts);
}

#ifdef STRUCTATTN_FUSED_EISNER
// The best projective tree: (score [B] in the input's dtype, heads [B, N] with -1 at ROOT
// and padding); max-plus in double on kTrees items at once, the batch split over threads.
std::pair<Tensor, Tensor> eisner_map(const Tensor& arc_scores, const Tensor& last,
                                     bool multiroot) {
  TORCH_CHECK(arc_scores.dim() == 3 && arc_scores.size(1) == arc_scores.size(2),
              "arc_scores must be [B, N, N]");
  TORCH_CHECK(arc_scores.scalar_type() == at::kFloat || arc_scores.scalar_type() == at::kDouble,
              "arc_scores must be float32 or float64");
  const int64_t batch = arc_scores.size(0), size = arc_scores.size(1);
  const int64_t ld = chart_stride(size), nn = ld * ld;
  const Tensor arcs = arc_scores.contiguous();  // read as is: no double copy
  const Tensor ends = last.to(at::kLong).contiguous();
  const int64_t* lp = ends.data_ptr<int64_t>();
  Tensor score = at::empty({batch}, arcs.options().dtype(at::kDouble));
  Tensor heads = at::full({batch, size}, -1, ends.options());
  double* zp = score.data_ptr<double>();
  int64_t* hp = heads.data_ptr<int64_t>();
  const std::vector<std::vector<int64_t>> items = chunk_items(ends, kTrees);
  const bool single = arcs.scalar_type() == at::kFloat;
  const float* fp = single ? arcs.data_ptr<float>() : nullptr;
  const double* dp = single ? nullptr : arcs.data_ptr<double>();
  for_each_chunk(static_cast<int64_t>(items.size()), [&](int64_t i) {
    const std::vector<int64_t>& mine = items[i];
    if (mine.empty()) return;
    Buffer chart(4 * nn), best(3 * nn);
    for (size_t first = 0; first < mine.size(); first += kTrees) {
      const Group g = make_group(mine, first, lp);  // its charts: this chunk's buffers
      std::vector<Vec> a =
          single ? to_lanes(fp, g.items, size, ld) : to_lanes(dp, g.items, size, ld);
      for (int64_t h = 0; h < size; ++h) a[h * ld] = splat(kNegInf);  // no arc into ROOT
      fused_max(chart.get(), best.get(), a.data(), g.last, ld, g.span, multiroot);
      for (size_t l = 0; l < g.items.size(); ++l) {
        const int64_t item = g.items[l], end = lp[item];
        zp[item] = chart[kCR * nn + end][l];  // CR(0, last)
        fused_backtrack(best.get(), ld, static_cast<int64_t>(l), end, hp + item * size);
      }
    }
  });
  return {score.to(arc_scores.scalar_type()), heads};
}
#endif

void bind_eisner(pybind11::module& m) {
  pybind11::class_<EisnerState, std::shared_ptr<EisnerState>>(m, "EisnerState");
  pybind11::class_<EisnerOutside, std::shared_ptr<EisnerOutside>>(m, "EisnerOutside");
  m.def("eisner_inside", &eisner_inside, "inside pass: state", pybind11::arg("arc_scores"),
        pybind11::arg("last"), pybind11::arg("multiroot"), pybind11::arg("kept_widths"),
        pybind11::arg("fused"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("eisner_log_partition", &eisner_log_partition, "log Z [B] from the state");
  m.def("eisner_outside", &eisner_outside, "seed[b] * marginals [B, N, N]",
        pybind11::arg("state"), pybind11::arg("seed"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("eisner_marginals", &eisner_marginals,
        "(seed[b] * marginals [B, N, N], the outside charts for eisner_hvp)",
        pybind11::arg("state"), pybind11::arg("seed"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("eisner_hvp", &eisner_hvp, "Hessian of log Z times direction [B, N, N]",
        pybind11::arg("state"), pybind11::arg("outside"), pybind11::arg("direction"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
#ifdef STRUCTATTN_FUSED_EISNER
  m.def("fused_memory", [] { return Pool::get().usage(); },
        "bytes in the fused path's live buffers (outside PyTorch's allocator): (now, peak)");
  m.def("fused_memory_reset_peak", [] { Pool::get().reset_peak(); },
        "start fused_memory's peak afresh");
  m.def("eisner_map", &eisner_map, "(best tree's score [B], its heads [B, N], -1 at ROOT)",
        pybind11::arg("arc_scores"), pybind11::arg("last"), pybind11::arg("multiroot"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
#endif
}

}  // namespace structattn
