// Buffer::combine_grad on the CPU backend (the oracle the CUDA kernel is held to) against a naive reference written
// from the contract: real rows are the rows whose plan row_head is set; grad_y = bf16(rows * weight); grad_weights =
// the 32-lane dot (lane l sums chunks l, l+32, ... element by element, then the xor butterfly 16, 8, 4, 2, 1).
// Padding rows and rows past the last group end hold NaN in rows, y and weights: nothing of them may leak.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "common/bf16.hpp"
#include "flatep/buffer.hpp"
#include "internal/api.hpp"
#include "layout/layout.hpp"
#include "routing/routing.hpp"
#include "transport/local_host.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using transport::LocalHostWorld;

using testing::bits_of;
using testing::error_message;
using testing::failures;
using testing::float_of;
using testing::run_ranks;

constexpr int kCanaryRows = 2;
constexpr uint16_t kCanaryY = 0x7fa5;          // a bf16 NaN nothing writes
constexpr uint32_t kCanaryWBits = 0x7fc0beef;  // an fp32 NaN nothing writes
constexpr uint16_t kNanBf16[2] = {0x7fc1, 0xffff};

// a * b rounded to fp32 on its own (the volatile store keeps any compiler from fusing it into the following add).
float product(float a, float b) {
    volatile float p = a * b;
    return p;
}

// The contract's dot, written lane by lane.
float reference_dot(const uint16_t* a, const uint16_t* b, int H) {
    const int n16 = H / 8;
    float s[32];
    for (int lane = 0; lane < 32; ++lane) {
        float acc = 0.0f;
        for (int c = lane; c < n16; c += 32) {
            for (int e = 0; e < 8; ++e) acc = acc + product(bf16_to_float(a[c * 8 + e]), bf16_to_float(b[c * 8 + e]));
        }
        s[lane] = acc;
    }
    for (int offset : {16, 8, 4, 2, 1}) {
        float t[32];
        for (int lane = 0; lane < 32; ++lane) t[lane] = s[lane] + s[lane ^ offset];
        std::memcpy(s, t, sizeof(s));
    }
    return s[0];
}

float sequential_dot(const uint16_t* a, const uint16_t* b, int H) {
    float acc = 0.0f;
    for (int h = 0; h < H; ++h) acc = acc + product(bf16_to_float(a[h]), bf16_to_float(b[h]));
    return acc;
}

struct Case {
    int R, epn, S, K, H, align;
    double capacity_factor, sigma;
    bool partial;  // ranks pass fewer tokens than S (more rows past the last group end)
    uint64_t seed;
};

std::string describe(const Case& c) {
    std::ostringstream os;
    os << "R=" << c.R << " E=" << c.R * c.epn << " S=" << c.S << " K=" << c.K << " H=" << c.H << " align=" << c.align
       << " cf=" << c.capacity_factor << " sigma=" << c.sigma << " partial=" << c.partial << " seed=" << c.seed;
    return os.str();
}

// Per rank: the real-row mask, the outputs (with canary rows around) of the three output combinations, and the
// number of rows whose lane-order dot differs from a sequential one (the order is observable in the data).
struct RankResult {
    int real_rows = 0, padding_rows = 0, order_visible = 0;
    std::string mismatch;  // first mismatch against the reference ("" when none)
};

