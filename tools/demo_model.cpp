#include "demo_model.hpp"

#include <cmath>

#include "internal/api.hpp"

namespace flatep::demo {

void expert_forward(const ModelDims& d, const uint16_t* x, const uint16_t* w1, const uint16_t* w2, float* h_pre,
                    uint16_t* h, uint16_t* y) {
    std::vector<float> acc(std::max(d.hidden, d.ffn));
    std::vector<uint16_t> hb(d.ffn);
    for (int j = 0; j < d.ffn; ++j) acc[j] = 0.0f;
    for (int i = 0; i < d.hidden; ++i) {
        const float xi = bf16_to_float(x[i]);
        const uint16_t* row = w1 + int64_t(i) * d.ffn;
        for (int j = 0; j < d.ffn; ++j) acc[j] += xi * bf16_to_float(row[j]);
    }
    for (int j = 0; j < d.ffn; ++j) {
        if (h_pre) h_pre[j] = acc[j];
        hb[j] = float_to_bf16(acc[j] > 0.0f ? acc[j] : 0.0f);
        if (h) h[j] = hb[j];
    }
    for (int c = 0; c < d.hidden; ++c) acc[c] = 0.0f;
    for (int j = 0; j < d.ffn; ++j) {
        const float hj = bf16_to_float(hb[j]);
        const uint16_t* row = w2 + int64_t(j) * d.hidden;
        for (int c = 0; c < d.hidden; ++c) acc[c] += hj * bf16_to_float(row[c]);
    }
    for (int c = 0; c < d.hidden; ++c) y[c] = float_to_bf16(acc[c]);
}

void expert_backward(const ModelDims& d, const uint16_t* x, const uint16_t* w1, const uint16_t* w2, const float* h_pre,
                     const uint16_t* h, const float* g_y, float* dw1, float* dw2, float* g_x) {
    std::vector<float> g_h(d.ffn, 0.0f);
    for (int j = 0; j < d.ffn; ++j) {
        const uint16_t* row = w2 + int64_t(j) * d.hidden;
        const float hj = bf16_to_float(h[j]);
        float* drow = dw2 + int64_t(j) * d.hidden;
        float acc = 0.0f;
        for (int c = 0; c < d.hidden; ++c) {
            acc += g_y[c] * bf16_to_float(row[c]);
            drow[c] += hj * g_y[c];
        }
        g_h[j] = h_pre[j] > 0.0f ? acc : 0.0f;
    }
    for (int i = 0; i < d.hidden; ++i) {
        const float xi = bf16_to_float(x[i]);
        const uint16_t* row = w1 + int64_t(i) * d.ffn;
        float* drow = dw1 + int64_t(i) * d.ffn;
        float acc = 0.0f;
        for (int j = 0; j < d.ffn; ++j) {
            acc += g_h[j] * bf16_to_float(row[j]);
            drow[j] += xi * g_h[j];
        }
        g_x[i] = acc;
    }
}

void router_weights(int hidden, int num_experts, int topk, const uint16_t* x, const float* wr, const int32_t* idx,
                    float* logits_chosen, float* weights) {
    float peak = -INFINITY;
    for (int k = 0; k < topk; ++k) {
        float acc = 0.0f;
        for (int i = 0; i < hidden; ++i) acc += bf16_to_float(x[i]) * wr[int64_t(i) * num_experts + idx[k]];
        logits_chosen[k] = acc;
        peak = std::max(peak, acc);
    }
    float total = 0.0f;
    for (int k = 0; k < topk; ++k) total += (weights[k] = std::exp(logits_chosen[k] - peak));
    for (int k = 0; k < topk; ++k) weights[k] /= total;
}

void router_backward(int hidden, int num_experts, int topk, const uint16_t* x, const float* wr, const int32_t* idx,
                     const float* weights, const float* g_weights, float* dwr, float* g_x) {
    // softmax backward: g_logit_k = w_k * (g_k - sum_j w_j g_j)
    float dot = 0.0f;
    for (int k = 0; k < topk; ++k) dot += weights[k] * g_weights[k];
    for (int k = 0; k < topk; ++k) {
        const float g_logit = weights[k] * (g_weights[k] - dot);
        for (int i = 0; i < hidden; ++i) {
            dwr[int64_t(i) * num_experts + idx[k]] += bf16_to_float(x[i]) * g_logit;
            g_x[i] += wr[int64_t(i) * num_experts + idx[k]] * g_logit;
        }
    }
}

void fill_bf16(std::vector<uint16_t>& v, uint64_t seed, float scale) {
    for (size_t i = 0; i < v.size(); ++i) v[i] = float_to_bf16(float((2.0 * routing::uniform(seed, i) - 1.0) * scale));
}

void fill_f32(std::vector<float>& v, uint64_t seed, float scale) {
    for (size_t i = 0; i < v.size(); ++i) v[i] = float((2.0 * routing::uniform(seed, i) - 1.0) * scale);
}

}  // namespace flatep::demo
