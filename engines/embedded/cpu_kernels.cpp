// The embedded engine's CPU kernels: a Qwen3 decoder layer's attention block and dense MLP block, each one
// call, over token-major rows (no padding) and the runner's per-slot KV cache.
//
// Why: on a CPU a small model's decode step is dominated by launching ~300 tiny torch ops (RMSNorms,
// the q/k norms, RoPE, cache writes, masks, softmax), not by arithmetic. Here everything between the
// matmuls is plain loops over one token's row, and the matmuls stay ATen's (MKL / oneDNN). The math is
// HF's Qwen3 in fp32 with HF's operation order; only summation order differs (float rounding).
// Loaded (compiled once, cached) by cpu_kernels.py; the Python forward in fused.py is the reference.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <cmath>
#include <limits>
#include <vector>

namespace {

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous(), name,
              " must be a contiguous float32 CPU tensor");
}

// HF's Qwen3RMSNorm in fp32: x * rsqrt(mean(x^2) + eps), then * weight (when given).
inline void rms_row(const float* x, float* out, const float* weight, int64_t n, float eps) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float r = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  if (weight) {
    for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * r);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r;
  }
}

// Eight floats as one value: GCC / Clang lower it to the machine's vector registers (AVX, AVX-512, NEON), so
// the hot loops below keep their partial sums in registers without per-ISA intrinsics.
typedef float vec8 __attribute__((vector_size(32)));
inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof v); }

// scores[g * stride + s] = scale * (q[g] . key[s]) for a kv head's G queries against its keys (transposed,
// [d, capacity]) at positions 0..span-1: 32 positions at a time, each key row read once for all G queries.
template <int G>
void group_scores(const float* q, const float* keys, int64_t capacity, int64_t d, int64_t span, float scale,
                  float* scores, int64_t stride) {
  constexpr int kVecs = 4;
  int64_t s0 = 0;
  for (; s0 + 8 * kVecs <= span; s0 += 8 * kVecs) {
    vec8 acc[G][kVecs] = {};
    for (int64_t i = 0; i < d; ++i) {
      const float* row = keys + i * capacity + s0;
      vec8 k[kVecs];
      for (int w = 0; w < kVecs; ++w) k[w] = load8(row + 8 * w);
      for (int g = 0; g < G; ++g) {
        const float a = q[g * d + i];
        for (int w = 0; w < kVecs; ++w) acc[g][w] += a * k[w];
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int w = 0; w < kVecs; ++w) store8(scores + g * stride + s0 + 8 * w, acc[g][w] * scale);
    }
  }
  for (; s0 < span; ++s0) {
    for (int g = 0; g < G; ++g) {
      float acc = 0.f;
      for (int64_t i = 0; i < d; ++i) acc += q[g * d + i] * keys[i * capacity + s0];
      scores[g * stride + s0] = acc * scale;
    }
  }
}

// out[g] = sum_s p[g * stride + s] * value[s] for G queries over values [span, D], each row read once.
template <int D, int G>
void group_values(const float* p, int64_t stride, const float* values, int64_t span, float* out) {
  constexpr int kVecs = D / 8;
  vec8 acc[G][kVecs] = {};
  for (int64_t s = 0; s < span; ++s) {
    const float* row = values + s * D;
    vec8 v[kVecs];
    for (int k = 0; k < kVecs; ++k) v[k] = load8(row + 8 * k);
    for (int g = 0; g < G; ++g) {
      const float w = p[g * stride + s];
      for (int k = 0; k < kVecs; ++k) acc[g][k] += w * v[k];
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int k = 0; k < kVecs; ++k) store8(out + g * D + 8 * k, acc[g][k]);
  }
}

// Any other head size or group: plain loops (correct, slower).
void any_scores(const float* q, int64_t group, const float* keys, int64_t capacity, int64_t d, int64_t span,
                float scale, float* scores, int64_t stride) {
  for (int64_t g = 0; g < group; ++g) {
    float* sc = scores + g * stride;
    std::fill(sc, sc + span, 0.f);
    for (int64_t i = 0; i < d; ++i) {
      const float a = q[g * d + i];
      const float* row = keys + i * capacity;
      for (int64_t s = 0; s < span; ++s) sc[s] += a * row[s];
    }
    for (int64_t s = 0; s < span; ++s) sc[s] *= scale;
  }
}

void any_values(const float* p, int64_t stride, int64_t group, const float* values, int64_t d, int64_t span,
                float* out) {
  std::fill(out, out + group * d, 0.f);
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t s = 0; s < span; ++s) {
      const float w = p[g * stride + s];
      for (int64_t i = 0; i < d; ++i) out[g * d + i] += w * values[s * d + i];
    }
  }
}

