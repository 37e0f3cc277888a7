// Paged attention on a CPU for a ragged batch's short spans (decode steps, verify rows): every span's
// query rows against the keys and values its block table names, read where they lie in the pool.
// One call per layer for the whole batch; app/model/cpu_attention.py builds and loads it, app/model/ragged.py
// calls it. Why by hand: docs/architecture.md ("CPU attention").
//
// Layouts (float32 or bfloat16, one dtype for all four; contiguous unless strided below):
//   q      [heads_q, rows, dim] with strides (q_head, q_row, 1)
//   k, v   [heads_kv, slots, dim]: one layer's pool, slot = block * block_size + offset
//   out    [rows, heads_q, dim]
//   spans  [n_spans, 4]: first row in q, rows, start (positions cached before the span's first
//          row), offset of the span's table in `tables`
// Row r of a span sits at position start + r and sees the keys of positions 0 .. start + r.
//
// Each row's result depends on its query and its keys alone, never on the other rows or spans of
// the call, so a sequence's output is the same whatever batch it runs in. bfloat16 is widened to
// float32 as it is read (exactly), every sum is a float32 one, and each output is rounded once to
// the nearest bfloat16 (ties to even, as torch rounds).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

typedef uint16_t bf16;
inline float widen(float x) { return x; }
inline float widen(bf16 x) {
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline void store(float x, float* out) { *out = x; }
inline void store(float x, bf16* out) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  *out = bf16((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);  // finite inputs: round to nearest, ties to even
}

template <typename T>
struct Args {
  const T *q, *k, *v;
  T* out;
  int64_t q_head, q_row;
  const int64_t *spans, *tables;
  int64_t heads_q, heads_kv, dim, slots, block;
  float scale;
};

// Every (position j, row r) pair of a span where row r sees position j, in the order the positions
// lie in the table's blocks: fn(j, r, the vector of position j in `pool`).
template <typename T, typename Fn>
void visit(const Args<T>& a, const int64_t* table, int64_t end, int64_t start, int64_t rows, const T* pool, Fn fn) {
  for (int64_t j0 = 0; j0 < end; j0 += a.block) {
    const int64_t base = table[j0 / a.block] * a.block, n = std::min(a.block, end - j0);
    for (int64_t jj = 0; jj < n; ++jj) {
      const int64_t j = j0 + jj;
      const T* vec = pool + (base + jj) * a.dim;
      for (int64_t r = std::max<int64_t>(0, j - start); r < rows; ++r) fn(j, r, vec);
    }
  }
}

// One (span, query head): scores of every row over its visible keys, softmax, weighted values.
template <typename T>
void span_head(const Args<T>& a, int64_t i, int64_t h, std::vector<float>& scores, std::vector<float>& sums) {
  const int64_t first = a.spans[4 * i], rows = a.spans[4 * i + 1], start = a.spans[4 * i + 2];
  const int64_t* table = a.tables + a.spans[4 * i + 3];
  const int64_t end = start + rows, dim = a.dim;
  const int64_t kv = h / (a.heads_q / a.heads_kv);
  const T* keys = a.k + kv * a.slots * dim;
  const T* values = a.v + kv * a.slots * dim;
  scores.resize(static_cast<size_t>(rows * end));
  sums.assign(static_cast<size_t>(rows * dim), 0.f);
  float* s = scores.data();

  visit(a, table, end, start, rows, keys, [&](int64_t j, int64_t r, const T* key) {
    const T* query = a.q + h * a.q_head + (first + r) * a.q_row;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t x = 0; x < dim; ++x) acc += widen(query[x]) * widen(key[x]);
    s[r * end + j] = acc * a.scale;
  });
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * end;
    const int64_t seen = start + r + 1;
    float top = sr[0];
    for (int64_t j = 1; j < seen; ++j) top = std::max(top, sr[j]);
    float total = 0.f;
    // weights under e^-80 are zero: past float's normal range they would be denormals, which cost
    // dozens of cycles each and change no sum they are added to
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < seen; ++j) {
      const float x = sr[j] - top;
      sr[j] = x < -80.f ? 0.f : std::exp(x);
      total += sr[j];
    }
    const float inv = 1.f / total;
    for (int64_t j = 0; j < seen; ++j) sr[j] *= inv;
  }
  visit(a, table, end, start, rows, values, [&](int64_t j, int64_t r, const T* value) {
    const float p = s[r * end + j];
    float* o = sums.data() + r * dim;
#pragma omp simd
    for (int64_t x = 0; x < dim; ++x) o[x] += p * widen(value[x]);
  });
  for (int64_t r = 0; r < rows; ++r) {
    T* o = a.out + ((first + r) * a.heads_q + h) * dim;
    for (int64_t x = 0; x < dim; ++x) store(sums[r * dim + x], o + x);
  }
}

template <typename T>
void run(const Args<T>& a, int64_t n_spans, int64_t begin, int64_t step) {
  std::vector<float> scores, sums;
  for (int64_t w = begin; w < n_spans * a.heads_q; w += step) span_head(a, w / a.heads_q, w % a.heads_q, scores, sums);
}

template <typename T>
void attend(const T* q, int64_t q_head, int64_t q_row, const T* k, const T* v, T* out, const int64_t* spans,
            int64_t n_spans, const int64_t* tables, int64_t heads_q, int64_t heads_kv, int64_t dim, int64_t slots,
            int64_t block, float scale, int64_t threads) {
  const Args<T> a{q, k, v, out, q_head, q_row, spans, tables, heads_q, heads_kv, dim, slots, block, scale};
  threads = std::max<int64_t>(1, std::min(threads, n_spans * heads_q));
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(run<T>, std::cref(a), n_spans, t, threads);
  run(a, n_spans, 0, threads);
  for (auto& t : pool) t.join();
}

}  // namespace

extern "C" {
void specserve_paged_attention_f32(const float* q, int64_t q_head, int64_t q_row, const float* k, const float* v,
                                   float* out, const int64_t* spans, int64_t n_spans, const int64_t* tables,
                                   int64_t heads_q, int64_t heads_kv, int64_t dim, int64_t slots, int64_t block,
                                   float scale, int64_t threads) {
  attend(q, q_head, q_row, k, v, out, spans, n_spans, tables, heads_q, heads_kv, dim, slots, block, scale, threads);
}
void specserve_paged_attention_bf16(const bf16* q, int64_t q_head, int64_t q_row, const bf16* k, const bf16* v,
                                    bf16* out, const int64_t* spans, int64_t n_spans, const int64_t* tables,
                                    int64_t heads_q, int64_t heads_kv, int64_t dim, int64_t slots, int64_t block,
                                    float scale, int64_t threads) {
  attend(q, q_head, q_row, k, v, out, spans, n_spans, tables, heads_q, heads_kv, dim, slots, block, scale, threads);
}
}
