// FP8 rows (design §6): the quantisation rule on exact cases and against an independent nearest-value reference, and
// dispatch_fp8 on the CPU backend (R rank threads) against the bf16 dispatch's rows quantised row by row.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/bf16.hpp"
#include "common/fp8.hpp"
#include "flatep/buffer.hpp"
#include "flatep/fp8.hpp"
#include "host/op_stats.hpp"
#include "internal/api.hpp"
#include "layout/layout.hpp"
#include "routing/routing.hpp"
#include "transport/local_host.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using transport::LocalHostWorld;

using fp8::block_scale;
using fp8::e4m3_to_float;
using fp8::float_to_e4m3;
using testing::bits_of;
using testing::float_of;
using testing::run_ranks;

// ---- the rule ----

// The nearest finite e4m3 code of a finite value by exhaustive search in double (ties: the even code), saturating at
// 448: an implementation that shares nothing with float_to_e4m3's bit arithmetic.
uint8_t nearest_e4m3(double v) {
    const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
    const double a = std::fabs(v);
    if (a >= 448.0) return sign | 0x7e;
    int best = 0;
    double best_err = std::numeric_limits<double>::infinity();
    for (int code = 0; code <= 0x7e; ++code) {
        const double err = std::fabs(double(e4m3_to_float(uint8_t(code))) - a);
        if (err < best_err || (err == best_err && code % 2 == 0)) {
            best = code;
            best_err = err;
        }
    }
    return uint8_t(sign | best);
}

// The value of an e4m3 code from its fields (independent of e4m3_to_float).
double e4m3_value(int code) {
    const int e = (code >> 3) & 0xf, m = code & 7;
    const double magnitude = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
    return (code & 0x80) ? -magnitude : magnitude;
}

TEST(Fp8Rule, DecodesEveryCode) {
    for (int code = 0; code < 256; ++code) {
        const float f = e4m3_to_float(uint8_t(code));
        if ((code & 0x7f) == 0x7f) {
            EXPECT_TRUE(std::isnan(f)) << code;
            EXPECT_EQ(float_to_e4m3(f), 0x7f) << code;
            continue;
        }
        EXPECT_EQ(double(f), e4m3_value(code)) << code;
        EXPECT_EQ(std::signbit(f), (code & 0x80) != 0) << code;
        EXPECT_EQ(float_to_e4m3(f), code) << code;  // every finite code round-trips, -0 included
    }
    EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
    EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
    EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));  // smallest normal
}

TEST(Fp8Rule, ExactCases) {
    EXPECT_EQ(float_to_e4m3(0.0f), 0x00);
    EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
    EXPECT_EQ(float_to_e4m3(1.0f), 0x38);
    EXPECT_EQ(float_to_e4m3(-1.5f), 0xbc);
    // Saturation: 448 and above, infinities included, give +-448; NaN of either sign gives 0x7f.
    EXPECT_EQ(float_to_e4m3(448.0f), 0x7e);
    EXPECT_EQ(float_to_e4m3(463.99f), 0x7e);
    EXPECT_EQ(float_to_e4m3(464.0f), 0x7e);
    EXPECT_EQ(float_to_e4m3(1e30f), 0x7e);
    EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::infinity()), 0x7e);
    EXPECT_EQ(float_to_e4m3(-std::numeric_limits<float>::infinity()), 0xfe);
    EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::quiet_NaN()), 0x7f);
    EXPECT_EQ(float_to_e4m3(-std::numeric_limits<float>::quiet_NaN()), 0x7f);
    EXPECT_EQ(float_to_e4m3(float_of(0x7f800001u)), 0x7f);  // a signalling NaN payload
    // Ties to even in the normal range: 1 + 1/16 lies between 1 (0x38) and 1.125 (0x39); 1.1875 between 0x39, 0x3a.
    EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);
    EXPECT_EQ(float_to_e4m3(1.1875f), 0x3a);
    EXPECT_EQ(float_to_e4m3(std::nextafter(1.0625f, 2.0f)), 0x39);
    EXPECT_EQ(float_to_e4m3(432.0f), 0x7e);  // between 416 (0x7d) and 448 (0x7e): even wins
    EXPECT_EQ(float_to_e4m3(431.99f), 0x7d);
    // Subnormals (multiples of 2^-9): 2^-10 ties to 0, 3*2^-10 ties to 2, 15*2^-10 ties up into the smallest normal.
    EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -9)), 0x01);
    EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);
    EXPECT_EQ(float_to_e4m3(-std::ldexp(1.0f, -10)), 0x80);
    EXPECT_EQ(float_to_e4m3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
    EXPECT_EQ(float_to_e4m3(std::ldexp(3.0f, -10)), 0x02);
    EXPECT_EQ(float_to_e4m3(std::ldexp(5.0f, -10)), 0x02);
    EXPECT_EQ(float_to_e4m3(std::ldexp(15.0f, -10)), 0x08);
    EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -6)), 0x08);
    EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::denorm_min()), 0x00);
    EXPECT_EQ(float_to_e4m3(-std::numeric_limits<float>::denorm_min()), 0x80);
}

