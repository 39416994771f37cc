// Shared by the C++ kernels of structattn (built on first use by _extension.py): running a
// function over the batch in one chunk per thread. Per-chunk work is a sequence of small
// tensor operations (too small for ATen's intra-op threads, and in the LAPACK case a
// sequential loop over the batch), so independent chunks are what uses the cores.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <vector>

// SIMD clones. With GCC >= 12 on x86-64 Linux the vector loops (STRUCTATTN_CLONES) are
// compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2) and baseline x86-64, and the loader
// picks the highest the CPU supports. A one-target build (STRUCTATTN_KERNEL_TARGET, see
// _extension.py: -march=<target> -DSTRUCTATTN_ONE_TARGET=<target>) compiles them for its
// -march only, so that every clone can be built, tested and timed on one machine.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && defined(__x86_64__) && \
    defined(__linux__) && !defined(STRUCTATTN_ONE_TARGET)
#define STRUCTATTN_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define STRUCTATTN_HAS_CLONES 1
#else
#define STRUCTATTN_CLONES
#endif

// One function per target, calling its body name##_lanes<P> (always inlined, so compiled
// for that target) with the target's vector width P in doubles (8 on x86-64-v4, 4 on
// x86-64-v3, 2 on baseline x86-64): function multiversioning with the targets and
// priorities of STRUCTATTN_CLONES; one width for a one-target build (its -march). Used by
// the fused Eisner loops (_eisner.cpp) and the Gauss-Jordan inversion (_matrix_tree.cpp).
#ifdef STRUCTATTN_HAS_CLONES
#define STRUCTATTN_PER_TARGET(name, params, args)                                          \
  __attribute__((target("arch=x86-64-v4"))) void name params { name##_lanes<8> args; } \
  __attribute__((target("arch=x86-64-v3"))) void name params { name##_lanes<4> args; } \
  __attribute__((target("default"))) void name params { name##_lanes<2> args; }
#else
#define STRUCTATTN_PER_TARGET(name, params, args) \
  void name params { name##_lanes<::structattn::kNativeWidth> args; }
#endif

namespace structattn {

#if defined(__AVX512F__)
constexpr int kNativeWidth = 8;  // a one-target build's width (STRUCTATTN_PER_TARGET)
#elif defined(__AVX__)
constexpr int kNativeWidth = 4;
#else
constexpr int kNativeWidth = 2;
#endif

// Below this much work (``work`` of chunk_starts: about the multiply-adds of the batch) the
// batch runs as one chunk: waking a second thread and joining the chunks' outputs cost more
// than they save (measured on the non-projective log Z fwd+bwd: benchmarks/README.md,
// "Figures behind the thresholds in structs/").
// (tests set it to 0 through set_parallel_work to run small batches in several chunks).
inline std::atomic<double>& parallel_work() {
  static std::atomic<double> value{1e5};
  return value;
}

// Chunk boundaries of a batch: starts[i] .. starts[i + 1], one chunk per thread (one chunk
// when a non-negative ``work`` is below parallel_work()).
inline std::vector<int64_t> chunk_starts(int64_t batch, double work = -1.0) {
  const bool small = work >= 0.0 && work < parallel_work().load();
  const int64_t threads = at::in_parallel_region() || small ? 1 : at::get_num_threads();
  const int64_t count = std::max<int64_t>(1, std::min<int64_t>(threads, batch));
  std::vector<int64_t> starts;
  for (int64_t i = 0; i <= count; ++i) starts.push_back(batch * i / count);
  return starts;
}

// fn(i) for every chunk i in 0 .. count, in parallel, without recording gradients.
template <typename F>
void for_each_chunk(int64_t count, const F& fn) {
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    at::NoGradGuard no_grad;
    for (int64_t i = begin; i < end; ++i) fn(i);
  });
}

// fn(i, start, length) for every chunk i (the batch items start .. start + length), in
// parallel, without recording gradients.
template <typename F>
void for_chunks(const std::vector<int64_t>& starts, const F& fn) {
  for_each_chunk(static_cast<int64_t>(starts.size()) - 1,
                 [&](int64_t i) { fn(i, starts[i], starts[i + 1] - starts[i]); });
}

inline at::Tensor cat_chunks(const std::vector<at::Tensor>& parts) {
  return parts.size() == 1 ? parts[0] : at::cat(parts, 0);
}

// fn(i, start, length) -> Tensor for every chunk, concatenated along the batch.
template <typename F>
at::Tensor chunked(const std::vector<int64_t>& starts, const F& fn) {
  std::vector<at::Tensor> parts(starts.size() - 1);
  for_chunks(starts, [&](int64_t i, int64_t start, int64_t length) {
    parts[i] = fn(i, start, length);
  });
  return cat_chunks(parts);
}

void bind_eisner(pybind11::module& m);
void bind_matrix_tree(pybind11::module& m);
void bind_chain(pybind11::module& m);

}  // namespace structattn