RankResult run_rank(const Case& c, LocalHostWorld& world, int rank) {
    const Config cfg{.num_ranks = c.R,
                     .rank = rank,
                     .num_experts = c.R * c.epn,
                     .num_tokens = c.S,
                     .topk = c.K,
                     .hidden = c.H,
                     .align = c.align,
                     .capacity_factor = c.capacity_factor};
    Buffer buffer(cfg, world.transport(rank));
    const Layout& l = internal::layout(buffer);
    const int H = c.H, nvs = l.num_recv_rows;
    const int s = c.partial ? (c.S * (rank + 1)) / (c.R + 1) : c.S;
    std::vector<int32_t> idx(size_t(c.S) * c.K);
    routing::sample_topk(routing::popularity(l.num_experts, c.sigma, c.seed), c.S, c.K, c.seed, rank, idx.data());
    const Plan plan = buffer.plan(idx.data(), 4, s);

    RankResult result;
    std::vector<bool> real(nvs);
    for (int i = 0; i < nvs; ++i) real[i] = plan.row_heads()[i] >= 0;
    const uint64_t stream = routing::mix64(c.seed * 977 + uint64_t(rank));
    std::vector<uint16_t> rows = testing::random_bf16_wide(size_t(nvs) * H, stream ^ 1);
    std::vector<uint16_t> y = testing::random_bf16_wide(size_t(nvs) * H, stream ^ 2);
    std::vector<float> weights = testing::random_floats(size_t(nvs), stream ^ 3, -2.0f, 2.0f);
    for (int i = 0; i < nvs; ++i) {
        if (real[i]) {
            ++result.real_rows;
            continue;
        }
        ++result.padding_rows;
        for (int h = 0; h < H; ++h) {
            rows[size_t(i) * H + h] = kNanBf16[h % 2];
            y[size_t(i) * H + h] = kNanBf16[(h + 1) % 2];
        }
        weights[i] = std::nanf("");
    }

    // Reference.
    std::vector<uint16_t> want_y(size_t(nvs) * H, 0);
    std::vector<float> want_w(nvs, 0.0f);
    for (int i = 0; i < nvs; ++i) {
        if (!real[i]) continue;
        const uint16_t* a = rows.data() + size_t(i) * H;
        const uint16_t* b = y.data() + size_t(i) * H;
        for (int h = 0; h < H; ++h) want_y[size_t(i) * H + h] = float_to_bf16(product(bf16_to_float(a[h]), weights[i]));
        want_w[i] = reference_dot(a, b, H);
        if (bits_of(want_w[i]) != bits_of(sequential_dot(a, b, H))) ++result.order_visible;
    }

    auto check = [&](bool with_y, bool with_w) -> std::string {
        std::vector<uint16_t> got_y(size_t(nvs + 2 * kCanaryRows) * H, kCanaryY);
        std::vector<float> got_w(size_t(nvs + 2 * kCanaryRows), float_of(kCanaryWBits));
        buffer.combine_grad(plan, rows.data(), with_w ? y.data() : nullptr, with_y ? weights.data() : nullptr,
                            with_y ? got_y.data() + kCanaryRows * H : nullptr,
                            with_w ? got_w.data() + kCanaryRows : nullptr);
        const std::string what = std::string("outputs ") + (with_y ? "grad_y" : "") + (with_y && with_w ? "+" : "") +
                                 (with_w ? "grad_weights" : "");
        for (int i = -kCanaryRows; i < nvs + kCanaryRows; ++i) {
            const bool inside = i >= 0 && i < nvs;
            for (int h = 0; h < H; ++h) {
                const uint16_t got = got_y[size_t(i + kCanaryRows) * H + h];
                const uint16_t want = inside && with_y ? want_y[size_t(i) * H + h] : kCanaryY;
                if (got != want) {
                    std::ostringstream os;
                    os << what << ": grad_y row " << i << " col " << h << " (" << (inside && real[i] ? "real" : "other")
                       << "): got 0x" << std::hex << got << " expected 0x" << want;
                    return os.str();
                }
            }
            const uint32_t got = bits_of(got_w[i + kCanaryRows]);
            const uint32_t want = inside && with_w ? bits_of(want_w[i]) : kCanaryWBits;
            if (got != want) {
                std::ostringstream os;
                os << what << ": grad_weights row " << i << " (" << (inside && real[i] ? "real" : "other") << "): got "
                   << float_of(got) << " (0x" << std::hex << got << ") expected " << std::dec << float_of(want)
                   << " (0x" << std::hex << want << ")";
                return os.str();
            }
        }
        return "";
    };
    for (auto [with_y, with_w] : {std::pair{true, true}, std::pair{true, false}, std::pair{false, true}}) {
        result.mismatch = check(with_y, with_w);
        if (!result.mismatch.empty()) break;
    }
    return result;
}

