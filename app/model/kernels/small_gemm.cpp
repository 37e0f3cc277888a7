// A linear layer for the few rows of a decode or verify step: y = x W^T (+ bias), with W packed once
// into column groups laid out for streaming. app/model/cpu_linear.py builds, loads and calls it. Why by
// hand: docs/architecture.md ("CPU linears").
//
// At 1 to ~16 rows a step's linears read every weight once and do little arithmetic with it, so
// their speed is the speed at which the weights stream from memory. The BLAS and oneDNN kernels
// torch calls are built for many rows and reach about half of one core's bandwidth on such shapes
// (measured on the reference target's matrices). Here each group of GROUP * LANES output columns
// is one contiguous stream, [K][GROUP * LANES], read once per tile of ROWS rows.
//
// Packed layout: groups = ceil(N / GW), GW = GROUP * LANES; packed[g][k][c] = W[g * GW + c][k],
// zero past N. Weights are float32 or bfloat16 (widened to float32 as they are read); x and bias are
// float32; y float32, or bfloat16 for a bfloat16 model: each sum (bias added) rounded once as torch
// rounds float32 to bfloat16, to the nearest even (a step's 121 conversions of float32 results cost a
// bfloat16 step of the reference target 0.55 ms in torch's calls).
//
// Exactness: every output is one chain of fused multiply-adds over k = 0 .. K-1 in order, the same
// for every row count, tile and thread split, so a row's result never depends on the other rows of
// the call (a verify's rows equal the plain steps' bit for bit). Built without -ffast-math for that.
//
// bfloat16 rows against bfloat16 weights, on a CPU with AVX512-BF16: the weights packed in pairs
// along k (packed[g][k / 2][c] = W[g * GW + c][k, k + 1], zero past K and N) and each step one
// vdpbf16ps, which adds two products of a pair to the sum at once: twice the products of an FMA per
// instruction, where tens of rows make the step bound by arithmetic. Its chain (the pairs in order)
// is the same for every row count, as above; its rounding is the instruction's, not an FMA chain's.
//
// int8 weights (a draft's, `packed_weights: int8`): each output column's weights as int8 times a float32
// scale of its own, packed[g][k][c] for k < K and the group's GW scales in the four k-rows after them
// (packed[g][K .. K + 4) as float32 bytes). The rows carry four zeros there, so those k-rows add nothing,
// and each sum is multiplied by its column's scale as it is stored. A weight widens to float32 exactly;
// the chain is the float32 one above. Half a bfloat16 weight's bytes: a draft's step streams half as much.
// A bfloat16 draft's int8 weights, on a CPU with AVX512-BF16, are packed in pairs along k as the bfloat16
// pairs are (packed[g][k / 2][c] = two int8, the scales in the two pair rows after them) and run the pair
// chain: an int8 value is a bfloat16 value exactly, so each pair widens to a bfloat16 pair and one
// vdpbf16ps adds its two products; the pairs widen in registers as they stream, in every row tile (a
// band widened once into an L2 buffer for the tiles to share measured no faster). Why: on float32 FMAs the
// int8 weights were 1.9x slower than bfloat16 pairs at 64 rows (a draft's prompt, its batches); in pairs
// 1.1x, and at one row as fast as the FMAs (53760 x 1536, one Zen 4 thread, ms, bfloat16 pairs -> int8
// pairs: 1 row 8.6 -> 3.8, 5 rows 7.8 -> 5.6, 16 rows 14.8 -> 16.4, 64 rows 50.7 -> 56.4; int8 on FMAs:
// 1 row 3.9, 5 rows 8.7, 16 rows 26.8, 64 rows 99.6).
#include <algorithm>
#include <cstdint>
#include <type_traits>
#if defined(__AVX2__) || defined(__AVX512F__)  // the int8 widening's intrinsics; the pairs' (AVX512-BF16)
#include <immintrin.h>
#endif
#include <cstring>
#include <thread>
#include <vector>