TEST(Fp8Rule, EveryBf16ValueAndRandomFloatsMatchTheNearestValueReference) {
    for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
        const float v = bf16_to_float(uint16_t(bits));
        const uint8_t got = float_to_e4m3(v);
        if (std::isnan(v)) {
            ASSERT_EQ(got, 0x7f) << std::hex << bits;
        } else {
            ASSERT_EQ(got, nearest_e4m3(v)) << std::hex << bits;
        }
    }
    for (uint64_t i = 0; i < 200000; ++i) {  // fp32 values around the e4m3 range (2^-12 .. 2^9), every fraction bit
        const uint32_t r = uint32_t(routing::mix64(i));
        const uint32_t bits = (r & 0x807fffffu) | (uint32_t(115 + (r >> 23) % 22) << 23);
        const float v = float_of(bits);
        ASSERT_EQ(float_to_e4m3(v), nearest_e4m3(v)) << std::hex << bits;
    }
}

TEST(Fp8Rule, BlockScales) {
    auto amax_of = [](float v) { return fp8::bf16_amax_bits(float_to_bf16(v)); };
    EXPECT_EQ(bits_of(block_scale(0, Fp8Scale::kFloat)), bits_of(1.0f));  // zeros (or NaN / Inf only): scale 1
    EXPECT_EQ(bits_of(block_scale(0, Fp8Scale::kUe8m0)), bits_of(1.0f));
    EXPECT_EQ(block_scale(amax_of(448.0f), Fp8Scale::kFloat), 1.0f);
    EXPECT_EQ(block_scale(amax_of(896.0f), Fp8Scale::kFloat), 2.0f);
    // UE8M0: the smallest power of two s with 448 * s >= amax.
    EXPECT_EQ(block_scale(amax_of(448.0f), Fp8Scale::kUe8m0), 1.0f);
    EXPECT_EQ(block_scale(amax_of(450.0f), Fp8Scale::kUe8m0), 2.0f);  // the bf16 after 448
    EXPECT_EQ(block_scale(amax_of(224.0f), Fp8Scale::kUe8m0), 0.5f);
    EXPECT_EQ(block_scale(amax_of(225.0f), Fp8Scale::kUe8m0), 1.0f);
    EXPECT_EQ(block_scale(amax_of(1.0f), Fp8Scale::kUe8m0), std::ldexp(1.0f, -8));  // 448/256 = 1.75 >= 1
    EXPECT_EQ(block_scale(amax_of(1.75f), Fp8Scale::kUe8m0), std::ldexp(1.0f, -8));
    EXPECT_EQ(block_scale(amax_of(1.7578125f), Fp8Scale::kUe8m0), std::ldexp(1.0f, -7));
    EXPECT_EQ(block_scale(0x7f7fu, Fp8Scale::kUe8m0), std::ldexp(1.0f, 120));  // largest finite bf16
    // The smallest bf16 subnormal, 2^-133: 2^-141 (an fp32 subnormal, bits 1 << 8); in kFloat its fp32 quotient.
    EXPECT_EQ(bits_of(block_scale(0x0001u, Fp8Scale::kUe8m0)), 0x00000100u);
    EXPECT_EQ(bits_of(block_scale(0x0001u, Fp8Scale::kFloat)), bits_of(std::ldexp(1.0f, -133) / 448.0f));
    EXPECT_EQ(bits_of(block_scale(0x0003u, Fp8Scale::kUe8m0)), 0x00000200u);  // 3 * 2^-133 <= 448 * 2^-140
    // Every finite positive bf16 amax: kFloat is the fp32 quotient; kUe8m0 the exact smallest power of two.
    for (uint32_t a = 1; a < 0x7f80u; ++a) {
        const double amax = double(bf16_to_float(uint16_t(a)));
        ASSERT_EQ(bits_of(block_scale(a, Fp8Scale::kFloat)), bits_of(float(amax) / 448.0f)) << a;
        const double s = double(block_scale(a, Fp8Scale::kUe8m0));
        int e = 0;
        ASSERT_EQ(std::frexp(s, &e), 0.5) << a;  // a power of two
        ASSERT_GE(448.0 * s, amax) << a;
        ASSERT_LT(448.0 * s / 2, amax) << a;
    }
}

