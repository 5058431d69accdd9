// Native kernels for tea_pipeline (LightTEA). Each has a pure-PyTorch fallback in tea_pipeline/kernels.py that
// computes the same thing; tests/tea/test_tea_kernels.py checks them against each other.
//
// weighted_segment_sum: the triple view's per-projection sums, all projections in one pass over the tuples.
//   out[h, j*m + k] = sum over q in [crow[h], crow[h+1]) of w[q, j] * z[col[q], j*m + k]
// The PyTorch path runs one CSR product per projection j (D passes over the tuple list, each reading a narrow
// column block of z); here every tuple is visited once and its whole z row is streamed. With prefetch > 0 the row
// `prefetch` tuples ahead is requested from memory first (the rows come at random: at scale each one is a cache
// miss); off by default, see bench/tea/README.md (2026-12-07 evening).
//
// gathered_dot: exact scores of candidate pairs without materialising the gathered rows.
//   out[i, c] = dot(left[rows[i]], right[index[i, c]])      (rows defaults to 0..R-1; right fp32 or fp16)
//
// sinkhorn_: Sinkhorn normalisation of a sparse k-candidate matrix in place, one pass over it per iteration (the
//   column divide of one iteration, the row normalisation and the column sums of the next are fused).
//
// dice_candidates: multiset Dice of time stamps for candidate pairs, 2 * sum_tau min(c1, c2) / (|c1| + |c2|), each
//   left row's few (time, count) entries looked up in the candidates' dense count rows.
//
// topk_merge_: merges one column tile of scores into running top-k lists (sorted: value descending, then column
//   ascending), in place, so a search can compute its products in tiles of the width that keeps them efficient,
//   however many columns there are. Tiles must come in increasing column order. Once a row holds k entries, a later
//   tile's entry enters only above the row's k-th value (on a tie the held, lower column stays first), so that
//   row's scan is one comparison per entry. Until then a strided sample of the tile gives a threshold that at least
//   k entries reach (checked; if not, the whole tile is taken), so only the few entries above it are selected and
//   sorted instead of the whole row. Optionally only some rows of the tile (rows) and only allowed columns take
//   part. Scores are fp32 or bf16 (a bf16 search's tiles, read as the fp32 values they exactly are); lists are fp32. A top-k of whole rows (topk_rows in tea_pipeline/kernels.py) is one merge into empty lists.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#if defined(__F16C__) && defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
#define TEA_HAVE_F16C 1
#endif

namespace {

void check_matrix(const torch::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, name, " must have unit column stride");
}

}  // namespace

torch::Tensor weighted_segment_sum(torch::Tensor crow, torch::Tensor col, torch::Tensor w, torch::Tensor z,
                                   int64_t m, torch::Tensor out, int64_t prefetch) {
  TORCH_CHECK(crow.scalar_type() == torch::kLong && crow.dim() == 1 && crow.is_contiguous(),
              "crow must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(col.scalar_type() == torch::kLong && col.dim() == 1 && col.is_contiguous(),
              "col must be a contiguous 1-D int64 tensor");
  check_matrix(w, "w", torch::kFloat);
  check_matrix(z, "z", torch::kFloat);
  check_matrix(out, "out", torch::kFloat);
  const int64_t n = crow.size(0) - 1;
  const int64_t d = w.size(1);
  TORCH_CHECK(m > 0, "m must be positive");
  TORCH_CHECK(prefetch >= 0, "prefetch must be >= 0 (tuples ahead; 0 turns it off)");
  TORCH_CHECK(z.size(1) == d * m, "z has ", z.size(1), " columns, expected w.size(1) * m = ", d * m);
  TORCH_CHECK(out.size(0) == n && out.size(1) == d * m, "out must be ", n, " x ", d * m);
  TORCH_CHECK(w.size(0) == col.size(0), "w and col must have one row per tuple");
  const int64_t* crow_p = crow.data_ptr<int64_t>();
  const int64_t* col_p = col.data_ptr<int64_t>();
  TORCH_CHECK(n >= 0 && crow_p[0] == 0 && crow_p[n] == col.size(0), "crow must run from 0 to the number of tuples");
  if (col.numel() > 0) {
    const int64_t lo = col.min().item<int64_t>(), hi = col.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < z.size(0), "col indexes rows [", lo, ", ", hi, "] but z has ", z.size(0), " rows");
  }
  const float* w_p = w.data_ptr<float>();
  const float* z_p = z.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  const int64_t ws = w.stride(0), zs = z.stride(0), os = out.stride(0), width = d * m;
  const int64_t tuples = col.size(0), row_bytes = width * static_cast<int64_t>(sizeof(float));
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      float* o = out_p + h * os;
      std::memset(o, 0, sizeof(float) * width);
      for (int64_t q = crow_p[h]; q < crow_p[h + 1]; ++q) {
        // The z rows are read in tuple order, i.e. at random once z outgrows the caches: ask for the row
        // `prefetch` tuples ahead now, so its cache misses overlap this tuple's work instead of following it.
        if (prefetch > 0 && q + prefetch < tuples) {
          const char* ahead = reinterpret_cast<const char*>(z_p + col_p[q + prefetch] * zs);
          for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + b, 0, 0);
        }
        const float* zr = z_p + col_p[q] * zs;
        const float* wr = w_p + q * ws;
        for (int64_t j = 0; j < d; ++j) {
          const float wj = wr[j];
          float* oj = o + j * m;
          const float* zj = zr + j * m;
#pragma omp simd
          for (int64_t k = 0; k < m; ++k) oj[k] += wj * zj[k];
        }
      }
    }
  });
  return out;
}

