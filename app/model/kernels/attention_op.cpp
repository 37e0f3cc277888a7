// specserve::ragged_attention's CPU kernel, registered with torch's dispatcher from C++, for the forwards
// whose every span the paged kernel computes (decode steps, verify rows): the kernel of
// paged_attention.cpp (compiled into this library too) called with no Python in between. Why: a step calls
// the op once per layer (30 on the reference target), and its Python body (the dispatcher's call into
// Python, the forward's Layout looked up, the kernel's twenty arguments through ctypes) cost ~25 us a call
// in a float32 forward (the step 28.63 -> 27.88 ms without it), less in bfloat16 (16.07 -> 15.98, 17.33 ->
// 17.01), beside the kernel's ~35 (one row over 200 keys, one thread, a 2-core Zen 4 EPYC).
//
// The forward's spans, block tables and pool are what app/model/cpu_attention.py `bind` sets for the thread
// that runs it; a forward it has not bound (a prompt's long span among them, another attention path, a
// dtype the pool does not hold) takes the op's Python body (specserve::ragged_attention_python), as does
// every call where this library was not built. What is computed is that body's, step for step: the same
// rows reach the same kernel with the same arguments, so the results are the same bits
// (tests/test_cpu_attention.py compares the two).
#include "paged_attention.cpp"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

namespace {

// The forward this thread runs, as bound; layers == 0: none (the Python body decides).
struct Bound {
  const int64_t* spans = nullptr;   // [n_spans, 4], paged_attention.cpp's layout
  int64_t n_spans = 0;
  const int64_t* tables = nullptr;
  const int64_t* pools = nullptr;   // every layer's keys tensor's address, then every layer's values'
  int64_t layers = 0, heads_kv = 0, dim = 0, slots = 0, block = 0;
  at::ScalarType dtype = at::kFloat;
  int64_t next = 0;                 // layer -1 (the layers in order): the layer whose call comes next
};
thread_local Bound bound;

at::Tensor python_body(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t layer,
                       double scale) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("specserve::ragged_attention_python", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double)>();
  return op.call(query, key, value, layer, scale);
}

template <typename T>
void run_kernel(const Bound& b, const at::Tensor& q, const at::Tensor& new_k, const at::Tensor& new_v, at::Tensor& out,
                int64_t layer, double scale) {
  attend<T>(static_cast<const T*>(q.const_data_ptr()), q.stride(1), q.stride(2),
            reinterpret_cast<T*>(b.pools[layer]), reinterpret_cast<T*>(b.pools[b.layers + layer]),
            static_cast<T*>(out.data_ptr()), static_cast<const T*>(new_k.const_data_ptr()),
            static_cast<const T*>(new_v.const_data_ptr()), new_k.stride(1), new_k.stride(2), b.spans, b.n_spans,
            b.tables, q.size(1), b.heads_kv, b.dim, b.slots, b.block, static_cast<float>(scale),
            at::get_num_threads());
}

// query [1, Hq, T, D] -> [1, T, Hq, D]; key, value: the rows' new keys and values [1, Hkv, T, D], written into
// their slots by the kernel (app/model/ragged.py `attend` says the rest).
at::Tensor ragged_attention_op(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t layer,
                               double scale) {
  Bound& b = bound;
  const at::ScalarType dtype = b.dtype;
  if (b.layers == 0 || query.scalar_type() != dtype || key.scalar_type() != dtype || value.scalar_type() != dtype)
    return python_body(query, key, value, layer, scale);
  if (layer < 0) {
    layer = b.next;
    b.next = (layer + 1) % b.layers;
  }
  const at::Tensor q = query.stride(-1) == 1 ? query : query.contiguous();
  at::Tensor new_k = key, new_v = value;
  if (new_k.stride(-1) != 1 || new_v.strides() != new_k.strides()) {
    new_k = key.contiguous();
    new_v = value.contiguous();
  }
  // rows past the spans' (a compiled step's padding) come out zero
  at::Tensor out = at::zeros({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());
  if (dtype == at::kBFloat16)
    run_kernel<bf16>(b, q, new_k, new_v, out, layer, scale);
  else
    run_kernel<float>(b, q, new_k, new_v, out, layer, scale);
  return out;
}

}  // namespace

extern "C" {
// dtype: 0 float32, 1 bfloat16 (the pool's)
void specserve_attention_bind(const int64_t* spans, int64_t n_spans, const int64_t* tables, const int64_t* pools,
                              int64_t layers, int64_t heads_kv, int64_t dim, int64_t slots, int64_t block,
                              int64_t dtype) {
  bound = Bound{spans, n_spans, tables, pools, layers, heads_kv, dim, slots, block,
                dtype == 1 ? at::kBFloat16 : at::kFloat, 0};
}
void specserve_attention_unbind() { bound = Bound{}; }
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) { m.impl("ragged_attention", &ragged_attention_op); }