// A block of 128 bf16 values built from a few special ones.
std::vector<uint16_t> block_of(std::initializer_list<float> head, float fill) {
    std::vector<uint16_t> b(kFp8BlockSize, float_to_bf16(fill));
    size_t i = 0;
    for (float v : head) b[i++] = float_to_bf16(v);
    return b;
}

TEST(Fp8Rule, QuantizeRowBlocks) {
    const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
    std::vector<uint16_t> row;
    for (const auto& b :
         {block_of({}, 0.0f), block_of({-0.0f, nan, -nan}, 0.0f), block_of({nan, inf, -inf}, 0.0f),
          block_of({896.0f, -448.0f, 2.0f, nan, inf, -1e-30f}, 1.0f), block_of({1.0f, 1.25f, 3.0f}, 0.0f)}) {
        row.insert(row.end(), b.begin(), b.end());
    }
    const int nb = int(row.size()) / kFp8BlockSize;
    std::vector<uint8_t> q(row.size());
    std::vector<float> s(static_cast<size_t>(nb));
    quantize_fp8_rows(row.data(), 1, int(row.size()), Fp8Scale::kFloat, q.data(), s.data());
    // Zero blocks, and blocks of only zeros / NaN / Inf, get scale 1; NaN -> 0x7f, +-Inf -> +-448, -0 -> 0x80.
    EXPECT_EQ(s[0], 1.0f);
    EXPECT_EQ(q[0], 0x00);
    EXPECT_EQ(s[1], 1.0f);
    EXPECT_EQ(q[128], 0x80);
    EXPECT_EQ(q[129], 0x7f);
    EXPECT_EQ(q[130], 0x7f);
    EXPECT_EQ(q[131], 0x00);
    EXPECT_EQ(s[2], 1.0f);
    EXPECT_EQ(q[256], 0x7f);
    EXPECT_EQ(q[257], 0x7e);
    EXPECT_EQ(q[258], 0xfe);
    // amax 896 (NaN and Inf ignored): scale 2, 896 -> 448, -448 -> -224 (0xf6), 2 -> 1 (0x38), Inf -> 448, a tiny
    // negative -> 0x80, 1 -> 0.5 (0x30).
    EXPECT_EQ(s[3], 2.0f);
    EXPECT_EQ(q[384], 0x7e);
    EXPECT_EQ(q[385], 0xf6);
    EXPECT_EQ(q[386], 0x38);
    EXPECT_EQ(q[387], 0x7f);
    EXPECT_EQ(q[388], 0x7e);
    EXPECT_EQ(q[389], 0x80);
    EXPECT_EQ(q[390], 0x30);
    // amax 3: scale 3/448 (not a power of two); 3 -> 448; 1 -> 1/(3/448) = 149.33.. -> 144 (0x71).
    EXPECT_EQ(bits_of(s[4]), bits_of(3.0f / 448.0f));
    EXPECT_EQ(q[514], 0x7e);
    EXPECT_EQ(q[512], float_to_e4m3(1.0f / (3.0f / 448.0f)));
    EXPECT_EQ(q[512], 0x71);
    // UE8M0: amax 3 -> 2^-7 (448/128 = 3.5 >= 3); 1 -> 128 (0x70), 1.25 -> 160 (0x72), 3 -> 384 (0x7c): exact.
    quantize_fp8_rows(row.data(), 1, int(row.size()), Fp8Scale::kUe8m0, q.data(), s.data());
    EXPECT_EQ(s[4], std::ldexp(1.0f, -7));
    EXPECT_EQ(q[512], 0x70);
    EXPECT_EQ(q[513], 0x72);
    EXPECT_EQ(q[514], 0x7c);
    EXPECT_EQ(s[3], 2.0f);  // 448 * 2 >= 896
    // Subnormal bf16 inputs: amax 2^-133 * 5, every value a multiple of the smallest subnormal; amax -> 448 (kFloat).
    std::vector<uint16_t> tiny(kFp8BlockSize, 0x0001);
    tiny[7] = 0x8005;
    std::vector<uint8_t> tq(kFp8BlockSize);
    float ts = 0;
    quantize_fp8_rows(tiny.data(), 1, kFp8BlockSize, Fp8Scale::kFloat, tq.data(), &ts);
    EXPECT_EQ(bits_of(ts), bits_of(bf16_to_float(0x0005) / 448.0f));
    EXPECT_EQ(tq[7], 0xfe);
    EXPECT_EQ(tq[0], float_to_e4m3(bf16_to_float(0x0001) / ts));
    EXPECT_EQ(tq[0], nearest_e4m3(double(bf16_to_float(0x0001)) / double(ts)));
}