namespace {

// ACCUMULATORS: vector registers a tile may hold sums in (of 32 with AVX-512, 16 otherwise); STREAMS: the
// most column groups a tile reads side by side; PREFETCH: how many k steps ahead a tile of several rows
// asks for its weights (0: the hardware's prefetcher alone).
// AVX2 (16 registers): tiles of 6 rows x 16 columns, 12 sums (BLAS's usual AVX2 shape), where 2 x 32 left
// a 5-row verify streaming the weights three times; at 1 row, four streams. Measured on the reference
// target's linears (AMD EPYC, Zen 3, one thread, float32; ms for all of them, against the 2 x 32 tiles):
// 1 row 36 against 39, 3 rows 45 against 66, 5 rows 56 against 77, 16 rows 110 against 145.
// FIRST_ALONE: whether the first row of a call streams the weights from memory by itself, the other rows'
// tiles then reading them from L2 (see run()). With AVX-512 every row takes one pass: on a Zen 4 EPYC (one
// thread, the reference target's linears; ms for all of them, first row alone -> one pass, both builds
// interleaved, medians) float32 1 row 26.8 -> 26.7, 5 rows 38.2 -> 26.5, 9 rows 46.6 -> 35.7, 16 rows 63.9
// -> 53.8; bfloat16 pairs 5 rows 18.1 -> 13.5, 16 rows 32.5 -> 26.6. Tiles of 7 rows (28 sums) then 9 rows
// 33.6, 16 rows 50.9 (float32). Asking for weights ahead (PREFETCH 16) lost: 5 rows 32.6.
#if defined(__AVX512F__)
constexpr int LANES = 16, GROUP = 4, ROWS = 7, ACCUMULATORS = 28, STREAMS = 2, PREFETCH = 0;
constexpr bool FIRST_ALONE = false;
#elif defined(__AVX__)
constexpr int LANES = 8, GROUP = 2, ROWS = 6, ACCUMULATORS = 12, STREAMS = 4, PREFETCH = 16;
constexpr bool FIRST_ALONE = true;
#else
constexpr int LANES = 4, GROUP = 4, ROWS = 2, ACCUMULATORS = 8, STREAMS = 2, PREFETCH = 0;
constexpr bool FIRST_ALONE = true;
#endif
constexpr int BAND = 4;  // column groups run through every row tile before the next (they stay in L2)
constexpr int GW = GROUP * LANES;

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef float vfu __attribute__((vector_size(LANES * 4), aligned(4)));
typedef uint16_t vhu __attribute__((vector_size(LANES * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline vf load(const uint16_t* p) {  // bfloat16 -> float32: the 16 bits are the float's high half
  vu wide = __builtin_convertvector(*reinterpret_cast<const vhu*>(p), vu) << 16;
  return reinterpret_cast<vf&>(wide);
}
inline vf load(const int8_t* p) {  // int8 -> float32, exact (sign-extended, then converted)
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return reinterpret_cast<vf>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  typedef int8_t vcu __attribute__((vector_size(LANES), aligned(1)));
  return __builtin_convertvector(*reinterpret_cast<const vcu*>(p), vf);
#endif
}
constexpr int SCALE_ROWS = 4;  // an int8 group's k-rows holding its columns' float32 scales

// one row's operand for a step: a float32 input, multiplied into every lane
inline float splat(float v) { return v; }
inline void mac(vf& acc, float s, vf w) { acc += s * w; }  // contracted to one FMA (-ffp-contract=fast)

// a row's width of results (bias added, where there is one) into y: float32 as they are, or bfloat16
// rounded to the nearest even as torch's conversion does (on a CPU every NaN becomes 0xFFFF)
inline void store(float* y, const float* row, int64_t width) { std::memcpy(y, row, width * sizeof(float)); }
inline void store(uint16_t* y, const float* row, int64_t width) {
  uint32_t bits[GW];
  uint16_t out[GW];
  std::memcpy(bits, row, sizeof(bits));
  for (int c = 0; c < GW; ++c) {
    const uint32_t rounded = (bits[c] + 0x7FFFu + ((bits[c] >> 16) & 1u)) >> 16;
    out[c] = row[c] != row[c] ? uint16_t(0xFFFF) : uint16_t(rounded);
  }
  std::memcpy(y, out, width * sizeof(uint16_t));
}

#if defined(__AVX512BF16__)
constexpr bool PAIRS = true;
typedef uint32_t pair;  // two bfloat16 values along k, the lower at the even k
typedef uint32_t vpu __attribute__((vector_size(64), aligned(4)));
inline __m512i load(const pair* p) { return reinterpret_cast<__m512i>(*reinterpret_cast<const vpu*>(p)); }
inline __m512i splat(pair v) { return _mm512_set1_epi32(int(v)); }  // a row's pair, in every lane
inline void mac(vf& acc, __m512i s, __m512i w) {
  acc = reinterpret_cast<vf>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc), reinterpret_cast<__m512bh>(s),
                                              reinterpret_cast<__m512bh>(w)));
}
// int8 weights in pairs along k, widened to bfloat16 pairs: int8 -> int32 -> float32 -> bfloat16, each step
// exact for |v| <= 127. A q8pair is one column's two bytes of storage; LANES of them in a row hold the LANES
// columns' even-k bytes, then their odd-k bytes
struct q8pair {
  int8_t bytes[2];
};
// 16 lanes' pairs: the 16 even-k bytes, then the 16 odd-k ones. A float32 of |v| <= 127 has its low 16 bits
// zero, so its high half is its bfloat16 exactly: the odd floats as they are, the even ones shifted down
inline __m512i load(const q8pair* p) {
  const __m512i even = _mm512_castps_si512(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
  const __m512i odd = _mm512_castps_si512(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + 1))));
  return _mm512_or_si512(_mm512_srli_epi32(even, 16), odd);
}
#else
constexpr bool PAIRS = false;
#endif