namespace {

float dot_f32(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

float dot_f16(const float* a, const at::Half* b, int64_t n) {
  int64_t i = 0;
  float acc = 0.f;
#ifdef TEA_HAVE_F16C
  __m256 v0 = _mm256_setzero_ps(), v1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    v0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i),
                         _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i))), v0);
    v1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8),
                         _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i + 8))), v1);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(v0, v1));
  for (float x : lanes) acc += x;
#endif
  for (; i < n; ++i) acc += a[i] * static_cast<float>(b[i]);
  return acc;
}

}  // namespace

torch::Tensor gathered_dot(torch::Tensor left, torch::Tensor right, torch::Tensor index,
                           c10::optional<torch::Tensor> rows) {
  check_matrix(left, "left", torch::kFloat);
  TORCH_CHECK(right.scalar_type() == torch::kFloat || right.scalar_type() == torch::kHalf,
              "right must be float32 or float16, got ", right.scalar_type());
  check_matrix(right, "right", right.scalar_type());
  TORCH_CHECK(left.size(1) == right.size(1), "left and right must have the same width");
  TORCH_CHECK(index.scalar_type() == torch::kLong && index.dim() == 2 && index.is_contiguous(),
              "index must be a contiguous 2-D int64 tensor");
  const int64_t r = index.size(0), k = index.size(1), dim = left.size(1);
  const int64_t* rows_p = nullptr;
  torch::Tensor rows_t;
  if (rows.has_value()) {
    rows_t = rows.value();
    TORCH_CHECK(rows_t.scalar_type() == torch::kLong && rows_t.dim() == 1 && rows_t.is_contiguous() &&
                    rows_t.size(0) == r, "rows must be a contiguous int64 vector with one entry per index row");
    if (r > 0) {
      TORCH_CHECK(rows_t.min().item<int64_t>() >= 0 && rows_t.max().item<int64_t>() < left.size(0),
                  "rows out of range for left");
    }
    rows_p = rows_t.data_ptr<int64_t>();
  } else {
    TORCH_CHECK(r <= left.size(0), "index has more rows than left");
  }
  if (index.numel() > 0) {
    TORCH_CHECK(index.min().item<int64_t>() >= 0 && index.max().item<int64_t>() < right.size(0),
                "index out of range for right");
  }
  auto out = torch::empty({r, k}, left.options());
  const float* l_p = left.data_ptr<float>();
  const int64_t* i_p = index.data_ptr<int64_t>();
  float* o_p = out.data_ptr<float>();
  const int64_t ls = left.stride(0), rs = right.stride(0);
  const bool half = right.scalar_type() == torch::kHalf;
  const float* rf = half ? nullptr : right.data_ptr<float>();
  const at::Half* rh = half ? right.data_ptr<at::Half>() : nullptr;
  at::parallel_for(0, r, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* a = l_p + (rows_p ? rows_p[i] : i) * ls;
      for (int64_t c = 0; c < k; ++c) {
        const int64_t j = i_p[i * k + c];
        o_p[i * k + c] = half ? dot_f16(a, rh + j * rs, dim) : dot_f32(a, rf + j * rs, dim);
      }
    }
  });
  return out;
}

