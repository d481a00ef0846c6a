// The embedded engine's CPU kernels: a Qwen3 decoder layer's attention block and dense MLP block (or a MoE
// layer's experts), each one call, over token-major rows (no padding) and the runner's per-slot KV cache; and the
// sampler, one call a step.
//
// Why: on a CPU a small model's decode step is dominated by launching ~300 tiny torch ops (RMSNorms,
// the q/k norms, RoPE, cache writes, masks, softmax), not by arithmetic. Here everything between the
// matmuls is plain loops over one token's row, and the matmuls stay ATen's (MKL / oneDNN). The math is
// HF's Qwen3 in fp32 with HF's operation order; only summation order differs (float rounding).
// Loaded (compiled once, cached) by cpu_kernels.py; the Python forward in fused.py is the reference.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <cstdint>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace {

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous(), name,
              " must be a contiguous float32 CPU tensor");
}

// A projection's weight as [in, out] (the module's weight transposed): a contiguous copy, which MKL multiplies
// fastest at a few rows, or the transposed view of the module's own weight; any strides do.
void check_weight(const torch::Tensor& t, int64_t in, int64_t out, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.dim() == 2, name,
              " must be a float32 CPU matrix");
  TORCH_CHECK(t.size(0) == in && t.size(1) == out, name, " must be [", in, ", ", out, "] (the weight transposed), got [",
              t.size(0), ", ", t.size(1), "]");
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