// int8 weights (both layouts): each group's GW float32 scales are the last 4 * GW bytes of its packed weights
template <typename W>
constexpr bool QUANTIZED = std::is_same_v<W, int8_t>;
#if defined(__AVX512BF16__)
template <>
constexpr bool QUANTIZED<q8pair> = true;
#endif

// rows x[0 .. R) against column groups g .. g + G: G contiguous streams of weights, R * G * GROUP
// independent accumulator chains
// X, W: float32 rows against float32 or bfloat16 weights, or bfloat16 pairs against pairs (k_dim pairs);
// Y: float32 or bfloat16 results
template <int R, int G, typename X, typename W, typename Y>
void tile(const X* x, int64_t ldx, const W* packed, const float* bias, Y* y, int64_t n, int64_t k_dim, int64_t g) {
  vf acc[R][G][GROUP] = {};
  const W* w = packed + g * k_dim * GW;
  for (int64_t k = 0; k < k_dim; ++k) {
    // the step's weight vectors once, then each row's input broadcast and used at once: R * G * GROUP
    // sums, G * GROUP weights and one input in registers (every sum's chain is the same as before)
    decltype(load(w)) wv[G][GROUP];
    for (int h = 0; h < G; ++h)
      for (int j = 0; j < GROUP; ++j) wv[h][j] = load(w + (h * k_dim + k) * GW + j * LANES);
    if constexpr (PREFETCH > 0 && R > 1)  // at 1 row the hardware's prefetcher keeps up with the FMAs
      for (int h = 0; h < G; ++h) __builtin_prefetch(w + (h * k_dim + k + PREFETCH) * GW, 0, 0);
    for (int r = 0; r < R; ++r) {
      const auto s = splat(x[r * ldx + k]);
      for (int h = 0; h < G; ++h)
        for (int j = 0; j < GROUP; ++j) mac(acc[r][h][j], s, wv[h][j]);
    }
  }
  for (int h = 0; h < G; ++h) {
    const int64_t col = (g + h) * GW, width = std::min<int64_t>(GW, n - col);
    float scale[GW];
    if constexpr (QUANTIZED<W>)
      std::memcpy(scale, reinterpret_cast<const char*>(w + (h + 1) * k_dim * GW) - sizeof(scale), sizeof(scale));
    for (int r = 0; r < R; ++r) {
      float row[GW];
      std::memcpy(row, acc[r][h], sizeof(row));
      if constexpr (QUANTIZED<W>)
        for (int64_t c = 0; c < width; ++c) row[c] *= scale[c];
      if (bias)
        for (int64_t c = 0; c < width; ++c) row[c] += bias[col + c];
      store(y + r * n + col, row, width);
    }
  }
}

