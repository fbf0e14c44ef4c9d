// Decode attention on a CPU: every decode of a micro-batch in one call.
//
// out[b, h] = softmax(q[b, h] . K_b[f_b:len_b, h / group]^T * scale) . V_b[f_b:len_b, h / group]
// where position j of decode b is at offset j % block_size of block tables[b, j / block_size],
// and f_b = max(0, len_b - window) with a sliding window (window > 0; Mistral), else 0.
//
// q: [D, heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim] in any
// memory order with head_dim contiguous (read through their strides: the "heads" layout
// streams each head's keys of a block); tables: [D, W] int32 block tables (BatchLayout's
// decode_tables), lens: [D] int32 (decode_seqlens). The keys are read in place through the
// table, never gathered. One task per (decode, head), spread over torch's intra-op threads
// (at::parallel_for); each reads exactly len_b - f_b keys and values once, accumulating in
// float32 (bfloat16 caches too). Built on first use by pp_runtime/model/cpu_kernels.py.
// Only the headers it uses (a tensor, at::empty, parallel_for, pybind's tensor caster):
// <torch/extension.h>, all of libtorch's C++ API, took 27 s of a 2-core machine's build
// (which every stage worker's first start waits on), these 10 s.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <vector>

template <typename T>
static void decode(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                   const int32_t* table, int64_t width, const int32_t* len, at::Tensor& out,
                   float scale, int64_t window) {
  const int64_t heads = q.size(1), dim = q.size(2), group = heads / kc.size(2);
  const int64_t bs = kc.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t ks0 = kc.stride(0), ks1 = kc.stride(1), ks2 = kc.stride(2);
  const int64_t vs0 = vc.stride(0), vs1 = vc.stride(1), vs2 = vc.stride(2);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  at::parallel_for(0, q.size(0) * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score, qf(dim), acc(dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / heads, h = i % heads, n = len[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, n - window) : 0;  // f_b
      const int32_t* blocks = table + b * width;
      const T* kh = kp + (h / group) * ks2;  // head h's keys, block 0
      const T* vh = vp + (h / group) * vs2;
      const T* qb = qp + b * qs0 + h * qs1;
      for (int64_t e = 0; e < dim; ++e) qf[e] = static_cast<float>(qb[e]) * scale;
      score.resize(n - first);  // score[j - first] for key j
      float top = -INFINITY;
      const int64_t blk0 = first / bs;  // the block of the first key read
      for (int64_t blk = blk0, j0 = blk0 * bs; j0 < n; ++blk, j0 += bs) {  // scores: one pass over
        const T* kb = kh + blocks[blk] * ks0;  // the keys, block by block (no division per key)
        const int64_t m = std::min(bs, n - j0);
        for (int64_t o = std::max<int64_t>(0, first - j0); o < m; ++o) {
          const T* kr = kb + o * ks1;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t e = 0; e < dim; ++e) s += qf[e] * static_cast<float>(kr[e]);
          score[j0 + o - first] = s;
          top = std::max(top, s);
        }
      }
      float total = 0.f;
      for (int64_t j = 0; j < n - first; ++j) {
        score[j] = std::exp(score[j] - top);
        total += score[j];
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t blk = blk0, j0 = blk0 * bs; j0 < n; ++blk, j0 += bs) {  // weighted values: one pass
        const T* vb = vh + blocks[blk] * vs0;
        const int64_t m = std::min(bs, n - j0);
        for (int64_t o = std::max<int64_t>(0, first - j0); o < m; ++o) {
          const T* vr = vb + o * vs1;
          const float p = score[j0 + o - first];
#pragma omp simd
          for (int64_t e = 0; e < dim; ++e) acc[e] += p * static_cast<float>(vr[e]);
        }
      }
      T* ob = op + (b * heads + h) * dim;
      for (int64_t e = 0; e < dim; ++e) ob[e] = static_cast<T>(acc[e] / total);
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& tables,
                            const at::Tensor& lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "q [D, heads, head_dim], caches [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(tables.scalar_type() == at::kInt && lens.scalar_type() == at::kInt &&
              tables.is_contiguous() && lens.is_contiguous() && tables.dim() == 2 &&
              tables.size(0) == q.size(0) && lens.numel() == q.size(0),
              "tables: [D, W] int32, lens: [D] int32");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const int64_t width = tables.size(1), bs = k_cache.size(1), blocks = k_cache.size(0);
  const int32_t* table = tables.data_ptr<int32_t>();
  const int32_t* len = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= width * bs, "decode ", b, ": length ", len[b],
                " beyond its block table of ", width, " blocks");
    for (int64_t i = 0; i < (len[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(table[b * width + i] >= 0 && table[b * width + i] < blocks, "decode ", b,
                  ": block ", table[b * width + i], " is outside the cache's ", blocks);
  }
  if (q.scalar_type() == at::kFloat)
    decode<float>(q, k_cache, v_cache, table, width, len, out, static_cast<float>(scale), window);
  else if (q.scalar_type() == at::kBFloat16)
    decode<at::BFloat16>(q, k_cache, v_cache, table, width, len, out, static_cast<float>(scale),
                         window);
  else
    TORCH_CHECK(false, "decode_attention: float32 or bfloat16, got ", q.scalar_type());
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "every decode of a micro-batch (CPU)");
}