TEST(Fp8Rule, ValuesAreMultipliedByTheBlockInverse) {
    // amax 12.25: inverse = 448 / 12.25 (one division per block), q = e4m3(x * inverse). For x = -0.1708984375
    // (bf16 0xbe2f) the product rounds to e4m3 0xcd, where x / (12.25 / 448) would give 0xcc: the rule is the
    // multiplication.
    std::vector<uint16_t> row(kFp8BlockSize, 0);
    row[0] = float_to_bf16(12.25f);
    row[1] = 0xbe2f;
    std::vector<uint8_t> q(row.size());
    float s = 0;
    quantize_fp8_rows(row.data(), 1, kFp8BlockSize, Fp8Scale::kFloat, q.data(), &s);
    EXPECT_EQ(bits_of(s), bits_of(12.25f / 448.0f));
    EXPECT_EQ(bits_of(fp8::block_inverse(float_to_bf16(12.25f), s, Fp8Scale::kFloat)), bits_of(448.0f / 12.25f));
    EXPECT_EQ(q[0], 0x7e);
    EXPECT_EQ(q[1], 0xcd);
    EXPECT_EQ(q[2], 0x00);
    // amax the smallest bf16 subnormal: 448 / amax overflows fp32, so the block divides by its scale; a
    // multiplication by the infinite inverse would turn the zeros into NaN (0x7f).
    std::vector<uint16_t> tiny(kFp8BlockSize, 0);
    tiny[0] = 0x0001;
    std::vector<uint8_t> tq(tiny.size());
    float ts = 0;
    quantize_fp8_rows(tiny.data(), 1, kFp8BlockSize, Fp8Scale::kFloat, tq.data(), &ts);
    EXPECT_TRUE(std::isinf(fp8::block_inverse(0x0001u, ts, Fp8Scale::kFloat)));
    EXPECT_EQ(tq[0], 0x7e);  // 2^-133 / (2^-133 / 448) = 448
    EXPECT_EQ(tq[1], 0x00);
}

TEST(Fp8Rule, RejectsBadArguments) {
    std::vector<uint16_t> x(200);
    std::vector<uint8_t> q(200);
    std::vector<float> s(2);
    EXPECT_EQ(
        testing::error_message([&] { quantize_fp8_rows(x.data(), 1, 200, Fp8Scale::kFloat, q.data(), s.data()); }),
        "quantize_fp8_rows: hidden (H) must be a positive multiple of 128 (one scale per 128 channels), got "
        "H=200");
    EXPECT_EQ(testing::error_message([&] { quantize_fp8_rows(x.data(), 1, 128, Fp8Scale(7), q.data(), s.data()); }),
              "quantize_fp8_rows: mode must be Fp8Scale::kFloat (0) or kUe8m0 (1), got 7");
}

// ---- dispatch_fp8 on the CPU backend ----

