// Paged attention on a CPU for a ragged batch's short spans (decode steps, verify rows): every span's
// query rows against the keys and values its block table names, read where they lie in the pool.
// One call per layer for the whole batch; app/model/cpu_attention.py builds and loads it, app/model/ragged.py
// calls it. Why by hand: docs/architecture.md ("CPU attention").
//
// Layouts (float32, contiguous unless strided below):
//   q      [heads_q, rows, dim] with strides (q_head, q_row, 1)
//   k, v   [heads_kv, slots, dim]: one layer's pool, slot = block * block_size + offset
//   out    [rows, heads_q, dim]
//   spans  [n_spans, 4]: first row in q, rows, start (positions cached before the span's first
//          row), offset of the span's table in `tables`
// Row r of a span sits at position start + r and sees the keys of positions 0 .. start + r.
//
// Each row's result depends on its query and its keys alone, never on the other rows or spans of
// the call, so a sequence's output is the same whatever batch it runs in.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

namespace {

struct Args {
  const float *q, *k, *v;
  float* out;
  int64_t q_head, q_row;
  const int64_t *spans, *tables;
  int64_t heads_q, heads_kv, dim, slots, block;
  float scale;
};

// Every (position j, row r) pair of a span where row r sees position j, in the order the positions
// lie in the table's blocks: fn(j, r, the vector of position j in `pool`).
template <typename Fn>
void visit(const Args& a, const int64_t* table, int64_t end, int64_t start, int64_t rows, const float* pool, Fn fn) {
  for (int64_t j0 = 0; j0 < end; j0 += a.block) {
    const int64_t base = table[j0 / a.block] * a.block, n = std::min(a.block, end - j0);
    for (int64_t jj = 0; jj < n; ++jj) {
      const int64_t j = j0 + jj;
      const float* vec = pool + (base + jj) * a.dim;
      for (int64_t r = std::max<int64_t>(0, j - start); r < rows; ++r) fn(j, r, vec);
    }
  }
}

// One (span, query head): scores of every row over its visible keys, softmax, weighted values.
void span_head(const Args& a, int64_t i, int64_t h, std::vector<float>& scores) {
  const int64_t first = a.spans[4 * i], rows = a.spans[4 * i + 1], start = a.spans[4 * i + 2];
  const int64_t* table = a.tables + a.spans[4 * i + 3];
  const int64_t end = start + rows, dim = a.dim;
  const int64_t kv = h / (a.heads_q / a.heads_kv);
  const float* keys = a.k + kv * a.slots * dim;
  const float* values = a.v + kv * a.slots * dim;
  scores.resize(static_cast<size_t>(rows * end));
  float* s = scores.data();

  visit(a, table, end, start, rows, keys, [&](int64_t j, int64_t r, const float* key) {
    const float* query = a.q + h * a.q_head + (first + r) * a.q_row;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t x = 0; x < dim; ++x) acc += query[x] * key[x];
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
    float* o = a.out + ((first + r) * a.heads_q + h) * dim;
    std::fill(o, o + dim, 0.f);
  }
  visit(a, table, end, start, rows, values, [&](int64_t j, int64_t r, const float* value) {
    const float p = s[r * end + j];
    float* o = a.out + ((first + r) * a.heads_q + h) * dim;
#pragma omp simd
    for (int64_t x = 0; x < dim; ++x) o[x] += p * value[x];
  });
}

void run(const Args& a, int64_t n_spans, int64_t begin, int64_t step) {
  std::vector<float> scores;
  for (int64_t w = begin; w < n_spans * a.heads_q; w += step) span_head(a, w / a.heads_q, w % a.heads_q, scores);
}

}  // namespace

extern "C" void specserve_paged_attention_f32(const float* q, int64_t q_head, int64_t q_row, const float* k,
                                              const float* v, float* out, const int64_t* spans, int64_t n_spans,
                                              const int64_t* tables, int64_t heads_q, int64_t heads_kv, int64_t dim,
                                              int64_t slots, int64_t block, float scale, int64_t threads) {
  const Args a{q, k, v, out, q_head, q_row, spans, tables, heads_q, heads_kv, dim, slots, block, scale};
  threads = std::max<int64_t>(1, std::min(threads, n_spans * heads_q));
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(run, std::cref(a), n_spans, t, threads);
  run(a, n_spans, 0, threads);
  for (auto& t : pool) t.join();
}
