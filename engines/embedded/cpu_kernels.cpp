// The embedded engine's CPU kernels: a Qwen3 decoder layer's attention block and dense MLP block, each one
// call, over token-major rows (no padding) and the runner's per-slot KV cache; and the sampler, one call a step.
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

// Eight floats as one value: GCC / Clang lower it to the machine's vector registers (AVX, AVX-512, NEON), so
// the hot loops below keep their partial sums in registers without per-ISA intrinsics.
typedef float vec8 __attribute__((vector_size(32)));
inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof v); }

// out[r][s] = scale * (q[r] . key[s]) for R query rows against one kv head's keys (transposed, [d, capacity])
// at positions 0..span-1: 32 positions at a time, each key row read once for all R queries.
template <int R>
void tile_scores(const float* const* q, const float* keys, int64_t capacity, int64_t d, int64_t span, float scale,
                 float* const* out) {
  constexpr int kVecs = 4;
  int64_t s0 = 0;
  for (; s0 + 8 * kVecs <= span; s0 += 8 * kVecs) {
    vec8 acc[R][kVecs] = {};
    for (int64_t i = 0; i < d; ++i) {
      const float* row = keys + i * capacity + s0;
      vec8 k[kVecs];
      for (int w = 0; w < kVecs; ++w) k[w] = load8(row + 8 * w);
      for (int r = 0; r < R; ++r) {
        const float a = q[r][i];
        for (int w = 0; w < kVecs; ++w) acc[r][w] += a * k[w];
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int w = 0; w < kVecs; ++w) store8(out[r] + s0 + 8 * w, acc[r][w] * scale);
    }
  }
  for (; s0 < span; ++s0) {
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t i = 0; i < d; ++i) acc += q[r][i] * keys[i * capacity + s0];
      out[r][s0] = acc * scale;
    }
  }
}

// out[r] = sum_s p[r][s] * value[s] for R weight rows over one kv head's values [span, D], each row read once.
template <int D, int R>
void tile_values(const float* const* p, const float* values, int64_t span, float* const* out) {
  constexpr int kVecs = D / 8;
  vec8 acc[R][kVecs] = {};
  for (int64_t s = 0; s < span; ++s) {
    const float* row = values + s * D;
    vec8 v[kVecs];
    for (int k = 0; k < kVecs; ++k) v[k] = load8(row + 8 * k);
    for (int r = 0; r < R; ++r) {
      const float w = p[r][s];
      for (int k = 0; k < kVecs; ++k) acc[r][k] += w * v[k];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int k = 0; k < kVecs; ++k) store8(out[r] + 8 * k, acc[r][k]);
  }
}

// Any other head size: plain loops (correct, slower).
void any_scores(const float* const* q, int64_t rows, const float* keys, int64_t capacity, int64_t d, int64_t span,
                float scale, float* const* out) {
  for (int64_t r = 0; r < rows; ++r) {
    std::fill(out[r], out[r] + span, 0.f);
    for (int64_t i = 0; i < d; ++i) {
      const float a = q[r][i];
      const float* row = keys + i * capacity;
      for (int64_t s = 0; s < span; ++s) out[r][s] += a * row[s];
    }
    for (int64_t s = 0; s < span; ++s) out[r][s] *= scale;
  }
}

void any_values(const float* const* p, int64_t rows, const float* values, int64_t d, int64_t span,
                float* const* out) {
  for (int64_t r = 0; r < rows; ++r) {
    std::fill(out[r], out[r] + d, 0.f);
    for (int64_t s = 0; s < span; ++s) {
      for (int64_t i = 0; i < d; ++i) out[r][i] += p[r][s] * values[s * d + i];
    }
  }
}

constexpr int kTileRows = 8;  // query rows that share one pass over a kv head's keys and values

using ScoresFn = void (*)(const float* const*, const float*, int64_t, int64_t, int64_t, float, float* const*);
using ValuesFn = void (*)(const float* const*, const float*, int64_t, float* const*);

template <int... R>
std::array<ScoresFn, kTileRows + 1> scores_table(std::integer_sequence<int, R...>) {
  return {nullptr, tile_scores<R + 1>...};
}