constexpr int kCanaryRows = 2;
constexpr uint8_t kCanaryQ = 0xa5;
constexpr uint32_t kCanaryBits = 0xdeadbeef;

struct Shape {
    int R, E, S, K, H, align;
    double capacity_factor;
};

Config config_of(const Shape& c, int rank) {
    Config cfg;
    cfg.num_ranks = c.R;
    cfg.rank = rank;
    cfg.num_experts = c.E;
    cfg.num_tokens = c.S;
    cfg.topk = c.K;
    cfg.hidden = c.H;
    cfg.align = c.align;
    cfg.capacity_factor = c.capacity_factor;
    return cfg;
}

// bf16 rows with a few special blocks (zeros, NaN, Inf, subnormals, a wide range) among ordinary ones.
std::vector<uint16_t> token_rows(int s, int H, uint64_t stream) {
    std::vector<uint16_t> x = testing::random_bf16_wide(size_t(s) * H, stream);
    for (int64_t b = 0; b < int64_t(s) * H / kFp8BlockSize; ++b) {
        uint16_t* block = x.data() + b * kFp8BlockSize;
        switch (routing::mix64(stream + uint64_t(b)) % 11) {
            case 0:
                std::fill(block, block + kFp8BlockSize, uint16_t(0));
                break;
            case 1:
                block[b % 128] = 0x7fc1;  // NaN
                break;
            case 2:
                block[b % 128] = (b & 1) ? 0x7f80 : 0xff80;  // +-Inf
                break;
            case 3:
                for (int i = 0; i < kFp8BlockSize; ++i) block[i] = uint16_t((i * 37 + b) % 128) | ((i & 1) << 15);
                break;
            default:
                break;
        }
    }
    return x;
}

struct RankRun {
    int num_tokens = 0;
    std::vector<int32_t> topk;
    std::vector<uint16_t> x;
    std::vector<float> weights;
    std::vector<uint16_t> recv_bf16;  // the bf16 dispatch of x
    std::vector<float> recv_w_bf16;
    std::vector<uint8_t> q[3];  // dispatch_fp8: [0] bf16 input, [1] pre-quantised input, [2] into the symmetric region
    std::vector<float> scales[3], recv_w[3];
    std::vector<int32_t> cu_seqlens, row_heads;
    host::OpStats stats_bf16, stats_fp8;
};

