// benchmarks/common: the parallel count generator is routing::generate_counts bitwise, the sweep's product and
// overrides, medians, CSV quoting. Reproduce: build/benchmarks/test_bench_common
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "csv.hpp"
#include "flags.hpp"
#include "internal/api.hpp"
#include "routing_cases.hpp"
#include "timing.hpp"

namespace flatep::bench {
namespace {

TEST(BenchCommon, ParallelCountsEqualTheGenerator) {
    for (int threads : {1, 3, 0}) {
        EXPECT_EQ(generate_counts_parallel(5, 40, 300, 6, 1.3, 77, threads),
                  routing::generate_counts(5, 40, 300, 6, 1.3, 77));
    }
}

std::vector<Case> cases_of(std::vector<std::string> args, std::vector<std::string> defaults) {
    Flags flags("test", "test");
    flags.add_sweep(std::move(defaults), 1024);
    std::vector<char*> argv{const_cast<char*>("test")};
    for (std::string& a : args) argv.push_back(a.data());
    flags.parse(int(argv.size()), argv.data());
    return flags.cases();
}

TEST(BenchCommon, PresetsAndListsMakeTheProduct) {
    const std::vector<Case> sweep = cases_of({"--preset", "moonep-sweep"}, {"moonep"});
    ASSERT_EQ(sweep.size(), 4u * 2 * 2 * 3);  // R x H x K x maxvio
    EXPECT_EQ(sweep.front().shape.label(), "R8_S8192_E896_H3584_K8");
    EXPECT_EQ(sweep.back().shape.label(), "R64_S8192_E896_H7168_K16");
    EXPECT_FALSE(sweep.back().skew.is_sigma);
    EXPECT_EQ(sweep.back().skew.value, 20.0);
    EXPECT_EQ(sweep.front().shape.ffn, 1024);  // the driver's default H'

    const std::vector<Case> two = cases_of({}, {"moonep", "deepep"});
    ASSERT_EQ(two.size(), 5u);  // moonep's 4 maxvios, deepep's uniform routing
    EXPECT_EQ(two[4].preset, "deepep");
    EXPECT_TRUE(two[4].skew.is_sigma);
    EXPECT_EQ(two[4].shape.tokens, 4096);

    // A flag replaces the field in every preset; --sigma replaces the maxvio targets.
    const std::vector<Case> k = cases_of({"--preset", "moonep,deepep", "--topk", "4,6", "--sigma", "0.5"}, {"moonep"});
    ASSERT_EQ(k.size(), 4u);
    for (const Case& c : k) {
        EXPECT_TRUE(c.skew.is_sigma);
        EXPECT_EQ(c.skew.value, 0.5);
    }
    EXPECT_EQ(k[1].shape.topk, 6);
    EXPECT_EQ(k[2].shape.experts, 256);
}

TEST(BenchCommon, MedianAndSummary) {
    EXPECT_EQ(median(std::vector<float>{5, 1, 3, 2}), 3.f);  // the upper median of an even count
    EXPECT_EQ(median(std::vector<double>{}), 0.0);
    const Timing t = summarize(std::vector<double>{4, 2, 9});
    EXPECT_EQ(t.median_us, 4.0);
    EXPECT_EQ(t.min_us, 2.0);
}

TEST(BenchCommon, CsvRowsAndQuoting) {
    const std::string path = ::testing::TempDir() + "bench_common_test.csv";
    {
        CsvWriter csv(path, {"a", "b", "c"});
        csv.row(std::string("x,y"), 3, 0.5);
        csv.row("q\"t", int64_t(1) << 40, fixed(2.0, 2));
        EXPECT_THROW(csv.row(1, 2), Error);
    }
    {
        CsvWriter again(path, {"a", "b", "c"}, /*append=*/true);  // no second header
        again.row(1, 2, 3);
    }
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    EXPECT_EQ(text.str(), "a,b,c\n\"x,y\",3,0.5\n\"q\"\"t\",1099511627776,2.00\n1,2,3\n");
    std::remove(path.c_str());
}

}  // namespace
}  // namespace flatep::bench