// Sixteen floats as one value: GCC / Clang lower them to the machine's vector registers (AVX-512, AVX,
// NEON; a width the machine lacks becomes two or four of its own), so the hot loops below keep their partial
// sums in registers without per-ISA intrinsics.
typedef float vec16 __attribute__((vector_size(64)));
typedef int32_t ivec16 __attribute__((vector_size(64)));
inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof v); }
inline vec16 splat16(float a) { return vec16{} + a; }
inline float hmax16(vec16 v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, v[i]);
  return m;
}
inline float hsum16(vec16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// e^x for x <= 0 (a score minus its row's maximum), 16 lanes: Cephes' single-precision expf (range reduction by
// ln 2 in two parts, degree-6 polynomial; within ~1 ulp, as ATen's Sleef exp). Below -87.3 it returns ~1e-38,
// not 0: such a term is 38 orders under the row's largest and cannot move a sum.
inline vec16 exp16(vec16 x) {
  const vec16 floor_x = splat16(-87.33654f);
  x = x < floor_x ? floor_x : x;
  vec16 n = x * 1.44269504088896341f;
  n = (n + 12582912.f) - 12582912.f;  // round to nearest (1.5 * 2^23)
  const vec16 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  vec16 p = splat16(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vec16 y = p * (r * r) + r + 1.f;
  const ivec16 bits = (__builtin_convertvector(n, ivec16) + 127) << 23;  // 2^n
  vec16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

constexpr int kTileRows = 8;  // query rows that share one pass over a kv head's keys and values

// out[r][s] = scale * (q[r] . key[s]) for R query rows against one kv head's keys (transposed, [d, capacity])
// at positions 0..span-1: P = 16 W positions at a time, each key row read once for all R queries. Positions
// past `span` in the last block are computed and dropped when the cache row has room for them.
// out[r][s] = scale * (q[r] . key[s]) for R query rows against one kv head's keys (transposed, [d, capacity]) at
// positions s0.., 16 W at a time while the cache row has room for a whole block, each key row read once for all R
// queries; positions past `span` in the last block are computed and dropped. Returns the first position left.
template <int R, int W>
int64_t score_blocks(const float* const* q, const float* keys, int64_t capacity, int64_t d, int64_t s0, int64_t span,
                     float scale, float* const* out) {
  for (; s0 < span && s0 + 16 * W <= capacity; s0 += 16 * W) {
    vec16 acc[R][W] = {};
    for (int64_t i = 0; i < d; ++i) {
      const float* row = keys + i * capacity + s0;
      vec16 k[W];
      for (int w = 0; w < W; ++w) k[w] = load16(row + 16 * w);
      for (int r = 0; r < R; ++r) {
        const float a = q[r][i];
        for (int w = 0; w < W; ++w) acc[r][w] += a * k[w];
      }
    }
    const int64_t lanes = std::min<int64_t>(16 * W, span - s0);
    for (int r = 0; r < R; ++r) {
      if (lanes == 16 * W) {
        for (int w = 0; w < W; ++w) store16(out[r] + s0 + 16 * w, acc[r][w] * scale);
      } else {  // the last block: only the positions in the span
        float block[16 * W];
        for (int w = 0; w < W; ++w) store16(block + 16 * w, acc[r][w] * scale);
        std::copy(block, block + lanes, out[r] + s0);
      }
    }
  }
  return s0;
}

// All of a tile's scores: wide blocks (fewer rows keep more positions in registers), then 16 at a time, then the
// cache's last few positions one by one.
template <int R>
void tile_scores(const float* const* q, const float* keys, int64_t capacity, int64_t d, int64_t span, float scale,
                 float* const* out) {
  int64_t s0 = score_blocks<R, (R <= 4 ? 4 : 2)>(q, keys, capacity, d, 0, span, scale, out);
  s0 = score_blocks<R, 1>(q, keys, capacity, d, s0, span, scale, out);
  for (; s0 < span; ++s0) {
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t i = 0; i < d; ++i) acc += q[r][i] * keys[i * capacity + s0];
      out[r][s0] = acc * scale;
    }
  }
}

// A row's softmax in place over its first `len` scores, and zeros up to `span` (the tile's longest row), so the
// weighted sum runs over the same span for every row; returns 1 / the sum of the exponentials.
inline float softmax_row(float* s, int64_t len, int64_t span) {
  int64_t i = 0;
  float m = -std::numeric_limits<float>::infinity();
  if (len >= 16) {
    vec16 mv = load16(s);
    for (i = 16; i + 16 <= len; i += 16) {
      const vec16 x = load16(s + i);
      mv = x > mv ? x : mv;
    }
    m = hmax16(mv);
  }
  for (; i < len; ++i) m = std::max(m, s[i]);
  vec16 sumv = {};
  for (i = 0; i + 16 <= len; i += 16) {
    const vec16 e = exp16(load16(s + i) - m);
    store16(s + i, e);
    sumv += e;
  }
  float sum = hsum16(sumv);
  if (i < len) {  // the last partial vector, through a padded copy
    float tail[16];
    std::fill(tail, tail + 16, m);
    std::copy(s + i, s + len, tail);
    store16(tail, exp16(load16(tail) - m));
    for (int64_t j = i; j < len; ++j) {
      s[j] = tail[j - i];
      sum += s[j];
    }
  }
  std::fill(s + len, s + span, 0.f);
  return 1.f / sum;
}

// out[r] = inv[r] * sum_s p[r][s] * value[s] for R weight rows over one kv head's values [span, d], 16 C dims at a
// time from `first`, each value row's chunk read once for all R rows.
template <int R, int C>
void tile_values(const float* const* p, const float* values, int64_t d, int64_t first, int64_t span,
                 const float* inv, float* const* out) {
  vec16 acc[R][C] = {};
  for (int64_t s = 0; s < span; ++s) {
    const float* row = values + s * d + first;
    vec16 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(row + 16 * c);
    for (int r = 0; r < R; ++r) {
      const float w = p[r][s];
      for (int c = 0; c < C; ++c) acc[r][c] += w * v[c];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) store16(out[r] + first + 16 * c, acc[r][c] * inv[r]);
  }
}

template <int R>
void tile_values_all(const float* const* p, const float* values, int64_t d, int64_t span, const float* inv,
                     float* const* out) {
  int64_t first = 0;
  for (; first + 32 <= d; first += 32) tile_values<R, 2>(p, values, d, first, span, inv, out);
  for (; first + 16 <= d; first += 16) tile_values<R, 1>(p, values, d, first, span, inv, out);
  for (int r = 0; r < R; ++r) {  // a head size that is no multiple of 16: its last dims in plain loops
    for (int64_t i = first; i < d; ++i) {
      float acc = 0.f;
      for (int64_t s = 0; s < span; ++s) acc += p[r][s] * values[s * d + i];
      out[r][i] = acc * inv[r];
    }
  }
}

// One tile's attention, exact (scores, their softmax, the weighted sum of values): R query rows of one kv head,
// row r seeing positions 0..lens[r]-1. `buf`: R rows of `stride` >= the longest len floats.
template <int R>
void attend_tile(const float* const* q, const int64_t* lens, const float* keys, const float* values,
                 int64_t capacity, int64_t d, float scale, float* buf, int64_t stride, float* const* out) {
  int64_t span = 0;
  for (int r = 0; r < R; ++r) span = std::max(span, lens[r]);
  float* rows[R];
  float inv[R];
  for (int r = 0; r < R; ++r) rows[r] = buf + r * stride;
  tile_scores<R>(q, keys, capacity, d, span, scale, rows);
  for (int r = 0; r < R; ++r) inv[r] = softmax_row(rows[r], lens[r], span);
  tile_values_all<R>(rows, values, d, span, inv, out);
}

using TileFn = void (*)(const float* const*, const int64_t*, const float*, const float*, int64_t, int64_t, float,
                        float*, int64_t, float* const*);

template <int... R>
std::array<TileFn, kTileRows + 1> tile_table(std::integer_sequence<int, R...>) {
  return {nullptr, attend_tile<R + 1>...};
}

// The kernel for a tile of `rows` query rows (1..kTileRows).
TileFn pick_tile(int64_t rows) {
  static const auto table = tile_table(std::make_integer_sequence<int, kTileRows>{});
  return table[rows];
}

// A tile: up to kTileRows query rows of one kv head -- heads first_head.. of its group (all of them unless the
// group is larger than a tile) for consecutive tokens of one sequence (a prefill's tokens share the keys they
// read; a decode step has one token per sequence).
struct Tile {
  int64_t first_token, tokens, kv_head, first_head, heads;
};

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
//   x = rms(h) * input_norm;  q, k, v = x @ qkv_wt (+ bias);  q, k = rope(rms(q|k) * q_norm|k_norm)
//   write k, v at (slot, position);  each query head attends to its slot's positions 0..position
//   return h + attn @ o_wt (+ bias)
// Weights come transposed, [in, out] (`check_weight`).
// Tokens of one sequence must come in position order: their keys are all written before any attends, so
// a prefill chunk's token sees the chunk's earlier tokens (and the cache before them), never later ones.
// Shapes: h [N, hidden]; rope [N, 2, D] (cos, and sin with its first half negated: HF's rotate_half);
// k_cache [slots, KV, D, capacity] (keys transposed), v_cache [slots, KV, capacity, D]; slots, positions [N].
torch::Tensor attention_block(const torch::Tensor& h, const torch::Tensor& input_norm, double eps,
                              const torch::Tensor& qkv_wt, const c10::optional<torch::Tensor>& qkv_bias,
                              const torch::Tensor& q_norm, const torch::Tensor& k_norm, double qk_eps,
                              const torch::Tensor& rope, torch::Tensor k_cache, torch::Tensor v_cache,
                              const torch::Tensor& slots, const torch::Tensor& positions,
                              const torch::Tensor& o_wt, const c10::optional<torch::Tensor>& o_bias,
                              double scaling, int64_t heads, int64_t kv_heads) {
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{
           &h, &input_norm, &q_norm, &k_norm, &rope, &k_cache, &v_cache}) {
    check_f32(*t, "attention_block: every float input");
  }
  TORCH_CHECK(slots.scalar_type() == torch::kLong && positions.scalar_type() == torch::kLong && slots.is_contiguous()
                  && positions.is_contiguous() && slots.device().is_cpu() && positions.device().is_cpu(),
              "attention_block: slots and positions must be contiguous int64 CPU tensors");
  const int64_t n = h.size(0), d = q_norm.size(0), half = d / 2, group = heads / kv_heads;
  const int64_t capacity = k_cache.size(3), num_slots = k_cache.size(0);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && d % 2 == 0,
              "attention_block: heads must be a multiple of kv_heads, and head_dim even");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.size(1) == kv_heads && k_cache.size(2) == d
                  && v_cache.size(0) == num_slots && v_cache.size(1) == kv_heads && v_cache.size(2) == capacity
                  && v_cache.size(3) == d,
              "attention_block: the KV cache does not match kv_heads / head_dim");
  TORCH_CHECK(h.dim() == 2 && input_norm.numel() == h.size(1) && k_norm.numel() == d && rope.dim() == 3
                  && rope.size(0) == n && rope.size(1) == 2 && rope.size(2) == d && slots.numel() == n
                  && positions.numel() == n,
              "attention_block: shapes disagree (h [N, hidden], input_norm [hidden], q/k norms [head_dim], "
              "rope [N, 2, head_dim], one slot and position per row)");
  check_weight(qkv_wt, h.size(1), (heads + 2 * kv_heads) * d, "attention_block: qkv_wt");
  check_weight(o_wt, heads * d, h.size(1), "attention_block: o_wt");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots && pos[t] >= 0 && pos[t] < capacity,
                "attention_block: a token's slot or position is outside the KV cache");
    longest = std::max(longest, pos[t] + 1);
  }

  auto x = rms_rows(h, input_norm, eps);
  auto qkv = (qkv_bias ? at::addmm(*qkv_bias, x, qkv_wt) : at::mm(x, qkv_wt)).contiguous();  // [N, (heads + 2 kv) d]
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
        // HF: x * cos + rotate_half(x) * sin, with rotate_half folded into sin's sign: the partner of dim i is
        // i + half in the first half and i - half in the second.
        const float* x = normed.data();
        if (is_q) {
          float* out = qp + (t * heads + j) * d;
          for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + x[i + half] * sin[i];
          for (int64_t i = half; i < d; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
        } else {
          float* out = kc + ((slot[t] * kv_heads + (j - heads)) * d) * capacity + pos[t];
          for (int64_t i = 0; i < half; ++i) out[i * capacity] = x[i] * cos[i] + x[i + half] * sin[i];
          for (int64_t i = half; i < d; ++i) out[i * capacity] = x[i] * cos[i] + x[i - half] * sin[i];
        }
      }
      const float* v = row + (heads + kv_heads) * d;
      for (int64_t j = 0; j < kv_heads; ++j) {
        std::copy(v + j * d, v + (j + 1) * d, vc + ((slot[t] * kv_heads + j) * capacity + pos[t]) * d);
      }
    }
  });

  // Attention over tiles, each exact on its own: its rows' scores into a small buffer, their softmax, the
  // weighted sum of values (no [N, heads, longest] score matrix, no masked positions computed).
  const float scale = static_cast<float>(scaling);
  const int64_t heads_per_tile = std::min<int64_t>(group, kTileRows);
  const int64_t per_tile = std::max<int64_t>(1, kTileRows / group);  // tokens per tile
  std::vector<Tile> tiles;
  for (int64_t t = 0; t < n;) {
    int64_t run = 1;
    while (t + run < n && run < per_tile && slot[t + run] == slot[t]) ++run;
    for (int64_t j = 0; j < kv_heads; ++j) {
      for (int64_t g = 0; g < group; g += heads_per_tile) {
        tiles.push_back({t, run, j, g, std::min(heads_per_tile, group - g)});
      }
    }
    t += run;
  }
  auto attn = torch::empty({n, heads * d}, h.options());
  float* ap = attn.data_ptr<float>();
  const int64_t stride = (longest + 15) / 16 * 16;
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(kTileRows * stride);
    const float* q_rows[kTileRows];
    float* out_rows[kTileRows];
    int64_t lens[kTileRows];
    for (int64_t i = begin; i < end; ++i) {
      const Tile& tile = tiles[i];
      int64_t r = 0;
      for (int64_t u = 0; u < tile.tokens; ++u) {  // the tile's rows: (token, head), tokens outer
        const int64_t t = tile.first_token + u;
        for (int64_t g = 0; g < tile.heads; ++g, ++r) {
          const int64_t head = tile.kv_head * group + tile.first_head + g;
          q_rows[r] = qp + (t * heads + head) * d;
          out_rows[r] = ap + (t * heads + head) * d;
          lens[r] = pos[t] + 1;
        }
      }
      const int64_t cache_row = slot[tile.first_token] * kv_heads + tile.kv_head;
      pick_tile(r)(q_rows, lens, kc + cache_row * d * capacity, vc + cache_row * capacity * d, capacity, d, scale,
                   buf.data(), stride, out_rows);
    }
  });
  return o_bias ? h + at::addmm(*o_bias, attn, o_wt) : at::addmm(h, attn, o_wt);  // the residual added in the GEMM
}

