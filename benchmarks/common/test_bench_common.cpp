// benchmarks/common: the parallel count generator is routing::generate_counts bitwise, the sweep's product and
// overrides, medians, CSV quoting, the device memory estimate and the refusal of a case that does not fit. Reproduce:
// build/benchmarks/test_bench_common
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "csv.hpp"
#include "flags.hpp"
#include "internal/api.hpp"
#include "memory.hpp"
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

// R=2 S=64 E=8 H=256 K=2 align 16: epn 4, C = 128, NvS = round_up(128 + 2*4*15, 16) = 256 rows of 512 bytes.
Layout small_layout() {
    return make_layout(
        Shape{.ranks = 2, .tokens = 64, .hidden = 256, .ffn = 128, .experts = 8, .topk = 2, .align = 16}.config());
}

TEST(BenchCommon, KernelStepMemoryFromTheShapes) {
    const Layout l = small_layout();
    ASSERT_EQ(l.num_recv_rows, 256);
    const MemoryEstimate e = kernel_step_memory(l, {256 * 128 * 2}, /*pool_slots=*/4, /*grads=*/true, 12345);
    auto part = [&](const std::string& name) {
        for (const MemoryPart& p : e.parts)
            if (p.name == name) return p;
        ADD_FAILURE() << "no part " << name;
        return MemoryPart{};
    };
    // The symmetric region by hand: barrier flags 64 * 8 (512), status 16 (-> 768), counts 2*8*4 (-> 1024), receive
    // rows 256*512 (-> 132096), weights, chain heads and links 1024 each (-> 135168), partials 256*512 (-> 266240),
    // marks 256 (-> 266496); every region 256-byte aligned.
    EXPECT_EQ(part("symmetric region").bytes, 266496);
    EXPECT_EQ(part("symmetric region").count, 2);
    EXPECT_EQ(part("plan").bytes, make_plan_sizes(l).total_words * 4);
    EXPECT_EQ(part("plan workspace").bytes, 12345);
    EXPECT_EQ(part("top-k ids").bytes, 64 * 2 * 4);
    EXPECT_EQ(part("input rows").bytes, 64 * 512);
    EXPECT_EQ(part("expert outputs").bytes, 256 * 512);
    EXPECT_EQ(part("receive weights").bytes, 256 * 4);
    EXPECT_EQ(part("own experts").bytes, 4 * 65536);
    EXPECT_EQ(part("slot pool").bytes, 4 * 65536);
    EXPECT_EQ(part("fp32 grads").bytes, 4 * 65536 * 2);
    EXPECT_EQ(part("fp32 reduce pool").bytes, 4 * 65536 * 2);
    // 13 allocations a rank, each rounded up to a 2 MiB page, and the allowance.
    ASSERT_EQ(e.parts.size(), 13u);
    EXPECT_EQ(e.total(), 2 * 13 * kAllocationGranule + kMemoryAllowance);
    // No pools, no grads (fp8_bench's step): 9 allocations a rank.
    EXPECT_EQ(kernel_step_memory(l, {}, 0, false, 100).total(), 2 * 9 * kAllocationGranule + kMemoryAllowance);
    // Rounding: 3 MiB takes two pages, 0 bytes none.
    EXPECT_EQ((MemoryPart{"x", 3 << 20, 5}.total()), 5 * 2 * kAllocationGranule);
    EXPECT_EQ((MemoryPart{"x", 0, 5}.total()), 0);
}

TEST(BenchCommon, EpRankMemoryFromTheShapes) {
    const Layout l = small_layout();
    const MemoryEstimate e = ep_rank_memory(l, 1000, /*plan_slots=*/4);
    int64_t allocations = 0, bytes_of_nccl_receive = 0;
    for (const MemoryPart& p : e.parts) {
        allocations += p.name == "nccl communicator (allowance)" ? 0 : p.count;
        if (p.name == "nccl dedup receive rows" || p.name == "nccl entries receive rows")
            bytes_of_nccl_receive += p.bytes;
        if (p.name == "symmetric region") {
            EXPECT_EQ(p.bytes, 266496);
        }
        if (p.name == "plan slots") {
            EXPECT_EQ(p.bytes, 4 * make_plan_sizes(l).total_words * 4);
        }
    }
    // The worst case of every source's rows to this rank: dedup R*S rows, entries R*S*min(K, epn) rows of 512 bytes.
    EXPECT_EQ(bytes_of_nccl_receive, 2 * 64 * 512 + 2 * 64 * 2 * 512);
    EXPECT_EQ(allocations, 19);
    EXPECT_EQ(e.total(), 19 * kAllocationGranule + kNcclAllowance + kMemoryAllowance);
}

TEST(BenchCommon, RefusesWhatDoesNotFit) {
    MemoryEstimate e;
    e.what = "preset k3 (R8_S4096_E896_H7168_K8)";
    e.add("pools", 3 * kGiB, 8);  // 24 GiB + the 1 GiB allowance
    EXPECT_EQ(e.total(), 25 * kGiB);
    EXPECT_EQ(does_not_fit(e, 25 * kGiB, "cuda:0", false), "");
    EXPECT_EQ(does_not_fit(e, 25 * kGiB - 1, "cuda:0", false),
              "preset k3 (R8_S4096_E896_H7168_K8) needs 25.00 GiB on cuda:0, 25.00 GiB free (--memory-gib overrides)");
    EXPECT_EQ(does_not_fit(e, available_bytes(10, 80 * kGiB), "cuda:0", true),
              "preset k3 (R8_S4096_E896_H7168_K8) needs 25.00 GiB on cuda:0, 10.00 GiB by --memory-gib");
    EXPECT_EQ(available_bytes(0, 80 * kGiB), 80 * kGiB);
    EXPECT_EQ(e.describe(), "pools 8 x 3.00 GiB, allowance 1.00 GiB: 25.00 GiB");
    EXPECT_EQ(size_text(3 << 19), "1.5 MiB");
    EXPECT_EQ(size_text(512), "0.5 KiB");
    EXPECT_EXIT(require_fit("prog", {e}, 24 * kGiB, "cuda:0", false), ::testing::ExitedWithCode(2),
                "prog: does not fit: preset k3 \\(R8_S4096_E896_H7168_K8\\) needs 25.00 GiB on cuda:0, 24.00 GiB free");
}

TEST(BenchCommon, MemoryGibFlag) {
    Flags flags("test", "test");
    double gib = 0;
    flags.add_memory(&gib);
    std::vector<std::string> args{"test", "--memory-gib", "79.5"};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    flags.parse(int(argv.size()), argv.data());
    EXPECT_EQ(gib, 79.5);
    EXPECT_TRUE(flags.given("--memory-gib"));
}

}  // namespace
}  // namespace flatep::bench