namespace {

using Entry = std::pair<float, int64_t>;

inline bool before(const Entry& a, const Entry& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// Merges row[0..c) (columns col0 + j; only where allowed[col0 + j] when allowed is given) into the sorted list
// vals/idx of k entries (idx -1 where not yet filled).
// T is float or at::BFloat16 (the scores of a bf16 search, read as the fp32 values they are exactly).
template <typename T>
void merge_row(const T* scores, int64_t c, int64_t col0, const bool* allowed, int64_t k, float* vals,
               int64_t* idx, std::vector<float>& sample, std::vector<Entry>& cand) {
  constexpr int64_t kStep = 16;
  auto row = [scores](int64_t j) { return static_cast<float>(scores[j]); };
  int64_t held = 0;
  while (held < k && idx[held] >= 0) ++held;
  cand.clear();
  auto ok = [&](int64_t j) { return allowed == nullptr || allowed[col0 + j]; };
  if (held == k) {
    const float thr = vals[k - 1];
    // Almost no entry of a later tile beats the k-th value: test 16 at a time (a branch-free, vectorised
    // comparison) and look at single entries only in the rare groups that have one.
    constexpr int64_t kGroup = 16;
    int64_t j = 0;
    for (; j + kGroup <= c; j += kGroup) {
      int hit = 0;
      for (int64_t t = 0; t < kGroup; ++t) hit |= row(j + t) > thr;
      if (!hit) continue;
      for (int64_t t = j; t < j + kGroup; ++t) {
        if (row(t) > thr && ok(t)) cand.emplace_back(row(t), col0 + t);
      }
    }
    for (; j < c; ++j) {
      if (row(j) > thr && ok(j)) cand.emplace_back(row(j), col0 + j);
    }
    if (cand.empty()) return;
  } else {
    bool filtered = false;
    if (c >= 8 * k && c / kStep >= 4 * (k / kStep + 8)) {
      sample.clear();
      for (int64_t j = 0; j < c; j += kStep) {
        if (ok(j)) sample.push_back(row(j));
      }
      // Every sample value stands for about kStep allowed entries: about twice k of them reach the
      // (2k/kStep + 8)-th largest sample value, so the threshold almost always keeps >= k entries.
      const int64_t rank = 2 * k / kStep + 8;
      if (static_cast<int64_t>(sample.size()) > rank) {
        std::nth_element(sample.begin(), sample.begin() + rank, sample.end(), std::greater<float>());
        const float thr = sample[rank];
        for (int64_t j = 0; j < c; ++j) {
          if (row(j) >= thr && ok(j)) cand.emplace_back(row(j), col0 + j);
        }
        filtered = static_cast<int64_t>(cand.size()) >= k;
      }
    }
    if (!filtered) {
      cand.clear();
      for (int64_t j = 0; j < c; ++j) {
        if (ok(j)) cand.emplace_back(row(j), col0 + j);
      }
    }
  }
  for (int64_t j = 0; j < held; ++j) cand.emplace_back(vals[j], idx[j]);
  if (static_cast<int64_t>(cand.size()) > k) {
    std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), before);
    cand.resize(k);
  }
  std::sort(cand.begin(), cand.end(), before);
  const int64_t got = static_cast<int64_t>(cand.size());
  for (int64_t j = 0; j < got; ++j) {
    vals[j] = cand[j].first;
    idx[j] = cand[j].second;
  }
  for (int64_t j = got; j < k; ++j) {
    vals[j] = -std::numeric_limits<float>::infinity();
    idx[j] = -1;
  }
}

}  // namespace