// Every rank: plan; bf16 dispatch; dispatch_fp8 from bf16 rows, from the same rows quantised on the host, and into
// the symmetric region; then a second bf16 dispatch and dispatch_fp8 (staging reused after another op).
std::vector<RankRun> run_case(const Shape& c, Fp8Scale mode, bool weighted, bool ragged, uint64_t seed) {
    LocalHostWorld world(c.R, 30.0);
    std::vector<RankRun> runs(c.R);
    const std::vector<std::string> errors = run_ranks(c.R, [&](int r) {
        Buffer buffer(config_of(c, r), world.transport(r));
        const Layout& l = internal::layout(buffer);
        const int nvs = l.num_recv_rows, H = c.H, nb = H / kFp8BlockSize;
        RankRun& run = runs[r];
        run.num_tokens = ragged ? (c.S * (r + 2)) % (c.S + 1) : c.S;
        const int s = run.num_tokens;
        run.topk.resize(size_t(s) * c.K);
        routing::sample_topk(routing::popularity(c.E, 1.5, seed), s, c.K, seed, r, run.topk.data());
        run.x = token_rows(s, H, seed * 100 + uint64_t(r));
        run.weights = testing::random_floats(size_t(s) * c.K, seed * 7 + uint64_t(r), -1.0f, 1.0f);
        const float* w = weighted ? run.weights.data() : nullptr;
        const Plan plan = buffer.plan(run.topk.data(), 4, s);
        run.cu_seqlens.assign(plan.cu_seqlens(r).begin(), plan.cu_seqlens(r).end());
        run.row_heads.assign(plan.row_heads().begin(), plan.row_heads().end());
        run.recv_bf16.assign(size_t(nvs) * H, 0);
        run.recv_w_bf16.assign(size_t(nvs), 0.0f);
        internal::set_op_stats(buffer, &run.stats_bf16);
        buffer.dispatch(plan, run.x.data(), w, run.recv_bf16.data(), run.recv_w_bf16.data());
        internal::set_op_stats(buffer, nullptr);
        std::vector<uint8_t> xq(size_t(s) * H);
        std::vector<float> xs(size_t(s) * nb);
        quantize_fp8_rows(run.x.data(), s, H, mode, xq.data(), xs.data());
        for (int v = 0; v < 3; ++v) {
            run.q[v].assign(size_t(nvs + 2 * kCanaryRows) * H, kCanaryQ);
            run.scales[v].assign(size_t(nvs + 2 * kCanaryRows) * nb, float_of(kCanaryBits));
            run.recv_w[v].assign(size_t(nvs + 2 * kCanaryRows), float_of(kCanaryBits));
            uint8_t* q = run.q[v].data() + kCanaryRows * H;
            float* sc = run.scales[v].data() + kCanaryRows * nb;
            float* rw = run.recv_w[v].data() + kCanaryRows;
            if (v == 0) {
                internal::set_op_stats(buffer, &run.stats_fp8);
                buffer.dispatch_fp8(plan, run.x.data(), nullptr, nullptr, w, q, sc, rw, mode);
                internal::set_op_stats(buffer, nullptr);
            } else if (v == 1) {
                buffer.dispatch_fp8(plan, nullptr, xq.data(), xs.data(), w, q, sc, rw, mode);
            } else {
                // A bf16 dispatch in between rewrites the shared staging region; then FP8 rows into the region itself.
                std::vector<uint16_t> scratch(size_t(nvs) * H);
                buffer.dispatch(plan, run.x.data(), w, scratch.data(), nullptr);
                buffer.dispatch_fp8(plan, run.x.data(), nullptr, nullptr, w, buffer.symmetric_recv_x_fp8(),
                                    buffer.symmetric_recv_scales(), rw, mode);
                const int end = run.cu_seqlens.back();  // rows past it are unspecified there: copy the rest
                std::memcpy(q, buffer.symmetric_recv_x_fp8(), size_t(end) * H);
                std::memcpy(sc, buffer.symmetric_recv_scales(), size_t(end) * nb * sizeof(float));
            }
        }
        buffer.check_status();
    });
    EXPECT_EQ(testing::failures(errors), "");
    return runs;
}

void expect_matches_bf16_dispatch(const Shape& c, Fp8Scale mode, const std::vector<RankRun>& runs) {
    const int H = c.H, nb = H / kFp8BlockSize;
    for (int r = 0; r < c.R; ++r) {
        const RankRun& run = runs[r];
        const int nvs = int(run.row_heads.size()), end = run.cu_seqlens.back();
        std::vector<uint8_t> want_q(static_cast<size_t>(H));
        std::vector<float> want_s(static_cast<size_t>(nb));
        for (int v = 0; v < 3; ++v) {
            const uint8_t* q = run.q[v].data() + kCanaryRows * H;
            const float* sc = run.scales[v].data() + kCanaryRows * nb;
            const float* rw = run.recv_w[v].data() + kCanaryRows;
            for (int row = 0; row < end; ++row) {
                if (run.row_heads[row] >= 0) {  // a real row: the bf16 dispatch's row, quantised
                    quantize_fp8_rows(run.recv_bf16.data() + int64_t(row) * H, 1, H, mode, want_q.data(),
                                      want_s.data());
                } else {  // padding: zero bytes, zero scales, weight 0
                    std::fill(want_q.begin(), want_q.end(), uint8_t(0));
                    std::fill(want_s.begin(), want_s.end(), 0.0f);
                }
                ASSERT_EQ(std::memcmp(q + int64_t(row) * H, want_q.data(), size_t(H)), 0)
                    << "rank " << r << " variant " << v << " row " << row;
                for (int b = 0; b < nb; ++b) {
                    ASSERT_EQ(bits_of(sc[int64_t(row) * nb + b]), bits_of(want_s[b]))
                        << "rank " << r << " variant " << v << " row " << row << " block " << b;
                }
                ASSERT_EQ(bits_of(rw[row]), bits_of(run.recv_w_bf16[row])) << "rank " << r << " row " << row;
            }
            if (v == 2) continue;                           // the symmetric region past the end is unspecified
            for (int row = -kCanaryRows; row < 0; ++row) {  // canaries before, and past the end (never written)
                ASSERT_EQ(q[int64_t(row) * H], kCanaryQ);
                ASSERT_EQ(bits_of(sc[int64_t(row) * nb]), kCanaryBits);
                ASSERT_EQ(bits_of(rw[row]), kCanaryBits);
            }
            for (int row = end; row < nvs + kCanaryRows; ++row) {
                for (int h = 0; h < H; ++h) ASSERT_EQ(q[int64_t(row) * H + h], kCanaryQ) << "row " << row;
                for (int b = 0; b < nb; ++b) ASSERT_EQ(bits_of(sc[int64_t(row) * nb + b]), kCanaryBits);
                ASSERT_EQ(bits_of(rw[row]), kCanaryBits) << "row " << row;
            }
        }
        EXPECT_EQ(run.q[0], run.q[1]) << "rank " << r << ": pre-quantised rows differ from rows quantised in the op";
        EXPECT_EQ(run.stats_fp8.rows_pushed, run.stats_bf16.rows_pushed);
        EXPECT_EQ(run.stats_fp8.rows_pushed_remote, run.stats_bf16.rows_pushed_remote);
        EXPECT_EQ(run.stats_fp8.rows_fanned_out, run.stats_bf16.rows_fanned_out);
    }
}