template <int D, int... R>
std::array<ValuesFn, kTileRows + 1> values_table(std::integer_sequence<int, R...>) {
  return {nullptr, tile_values<D, R + 1>...};
}

// The vectorized kernel for a tile of `rows` query rows (1..kTileRows), or nullptr: use the plain loops.
ScoresFn pick_scores(int64_t rows) {
  static const auto table = scores_table(std::make_integer_sequence<int, kTileRows>{});
  return table[rows];
}

ValuesFn pick_values(int64_t d, int64_t rows) {
  static const auto t32 = values_table<32>(std::make_integer_sequence<int, kTileRows>{});
  static const auto t64 = values_table<64>(std::make_integer_sequence<int, kTileRows>{});
  static const auto t128 = values_table<128>(std::make_integer_sequence<int, kTileRows>{});
  switch (d) {
    case 32: return t32[rows];
    case 64: return t64[rows];
    case 128: return t128[rows];
    default: return nullptr;
  }
}

// A tile: up to kTileRows query rows of one kv head -- its group's heads for consecutive tokens of one sequence
// (a prefill's tokens share the keys they read; a decode step has one token per sequence).
struct Tile {
  int64_t first_token, tokens, kv_head;
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

  // Attention over tiles: scores into one buffer (a token's positions past its own are -inf), ATen's
  // vectorized softmax over all of it at once, then the weighted sum of values.
  const float scale = static_cast<float>(scaling);
  const int64_t per_tile = std::max<int64_t>(1, kTileRows / group);  // tokens per tile
  std::vector<Tile> tiles;
  for (int64_t t = 0; t < n;) {
    int64_t run = 1;
    while (t + run < n && run < per_tile && slot[t + run] == slot[t]) ++run;
    for (int64_t j = 0; j < kv_heads; ++j) tiles.push_back({t, run, j});
    t += run;
  }
  auto scores = torch::empty({n, heads, longest}, h.options());
  float* sp = scores.data_ptr<float>();
  auto attn = torch::empty({n, heads * d}, h.options());
  float* ap = attn.data_ptr<float>();
  // The rows of a tile: (token, head) pairs, tokens outer; their query, score and output rows.
  auto tile_rows = [&](const Tile& tile, auto&& visit) {
    int64_t r = 0;
    for (int64_t u = 0; u < tile.tokens; ++u) {
      for (int64_t g = 0; g < group; ++g, ++r) visit(r, tile.first_token + u, tile.kv_head * group + g);
    }
  };
  // Points each tile row at its input row (stride `in_width`) and output row (stride `out_width`); returns the
  // tile's span, its longest token's positions.
  auto point_rows = [&](const Tile& tile, const float* in, int64_t in_width, const float** in_rows, float* out,
                        int64_t out_width, float** out_rows) {
    int64_t span = 0;
    tile_rows(tile, [&](int64_t r, int64_t t, int64_t head) {
      in_rows[r] = in + (t * heads + head) * in_width;
      out_rows[r] = out + (t * heads + head) * out_width;
      span = std::max(span, pos[t] + 1);
    });
    return span;
  };
  const int64_t tiles_n = static_cast<int64_t>(tiles.size());
  at::parallel_for(0, tiles_n, 1, [&](int64_t begin, int64_t end) {
    std::vector<const float*> q_rows(kTileRows * std::max<int64_t>(1, group));
    std::vector<float*> out_rows(q_rows.size());
    for (int64_t i = begin; i < end; ++i) {
      const Tile& tile = tiles[i];
      const int64_t span = point_rows(tile, qp, d, q_rows.data(), sp, longest, out_rows.data());
      const int64_t rows = tile.tokens * group;
      const float* keys = kc + ((slot[tile.first_token] * kv_heads + tile.kv_head) * d) * capacity;
      const ScoresFn fn = rows <= kTileRows ? pick_scores(rows) : nullptr;
      if (fn) {
        fn(q_rows.data(), keys, capacity, d, span, scale, out_rows.data());
      } else {
        any_scores(q_rows.data(), rows, keys, capacity, d, span, scale, out_rows.data());
      }
      tile_rows(tile, [&](int64_t r, int64_t t, int64_t) {
        std::fill(out_rows[r] + pos[t] + 1, out_rows[r] + longest, -std::numeric_limits<float>::infinity());
      });
    }
  });
  scores = at::_softmax(scores, -1, false);
  sp = scores.data_ptr<float>();
  at::parallel_for(0, tiles_n, 1, [&](int64_t begin, int64_t end) {
    std::vector<const float*> p_rows(kTileRows * std::max<int64_t>(1, group));
    std::vector<float*> out_rows(p_rows.size());
    for (int64_t i = begin; i < end; ++i) {
      const Tile& tile = tiles[i];
      const int64_t span = point_rows(tile, sp, longest, p_rows.data(), ap, d, out_rows.data());
      const int64_t rows = tile.tokens * group;
      const float* values = vc + ((slot[tile.first_token] * kv_heads + tile.kv_head) * capacity) * d;
      const ValuesFn fn = rows <= kTileRows ? pick_values(d, rows) : nullptr;
      if (fn) {
        fn(p_rows.data(), values, span, out_rows.data());
      } else {
        any_values(p_rows.data(), rows, values, d, span, out_rows.data());
      }
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

// HF's final RMSNorm over token rows (the logits' input).
torch::Tensor rms_norm(const torch::Tensor& h, const torch::Tensor& weight, double eps) {
  check_f32(h, "rms_norm: h");
  check_f32(weight, "rms_norm: weight");
  TORCH_CHECK(h.dim() == 2 && weight.numel() == h.size(1), "rms_norm: h must be [N, hidden] and weight [hidden]");
  return rms_rows(h, weight, eps);
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
  auto columns = requests.to(torch::kFloat64).contiguous();
  auto temps = columns.select(1, 0).to(torch::kFloat32).contiguous();
  auto ps = columns.select(1, 1).to(torch::kFloat32).contiguous();
  auto ks = columns.select(1, 2).to(torch::kLong).contiguous();
  auto us = columns.select(1, 3).contiguous();
  // The row-wise math in ATen's vectorized kernels; the per-row walk below in plain loops.
  const float* tp = temps.data_ptr<float>();
  const bool tempered = std::any_of(tp, tp + batch, [](float t) { return t > 0.f && t != 1.f; });
  torch::Tensor scaled = tempered ? logits / at::where(temps > 0, temps, at::ones_like(temps)).unsqueeze(1) : logits;
  auto logp = at::log_softmax(scaled, 1).contiguous();
  auto probs = logp.exp();
  auto tokens = torch::empty({batch}, torch::kLong);
  auto logprobs = torch::empty({batch}, torch::kFloat32);
  scaled = scaled.contiguous();
  const float* sp = scaled.data_ptr<float>();
  const float* lpp = logp.data_ptr<float>();
  const float* pp = probs.data_ptr<float>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint64_t> order(vocab);
    for (int64_t b = begin; b < end; ++b) {
      const float* row = sp + b * vocab;
      const float* prob = pp + b * vocab;
      int64_t token = 0;
      if (!(tp[b] > 0.f)) {  // greedy: the first maximum
        for (int64_t i = 1; i < vocab; ++i) token = row[i] > row[token] ? i : token;
      } else {
        const int64_t k = ks.data_ptr<int64_t>()[b];
        const float p = ps.data_ptr<float>()[b];
        const double u = us.data_ptr<double>()[b];
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
          // One integer per token, ordering by descending logit then ascending id: a plain integer sort.
          for (int64_t i = 0; i < vocab; ++i) {
            uint32_t bits;
            std::memcpy(&bits, row + i, sizeof bits);
            const uint32_t ascending = bits ^ ((bits >> 31) ? 0xFFFFFFFFu : 0x80000000u);
            order[i] = (static_cast<uint64_t>(~ascending) << 32) | static_cast<uint64_t>(i);
          }
          std::sort(order.begin(), order.end());
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
}
