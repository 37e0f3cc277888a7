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
//   new_k, new_v  [heads_kv, rows, dim] with strides (new_head, new_row, 1): the spans' new keys and values,
//          written into their slots of k and v before the span reads them (null: already written). A
//          span's new slots are its own (the pool shares whole cached blocks only), so no other span
//          of the call reads them.
//
// Each row's result depends on its query and its keys alone, never on the other rows or spans of
// the call, so a sequence's output is the same whatever batch it runs in, and a verify's row is the
// plain step's at its position. The work is split by (span, key-value head), so that each block of
// keys and values is read from memory once for all the rows and query heads that read it. bfloat16 is widened to
// float32 once a block (exactly), every sum is a float32 one, and each output is rounded once to
// the nearest bfloat16 (ties to even, as torch rounds).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
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
  const T* q;
  T *k, *v;
  T* out;
  const T *new_k, *new_v;
  int64_t new_head, new_row;
  int64_t q_head, q_row;
  const int64_t *spans, *tables;
  int64_t heads_q, heads_kv, dim, slots, block;
  float scale;
};

// Eight floats, in whatever registers the target has (GCC's vector extension: AVX2 and AVX-512 take
// one ymm register, SSE two xmm). Loads are unaligned; bfloat16 widens exactly as it loads.
typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v8 load8(const bf16* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  const u32x8 bits = __builtin_convertvector(h, u32x8) << 16;
  v8 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
inline float hsum(v8 a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

// The dot product of a query (widened) and a key: two chains of multiply-adds (half the wait on each),
// the same order for every call.
template <typename T>
inline float dot(const float* q, const T* key, int64_t dim, int64_t full) {
  v8 even = {}, odd = {};
  int64_t x = 0;
  for (; x + 16 <= full; x += 16) {
    even += load8(q + x) * load8(key + x);
    odd += load8(q + x + 8) * load8(key + x + 8);
  }
  if (x < full) even += load8(q + x) * load8(key + x);
  float acc = hsum(even + odd);
  for (x = full; x < dim; ++x) acc += q[x] * widen(key[x]);
  return acc;
}

// Two vectors' lanes picked by index (0-7: a's, 8-15: b's), in GCC's and clang's spelling.
typedef int32_t i32x8 __attribute__((vector_size(32)));
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, i32x8{__VA_ARGS__})
#endif

// out[u] = the sum of acc[u]'s lanes, u = 0..7: a tree of adds that transposes as it goes (three levels of
// two shuffles and an add, where eight horizontal sums take eight times four), the same order every call.
inline v8 sum_lanes(const v8* acc) {
  v8 pairs[4], quads[2];
  for (int u = 0; u < 4; ++u)  // [a0+a4, b0+b4, a1+a5, b1+b5, a2+a6, b2+b6, a3+a7, b3+b7]
    pairs[u] = SHUFFLE(acc[2 * u], acc[2 * u + 1], 0, 8, 1, 9, 2, 10, 3, 11) +
               SHUFFLE(acc[2 * u], acc[2 * u + 1], 4, 12, 5, 13, 6, 14, 7, 15);
  for (int u = 0; u < 2; ++u)  // [a0145, b0145, c0145, d0145, a2367, b2367, c2367, d2367]
    quads[u] = SHUFFLE(pairs[2 * u], pairs[2 * u + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SHUFFLE(pairs[2 * u], pairs[2 * u + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return SHUFFLE(quads[0], quads[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(quads[0], quads[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// scores[jj] = scale * (query . key jj) for a block's first m keys (float32, `dim` apart): eight keys at a
// time in eight chains of multiply-adds, their sums gathered by sum_lanes; the block's last m % 8 keys one
// by one (dot). Which way a key goes depends on m alone, and a row's m at a block is fixed by its position,
// so a row's scores are the same in any batch.
inline void block_scores(const float* q, const float* keys, int64_t m, int64_t dim, int64_t full, float scale,
                         float* scores) {
  int64_t jj = 0;
  for (; jj + 8 <= m; jj += 8) {
    v8 acc[8] = {};
    const float* k = keys + jj * dim;
    for (int64_t x = 0; x < full; x += 8) {
      const v8 qx = load8(q + x);
      for (int u = 0; u < 8; ++u) acc[u] += qx * load8(k + u * dim + x);
    }
    v8 sums = sum_lanes(acc);
    for (int64_t x = full; x < dim; ++x)  // a head size that is not a multiple of 8
      for (int u = 0; u < 8; ++u) sums[u] += q[x] * k[u * dim + x];
    sums *= scale;
    std::memcpy(scores + jj, &sums, sizeof sums);
  }
  for (; jj < m; ++jj) scores[jj] = dot(q, keys + jj * dim, dim, full) * scale;
}

// acc[base .. base + 8N) += p[jj] * value_jj[base ..] for the block's positions jj < n in order, the sums
// held in registers across the block (in memory, every position's add would wait on the last one's store).
template <int N, typename T>
inline void weigh(float* acc, const float* p, const T* values, int64_t n, int64_t dim, int64_t base) {
  v8 sum[N];
  std::memcpy(sum, acc + base, sizeof sum);
  for (int64_t jj = 0; jj < n; ++jj) {
    const T* value = values + jj * dim + base;
    const float w = p[jj];
    for (int u = 0; u < N; ++u) sum[u] += w * load8(value + 8 * u);
  }
  std::memcpy(acc + base, sum, sizeof sum);
}

template <typename T>
void weigh_all(float* acc, const float* p, const T* values, int64_t n, int64_t dim, int64_t full) {
  for (int64_t base = 0; base < full; base += 64) {
    switch (std::min<int64_t>(8, (full - base) / 8)) {
      case 1: weigh<1>(acc, p, values, n, dim, base); break;
      case 2: weigh<2>(acc, p, values, n, dim, base); break;
      case 3: weigh<3>(acc, p, values, n, dim, base); break;
      case 4: weigh<4>(acc, p, values, n, dim, base); break;
      case 5: weigh<5>(acc, p, values, n, dim, base); break;
      case 6: weigh<6>(acc, p, values, n, dim, base); break;
      case 7: weigh<7>(acc, p, values, n, dim, base); break;
      default: weigh<8>(acc, p, values, n, dim, base); break;
    }
  }
  for (int64_t x = full; x < dim; ++x)  // a head size that is not a multiple of 8
    for (int64_t jj = 0; jj < n; ++jj) acc[x] += p[jj] * widen(values[jj * dim + x]);
}

struct Scratch {
  std::vector<float> queries, scores, sums, block;
};

// A block's first m positions as float32, for the n query vectors that read it: bfloat16 widened once
// into `w.block` (exactly: the floats every read would widen them to), not once per query vector and
// position; float32 read where it lies. A verify's rows and a GQA group make a block's readers many (15
// for the reference target's 5-row verify): its bfloat16 attention call in a forward (one thread, ~200
// keys, the variants interleaved in one process) 334 -> 206 us, at 1 row 47 -> 46 us.
template <typename T>
inline const float* as_float(const T* block, int64_t m, int64_t dim, Scratch& w) {
  if constexpr (std::is_same_v<T, float>) {
    return block;
  } else {
    w.block.resize(static_cast<size_t>(m * dim));
    float* out = w.block.data();
    for (int64_t x = 0; x < m * dim; ++x) out[x] = widen(block[x]);
    return out;
  }
}

// Rows [first, first + rows) of a span, at positions start .. start + rows - 1, for key-value head g.
template <typename T>
void tile_group(const Args<T>& a, const T* keys, const T* values, const int64_t* table, int64_t first,
                int64_t rows, int64_t start, int64_t g, int64_t group, Scratch& w) {
  const int64_t dim = a.dim, full = dim / 8 * 8, end = start + rows;
  const int64_t n = group * rows;  // query vectors: head h0 + qi / rows, row qi % rows
  w.queries.resize(static_cast<size_t>(n * dim));
  w.scores.resize(static_cast<size_t>(n * end));
  w.sums.assign(static_cast<size_t>(n * dim), 0.f);
  float *qf = w.queries.data(), *s = w.scores.data(), *acc = w.sums.data();
  for (int64_t qi = 0; qi < n; ++qi) {
    const T* query = a.q + (g * group + qi / rows) * a.q_head + (first + qi % rows) * a.q_row;
    for (int64_t x = 0; x < dim; ++x) qf[qi * dim + x] = widen(query[x]);
  }
  for (int64_t j0 = 0, b = 0; j0 < end; j0 += a.block, ++b) {
    const float* block = as_float(keys + table[b] * a.block * dim, std::min(a.block, end - j0), dim, w);
    for (int64_t qi = 0; qi < n; ++qi) {
      const int64_t seen = start + qi % rows + 1, m = std::min(a.block, seen - j0);
      if (m > 0) block_scores(qf + qi * dim, block, m, dim, full, a.scale, s + qi * end + j0);
    }
  }
  for (int64_t qi = 0; qi < n; ++qi) {
    float* sr = s + qi * end;
    const int64_t seen = start + qi % rows + 1;
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
  for (int64_t j0 = 0, b = 0; j0 < end; j0 += a.block, ++b) {
    const float* block = as_float(values + table[b] * a.block * dim, std::min(a.block, end - j0), dim, w);
    for (int64_t qi = 0; qi < n; ++qi) {
      const int64_t seen = start + qi % rows + 1, m = std::min(a.block, seen - j0);
      if (m > 0) weigh_all(acc + qi * dim, s + qi * end + j0, block, m, dim, full);
    }
  }
  for (int64_t qi = 0; qi < n; ++qi) {
    T* o = a.out + ((first + qi % rows) * a.heads_q + g * group + qi / rows) * dim;
    for (int64_t x = 0; x < dim; ++x) store(acc[qi * dim + x], o + x);
  }
}

// Rows a pass of span_group takes: a long span (a prompt's chunk) in passes of this many, so that its
// scores take n * end floats for a tile's rows, not every row's (a 2048-row chunk of a 12-head model
// over 4096 positions would hold 400 MB). Which pass a row is in changes nothing it computes.
constexpr int64_t ROW_TILE = 32;

// One (span, key-value head): the rows of every query head that reads this head (GQA) together, so each
// block of keys and values is read once, from memory, for all of them and then found in the cache.
// Every row still computes alone, in one order: its scores over positions 0 .. its own in order, the
// softmax, then its weighted values summed position by position in order. So a row's result depends
// on its query and those positions alone: the same alone, in a span of several rows (a verify), with
// other query heads, beside other spans, or in a prompt's chunk of any length.
template <typename T>
void span_group(const Args<T>& a, int64_t i, int64_t g, Scratch& w) {
  const int64_t first = a.spans[4 * i], rows = a.spans[4 * i + 1], start = a.spans[4 * i + 2];
  const int64_t* table = a.tables + a.spans[4 * i + 3];
  const int64_t dim = a.dim, group = a.heads_q / a.heads_kv;
  T* keys = a.k + g * a.slots * dim;
  T* values = a.v + g * a.slots * dim;
  if (a.new_k)  // this head's new keys and values of the span's rows, into their slots
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = start + r, slot = table[pos / a.block] * a.block + pos % a.block;
      const int64_t from = g * a.new_head + (first + r) * a.new_row;
      std::memcpy(keys + slot * dim, a.new_k + from, dim * sizeof(T));
      std::memcpy(values + slot * dim, a.new_v + from, dim * sizeof(T));
    }
  for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE)
    tile_group(a, keys, values, table, first + r0, std::min(ROW_TILE, rows - r0), start + r0, g, group, w);
}

template <typename T>
void run(const Args<T>& a, int64_t n_spans, int64_t begin, int64_t step) {
  Scratch w;
  for (int64_t u = begin; u < n_spans * a.heads_kv; u += step) span_group(a, u / a.heads_kv, u % a.heads_kv, w);
}

template <typename T>
void attend(const T* q, int64_t q_head, int64_t q_row, T* k, T* v, T* out, const T* new_k, const T* new_v,
            int64_t new_head, int64_t new_row, const int64_t* spans, int64_t n_spans, const int64_t* tables,
            int64_t heads_q, int64_t heads_kv, int64_t dim, int64_t slots, int64_t block, float scale,
            int64_t threads) {
  const Args<T> a{q, k, v, out, new_k, new_v, new_head, new_row, q_head, q_row, spans, tables, heads_q, heads_kv,
                  dim, slots, block, scale};
  threads = std::max<int64_t>(1, std::min(threads, n_spans * heads_kv));
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(run<T>, std::cref(a), n_spans, t, threads);
  run(a, n_spans, 0, threads);
  for (auto& t : pool) t.join();
}

}  // namespace

extern "C" {
void specserve_paged_attention_f32(const float* q, int64_t q_head, int64_t q_row, float* k, float* v, float* out,
                                   const float* new_k, const float* new_v, int64_t new_head, int64_t new_row,
                                   const int64_t* spans, int64_t n_spans, const int64_t* tables, int64_t heads_q,
                                   int64_t heads_kv, int64_t dim, int64_t slots, int64_t block, float scale,
                                   int64_t threads) {
  attend(q, q_head, q_row, k, v, out, new_k, new_v, new_head, new_row, spans, n_spans, tables, heads_q, heads_kv,
         dim, slots, block, scale, threads);
}
void specserve_paged_attention_bf16(const bf16* q, int64_t q_head, int64_t q_row, bf16* k, bf16* v, bf16* out,
                                    const bf16* new_k, const bf16* new_v, int64_t new_head, int64_t new_row,
                                    const int64_t* spans, int64_t n_spans, const int64_t* tables, int64_t heads_q,
                                    int64_t heads_kv, int64_t dim, int64_t slots, int64_t block, float scale,
                                    int64_t threads) {
  attend(q, q_head, q_row, k, v, out, new_k, new_v, new_head, new_row, spans, n_spans, tables, heads_q, heads_kv,
         dim, slots, block, scale, threads);
}
}