// The dense MLP block: h + down(silu(gate) * up) with gate, up = rms(h) * post_norm @ gate_up_wt (gate columns
// first, as fused.py concatenates them); weights transposed, [in, out].
torch::Tensor mlp_block(const torch::Tensor& h, const torch::Tensor& post_norm, double eps,
                        const torch::Tensor& gate_up_wt, const torch::Tensor& down_wt) {
  check_f32(h, "mlp_block: h");
  check_f32(post_norm, "mlp_block: post_norm");
  TORCH_CHECK(h.dim() == 2 && post_norm.numel() == h.size(1) && gate_up_wt.dim() == 2 && gate_up_wt.size(1) % 2 == 0,
              "mlp_block: h must be [N, hidden], post_norm [hidden], gate_up_wt [hidden, 2 intermediate]");
  check_weight(gate_up_wt, h.size(1), gate_up_wt.size(1), "mlp_block: gate_up_wt");
  check_weight(down_wt, gate_up_wt.size(1) / 2, h.size(1), "mlp_block: down_wt");
  auto gate_up = at::mm(rms_rows(h, post_norm, eps), gate_up_wt);
  const int64_t inter = gate_up.size(1) / 2;
  auto act = at::silu(gate_up.narrow(1, 0, inter)).mul_(gate_up.narrow(1, inter, inter));  // ATen's vectorized silu
  return at::addmm(h, act, down_wt);  // the residual added in the GEMM
}

