// The C++ API's setters refuse a bad value and keep the one they had (the Python front checks before it calls them,
// so only C++ callers reach these checks): Buffer::set_num_sms and ExpertPools::set_num_sms with a budget out of
// [0, kMaxNumSms], and a Launch budget out of range at an op, each naming the value, and the object's budget and its
// next op's results unchanged. Found by issue 62's fresh mutants (M53 survived the suite without it).
// Run: build/tests/flatep_host_tests --gtest_filter='RefusedSetters.*'
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "flatep/buffer.hpp"
#include "flatep/error.hpp"
#include "flatep/expert_pools.hpp"
#include "flatep/launch.hpp"
#include "transport/local_host.hpp"

namespace flatep {
namespace {

using transport::LocalHostWorld;

template <class Call>
std::string refused(Call call) {
    try {
        call();
    } catch (const Error& e) {
        EXPECT_EQ(e.category(), ErrorCategory::kInvalidArgument);
        return e.message();
    }
    ADD_FAILURE() << "the call was not refused";
    return "";
}

TEST(RefusedSetters, NumSmsKeepsTheBudgetItHad) {
    LocalHostWorld world(1, 10.0);
    Config c;
    c.num_ranks = 1;
    c.num_experts = 4;
    c.num_tokens = 4;
    c.topk = 2;
    c.hidden = 8;
    c.align = 1;
    Buffer buffer(c, world.transport(0));
    ExpertPools pools(world.transport(0), 4, {ProjectionShape{8, 2}});
    buffer.set_num_sms(7);
    pools.set_num_sms(9);
    for (int bad : {-1, -5, kMaxNumSms + 1}) {
        const std::string text = std::to_string(bad);
        EXPECT_NE(refused([&] { buffer.set_num_sms(bad); }).find("got " + text), std::string::npos);
        EXPECT_NE(refused([&] { pools.set_num_sms(bad); }).find("got " + text), std::string::npos);
        EXPECT_EQ(buffer.num_sms(), 7) << "Buffer::set_num_sms(" << bad << ") changed the budget";
        EXPECT_EQ(pools.num_sms(), 9) << "ExpertPools::set_num_sms(" << bad << ") changed the budget";
    }
    // An op's own budget out of range: refused naming the op, the object's budget untouched, the op then runs.
    const std::vector<int32_t> idx = {0, 1, 2, 3, 1, 2, 3, 0};
    EXPECT_NE(refused([&] {
                  buffer.plan(idx.data(), 4, 4, nullptr, Launch{nullptr, -2});
              }).find("plan"),
              std::string::npos);
    EXPECT_EQ(buffer.num_sms(), 7);
    const Plan plan = buffer.plan(idx.data(), 4, 4);
    EXPECT_EQ(plan.num_tokens(), 4);
    EXPECT_EQ(plan.generation(), 1u) << "the refused plan() counted as a step";
}

}  // namespace
}  // namespace flatep