constexpr int Q4_K = 32;  // int4 weights: inputs a block's scale and zero point cover (below)
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SPECSERVE_Q4 1
// int4 weights (a bfloat16 draft's, `packed_weights: int4`), in blocks of Q4_K inputs: within a block each
// column's weights are s * (q - z), q and its zero point z in 0 .. 15, s a bfloat16 scale of the column's
// own. A block of a column group: Q4_PAIRS pair rows of GW bytes (a byte holds one column's two inputs, the
// even one in its low nibble, in the column order `unpack_q4` leaves them in), then the GW scales as
// bfloat16, then the GW zero points as bytes. A nibble q becomes the bfloat16 pair value 128 + q by writing
// it under the exponent byte 0x43, with no conversion; each block's sum over its pairs, part, then enters
// the column's chain as acc = fma(part - (128 + z) * X, s, acc), X the row's sum of the block's inputs (in
// order, in float32). Why: a draft's step streams its weights; int4 blocks are 0.59 of int8's bytes, and
// with zero points per 32 inputs the Qwen2.5-Coder-0.5B draft agreed with its target's greedy tokens
// nearly as often as on int8 (0.862 against 0.881; docs/performance.md).
constexpr int Q4_PAIRS = Q4_K / 2;
constexpr int Q4_BLOCK = Q4_PAIRS * GW + 2 * GW + GW;  // nibbles, bfloat16 scales, zero points
// sums a tile holds: each output's chain and its block's part (twice the registers of the other paths)
constexpr int Q4_ROWS = 3, Q4_SUMS = 12;

// GW bytes of a pair row -> GROUP vectors of LANES pairs (128 + q each). The unpacking interleaves within
// each 128-bit lane: vector j, lane l holds byte 16 * (l / 4) + 4 * j + l % 4, where pack_q4 puts column
// LANES * j + l
inline void unpack_q4(const uint8_t* p, __m512i out[GROUP]) {
  const __m512i bytes = _mm512_loadu_si512(p), nibble = _mm512_set1_epi8(0x0F), exponent = _mm512_set1_epi8(0x43);
  const __m512i even = _mm512_and_si512(bytes, nibble), odd = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
  const __m512i even_lo = _mm512_unpacklo_epi8(even, exponent), even_hi = _mm512_unpackhi_epi8(even, exponent);
  const __m512i odd_lo = _mm512_unpacklo_epi8(odd, exponent), odd_hi = _mm512_unpackhi_epi8(odd, exponent);
  out[0] = _mm512_unpacklo_epi16(even_lo, odd_lo);
  out[1] = _mm512_unpackhi_epi16(even_lo, odd_lo);
  out[2] = _mm512_unpacklo_epi16(even_hi, odd_hi);
  out[3] = _mm512_unpackhi_epi16(even_hi, odd_hi);
}

inline vf load_u8(const uint8_t* p) {
  return reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
}