// A Qwen3-MoE layer's experts over token rows, as HF's eager `Qwen3MoeExperts.forward` computes them (the same
// ATen ops in the same order) without its per-expert Python: each expert in turn takes its tokens (by top-k slot,
// then token, as HF's `torch.where` lists them), gate and up from gate_up [E, 2I, H] (gate rows first),
// silu(gate) * up, down [E, H, I], times the routing weight, added into its tokens' rows. The router stays HF's
// module, so its choices are the torch path's; indices must be real experts (a router never picks another).
torch::Tensor moe_experts(const torch::Tensor& x, const torch::Tensor& top_k_index, const torch::Tensor& top_k_weights,
                          const torch::Tensor& gate_up, const torch::Tensor& down) {
  check_f32(x, "moe_experts: x");
  check_f32(top_k_weights, "moe_experts: top_k_weights");
  check_f32(gate_up, "moe_experts: gate_up");
  check_f32(down, "moe_experts: down");
  TORCH_CHECK(top_k_index.scalar_type() == torch::kLong && top_k_index.device().is_cpu() && top_k_index.dim() == 2,
              "moe_experts: top_k_index must be an int64 CPU tensor [N, top_k]");
  const int64_t n = x.size(0), k = top_k_index.size(1), experts = gate_up.size(0), inter = down.size(2);
  TORCH_CHECK(x.dim() == 2 && top_k_index.size(0) == n && top_k_weights.sizes() == top_k_index.sizes()
                  && gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(1) == 2 * inter
                  && gate_up.size(2) == x.size(1) && down.size(0) == experts && down.size(1) == x.size(1),
              "moe_experts: shapes disagree (x [N, H], top_k_index and top_k_weights [N, K], gate_up [E, 2I, H], "
              "down [E, H, I])");
  auto index = top_k_index.contiguous();
  const int64_t* ip = index.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> tokens(experts), slots(experts);
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t t = 0; t < n; ++t) {
      const int64_t e = ip[t * k + j];
      TORCH_CHECK(e >= 0 && e < experts, "moe_experts: expert index ", e, " is outside 0..", experts - 1);
      tokens[e].push_back(t);
      slots[e].push_back(t * k + j);
    }
  }
  auto out = torch::zeros_like(x);
  const auto weights = top_k_weights.reshape(-1);
  for (int64_t e = 0; e < experts; ++e) {
    if (tokens[e].empty()) continue;
    const int64_t m = static_cast<int64_t>(tokens[e].size());
    const auto rows = torch::from_blob(tokens[e].data(), {m}, torch::kLong);
    const auto picked = torch::from_blob(slots[e].data(), {m}, torch::kLong);
    const auto gu = at::linear(x.index_select(0, rows), gate_up[e]);  // HF's F.linear: the same GEMM path
    const auto act = at::silu(gu.narrow(1, 0, inter)).mul_(gu.narrow(1, inter, inter));
    out.index_add_(0, rows, at::linear(act, down[e]).mul_(weights.index_select(0, picked).unsqueeze(1)));
  }
  return out;
}