void topk_merge_(torch::Tensor sims, int64_t col0, torch::Tensor vals, torch::Tensor idx,
                 std::optional<torch::Tensor> rows, std::optional<torch::Tensor> allowed) {
  const bool bf16 = sims.scalar_type() == torch::kBFloat16;
  check_matrix(sims, "sims", bf16 ? torch::kBFloat16 : torch::kFloat);
  check_matrix(vals, "vals", torch::kFloat);
  check_matrix(idx, "idx", torch::kLong);
  TORCH_CHECK(vals.is_contiguous() && idx.is_contiguous(), "vals and idx must be contiguous");
  const int64_t k = vals.size(1), c = sims.size(1);
  const int64_t r = rows.has_value() ? rows->numel() : sims.size(0);
  TORCH_CHECK(k >= 1 && vals.size(0) == r && idx.size(0) == r && idx.size(1) == k,
              "vals and idx must both be (rows, k) with k >= 1");
  const int64_t* rows_p = nullptr;
  if (rows.has_value()) {
    TORCH_CHECK(rows->scalar_type() == torch::kLong && rows->dim() == 1 && rows->is_contiguous(),
                "rows must be a contiguous 1-D int64 tensor");
    TORCH_CHECK(r == 0 || (rows->min().item<int64_t>() >= 0 && rows->max().item<int64_t>() < sims.size(0)),
                "rows must index the rows of sims (0 .. ", sims.size(0) - 1, ")");
    rows_p = rows->data_ptr<int64_t>();
  }
  const bool* allowed_p = nullptr;
  if (allowed.has_value()) {
    TORCH_CHECK(allowed->scalar_type() == torch::kBool && allowed->dim() == 1 && allowed->is_contiguous() &&
                allowed->numel() >= col0 + c, "allowed must be a contiguous 1-D bool tensor over all columns");
    allowed_p = allowed->data_ptr<bool>();
  }
  float* v_p = vals.data_ptr<float>();
  int64_t* i_p = idx.data_ptr<int64_t>();
  const int64_t ss = sims.stride(0);
  auto merge_rows = [&](const auto* s_p) {
    at::parallel_for(0, r, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> sample;
      std::vector<Entry> cand;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t src = rows_p ? rows_p[i] : i;
        merge_row(s_p + src * ss, c, col0, allowed_p, k, v_p + i * k, i_p + i * k, sample, cand);
      }
    });
  };
  if (bf16) {
    merge_rows(sims.data_ptr<at::BFloat16>());
  } else {
    merge_rows(sims.data_ptr<float>());
  }
}

void sinkhorn_(torch::Tensor m, torch::Tensor index, int64_t num_cols, int64_t iterations) {
  TORCH_CHECK(m.device().is_cpu() && m.scalar_type() == torch::kFloat && m.dim() == 2 && m.is_contiguous(),
              "m must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(index.scalar_type() == torch::kLong && index.sizes() == m.sizes() && index.is_contiguous(),
              "index must be a contiguous int64 tensor shaped like m");
  TORCH_CHECK(iterations >= 1, "iterations must be >= 1");
  const int64_t r = m.size(0), k = m.size(1);
  if (m.numel() > 0) {
    TORCH_CHECK(index.min().item<int64_t>() >= 0 && index.max().item<int64_t>() < num_cols,
                "index out of range for num_cols=", num_cols);
  }
  float* m_p = m.data_ptr<float>();
  const int64_t* i_p = index.data_ptr<int64_t>();
  const int threads = at::get_num_threads();
  std::vector<float> partial(static_cast<size_t>(threads) * num_cols);
  std::vector<float> col(num_cols);
  // Zero sums (rows kept out, columns only they use) leave their zero entries as they are.
  auto inverse = [](float x) { return x > 0.f ? 1.f / x : 0.f; };
  // One pass: optionally divide row i by its columns' sums, then normalise it and add it to this thread's sums.
  auto pass = [&](bool divide, bool accumulate) {
    std::fill(partial.begin(), partial.end(), 0.f);
    at::parallel_for(0, r, 256, [&](int64_t begin, int64_t end) {
      float* acc = partial.data() + static_cast<size_t>(at::get_thread_num()) * num_cols;
      for (int64_t i = begin; i < end; ++i) {
        float* row = m_p + i * k;
        const int64_t* idx = i_p + i * k;
        if (divide) {
          for (int64_t c = 0; c < k; ++c) row[c] = row[c] > 0.f ? row[c] / col[idx[c]] : row[c];
        }
        if (!accumulate) continue;
        float sum = 0.f;
        for (int64_t c = 0; c < k; ++c) sum += row[c];
        const float inv = inverse(sum);
        for (int64_t c = 0; c < k; ++c) {
          row[c] *= inv;
          acc[idx[c]] += row[c];
        }
      }
    });
    if (!accumulate) return;
    for (int64_t j = 0; j < num_cols; ++j) {
      float total = 0.f;
      for (int t = 0; t < threads; ++t) total += partial[static_cast<size_t>(t) * num_cols + j];
      col[j] = total;
    }
  };
  pass(false, true);
  for (int64_t it = 1; it < iterations; ++it) pass(true, true);
  pass(true, false);
}