TEST(DispatchFp8, EqualsTheBf16DispatchQuantisedPerRow) {
    const Shape shapes[] = {{4, 16, 48, 4, 256, 16, 1.0}, {2, 8, 40, 3, 384, 8, 1.25}, {1, 4, 16, 2, 128, 1, 1.0}};
    for (const Shape& c : shapes) {
        for (Fp8Scale mode : {Fp8Scale::kFloat, Fp8Scale::kUe8m0}) {
            for (int variant = 0; variant < 2; ++variant) {
                SCOPED_TRACE("R=" + std::to_string(c.R) + " H=" + std::to_string(c.H) +
                             " mode=" + std::to_string(int(mode)) + " variant=" + std::to_string(variant));
                const bool weighted = variant == 0, ragged = variant == 1;
                const auto runs = run_case(c, mode, weighted, ragged, 11 + uint64_t(variant));
                expect_matches_bf16_dispatch(c, mode, runs);
                bool padding = false, nan = false;  // the inputs reach the cases they are meant to
                for (const RankRun& run : runs) {
                    for (size_t i = 0; i < run.row_heads.size() && int(i) < run.cu_seqlens.back(); ++i)
                        padding |= run.row_heads[i] < 0;
                    for (uint8_t b : run.q[0]) nan |= b == 0x7f;
                }
                EXPECT_TRUE(padding || c.align == 1);
                EXPECT_TRUE(nan);
            }
        }
    }
}