// HF's final RMSNorm over token rows (the logits' input).
torch::Tensor rms_norm(const torch::Tensor& h, const torch::Tensor& weight, double eps) {
  check_f32(h, "rms_norm: h");
  check_f32(weight, "rms_norm: weight");
  TORCH_CHECK(h.dim() == 2 && weight.numel() == h.size(1), "rms_norm: h must be [N, hidden] and weight [hidden]");
  return rms_rows(h, weight, eps);
}

// Sorts `keys` stably by their high 32 bits: an LSD radix sort, a byte a pass, skipping a pass whose byte all keys
// share. Linear in the vocabulary, where a comparison sort of 150k tokens took ~10 ms a row.
void radix_sort_high(std::vector<uint64_t>& keys, std::vector<uint64_t>& scratch) {
  const size_t n = keys.size();
  scratch.resize(n);
  for (int shift = 32; shift < 64; shift += 8) {
    size_t count[256] = {};
    for (const uint64_t k : keys) ++count[(k >> shift) & 0xFF];
    if (std::find(count, count + 256, n) != count + 256) continue;  // one bucket holds them all
    size_t start = 0;
    for (size_t& c : count) start += std::exchange(c, start);
    for (const uint64_t k : keys) scratch[count[(k >> shift) & 0xFF]++] = k;
    keys.swap(scratch);
  }
}

