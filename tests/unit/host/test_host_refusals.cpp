// What a host (CPU backend) Buffer and the FFN row ops refuse that the Python front never asks for: a host Plan's
// device arrays, plan_storage given to a host Buffer, and rows > 0 with null row pointers. One kInvalidArgument line
// each, exact; the objects stay usable after.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flatep/buffer.hpp"
#include "flatep/error.hpp"
#include "flatep/expert_pools.hpp"
#include "flatep/ffn.hpp"
#include "flatep/transport.hpp"
#include "transport/local_host.hpp"
#include "unit/host/bootstrap_transport.hpp"
#include "unit/host/rank_threads.hpp"

namespace flatep {
namespace {

using testing::make_config;
using testing::Outcome;
using testing::outcome_of;
using transport::LocalHostWorld;

constexpr int kInvalid = int(ErrorCategory::kInvalidArgument);

TEST(HostRefusals, AHostPlanHasNoDeviceArraysAndAHostBufferNoPlanStorage) {
    LocalHostWorld world(1, 10.0);
    Buffer buffer(make_config(1, 2, 2, 1, 8, 1), world.transport(0));
    const int32_t idx[2] = {1, 0};
    int32_t storage[64] = {};
    const Outcome stored = outcome_of([&] { buffer.plan(idx, 4, 2, storage); });
    EXPECT_EQ(stored.message, "plan: plan_storage is for device Buffers; this one is on the host");
    EXPECT_EQ(stored.category, kInvalid);
    const Plan plan = buffer.plan(idx, 4, 2);  // the refusal left the Buffer usable
    EXPECT_FALSE(plan.on_device());
    for (const int rank : {0, 5}) {  // the memory is checked before the rank
        const Outcome cu = outcome_of([&] { plan.device_cu_seqlens(rank); });
        EXPECT_EQ(cu.message, "device_cu_seqlens: the plan is in host memory (CPU backend)");
        EXPECT_EQ(cu.category, kInvalid);
        const Outcome slots = outcome_of([&] { plan.device_slot_expert(rank); });
        EXPECT_EQ(slots.message, "device_slot_expert: the plan is in host memory (CPU backend)");
        EXPECT_EQ(slots.category, kInvalid);
    }
    EXPECT_EQ(plan.cu_seqlens(0)[1], 2);  // e1's token, then e0's: one row each
}

TEST(HostRefusals, FfnRowOpsNeedTheirRowsWhenRowsArePositive) {
    static const int32_t end = 3;
    uint16_t h[16] = {}, a[16] = {};
    for (auto [hp, ap] : {std::pair<const uint16_t*, uint16_t*>{nullptr, a}, {h, nullptr}, {nullptr, nullptr}}) {
        const Outcome o =
            outcome_of([&] { activate_rows(hp, ap, 2, 4, FfnActivation::kSwiglu, &end, PastEnd::kZero); });
        EXPECT_EQ(o.message, "activate_rows: h and a must be set when rows > 0");
        EXPECT_EQ(o.category, kInvalid);
    }
    const Outcome y = outcome_of([] { zero_rows_from_end(nullptr, 2, 4, &end); });
    EXPECT_EQ(y.message, "zero_rows_from_end: y must be set when rows > 0");
    EXPECT_EQ(y.category, kInvalid);
#if !defined(FLATEP_WITH_CUDA)
    // Set: the checks pass and the launch says this build has none.
    const std::string no_cuda = ": this FlatEP build has no CUDA support (nvcc was not found at build time)";
    EXPECT_EQ(outcome_of([&] { activate_rows(h, a, 2, 4, FfnActivation::kSwiglu, &end, PastEnd::kZero); }).message,
              "activate_rows" + no_cuda);
    EXPECT_EQ(outcome_of([&] { zero_rows_from_end(a, 2, 4, &end); }).message, "zero_rows_from_end" + no_cuda);
#endif
}

// Serving pools of R=2, epn=1, B=0 and one projection of [1][56] bf16 (112 bytes an expert) on 4096-byte pages. Rank
// r's chunk maps at its row's page, its data at the row's offset in that page, and every rank's own allocation is
// sized for the largest such offset. Stride 36: rank 1's row at 4032 (page 0, offset 4032) needs two pages, and rank
// 1's chunk would start at page 0 inside rank 0's: no fit. Stride 37 (the smallest): row at 4144, offset 48, one page
// each, no overlap. Stride 73 (larger): row at 8176, offset 4080, so each allocation takes two pages while rank 1's
// chunk starts one page after rank 0's: refused.
TEST(HostRefusals, AServingStrideAboveTheSmallestThatDoesNotFit) {
    LocalHostWorld world(2, 10.0);
    if (world.transport(0)->granularity() != 4096) GTEST_SKIP() << "the worked numbers are for 4096-byte pages";
    std::vector<std::string> messages(2), strides(2);
    const std::vector<std::string> errors = testing::run_ranks(2, [&](int r) {
        const std::shared_ptr<Transport> t = world.transport(r);
        strides[r] = std::to_string(ExpertPools(t, 1, {{1, 56}}, 0).view_stride());
        messages[r] = outcome_of([&] { ExpertPools p(t, 1, {{1, 56}}, 0, 73); }).message;
    });
    EXPECT_EQ(testing::failures(errors), "");
    for (int r = 0; r < 2; ++r) {
        EXPECT_EQ(strides[r], "37") << r;
        EXPECT_EQ(messages[r],
                  "ExpertPools: view_stride 73 does not fit projection 0 (112 bytes an expert) on this transport's "
                  "4096-byte granularity")
            << r;
    }
}

// A bootstrap (a broken custom transport's) that drops the last byte of the first all_gather's blob: the Buffer's
// config exchange names the rank and both sizes (kRuntime).
class TruncatingBootstrap final : public Bootstrap {
  public:
    explicit TruncatingBootstrap(Bootstrap& inner) : inner_(inner) {}
    int rank() const override { return inner_.rank(); }
    int size() const override { return inner_.size(); }
    std::vector<std::string> all_gather(const std::string& blob) override {
        std::vector<std::string> all = inner_.all_gather(blob);
        if (sent_ == 0) {
            sent_ = blob.size();
            all[0].pop_back();
        }
        return all;
    }
    size_t sent_ = 0;

  private:
    Bootstrap& inner_;
};

TEST(HostRefusals, AConfigBlobOfTheWrongSizeIsRefused) {
    LocalHostWorld world(1, 10.0);
    auto truncating =
        std::make_shared<testing::BootstrapTransport<TruncatingBootstrap>>(world.transport(0), "truncating");
    const Outcome o = outcome_of([&] { Buffer b(make_config(1, 2, 2, 1, 8, 1), truncating); });
    const size_t n = truncating->custom_bootstrap().sent_;
    ASSERT_GT(n, 1u);
    EXPECT_EQ(o.message,
              "Buffer: rank 0 sent a config of " + std::to_string(n - 1) + " bytes, expected " + std::to_string(n));
    EXPECT_EQ(o.category, int(ErrorCategory::kRuntime));
}

}  // namespace
}  // namespace flatep