TEST(DispatchFp8, BadInputIsOneLineNamingTheArgument) {
    LocalHostWorld world(1, 10.0);
    Shape c{1, 4, 8, 2, 128, 8, 1.0};
    Buffer buffer(config_of(c, 0), world.transport(0));
    const int32_t idx[16] = {0, 1, 1, 2, 2, 3, 3, 0, 0, 2, 1, 3, 2, 0, 3, 1};
    const Plan plan = buffer.plan(idx, 4, 8);
    const int nvs = buffer.num_recv_rows();
    std::vector<uint16_t> x(8 * 128);
    std::vector<uint8_t> xq(8 * 128), q(size_t(nvs) * 128);
    std::vector<float> xs(8), s(static_cast<size_t>(nvs));
    auto message = [&](auto&& fn) { return testing::error_message(fn); };
    EXPECT_EQ(
        message([&] { buffer.dispatch_fp8(plan, x.data(), xq.data(), nullptr, nullptr, q.data(), s.data(), nullptr); }),
        "dispatch_fp8: pass x_bf16 (quantised in the op) or x_fp8 with x_scales, not both");
    EXPECT_EQ(
        message([&] { buffer.dispatch_fp8(plan, nullptr, nullptr, nullptr, nullptr, q.data(), s.data(), nullptr); }),
        "dispatch_fp8: x_bf16 and x_fp8 are both null; pass one of them");
    EXPECT_EQ(
        message([&] { buffer.dispatch_fp8(plan, nullptr, xq.data(), nullptr, nullptr, q.data(), s.data(), nullptr); }),
        "dispatch_fp8: x_scales is null; x_fp8 needs its [s][H/128] fp32 scales");
    EXPECT_EQ(
        message([&] { buffer.dispatch_fp8(plan, x.data(), nullptr, xs.data(), nullptr, q.data(), s.data(), nullptr); }),
        "dispatch_fp8: x_scales is set without x_fp8; bf16 rows (x_bf16) get their scales in the op");
    EXPECT_EQ(
        message([&] { buffer.dispatch_fp8(plan, x.data(), nullptr, nullptr, nullptr, nullptr, s.data(), nullptr); }),
        "dispatch_fp8: recv_x is null");
    EXPECT_EQ(
        message([&] { buffer.dispatch_fp8(plan, x.data(), nullptr, nullptr, nullptr, q.data(), nullptr, nullptr); }),
        "dispatch_fp8: recv_scales is null");
    EXPECT_EQ(message([&] {
                  buffer.dispatch_fp8(plan, x.data(), nullptr, nullptr, nullptr, q.data(), s.data(), nullptr,
                                      Fp8Scale(2));
              }),
              "dispatch_fp8: scale_mode must be Fp8Scale::kFloat (0) or kUe8m0 (1), got 2");
    EXPECT_EQ(
        message([&] { buffer.dispatch_fp8(Plan(), x.data(), nullptr, nullptr, nullptr, q.data(), s.data(), nullptr); }),
        "dispatch_fp8: plan is empty (default-constructed); get one from Buffer::plan()");
    EXPECT_FALSE(buffer.poisoned());  // argument errors are local: the Buffer still computes
    buffer.dispatch_fp8(plan, x.data(), nullptr, nullptr, nullptr, q.data(), s.data(), nullptr);

    c.H = 200;  // a valid bf16 row width, but not a whole number of 128-channel blocks
    Buffer odd(config_of(c, 0), world.transport(0));
    const Plan odd_plan = odd.plan(idx, 4, 8);
    std::vector<uint16_t> x200(8 * 200);
    EXPECT_EQ(message([&] {
                  odd.dispatch_fp8(odd_plan, x200.data(), nullptr, nullptr, nullptr, q.data(), s.data(), nullptr);
              }),
              "dispatch_fp8: hidden (H) must be a multiple of 128 for FP8 rows (one scale per 128 channels), got "
              "H=200");
}

TEST(DispatchFp8, RanksInDispatchAndDispatchFp8FailOnEveryRank) {
    const Shape c{2, 4, 4, 2, 128, 1, 1.0};
    LocalHostWorld world(c.R, 10.0);
    std::vector<std::string> messages(c.R);
    const std::vector<std::string> errors = run_ranks(c.R, [&](int r) {
        Buffer buffer(config_of(c, r), world.transport(r));
        const int32_t idx[8] = {0, 1, 2, 3, 1, 2, 3, 0};
        const Plan plan = buffer.plan(idx, 4, 4);
        const int nvs = buffer.num_recv_rows();
        std::vector<uint16_t> x(4 * 128), recv(size_t(nvs) * 128);
        std::vector<uint8_t> q(size_t(nvs) * 128);
        std::vector<float> s(static_cast<size_t>(nvs));
        messages[r] = testing::error_message([&] {
            if (r == 0) {
                buffer.dispatch_fp8(plan, x.data(), nullptr, nullptr, nullptr, q.data(), s.data(), nullptr);
            } else {
                buffer.dispatch(plan, x.data(), nullptr, recv.data(), nullptr);
            }
        });
        EXPECT_TRUE(buffer.poisoned());
    });
    ASSERT_EQ(testing::failures(errors), "");
    const std::string tail = "; every rank must call the same ops in the same order, with plans of the same step";
    EXPECT_EQ(messages[0], "dispatch_fp8: rank 0 is in dispatch_fp8 of step 1 but rank 1 in dispatch of step 1" + tail);
    EXPECT_EQ(messages[1], "dispatch: rank 1 is in dispatch of step 1 but rank 0 in dispatch_fp8 of step 1" + tail);
}

}  // namespace
}  // namespace flatep