// One token per row of logits [B, V] and its logprob, as sampling.py's `sample` computes them (its docstring has
// the convention): logprob = log_softmax(logits / T)[token]; temperature 0 is greedy (T = 1 for the logprob);
// otherwise inverse CDF with the row's uniform u over the tokens top-k / top-p keep, by descending probability.
// top_k <= 0 or >= V keeps all; top_p >= 1 keeps all. Cumulative sums accumulate in double, as ATen's CPU cumsum.
std::tuple<torch::Tensor, torch::Tensor> sample_rows(const torch::Tensor& logits, const torch::Tensor& requests) {
  check_f32(logits, "sample_rows: logits");
  TORCH_CHECK(logits.dim() == 2, "sample_rows: logits must be [batch, vocab]");
  const int64_t batch = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(requests.dim() == 2 && requests.size(0) == batch && requests.size(1) == 4,
              "sample_rows: requests must be [batch, 4]: temperature, top_p, top_k, uniform per row");
  // Each row's request read in place (a few small tensor ops here would cost more than the sampling itself).
  auto columns = requests.to(torch::kFloat64).contiguous();
  const double* rq = columns.data_ptr<double>();
  std::vector<float> tp(batch);  // temperatures, as float32 like the logits
  for (int64_t b = 0; b < batch; ++b) tp[b] = static_cast<float>(rq[4 * b]);
  // The row-wise math in ATen's vectorized kernels; the per-row walk below in plain loops.
  const bool tempered = std::any_of(tp.begin(), tp.end(), [](float t) { return t > 0.f && t != 1.f; });
  torch::Tensor scaled = logits;
  if (tempered) {
    auto divisors = torch::empty({batch, 1}, torch::kFloat32);
    for (int64_t b = 0; b < batch; ++b) divisors.data_ptr<float>()[b] = tp[b] > 0.f ? tp[b] : 1.f;
    scaled = logits / divisors;
  }
  auto logp = at::log_softmax(scaled, 1).contiguous();
  auto probs = logp.exp();
  auto tokens = torch::empty({batch}, torch::kLong);
  auto logprobs = torch::empty({batch}, torch::kFloat32);
  scaled = scaled.contiguous();
  const float* sp = scaled.data_ptr<float>();
  const float* lpp = logp.data_ptr<float>();
  const float* pp = probs.data_ptr<float>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint64_t> order(vocab), scratch(vocab);
    for (int64_t b = begin; b < end; ++b) {
      const float* row = sp + b * vocab;
      const float* prob = pp + b * vocab;
      int64_t token = 0;
      if (!(tp[b] > 0.f)) {  // greedy: the first maximum
        for (int64_t i = 1; i < vocab; ++i) token = row[i] > row[token] ? i : token;
      } else {
        const int64_t k = static_cast<int64_t>(rq[4 * b + 2]);
        const float p = static_cast<float>(rq[4 * b + 1]);
        const double u = rq[4 * b + 3];
        if (!((k > 0 && k < vocab) || p < 1.f)) {  // unfiltered: inverse CDF in token order
          double mass = 0.0;
          for (int64_t i = 0; i < vocab; ++i) mass += prob[i];
          const double target = u * mass;
          double cdf = 0.0;
          token = vocab - 1;
          for (int64_t i = 0; i < vocab; ++i) {
            cdf += prob[i];
            if (cdf > target) {
              token = i;
              break;
            }
          }
        } else {  // by descending probability, over the prefix top-k / top-p keep
          // One integer per token, its high half ordering by descending logit; the low half is its id, so ties stay
          // in ascending id through the stable sort.
          for (int64_t i = 0; i < vocab; ++i) {
            uint32_t bits;
            std::memcpy(&bits, row + i, sizeof bits);
            const uint32_t ascending = bits ^ ((bits >> 31) ? 0xFFFFFFFFu : 0x80000000u);
            order[i] = (static_cast<uint64_t>(~ascending) << 32) | static_cast<uint64_t>(i);
          }
          radix_sort_high(order, scratch);
          auto id = [&](int64_t rank) { return static_cast<int64_t>(order[rank] & 0xFFFFFFFFu); };
          // A token stays while the mass strictly before it is below top_p and its rank is below top_k.
          const int64_t rank_limit = (k > 0 && k < vocab) ? k : vocab;
          int64_t kept = 1;
          double before = prob[id(0)];
          for (int64_t i = 1; i < rank_limit && static_cast<float>(before) < p; ++i) {
            before += prob[id(i)];
            kept = i + 1;
          }
          double mass = 0.0;
          for (int64_t i = 0; i < kept; ++i) mass += prob[id(i)];
          const double target = u * mass;
          double cdf = 0.0;
          token = id(kept - 1);
          for (int64_t i = 0; i < kept; ++i) {
            cdf += prob[id(i)];
            if (cdf > target) {
              token = id(i);
              break;
            }
          }
        }
      }
      tokens.data_ptr<int64_t>()[b] = token;
      logprobs.data_ptr<float>()[b] = lpp[b * vocab + token];
    }
  });
  return {tokens, logprobs};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sample_rows", &sample_rows, "One token per row: greedy or inverse CDF under top-k / top-p, and its logprob");
  m.def("attention_block", &attention_block, "Qwen3 attention block over token rows and the slot KV cache");
  m.def("mlp_block", &mlp_block, "Qwen3 dense MLP block over token rows");
  m.def("rms_norm", &rms_norm, "Qwen3 RMSNorm over token rows");
  m.def("moe_experts", &moe_experts, "Qwen3-MoE experts over token rows, as HF's eager experts loop");
}
