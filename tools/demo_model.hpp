// The model the demo runs: a router and experts with a two-projection ReLU FFN, on bf16 rows with fp32
// accumulation in a fixed order. The same per-row functions serve the FlatEP ranks and the dense single-process
// reference, so expert outputs of a row are bitwise the same on both paths; only sums whose order the data plane
// fixes differently (combine across ranks, weight gradients split across replicas) can differ, by rounding.
#pragma once

#include <cstdint>
#include <vector>

namespace flatep::demo {

struct ModelDims {
    int hidden;  // H
    int ffn;     // H'
};

// y = bf16(relu_bf16(x W1) W2) for one row. x [H] bf16, w1 [H][H'] bf16, w2 [H'][H] bf16; h_pre [H'] fp32 and
// h [H'] bf16 are kept for backward (may be null).
void expert_forward(const ModelDims& d, const uint16_t* x, const uint16_t* w1, const uint16_t* w2, float* h_pre,
                    uint16_t* h, uint16_t* y);

// Backward of one row given g_y [H] fp32 (already scaled by the routing weight): accumulates dW1 [H][H'] and
// dW2 [H'][H] (fp32) and writes g_x [H] fp32.
void expert_backward(const ModelDims& d, const uint16_t* x, const uint16_t* w1, const uint16_t* w2, const float* h_pre,
                     const uint16_t* h, const float* g_y, float* dw1, float* dw2, float* g_x);

// Router: logits [E] = x Wr (fp32, Wr [H][E] fp32); weights of the chosen experts = softmax over the K chosen
// logits.
void router_weights(int hidden, int num_experts, int topk, const uint16_t* x, const float* wr, const int32_t* idx,
                    float* logits_chosen, float* weights);

// Backward of router_weights for one token: given dL/dweights [K], accumulates dWr [H][E] and adds to g_x [H].
void router_backward(int hidden, int num_experts, int topk, const uint16_t* x, const float* wr, const int32_t* idx,
                     const float* weights, const float* g_weights, float* dwr, float* g_x);

// Deterministic bf16 / fp32 fills in [-scale, scale).
void fill_bf16(std::vector<uint16_t>& v, uint64_t seed, float scale);
void fill_f32(std::vector<float>& v, uint64_t seed, float scale);

}  // namespace flatep::demo
