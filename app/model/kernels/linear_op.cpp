// specserve::linear's CPU kernel, registered with torch's dispatcher from C++: the small-row kernels of
// small_gemm.cpp (compiled into this library too) behind the op app/model/cpu_linear.py defines. Why:
// a step calls the op once per linear (121 on the reference target, 17 on its draft); with the op's body
// in Python and the kernel reached through ctypes a call cost ~7.8 us before any arithmetic, ~1.5 here
// (measured on a 2-core Zen 4 EPYC). What it does is cpu_linear._linear's, line for line: the same rows
// reach the same kernel, so the results are the same bits (tests/test_cpu_linear.py compares the two).
#include "small_gemm.cpp"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <optional>

namespace {

// the real row count of the compiled step this thread runs (cpu_linear.real_rows); 0: every row
thread_local int64_t real_rows = 0;

at::Tensor linear_op(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                     int64_t out_features) {
  const bool wide = x.scalar_type() == at::kFloat;
  at::Tensor rows;
  if (packed.scalar_type() == at::kInt) {  // pairs: a bfloat16 model's rows are bfloat16 already
    rows = x.scalar_type() == at::kBFloat16 && x.is_contiguous() ? x : x.to(at::kBFloat16).contiguous();
    if (rows.size(-1) % 2) rows = at::constant_pad_nd(rows, {0, 1}, 0);  // the weights' input padded to even
  } else if (packed.scalar_type() == at::kByte) {  // int4 blocks: bfloat16 rows, zeros against the padding
    rows = x.scalar_type() == at::kBFloat16 ? x : x.to(at::kBFloat16);
    // contiguous: with no padding to add (whole blocks) the pad returns strided rows as they came
    rows = at::constant_pad_nd(rows, {0, Q4_K * packed.size(1) - x.size(-1)}, 0).contiguous();
  } else if (packed.scalar_type() == at::kChar && packed.dim() == 4) {  // int8 pairs: bfloat16 rows, zeros
    rows = x.scalar_type() == at::kBFloat16 ? x : x.to(at::kBFloat16);  // against the padding and the scales
    rows = at::constant_pad_nd(rows, {0, 2 * packed.size(1) - x.size(-1)}, 0);
  } else if (packed.scalar_type() == at::kChar) {  // int8: float32 rows with zeros against the scale rows,
    auto shape = x.sizes().vec();                    // widened and padded in one copy
    shape.back() += SCALE_ROWS;
    rows = at::empty(shape, x.options().dtype(at::kFloat));
    rows.narrow(-1, x.size(-1), SCALE_ROWS).zero_();
    rows.narrow(-1, 0, x.size(-1)).copy_(x);
  } else {
    rows = wide && x.is_contiguous() ? x : x.to(at::kFloat).contiguous();
  }
  const int64_t count = rows.numel() / rows.size(-1);
  const int64_t real = std::min(count, real_rows > 0 ? real_rows : count);
  const bool to_bf16 = x.scalar_type() == at::kBFloat16;
  auto shape = x.sizes().vec();
  shape.back() = out_features;
  const auto options = x.options().dtype(wide ? at::kFloat : to_bf16 ? at::kBFloat16 : at::kFloat);
  at::Tensor y = real == count ? at::empty(shape, options) : at::zeros(shape, options);  // padding rows: zero
  std::optional<at::Tensor> b;
  if (bias.has_value()) b = bias->to(at::kFloat).contiguous();
  const float* bp = b.has_value() ? b->const_data_ptr<float>() : nullptr;
  const int64_t threads = at::get_num_threads(), k = packed.size(1);
  void* out = y.data_ptr();
  switch (packed.scalar_type()) {
    case at::kInt:
#if defined(__AVX512BF16__)
      linear_to(static_cast<const uint32_t*>(rows.const_data_ptr()), real, k,
                static_cast<const uint32_t*>(packed.const_data_ptr()), out_features, bp, out, threads, to_bf16);
#endif
      break;
    case at::kByte:
#if defined(SPECSERVE_Q4)
      if (to_bf16) linear_q4(static_cast<const uint32_t*>(rows.const_data_ptr()), real, k,
                             static_cast<const uint8_t*>(packed.const_data_ptr()), out_features, bp,
                             static_cast<uint16_t*>(out), threads);
      else linear_q4(static_cast<const uint32_t*>(rows.const_data_ptr()), real, k,
                     static_cast<const uint8_t*>(packed.const_data_ptr()), out_features, bp,
                     static_cast<float*>(out), threads);
#endif
      break;
    case at::kChar:
      if (packed.dim() == 4) {
#if defined(__AVX512BF16__)
        linear_to(static_cast<const uint32_t*>(rows.const_data_ptr()), real, k,
                  reinterpret_cast<const q8pair*>(packed.const_data_ptr()), out_features, bp, out, threads, to_bf16);
#endif
        break;
      }
      linear_to(rows.const_data_ptr<float>(), real, k, static_cast<const int8_t*>(packed.const_data_ptr()),
                out_features, bp, out, threads, to_bf16);
      break;
    case at::kBFloat16:
      linear_to(rows.const_data_ptr<float>(), real, k, static_cast<const uint16_t*>(packed.const_data_ptr()),
                out_features, bp, out, threads, to_bf16);
      break;
    default:
      linear_to(rows.const_data_ptr<float>(), real, k, packed.const_data_ptr<float>(), out_features, bp, out,
                threads, to_bf16);
  }
  return wide || to_bf16 ? y : y.to(x.scalar_type());  // float16 rows: the kernel writes float32
}

}  // namespace

extern "C" void specserve_linear_real_rows(int64_t count) { real_rows = count; }

TORCH_LIBRARY_IMPL(specserve, CPU, m) { m.impl("linear", &linear_op); }
