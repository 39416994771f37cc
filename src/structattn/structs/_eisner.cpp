// Eisner's inside pass, outside pass and Hessian-vector product for projective dependency
// trees (log semiring), the same algorithm and chart layout as the PyTorch code in
// dependency.py (read the comments there), written against ATen so that
//   * the ~90 small tensor operations per span width pay no Python overhead, and
//   * the batch is split into one chunk per thread, each chunk running all span widths on
//     its own (the per-width tensors are too small for ATen's intra-op threads).
// Built on first use by structattn.structs._extension (torch.utils.cpp_extension.load).
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
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
struct Chunk {
  Tensor chart;  // [B, 6, N, N]
  Tensor inner;  // [B, N, N] (empty when the weights are kept)
  Tensor last;   // [B]
  bool multiroot = true;
  std::vector<std::pair<Tensor, Tensor>> weights;  // per width 1 .. N-1, if kept

  Tensor open_root(int64_t w) const { return multiroot ? Tensor() : last.ne(w); }

  std::pair<Tensor, Tensor> split_weights(const Layout& lay, int64_t w) const {
    if (!weights.empty()) return weights[w - 1];
    const int64_t n = lay.size - w;
    Tensor terms = lay.terms(chart, w);
    terms.select(1, 0).select(1, w - 1).fill_(kNegInf);  // the I(s, w) slots
    terms.select(1, 2).select(1, 0).fill_(kNegInf);
    Tensor sums = groups(lay.comp(chart, w).select(1, 0),
                         inner.select(1, w).narrow(1, 0, n).unsqueeze(1));
    return split_weights_from(terms, Tensor(), sums, lay.inc(chart, w), open_root(w));
  }
};