// rows x[0 .. R) (bfloat16 pairs, blocks * Q4_PAIRS a row; xsum: each row's block sums) against column
// groups g .. g + G
template <int R, int G, typename Y>
void tile_q4(const uint32_t* x, int64_t ldx, const float* xsum, const uint8_t* packed, const float* bias, Y* y,
             int64_t n, int64_t blocks, int64_t g) {
  __m512 acc[R][G][GROUP];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < G; ++h)
      for (int j = 0; j < GROUP; ++j) acc[r][h][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    vf part[R][G][GROUP] = {};
    const uint8_t* block[G];
    for (int h = 0; h < G; ++h) block[h] = packed + ((g + h) * blocks + b) * Q4_BLOCK;
    for (int p = 0; p < Q4_PAIRS; ++p) {
      __m512i wv[G][GROUP];
      for (int h = 0; h < G; ++h) unpack_q4(block[h] + p * GW, wv[h]);
      for (int r = 0; r < R; ++r) {
        const auto s = splat(x[r * ldx + b * Q4_PAIRS + p]);
        for (int h = 0; h < G; ++h)
          for (int j = 0; j < GROUP; ++j) mac(part[r][h][j], s, wv[h][j]);
      }
    }
    for (int h = 0; h < G; ++h)
      for (int j = 0; j < GROUP; ++j) {
        const __m512 scale = reinterpret_cast<__m512>(load(reinterpret_cast<const uint16_t*>(block[h] + Q4_PAIRS * GW) + j * LANES));
        const __m512 offset = _mm512_add_ps(reinterpret_cast<__m512>(load_u8(block[h] + Q4_PAIRS * GW + 2 * GW + j * LANES)),
                                            _mm512_set1_ps(128.0f));
        for (int r = 0; r < R; ++r) {
          const __m512 t = _mm512_fnmadd_ps(offset, _mm512_set1_ps(xsum[r * blocks + b]), reinterpret_cast<__m512>(part[r][h][j]));
          acc[r][h][j] = _mm512_fmadd_ps(t, scale, acc[r][h][j]);
        }
      }
  }
  for (int h = 0; h < G; ++h) {
    const int64_t col = (g + h) * GW, width = std::min<int64_t>(GW, n - col);
    for (int r = 0; r < R; ++r) {
      float row[GW];
      std::memcpy(row, acc[r][h], sizeof(row));
      if (bias)
        for (int64_t c = 0; c < width; ++c) row[c] += bias[col + c];
      store(y + r * n + col, row, width);
    }
  }
}

template <int R, typename Y>
void rows_q4(const uint32_t* x, int64_t ldx, const float* xsum, const uint8_t* packed, const float* bias, Y* y,
             int64_t n, int64_t blocks, int64_t g0, int64_t g1) {
  constexpr int G = std::max(1, std::min(STREAMS, Q4_SUMS / (R * GROUP)));
  int64_t g = g0;
  for (; g + G <= g1; g += G) tile_q4<R, G>(x, ldx, xsum, packed, bias, y, n, blocks, g);
  for (; g < g1; ++g) tile_q4<R, 1>(x, ldx, xsum, packed, bias, y, n, blocks, g);
}

template <typename Y>
void run_q4(const uint32_t* x, int64_t m, const float* xsum, const uint8_t* packed, const float* bias, Y* y,
            int64_t n, int64_t blocks, int64_t g0, int64_t g1) {
  const int64_t ldx = blocks * Q4_PAIRS;
  for (int64_t g = g0; g < g1; g += BAND) {
    const int64_t g_end = std::min(g1, g + BAND);
    int64_t r = 0;
    for (; r + Q4_ROWS <= m; r += Q4_ROWS)
      rows_q4<Q4_ROWS>(x + r * ldx, ldx, xsum + r * blocks, packed, bias, y + r * n, n, blocks, g, g_end);
    if (m - r == 2) rows_q4<2>(x + r * ldx, ldx, xsum + r * blocks, packed, bias, y + r * n, n, blocks, g, g_end);
    if (m - r == 1) rows_q4<1>(x + r * ldx, ldx, xsum + r * blocks, packed, bias, y + r * n, n, blocks, g, g_end);
  }
}

