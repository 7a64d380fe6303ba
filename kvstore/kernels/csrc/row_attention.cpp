// Decode attention over KV rows read in place (kvstore/kernels/cpu_rows.py calls it; cpu_ext.py builds it).
//
// Sequence s (one new token: G query heads per KV head) attends to the KV rows it names, ids
// of the row views k and v ([R, H, D], rows strided, heads contiguous): no row is copied out of
// the pool first. Its rows are its own, own_rows[s, 0:own_lens[s]], after the shared rows of
// its item: item b is a group of sequences, members[b, 0:counts[b]], whose contexts begin with
// the same rows shared_rows[b, 0:shared_lens[b]] (none for a sequence alone). A group's shared
// rows are read once for all its members' queries. One task per (item, KV head), spread over
// the calling thread's OpenMP count: scores over K (each row read once for every query that
// attends to it), one softmax per query over all its rows, then the weighted sum over V. The next paged block's rows are prefetched, since
// consecutive blocks lie anywhere in the pool.
//
// With AVX2 and FMA (and a head dim that is a multiple of 8), both passes go a tile of 64 rows
// at a time, so that a tile stays in cache while every query of the item reads it: scores in
// blocks of 4 queries x 2 rows (each vector loaded once for 8 products, the 8 sums reduced
// together), the weighted sum with 2 queries x 32 floats of the head held in registers over the
// tile. Each (query, row) product and each query's running sum are computed the same way
// wherever the query falls in a block (a short block repeats a query and drops its results). On the 2-core EPYC a decode
// call of 32 Gemma-3-270M sequences in 4 groups took 0.89 against 1.37 ms (its window of 480
// shared rows) and 1.87 against 2.83 ms (1,024), 32 SmolLM2 sequences 1.27 against 2.01 ms.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVSTORE_ROWS_AVX2 1
#endif

namespace {

constexpr int64_t kPrefetchRows = 16;  // a block of 16 tokens ahead
constexpr int64_t kTileRows = 64;  // rows read for every query before the next ones (64 KiB of K at 256 floats)

// exp(x) for x <= 0 (a score minus its row's maximum), in a form the compiler vectorizes (std::exp
// is a scalar call): x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two for exactness), n rounded by
// adding and subtracting 1.5 * 2^23 (no call: it vectorizes), e^r by its degree-6 minimax polynomial (Cephes' expf coefficients, relative error ~1e-7), 2^n from the
// exponent bits. Below -87 (e^x < 2^-126) it returns 0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5 * 2^23
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x <= -87.0f ? 0.0f : e * two_n;
}

inline void prefetch_row(const float* row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(p + c);
}

#ifdef KVSTORE_ROWS_AVX2
// The eight sums of a0 ... a7's lanes, in order, as one vector.
inline __m256 sum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// dots[m * 2 + r] = q_m . k_r for 4 queries and 2 rows of d floats (d a multiple of 8): each
// row's and query's vector loaded once for 8 products, the 8 sums reduced together.
inline void dots_4x2(const float* const* q, const float* k0, const float* k1, int64_t d, float* dots) {
  __m256 a[8];
  for (auto& x : a) x = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 r0 = _mm256_loadu_ps(k0 + i), r1 = _mm256_loadu_ps(k1 + i);
    for (int m = 0; m < 4; ++m) {
      const __m256 qm = _mm256_loadu_ps(q[m] + i);
      a[2 * m] = _mm256_fmadd_ps(qm, r0, a[2 * m]);
      a[2 * m + 1] = _mm256_fmadd_ps(qm, r1, a[2 * m + 1]);
    }
  }
  _mm256_storeu_ps(dots, sum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
}
#endif

inline void check_ids(const torch::Tensor& ids, const torch::Tensor& lens, int64_t limit, int64_t min_len,
                      const char* what, const char* bound) {
  const int64_t n = ids.size(0), width = ids.size(1);
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < n; ++b) {
    TORCH_CHECK(lp[b] >= min_len && lp[b] <= width, what, " length ", b, " = ", lp[b], " is outside [", min_len,
                ", ", width, "]");
    for (int64_t j = 0; j < lp[b]; ++j) {
      TORCH_CHECK(ip[b * width + j] >= 0 && ip[b * width + j] < limit, what, "[", b, ", ", j, "] = ",
                  ip[b * width + j], " is outside the ", limit, " ", bound);
    }
  }
}