using ScoresFn = void (*)(const float*, const float*, int64_t, int64_t, int64_t, float, float*, int64_t);
using ValuesFn = void (*)(const float*, int64_t, const float*, int64_t, float*);

ScoresFn pick_scores(int64_t group) {
  switch (group) {
    case 1: return group_scores<1>;
    case 2: return group_scores<2>;
    case 4: return group_scores<4>;
    case 8: return group_scores<8>;
    default: return nullptr;
  }
}

template <int D>
ValuesFn pick_values_for(int64_t group) {
  switch (group) {
    case 1: return group_values<D, 1>;
    case 2: return group_values<D, 2>;
    case 4: return group_values<D, 4>;
    case 8: return group_values<D, 8>;
    default: return nullptr;
  }
}

ValuesFn pick_values(int64_t d, int64_t group) {
  switch (d) {
    case 32: return pick_values_for<32>(group);
    case 64: return pick_values_for<64>(group);
    case 128: return pick_values_for<128>(group);
    default: return nullptr;
  }
}

torch::Tensor rms_rows(const torch::Tensor& h, const torch::Tensor& weight, double eps) {
  auto out = torch::empty_like(h);
  const int64_t n = h.size(1);
  const float* x = h.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  for (int64_t t = 0; t < h.size(0); ++t) rms_row(x + t * n, o + t * n, w, n, static_cast<float>(eps));
  return out;
}

}  // namespace

// One attention block for N tokens, each of one sequence (its KV-cache ``slot``) at ``position``:
//   x = rms(h) * input_norm;  q, k, v = x @ qkv_weight^T (+ bias);  q, k = rope(rms(q|k) * q_norm|k_norm)
//   write k, v at (slot, position);  each query head attends to its slot's positions 0..position
//   return h + attn @ o_weight^T (+ bias)
// Tokens of one sequence must come in position order: their keys are all written before any attends, so
// a prefill chunk's token sees the chunk's earlier tokens (and the cache before them), never later ones.
// Shapes: h [N, hidden]; rope [N, 2, D] (cos, and sin with its first half negated: HF's rotate_half);
// k_cache [slots, KV, D, capacity] (keys transposed), v_cache [slots, KV, capacity, D]; slots, positions [N].
torch::Tensor attention_block(const torch::Tensor& h, const torch::Tensor& input_norm, double eps,
                              const torch::Tensor& qkv_weight, const c10::optional<torch::Tensor>& qkv_bias,
                              const torch::Tensor& q_norm, const torch::Tensor& k_norm, double qk_eps,
                              const torch::Tensor& rope, torch::Tensor k_cache, torch::Tensor v_cache,
                              const torch::Tensor& slots, const torch::Tensor& positions,
                              const torch::Tensor& o_weight, const c10::optional<torch::Tensor>& o_bias,
                              double scaling, int64_t heads, int64_t kv_heads) {
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{
           &h, &input_norm, &qkv_weight, &q_norm, &k_norm, &rope, &k_cache, &v_cache, &o_weight}) {
    check_f32(*t, "attention_block: every float input");
  }
  TORCH_CHECK(slots.scalar_type() == torch::kLong && positions.scalar_type() == torch::kLong,
              "attention_block: slots and positions must be int64");
  const int64_t n = h.size(0), d = q_norm.size(0), half = d / 2, group = heads / kv_heads;
  const int64_t capacity = k_cache.size(3), num_slots = k_cache.size(0);
  TORCH_CHECK(heads % kv_heads == 0 && d % 2 == 0, "attention_block: heads must be a multiple of kv_heads");
  TORCH_CHECK(k_cache.size(1) == kv_heads && k_cache.size(2) == d && v_cache.size(2) == capacity,
              "attention_block: the KV cache does not match kv_heads / head_dim");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots && pos[t] >= 0 && pos[t] < capacity,
                "attention_block: a token's slot or position is outside the KV cache");
    longest = std::max(longest, pos[t] + 1);
  }

  auto x = rms_rows(h, input_norm, eps);
  auto qkv = at::linear(x, qkv_weight, qkv_bias).contiguous();  // [N, (heads + 2 kv) d]
  const int64_t width = (heads + 2 * kv_heads) * d;
  auto q = torch::empty({n, heads, d}, h.options());
  float* qp = q.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const float* qkvp = qkv.data_ptr<float>();
  const float* cs = rope.data_ptr<float>();
  const float* qn = q_norm.data_ptr<float>();
  const float* kn = k_norm.data_ptr<float>();
  const float qk_epsf = static_cast<float>(qk_eps);

  // q/k norms and RoPE per head; keys and values straight into the cache.
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> normed(d);
    for (int64_t t = begin; t < end; ++t) {
      const float* row = qkvp + t * width;
      const float* cos = cs + t * 2 * d;
      const float* sin = cos + d;
      for (int64_t j = 0; j < heads + kv_heads; ++j) {
        const bool is_q = j < heads;
        rms_row(row + j * d, normed.data(), is_q ? qn : kn, d, qk_epsf);
        // HF: x * cos + rotate_half(x) * sin, with rotate_half folded into sin's sign.
        if (is_q) {
          float* out = qp + (t * heads + j) * d;
          for (int64_t i = 0; i < d; ++i) out[i] = normed[i] * cos[i] + normed[(i + half) % d] * sin[i];
        } else {
          float* out = kc + ((slot[t] * kv_heads + (j - heads)) * d) * capacity + pos[t];
          for (int64_t i = 0; i < d; ++i) out[i * capacity] = normed[i] * cos[i] + normed[(i + half) % d] * sin[i];
        }
      }
      const float* v = row + (heads + kv_heads) * d;
      for (int64_t j = 0; j < kv_heads; ++j) {
        std::copy(v + j * d, v + (j + 1) * d, vc + ((slot[t] * kv_heads + j) * capacity + pos[t]) * d);
      }
    }
  });

  // Attention, one task per (token, kv head): scores into one buffer (positions past a token's own are -inf),
  // ATen's vectorized softmax over all of it at once, then the weighted sum of values.
  const float scale = static_cast<float>(scaling);
  const ScoresFn scores_fn = pick_scores(group);
  const ValuesFn values_fn = pick_values(d, group);
  auto scores = torch::empty({n * kv_heads, group, longest}, h.options());
  float* sp = scores.data_ptr<float>();
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / kv_heads, j = task % kv_heads, span = pos[t] + 1;
      const float* keys = kc + ((slot[t] * kv_heads + j) * d) * capacity;
      const float* qg = qp + (t * heads + j * group) * d;
      float* sc = sp + task * group * longest;
      if (scores_fn) {
        scores_fn(qg, keys, capacity, d, span, scale, sc, longest);
      } else {
        any_scores(qg, group, keys, capacity, d, span, scale, sc, longest);
      }
      for (int64_t g = 0; g < group; ++g) {
        std::fill(sc + g * longest + span, sc + (g + 1) * longest, -std::numeric_limits<float>::infinity());
      }
    }
  });
  scores = at::_softmax(scores, -1, false);
  sp = scores.data_ptr<float>();
  auto attn = torch::empty({n, heads * d}, h.options());
  float* ap = attn.data_ptr<float>();
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / kv_heads, j = task % kv_heads, span = pos[t] + 1;
      const float* values = vc + ((slot[t] * kv_heads + j) * capacity) * d;  // [capacity, d]
      const float* p = sp + task * group * longest;
      float* out = ap + t * heads * d + j * group * d;
      if (values_fn) {
        values_fn(p, longest, values, span, out);
      } else {
        any_values(p, longest, group, values, d, span, out);
      }
    }
  });
  return h + at::linear(attn, o_weight, o_bias);
}