template <typename Y>
void linear_q4(const uint32_t* x, int64_t m, int64_t blocks, const uint8_t* packed, int64_t n, const float* bias,
               Y* y, int64_t threads) {
  // each row's block sums, in order: the zero points' and the 128's share of the block's part
  std::vector<float> xsum(m * blocks);
  const uint16_t* values = reinterpret_cast<const uint16_t*>(x);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      float sum = 0;
      for (int k = 0; k < Q4_K; ++k) {
        const uint32_t bits = uint32_t(values[(r * blocks + b) * Q4_K + k]) << 16;
        float v;
        std::memcpy(&v, &bits, sizeof(v));
        sum += v;
      }
      xsum[r * blocks + b] = sum;
    }
  const int64_t groups = (n + GW - 1) / GW;
  const int64_t bytes = groups * blocks * Q4_BLOCK * ((m + Q4_ROWS - 1) / Q4_ROWS);
  threads = std::max<int64_t>(1, std::min<int64_t>({threads, groups, bytes >> 22}));
  if (threads == 1) return run_q4(x, m, xsum.data(), packed, bias, y, n, blocks, 0, groups);
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t)
    pool.emplace_back(run_q4<Y>, x, m, xsum.data(), packed, bias, y, n, blocks, groups * t / threads,
                      groups * (t + 1) / threads);
  run_q4(x, m, xsum.data(), packed, bias, y, n, blocks, 0, groups / threads);
  for (auto& th : pool) th.join();
}
#endif

// rows x[0 .. R) against groups g0 .. g1, up to STREAMS at a time where registers allow
template <int R, typename X, typename W, typename Y>
void rows(const X* x, int64_t k_dim, const W* packed, const float* bias, Y* y, int64_t n, int64_t g0, int64_t g1) {
  constexpr int G = std::max(1, std::min(STREAMS, ACCUMULATORS / (R * GROUP)));
  int64_t g = g0;
  for (; g + G <= g1; g += G) tile<R, G>(x, k_dim, packed, bias, y, n, k_dim, g);
  for (; g < g1; ++g) tile<R, 1>(x, k_dim, packed, bias, y, n, k_dim, g);
}

template <int R, typename X, typename W, typename Y>
void rows_upto(int64_t left, const X* x, int64_t k_dim, const W* packed, const float* bias, Y* y, int64_t n,
               int64_t g0, int64_t g1) {
  if constexpr (R > 0) {
    if (left == R) return rows<R>(x, k_dim, packed, bias, y, n, g0, g1);
    rows_upto<R - 1>(left, x, k_dim, packed, bias, y, n, g0, g1);
  }
}

template <typename X, typename W, typename Y>
void run(const X* x, int64_t m, int64_t k_dim, const W* packed, int64_t n, const float* bias, Y* y,
         int64_t g0, int64_t g1) {
  // per band of groups: the first row alone, then row tiles of ROWS, then one of the rows left; each row's
  // chain is the same in every instantiation
  for (int64_t g = g0; g < g1; g += BAND) {
    const int64_t g_end = std::min(g1, g + BAND);  // a band of groups stays in cache across the row tiles
    int64_t r = 0;
    // A tile of several rows reads one column group at a time (its sums fill the registers): one stream
    // from memory, which ran at half the rate of the first row's STREAMS side by side. So the first row
    // streams the band from memory alone and the tiles read it from L2. AVX2 EPYC (Zen 3), one thread, the
    // reference target's float32 linears, both builds interleaved, medians: 1 row 37.6 ms either way, 2 rows
    // 50.3 -> 46.8, 5 rows 61.5 -> 60.6, 16 rows 112 -> 97 (3 rows 50.7 -> 52.4). With AVX-512 (above) the
    // rows' tiles stream the weights as fast as one row does: one pass.
    if (FIRST_ALONE && m > 1) {
      rows<1>(x, k_dim, packed, bias, y, n, g, g_end);
      r = 1;
    }
    for (; r + ROWS <= m; r += ROWS) rows<ROWS>(x + r * k_dim, k_dim, packed, bias, y + r * n, n, g, g_end);
    rows_upto<ROWS - 1>(m - r, x + r * k_dim, k_dim, packed, bias, y + r * n, n, g, g_end);
  }
}

