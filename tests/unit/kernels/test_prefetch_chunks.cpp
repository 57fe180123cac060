// How the push prefetch cuts an expert's words of every projection into chunks, and how the serving pull cuts its
// slots' words over the grid (kernels/prefetch/chunks.hpp, the host arithmetic of prefetch.cu), in the CPU build: over
// the layer shapes the pools move and every grid of 1 to 300 blocks, every word in exactly one chunk, no chunk empty,
// chunks in whole 512-byte lines, at most one chunk a block once the grid has a block per projection, no block given
// more than its share; the pull's block ranges follow each other and cover the stream once.
// Run: build/tests/flatep_kernels_tests --gtest_filter='PrefetchChunks.*:PullBlockWords.*'
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/prefetch/chunks.hpp"

namespace flatep::kernels {
namespace {

// Words of one expert per projection, for a layer of hidden H and ffn F.
std::vector<int64_t> bf16_matrix(int64_t H, int64_t F) { return {H * F * 2 / 16}; }
std::vector<int64_t> fp8_pair(int64_t H, int64_t F) { return {H * F / 16, H * F / 128 * 4 / 16}; }

// Every property of the chunks of `n16` on a grid of `blocks`; the first violation as text ("" when none).
std::string chunk_violation(const std::vector<int64_t>& n16, int blocks) {
    const int P = int(n16.size());
    const PrefetchChunks c = prefetch_chunks(n16.data(), P, blocks);
    int64_t total16 = 0;
    for (int64_t n : n16) total16 += n;
    if (c.chunk16 < 32 || c.chunk16 % 32 != 0) return "chunk16 " + std::to_string(c.chunk16) + " is not whole lines";
    if (c.first_chunk[0] != 0) return "first_chunk[0] " + std::to_string(c.first_chunk[0]);
    for (int p = 0; p < P; ++p) {
        // Chunks [first_chunk[p], first_chunk[p + 1]) of chunk16 words cover projection p's n16[p] words: the last one
        // holds at least one word, and together they reach the end.
        const int64_t count = c.first_chunk[p + 1] - c.first_chunk[p];
        if (count < 1 || (count - 1) * c.chunk16 >= n16[p] || count * c.chunk16 < n16[p])
            return "projection " + std::to_string(p) + ": " + std::to_string(count) + " chunks of " +
                   std::to_string(c.chunk16) + " words for " + std::to_string(n16[p]);
    }
    const int chunks = c.first_chunk[P];
    if (blocks >= P && chunks > blocks) return std::to_string(chunks) + " chunks: some block copies two of one expert";
    // A block's words: its share of blocks - (P - 1), in whole lines.
    const int64_t shares = blocks - (P - 1) > 1 ? blocks - (P - 1) : 1;
    if (c.chunk16 >= (total16 + shares - 1) / shares + 32 && c.chunk16 > 32)
        return "chunk16 " + std::to_string(c.chunk16) + " above the share of " + std::to_string(total16);
    return "";
}

TEST(PrefetchChunks, LayerShapesOnEveryGrid) {
    std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
        {"bf16 H=7168 F=2048", bf16_matrix(7168, 2048)},
        {"fp8 + scales H=7168 F=2048", fp8_pair(7168, 2048)},
        {"fp8 + scales H=7168 F=512", fp8_pair(7168, 512)},
        {"swiglu bf16 W1 [H, 2F] and W2 [F, H], H=7168 F=1536", {7168 * 3072 * 2 / 16, 1536 * 7168 * 2 / 16}},
        {"swiglu fp8 with scales, H=7168 F=2048",
         {7168 * 4096 / 16, 7168 * 4096 / 128 * 4 / 16, 2048 * 7168 / 16, 2048 * 7168 / 128 * 4 / 16}},
        {"tiny: one line", {2}},
        {"tiny fp8 H=64 F=32", {64 * 32 / 16, 64 * 32 / 128 * 4 / 16}},
    };
    std::vector<int64_t> eight;
    for (int p = 0; p < kMaxPrefetchProjections; ++p) eight.push_back(1000 + 7919 * p);
    shapes.push_back({"8 projections of uneven sizes", eight});
    for (const auto& [name, n16] : shapes)
        for (int blocks = 1; blocks <= 300; ++blocks)
            ASSERT_EQ(chunk_violation(n16, blocks), "") << name << ", " << blocks << " blocks";
}

TEST(PrefetchChunks, RandomProjections) {
    std::mt19937_64 rng(62);
    for (int trial = 0; trial < 3000; ++trial) {
        const int P = 1 + int(rng() % kMaxPrefetchProjections);
        std::vector<int64_t> n16;
        for (int p = 0; p < P; ++p) n16.push_back(1 + int64_t(rng() % (trial % 2 ? 5000 : 3000000)));
        const int blocks = 1 + int(rng() % 600);
        ASSERT_EQ(chunk_violation(n16, blocks), "")
            << "trial " << trial << ", " << P << " projections, " << blocks << " blocks, n16[0] " << n16[0];
    }
}

// The case that showed on the H200: 32 blocks a rank, FP8 weights and scales of H=7168 F=2048 in 32 chunks (sized for
// 32 shares, they made 33 chunks and one block copied two).
TEST(PrefetchChunks, Fp8PairOnThirtyTwoBlocks) {
    const std::vector<int64_t> pair = fp8_pair(7168, 2048);
    const PrefetchChunks c = prefetch_chunks(pair.data(), 2, 32);
    EXPECT_EQ(c.first_chunk[2], 32);
    EXPECT_EQ(c.chunk16, 30528);
}

// The pull's ranges over a grid: each starts where the one before ends, whole lines but the stream's end, covering [0,
// words) once, no block more than ceil(lines / blocks) lines.
TEST(PullBlockWords, BlocksCoverTheStreamOnceInWholeLines) {
    std::mt19937_64 rng(6201);
    std::vector<int64_t> cases = {0, 1, 31, 32, 33, 1000, 4096, 30528 * 3 + 7};
    for (int i = 0; i < 400; ++i) cases.push_back(int64_t(rng() % 5000000));
    for (int64_t words : cases) {
        for (int64_t blocks :
             {int64_t(1), int64_t(2), int64_t(3), int64_t(7), int64_t(32), int64_t(132), int64_t(1 + rng() % 1000)}) {
            const int64_t lines = (words + 31) / 32;
            int64_t at = 0;
            for (int64_t b = 0; b < blocks; ++b) {
                const WordRange r = pull_block_words(words, b, blocks);
                ASSERT_EQ(r.begin, at) << words << " words, block " << b << " of " << blocks;
                ASSERT_GE(r.end, r.begin);
                ASSERT_EQ(r.begin % 32, 0);
                ASSERT_LE(r.end - r.begin, (lines + blocks - 1) / blocks * 32);
                at = r.end;
            }
            ASSERT_EQ(at, words) << words << " words over " << blocks << " blocks";
        }
    }
}

}  // namespace
}  // namespace flatep::kernels