TEST(CombineGrad, MatchesTheLaneOrderReferenceAndNothingLeaksFromOtherRows) {
    const Case cases[] = {
        {1, 4, 32, 2, 8, 8, 1.0, 1.0, false, 1},           // one chunk: lanes 1..31 add zeros
        {2, 4, 64, 4, 72, 16, 1.0, 2.0, false, 2},         // 9 chunks: fewer chunks than lanes
        {2, 8, 96, 4, 264, 8, 1.25, 1.5, true, 3},         // 33 chunks: lane 0 takes two; slack + ragged: rows past end
        {4, 4, 128, 8, 1024, 32, 1.0, 3.0, false, 4},      // 128 chunks: 4 per lane; skewed: replica groups
        {4, 2, 64, 2, 360, 1, 1.0, 0.5, true, 5},          // align 1: no padding inside groups
        {2, 2, 40, 2, 2048 + 64, 128, 1.5, 2.5, true, 6},  // 264 chunks: lanes 0..7 take 9, the others 8
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(describe(c));
        LocalHostWorld world(c.R, 30.0);
        std::vector<RankResult> results(c.R);
        const std::vector<std::string> errors =
            run_ranks(c.R, [&](int rank) { results[rank] = run_rank(c, world, rank); });
        ASSERT_EQ(failures(errors), "");
        int real = 0, padding = 0, visible = 0;
        for (int r = 0; r < c.R; ++r) {
            EXPECT_EQ(results[r].mismatch, "") << "rank " << r;
            real += results[r].real_rows;
            padding += results[r].padding_rows;
            visible += results[r].order_visible;
        }
        EXPECT_GT(real, 0);
        EXPECT_GT(padding, 0);  // every case has rows that are not real (NaN inputs there)
        if (c.H > 8) EXPECT_GT(visible, 0) << "the data should make the summation order observable";
    }
}

TEST(CombineGrad, BadArgumentsNameTheArgument) {
    LocalHostWorld world(1, 10.0);
    const Config cfg{.num_experts = 2, .num_tokens = 2, .hidden = 8, .align = 1};
    Buffer buffer(cfg, world.transport(0));
    Buffer other(cfg, world.transport(0));
    const int32_t idx[2] = {0, 1};
    const Plan plan = buffer.plan(idx, 4, 2);
    const int nvs = buffer.num_recv_rows();
    std::vector<uint16_t> rows(size_t(nvs) * 8), y(size_t(nvs) * 8), grad_y(size_t(nvs) * 8);
    std::vector<float> w(nvs), grad_w(nvs);
    EXPECT_EQ(
        error_message([&] { buffer.combine_grad(plan, nullptr, y.data(), w.data(), grad_y.data(), grad_w.data()); }),
        "combine_grad: rows is null");
    EXPECT_EQ(error_message([&] { buffer.combine_grad(plan, rows.data(), y.data(), w.data(), nullptr, nullptr); }),
              "combine_grad: grad_y and grad_weights are both null (nothing to compute)");
    EXPECT_EQ(error_message([&] { buffer.combine_grad(plan, rows.data(), y.data(), nullptr, grad_y.data(), nullptr); }),
              "combine_grad: weights is null (grad_y needs it)");
    EXPECT_EQ(error_message([&] { buffer.combine_grad(plan, rows.data(), nullptr, w.data(), nullptr, grad_w.data()); }),
              "combine_grad: y is null (grad_weights needs it)");
    EXPECT_EQ(
        error_message([&] { buffer.combine_grad(Plan(), rows.data(), y.data(), w.data(), grad_y.data(), nullptr); }),
        "combine_grad: plan is empty (default-constructed); get one from Buffer::plan()");
    EXPECT_EQ(error_message([&] { other.combine_grad(plan, rows.data(), y.data(), w.data(), grad_y.data(), nullptr); }),
              "combine_grad: plan was made by buffer " + std::to_string(buffer.id()) + ", not by this buffer (" +
                  std::to_string(other.id()) + ")");
    // The allowed partial forms run.
    EXPECT_EQ(error_message([&] { buffer.combine_grad(plan, rows.data(), nullptr, w.data(), grad_y.data(), nullptr); }),
              "(no error)");
    EXPECT_EQ(error_message([&] { buffer.combine_grad(plan, rows.data(), y.data(), nullptr, nullptr, grad_w.data()); }),
              "(no error)");
}

}  // namespace
}  // namespace flatep