template <typename X, typename W, typename Y>
void linear(const X* x, int64_t m, int64_t k_dim, const W* packed, int64_t n, const float* bias, Y* y,
            int64_t threads) {
  const int64_t groups = (n + GW - 1) / GW;
  // a thread costs tens of microseconds to start: only calls that read megabytes share the work
  const int64_t bytes = groups * GW * k_dim * int64_t(sizeof(W)) * ((m + ROWS - 1) / ROWS);
  threads = std::max<int64_t>(1, std::min<int64_t>({threads, groups, bytes >> 22}));
  if (threads == 1) return run(x, m, k_dim, packed, n, bias, y, 0, groups);
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t)
    pool.emplace_back(run<X, W, Y>, x, m, k_dim, packed, n, bias, y, groups * t / threads, groups * (t + 1) / threads);
  run(x, m, k_dim, packed, n, bias, y, 0, groups / threads);
  for (auto& th : pool) th.join();
}

template <typename W>
void pack(const W* weight, int64_t n, int64_t k_dim, W* packed) {
  const int64_t groups = (n + GW - 1) / GW;
  std::memset(packed, 0, groups * k_dim * GW * sizeof(W));
  for (int64_t col = 0; col < n; ++col)
    for (int64_t k = 0; k < k_dim; ++k) packed[((col / GW) * k_dim + k) * GW + col % GW] = weight[col * k_dim + k];
}

// bfloat16 weights [N, K] in pairs along k: packed[g][k / 2][c] (the even k in the lower half), K padded
// to even with zero
void pack_pairs(const uint16_t* weight, int64_t n, int64_t k_dim, uint32_t* packed) {
  const int64_t groups = (n + GW - 1) / GW, pairs = (k_dim + 1) / 2;
  std::memset(packed, 0, groups * pairs * GW * sizeof(uint32_t));
  for (int64_t col = 0; col < n; ++col)
    for (int64_t k = 0; k < k_dim; ++k)
      packed[((col / GW) * pairs + k / 2) * GW + col % GW] |= uint32_t(weight[col * k_dim + k]) << (16 * (k % 2));
}

#if defined(__AVX512BF16__)
// int8 weights [N, K] in pairs along k: packed[g][k / 2][c] (each LANES columns' even k, then their odd k),
// K padded to even with zero; the caller writes each group's scales in the two pair rows after them
void pack_q8_pairs(const int8_t* weight, int64_t n, int64_t k_dim, q8pair* packed) {
  const int64_t groups = (n + GW - 1) / GW, pairs = (k_dim + 1) / 2;
  std::memset(packed, 0, groups * pairs * GW * sizeof(q8pair));
  for (int64_t col = 0; col < n; ++col)
    for (int64_t k = 0; k < k_dim; ++k) {  // within each LANES columns: their even-k bytes, then their odd-k
      int8_t* to = packed[((col / GW) * pairs + k / 2) * GW + col % GW - col % LANES].bytes;
      to[(k % 2) * LANES + col % LANES] = weight[col * k_dim + k];
    }
}
#endif

}  // namespace

namespace {
// y: float32, or bfloat16 where y_bf16
template <typename X, typename W>
void linear_to(const X* x, int64_t m, int64_t k, const W* packed, int64_t n, const float* bias, void* y,
               int64_t threads, int64_t y_bf16) {
  if (y_bf16) return linear(x, m, k, packed, n, bias, static_cast<uint16_t*>(y), threads);
  linear(x, m, k, packed, n, bias, static_cast<float*>(y), threads);
}
}  // namespace