// The dense MLP block: h + down(silu(gate) * up) with gate, up = rms(h) * post_norm @ gate_up_weight^T
// (gate rows first, as fused.py concatenates them).
torch::Tensor mlp_block(const torch::Tensor& h, const torch::Tensor& post_norm, double eps,
                        const torch::Tensor& gate_up_weight, const torch::Tensor& down_weight) {
  for (const torch::Tensor* t : {&h, &post_norm, &gate_up_weight, &down_weight}) check_f32(*t, "mlp_block: every input");
  auto gate_up = at::linear(rms_rows(h, post_norm, eps), gate_up_weight).contiguous();
  const int64_t n = h.size(0), inter = gate_up.size(1) / 2;
  auto act = torch::empty({n, inter}, h.options());
  const float* gu = gate_up.data_ptr<float>();
  float* a = act.data_ptr<float>();
  for (int64_t t = 0; t < n; ++t) {
    const float* g = gu + t * 2 * inter;
    const float* u = g + inter;
    float* out = a + t * inter;
    for (int64_t i = 0; i < inter; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
  return h + at::linear(act, down_weight);
}

// HF's final RMSNorm over token rows (the logits' input).
torch::Tensor rms_norm(const torch::Tensor& h, const torch::Tensor& weight, double eps) {
  check_f32(h, "rms_norm: h");
  check_f32(weight, "rms_norm: weight");
  return rms_rows(h, weight, eps);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention_block", &attention_block, "Qwen3 attention block over token rows and the slot KV cache");
  m.def("mlp_block", &mlp_block, "Qwen3 dense MLP block over token rows");
  m.def("rms_norm", &rms_norm, "Qwen3 RMSNorm over token rows");
}