inline void check_index(const torch::Tensor& t, const torch::Tensor& lens, const char* name, const char* lens_name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kInt64 && t.is_contiguous(), name,
              " must be a contiguous int64 2-D tensor, got ", t.sizes(), " ", t.scalar_type());
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == t.size(0) && lens.scalar_type() == torch::kInt64 &&
                  lens.is_contiguous(),
              lens_name, " must be a contiguous int64 [", t.size(0), "] tensor, got ", lens.sizes(), " ",
              lens.scalar_type());
}

}  // namespace

namespace kvstore {

torch::Tensor row_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor own_rows,
                            torch::Tensor own_lens, torch::Tensor members, torch::Tensor counts,
                            torch::Tensor shared_rows, torch::Tensor shared_lens, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
              "q must be a contiguous float32 [S, H, G, D] tensor, got ", q.sizes(), " ", q.scalar_type());
  const int64_t S = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  for (const auto& kv : {k, v}) {
    TORCH_CHECK(kv.dim() == 3 && kv.scalar_type() == torch::kFloat32 && kv.size(1) == H && kv.size(2) == D &&
                    kv.stride(2) == 1 && kv.stride(1) == D,
                "k and v must be float32 row views [R, ", H, ", ", D, "] with contiguous heads, got ", kv.sizes(),
                " strides ", kv.strides(), " ", kv.scalar_type());
  }
  TORCH_CHECK(k.size(0) == v.size(0) && k.stride(0) == v.stride(0), "k and v must have the same rows and strides");
  check_index(own_rows, own_lens, "own_rows", "own_lens");
  check_index(members, counts, "members", "counts");
  check_index(shared_rows, shared_lens, "shared_rows", "shared_lens");
  TORCH_CHECK(own_rows.size(0) == S, "own_rows must have a row per sequence (", S, "), got ", own_rows.size(0));
  TORCH_CHECK(shared_rows.size(0) == members.size(0), "shared_rows must have a row per item (", members.size(0),
              "), got ", shared_rows.size(0));
  const int64_t R = k.size(0), B = members.size(0);
  check_ids(own_rows, own_lens, R, 1, "own_rows", "rows of k and v");
  check_ids(shared_rows, shared_lens, R, 0, "shared_rows", "rows of k and v");
  check_ids(members, counts, S, 1, "members", "sequences of q");
  {  // every sequence in exactly one item
    std::vector<int> seen(S, 0);
    const int64_t* mp = members.data_ptr<int64_t>();
    const int64_t* cp = counts.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < cp[b]; ++i) ++seen[mp[b * members.size(1) + i]];
    for (int64_t s = 0; s < S; ++s)
      TORCH_CHECK(seen[s] == 1, "sequence ", s, " is in ", seen[s], " items, must be in exactly one");
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* orp = own_rows.data_ptr<int64_t>();
  const int64_t* olp = own_lens.data_ptr<int64_t>();
  const int64_t* mp = members.data_ptr<int64_t>();
  const int64_t* cp = counts.data_ptr<int64_t>();
  const int64_t* srp = shared_rows.data_ptr<int64_t>();
  const int64_t* slp = shared_lens.data_ptr<int64_t>();
  const int64_t own_width = own_rows.size(1), member_width = members.size(1), shared_width = shared_rows.size(1);
  const int64_t row_stride = k.stride(0), head_bytes = D * static_cast<int64_t>(sizeof(float));
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);

  // scores[q, 0:n] of queries qs (row pointers) over rows ids[0:n] of the head's K; top[q] their max so far
  auto score = [&](const float* kh, const int64_t* ids, int64_t n, const float* const* qs, int64_t nq,
                   float* scores, int64_t stride, float* top) {
#ifdef KVSTORE_ROWS_AVX2
    if (D % 8 == 0) {  // 4 queries x 2 rows a block; a short block repeats its first query or row
      float dots[8];
      for (int64_t t0 = 0; t0 < n; t0 += kTileRows) {  // a tile of rows stays in cache for every query
        const int64_t t1 = std::min(n, t0 + kTileRows);
        for (int64_t m0 = 0; m0 < nq; m0 += 4) {
          const int64_t mb = std::min<int64_t>(4, nq - m0);
          const float* q4[4];
          for (int64_t m = 0; m < 4; ++m) q4[m] = qs[m0 + (m < mb ? m : 0)];
          for (int64_t j = t0; j < t1; j += 2) {
            if (m0 == 0 && j + kPrefetchRows < n) {
              prefetch_row(kh + ids[j + kPrefetchRows] * row_stride, head_bytes);
              if (j + 1 + kPrefetchRows < n) prefetch_row(kh + ids[j + 1 + kPrefetchRows] * row_stride, head_bytes);
            }
            const int64_t jb = std::min<int64_t>(2, t1 - j);
            const float* k0 = kh + ids[j] * row_stride;
            const float* k1 = jb > 1 ? kh + ids[j + 1] * row_stride : k0;
            dots_4x2(q4, k0, k1, D, dots);
            for (int64_t m = 0; m < mb; ++m) {
              for (int64_t r = 0; r < jb; ++r) {
                const float dot = dots[2 * m + r] * sc;
                scores[(m0 + m) * stride + j + r] = dot;
                top[m0 + m] = std::max(top[m0 + m], dot);
              }
            }
          }
        }
      }
      return;
    }
#endif
    for (int64_t j = 0; j < n; ++j) {
      if (j + kPrefetchRows < n) prefetch_row(kh + ids[j + kPrefetchRows] * row_stride, head_bytes);
      const float* kr = kh + ids[j] * row_stride;
      for (int64_t m = 0; m < nq; ++m) {
        const float* qm = qs[m];
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qm[d] * kr[d];
        dot *= sc;
        scores[m * stride + j] = dot;
        top[m] = std::max(top[m], dot);
      }
    }
  };
  // scores -> exp(score - top) in place; returns their sum
  auto numerators = [&](float* s, int64_t n, float top) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      s[j] = exp_nonpositive(s[j] - top);
      sum += s[j];
    }
    return sum;
  };
  // acc[q] += sum_j p[q, j] v_j over rows ids[0:n] of the head's V
  auto accumulate = [&](const float* vh, const int64_t* ids, int64_t n, const float* p, int64_t stride, int64_t nq,
                        float* acc) {
#ifdef KVSTORE_ROWS_AVX2
    if (D % 8 == 0) {  // 2 queries x 32 floats of the head in registers over a tile of rows
      for (int64_t t0 = 0; t0 < n; t0 += kTileRows) {  // a tile of rows stays in cache for every query
        const int64_t t1 = std::min(n, t0 + kTileRows);
        for (int64_t m0 = 0; m0 < nq; m0 += 2) {
          const bool two = m0 + 1 < nq;
          const float* p0 = p + m0 * stride;
          const float* p1 = two ? p0 + stride : p0;
          float* a0 = acc + m0 * D;
          float* a1 = two ? a0 + D : a0;
          for (int64_t d0 = 0; d0 < D; d0 += 32) {
            const int c = static_cast<int>(std::min<int64_t>(32, D - d0) / 8);
            __m256 x0[4], x1[4];
            for (int i = 0; i < c; ++i) x0[i] = _mm256_loadu_ps(a0 + d0 + 8 * i), x1[i] = _mm256_loadu_ps(a1 + d0 + 8 * i);
            for (int64_t j = t0; j < t1; ++j) {
              if (m0 == 0 && d0 == 0 && j + kPrefetchRows < n)
                prefetch_row(vh + ids[j + kPrefetchRows] * row_stride, head_bytes);
              const float* vr = vh + ids[j] * row_stride + d0;
              const __m256 w0 = _mm256_set1_ps(p0[j]), w1 = _mm256_set1_ps(p1[j]);
              for (int i = 0; i < c; ++i) {
                const __m256 x = _mm256_loadu_ps(vr + 8 * i);
                x0[i] = _mm256_fmadd_ps(w0, x, x0[i]);
                x1[i] = _mm256_fmadd_ps(w1, x, x1[i]);
              }
            }
            for (int i = 0; i < c; ++i) {
              if (two) _mm256_storeu_ps(a1 + d0 + 8 * i, x1[i]);
              _mm256_storeu_ps(a0 + d0 + 8 * i, x0[i]);
            }
          }
        }
      }
      return;
    }
#endif
    for (int64_t j = 0; j < n; ++j) {
      if (j + kPrefetchRows < n) prefetch_row(vh + ids[j + kPrefetchRows] * row_stride, head_bytes);
      const float* vr = vh + ids[j] * row_stride;
      for (int64_t m = 0; m < nq; ++m) {
        const float w = p[m * stride + j];
        float* a = acc + m * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += w * vr[d];
      }
    }
  };

  auto tasks = [&](int64_t begin, int64_t end) {
    std::vector<float> shared_scores, own_scores, acc, top, total;
    std::vector<const float*> qs;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const int64_t n_members = cp[b], ns = slp[b], nq = n_members * G;
      const int64_t* seqs = mp + b * member_width;
      const int64_t* shared = srp + b * shared_width;
      const float* kh = kp + h * D;
      const float* vh = vp + h * D;
      qs.resize(nq);
      for (int64_t i = 0; i < n_members; ++i)
        for (int64_t g = 0; g < G; ++g) qs[i * G + g] = qp + ((seqs[i] * H + h) * G + g) * D;
      top.assign(nq, -std::numeric_limits<float>::max());
      total.assign(nq, 0.f);
      acc.assign(nq * D, 0.f);
      // the shared rows: one pass over K for every member's queries
      shared_scores.resize(nq * ns);
      score(kh, shared, ns, qs.data(), nq, shared_scores.data(), ns, top.data());
      // each member's own rows
      int64_t own_total = 0;
      for (int64_t i = 0; i < n_members; ++i) own_total += olp[seqs[i]];
      own_scores.resize(G * own_total);
      for (int64_t i = 0, at = 0; i < n_members; at += G * olp[seqs[i]], ++i)
        score(kh, orp + seqs[i] * own_width, olp[seqs[i]], qs.data() + i * G, G, own_scores.data() + at,
              olp[seqs[i]], top.data() + i * G);
      // one softmax per query over its shared and own rows
      for (int64_t m = 0; m < nq; ++m) total[m] = numerators(shared_scores.data() + m * ns, ns, top[m]);
      for (int64_t i = 0, at = 0; i < n_members; at += G * olp[seqs[i]], ++i)
        for (int64_t g = 0; g < G; ++g)
          total[i * G + g] += numerators(own_scores.data() + at + g * olp[seqs[i]], olp[seqs[i]], top[i * G + g]);
      accumulate(vh, shared, ns, shared_scores.data(), ns, nq, acc.data());
      for (int64_t i = 0, at = 0; i < n_members; at += G * olp[seqs[i]], ++i)
        accumulate(vh, orp + seqs[i] * own_width, olp[seqs[i]], own_scores.data() + at, olp[seqs[i]], G,
                   acc.data() + i * G * D);
      for (int64_t i = 0; i < n_members; ++i) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t m = i * G + g;
          const float inv = 1.f / total[m];
          float* o = op + ((seqs[i] * H + h) * G + g) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = acc[m * D + d] * inv;
        }
      }
    }
  };
  // OpenMP directly, not at::parallel_for: its first call on a thread would reset that thread's
  // count to torch's global one (the header's lazy init, a copy of its own in this library), and
  // the engine's one-thread worker must stay at one. The calling thread's count is torch's.
  const int64_t num_tasks = B * H;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bh = 0; bh < num_tasks; ++bh) tasks(bh, bh + 1);
  return out;
}

}  // namespace kvstore