extern "C" {
int64_t specserve_gemm_has_pairs() { return PAIRS; }
void specserve_gemm_pack_pairs(const uint16_t* w, int64_t n, int64_t k, uint32_t* out) { pack_pairs(w, n, k, out); }
// x: m rows of k_pairs bfloat16 pairs (a row of 2 * k_pairs bfloat16 values, K padded to even)
void specserve_gemm_pairs(const uint32_t* x, int64_t m, int64_t k_pairs, const uint32_t* packed, int64_t n,
                          const float* bias, void* y, int64_t threads, int64_t y_bf16) {
#if defined(__AVX512BF16__)
  linear_to(x, m, k_pairs, packed, n, bias, y, threads, y_bf16);
#endif
}
// int8 weights in pairs, for bfloat16 rows: x as for specserve_gemm_pairs, k_pairs counting the scales' two
void specserve_gemm_pack_q8_pairs(const int8_t* w, int64_t n, int64_t k, int8_t* out) {
#if defined(__AVX512BF16__)
  pack_q8_pairs(w, n, k, reinterpret_cast<q8pair*>(out));
#endif
}
void specserve_gemm_q8_pairs(const uint32_t* x, int64_t m, int64_t k_pairs, const int8_t* packed, int64_t n,
                             const float* bias, void* y, int64_t threads, int64_t y_bf16) {
#if defined(__AVX512BF16__)
  linear_to(x, m, k_pairs, reinterpret_cast<const q8pair*>(packed), n, bias, y, threads, y_bf16);
#endif
}
// int4 weights in blocks (packed by cpu_linear._pack_int4), for bfloat16 rows of blocks * Q4_K values
void specserve_gemm_q4(const uint32_t* x, int64_t m, int64_t blocks, const uint8_t* packed, int64_t n,
                       const float* bias, void* y, int64_t threads, int64_t y_bf16) {
#if defined(SPECSERVE_Q4)
  if (y_bf16) return linear_q4(x, m, blocks, packed, n, bias, static_cast<uint16_t*>(y), threads);
  linear_q4(x, m, blocks, packed, n, bias, static_cast<float*>(y), threads);
#endif
}
int64_t specserve_gemm_q4_block() {  // 0: no int4 path on this CPU
#if defined(SPECSERVE_Q4)
  return Q4_BLOCK;
#else
  return 0;
#endif
}
int64_t specserve_gemm_group_width() { return GW; }

void specserve_gemm_pack_f32(const float* w, int64_t n, int64_t k, float* out) { pack(w, n, k, out); }
void specserve_gemm_pack_bf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* out) { pack(w, n, k, out); }
// int8 weights [N, K] packed as the others; the caller writes each group's scale rows after its K k-rows
void specserve_gemm_pack_q8(const int8_t* w, int64_t n, int64_t k, int8_t* out) { pack(w, n, k, out); }

void specserve_gemm_f32(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias,
                        void* y, int64_t threads, int64_t y_bf16) {
  linear_to(x, m, k, packed, n, bias, y, threads, y_bf16);
}
// k: the packed k-rows, the scale rows included (the rows x hold as many, zero past K)
void specserve_gemm_q8(const float* x, int64_t m, int64_t k, const int8_t* packed, int64_t n, const float* bias,
                       void* y, int64_t threads, int64_t y_bf16) {
  linear_to(x, m, k, packed, n, bias, y, threads, y_bf16);
}
void specserve_gemm_bf16(const float* x, int64_t m, int64_t k, const uint16_t* packed, int64_t n, const float* bias,
                         void* y, int64_t threads, int64_t y_bf16) {
  linear_to(x, m, k, packed, n, bias, y, threads, y_bf16);
}
}