torch::Tensor dice_candidates(torch::Tensor crow, torch::Tensor col, torch::Tensor val, torch::Tensor totals,
                              torch::Tensor left, torch::Tensor candidates, torch::Tensor right_dense,
                              torch::Tensor right_totals) {
  TORCH_CHECK(crow.scalar_type() == torch::kLong && col.scalar_type() == torch::kLong && crow.is_contiguous() &&
                  col.is_contiguous(), "crow and col must be contiguous int64");
  TORCH_CHECK(val.scalar_type() == torch::kFloat && totals.scalar_type() == torch::kFloat && val.is_contiguous() &&
                  totals.is_contiguous(), "val and totals must be contiguous float32");
  TORCH_CHECK(left.scalar_type() == torch::kLong && left.dim() == 1 && left.is_contiguous(),
              "left must be a contiguous int64 vector");
  TORCH_CHECK(candidates.scalar_type() == torch::kLong && candidates.dim() == 2 && candidates.is_contiguous() &&
                  candidates.size(0) == left.size(0), "candidates must be contiguous int64, one row per left entity");
  check_matrix(right_dense, "right_dense", torch::kFloat);
  TORCH_CHECK(right_totals.scalar_type() == torch::kFloat && right_totals.is_contiguous() &&
                  right_totals.size(0) == right_dense.size(0), "right_totals must hold one float per right row");
  const int64_t r = candidates.size(0), k = candidates.size(1), n = crow.size(0) - 1, t = right_dense.size(1);
  if (left.numel() > 0) {
    TORCH_CHECK(left.min().item<int64_t>() >= 0 && left.max().item<int64_t>() < n, "left entity out of range");
  }
  if (candidates.numel() > 0) {
    TORCH_CHECK(candidates.min().item<int64_t>() >= 0 && candidates.max().item<int64_t>() < right_dense.size(0),
                "candidate out of range");
  }
  if (col.numel() > 0) {
    TORCH_CHECK(col.min().item<int64_t>() >= 0 && col.max().item<int64_t>() < t, "time id out of range");
  }
  auto out = torch::empty({r, k}, right_dense.options());
  const int64_t *crow_p = crow.data_ptr<int64_t>(), *col_p = col.data_ptr<int64_t>();
  const int64_t *left_p = left.data_ptr<int64_t>(), *cand_p = candidates.data_ptr<int64_t>();
  const float *val_p = val.data_ptr<float>(), *tot_p = totals.data_ptr<float>();
  const float *dense_p = right_dense.data_ptr<float>(), *rtot_p = right_totals.data_ptr<float>();
  const int64_t ds = right_dense.stride(0);
  float* out_p = out.data_ptr<float>();
  at::parallel_for(0, r, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = left_p[i], lo = crow_p[e], hi = crow_p[e + 1];
      for (int64_t c = 0; c < k; ++c) {
        const int64_t j = cand_p[i * k + c];
        const float* row = dense_p + j * ds;
        float num = 0.f;
        for (int64_t q = lo; q < hi; ++q) num += std::min(row[col_p[q]], val_p[q]);
        const float den = tot_p[e] + rtot_p[j];
        out_p[i * k + c] = den > 0.f ? 2.f * num / std::max(den, 1e-12f) : 0.f;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("weighted_segment_sum", &weighted_segment_sum, "Per-projection weighted CSR sums in one pass",
             pybind11::arg("crow"), pybind11::arg("col"), pybind11::arg("w"), pybind11::arg("z"), pybind11::arg("m"),
             pybind11::arg("out"), pybind11::arg("prefetch") = 0);
  module.def("gathered_dot", &gathered_dot, "Dot products of left rows with gathered right rows");
  module.def("topk_merge_", &topk_merge_, "Merge a column tile of scores into running top-k lists, in place");
  module.def("sinkhorn_", &sinkhorn_, "Sinkhorn iterations on a sparse k-candidate matrix, in place");
  module.def("dice_candidates", &dice_candidates, "Multiset Dice of time stamps for candidate pairs");
}