void inside(Chunk& c, const Tensor& arcs, bool keep_weights) {
  const int64_t batch = arcs.size(0), size = arcs.size(1);
  c.chart = at::full({batch, 6, size, size}, kNegInf, arcs.options());
  c.chart.narrow(1, 1, 2).select(2, 0).fill_(0.0);  // complete spans of width 0
  c.chart.narrow(1, 3, 2).select(2, size - 1).fill_(0.0);
  c.inner = keep_weights ? at::empty({0}, arcs.options())
                         : at::full({batch, size, size}, kNegInf, arcs.options());
  const Layout lay(c.chart);
  const double floor = lowest(arcs);
  for (int64_t w = 1; w < size; ++w) {
    const int64_t n = size - w;
    Tensor terms = lay.terms(c.chart, w);
    Tensor inc = lay.inc(c.chart, w);
    if (keep_weights) {  // one exp of the terms gives the sums and the split weights
      Tensor top = terms.amax({2}, true).clamp_min_(floor);
      Tensor e = terms.sub_(top).exp_();
      auto [scale, r] = inside_width(top, e.sum({2}), arcs_of_width(arcs, w), inc,
                                     lay.comp(c.chart, w), c.last, c.multiroot, w);
      c.weights.emplace_back(e.mul_(scale), r);
      continue;
    }
    Tensor sums = at::logsumexp(terms, {2});
    at::add_out(inc, sums.narrow(1, 1, 1), arcs_of_width(arcs, w));
    Tensor comp = at::logaddexp(even_groups(sums), inc);
    c.inner.select(1, w).narrow(1, 0, n).copy_(sums.select(1, 1));
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
  const Layout lay(grad);
  const bool keep_parents = keep != nullptr && !c.weights.empty();
  for (int64_t w = lay.size - 1; w > 0; --w) {
    auto [p, r] = c.split_weights(lay, w);
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
  const Layout lay(tangent);
  const bool keep = !c.weights.empty() && !o.parents.empty();
  std::vector<std::pair<Tensor, Tensor>> sums;  // per width (dot terms, dot sums [B, 3, 1, n])
  for (int64_t w = 1; w < lay.size; ++w) {
    auto [p, r] = c.split_weights(lay, w);
    Tensor d_terms = lay.terms(tangent, w);
    Tensor d_sums = (p * d_terms).sum(2);  // [B, 3, n]; groups 0, 2 become dot C below
    hvp_inside_width(d_sums, arcs_of_width(direction, w), r, lay.inc(tangent, w),
                     lay.comp(tangent, w));
    if (keep) sums.emplace_back(d_terms, d_sums.unsqueeze(2));
  }
  Tensor d_grad = at::zeros_like(tangent);
  for (int64_t w = lay.size - 1; w > 0; --w) {
    auto [p, r] = c.split_weights(lay, w);
    Tensor d_terms, d_parent, g_parent;  // [B, 3, w, n], [B, 3, 1, n] (dot P), (g(P))
    if (keep) {
      std::tie(d_terms, d_parent) = sums.back();
      sums.pop_back();
      g_parent = o.parents[lay.size - 1 - w];
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

}  // namespace

// The state of one batch after the inside pass (read-only afterwards: any number of outside
// passes and HVPs, from any thread, may use it).
struct EisnerState {
  std::vector<Chunk> chunks;
  std::vector<int64_t> starts;  // chunk i is the batch items starts[i] .. starts[i + 1]
};

// One outside pass's charts, kept for the HVP (owned by the marginals' autograd node).
struct EisnerOutside {
  std::vector<Outside> chunks;
};

std::shared_ptr<EisnerState> eisner_inside(const Tensor& arc_scores, const Tensor& last,
                                           bool multiroot, bool keep_weights) {
  TORCH_CHECK(arc_scores.dim() == 3 && arc_scores.size(1) == arc_scores.size(2),
              "arc_scores must be [B, N, N]");
  auto state = std::make_shared<EisnerState>();
  state->starts = chunk_starts(arc_scores.size(0));
  const int64_t count = static_cast<int64_t>(state->starts.size()) - 1;
  state->chunks.resize(count);
  for (Chunk& c : state->chunks) c.multiroot = multiroot;
  const Tensor arcs = arc_scores.contiguous();
  for_chunks(state->starts, [&](int64_t i, int64_t start, int64_t length) {
    Chunk& c = state->chunks[i];
    c.last = last.narrow(0, start, length);
    inside(c, arcs.narrow(0, start, length), keep_weights);
  });
  return state;
}

Tensor eisner_log_partition(const EisnerState& state) {
  std::vector<Tensor> parts;
  for (const Chunk& c : state.chunks)
    parts.push_back(c.chart.select(1, 1).select(2, 0).gather(1, c.last.unsqueeze(-1)).squeeze(-1));
  return cat_chunks(parts);
}

// seed[b] * marginals [B, N, N], and (if keep) the outside charts for eisner_hvp
std::pair<Tensor, std::shared_ptr<EisnerOutside>> outside_pass(const EisnerState& state,
                                                               const Tensor& seed, bool keep) {
  const int64_t count = static_cast<int64_t>(state.chunks.size());
  std::shared_ptr<EisnerOutside> kept;
  if (keep) {
    kept = std::make_shared<EisnerOutside>();
    kept->chunks.resize(count);
  }
  Tensor out = chunked(state.starts, [&](int64_t i, int64_t start, int64_t length) {
    return outside(state.chunks[i], seed.narrow(0, start, length),
                   keep ? &kept->chunks[i] : nullptr);
  });
  return {out, kept};
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
  const int64_t count = static_cast<int64_t>(state.chunks.size());
  TORCH_CHECK(static_cast<int64_t>(outside_charts.chunks.size()) == count,
              "eisner_hvp: the outside charts come from another batch");
  const Tensor dirs = direction.contiguous();
  return chunked(state.starts, [&](int64_t i, int64_t start, int64_t length) {
    return hvp(state.chunks[i], outside_charts.chunks[i], dirs.narrow(0, start, length));
  });
}

void bind_eisner(pybind11::module& m) {
  pybind11::class_<EisnerState, std::shared_ptr<EisnerState>>(m, "EisnerState");
  pybind11::class_<EisnerOutside, std::shared_ptr<EisnerOutside>>(m, "EisnerOutside");
  m.def("eisner_inside", &eisner_inside, "inside pass: state", pybind11::arg("arc_scores"),
        pybind11::arg("last"), pybind11::arg("multiroot"), pybind11::arg("keep_weights"),
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
}

}  // namespace structattn
