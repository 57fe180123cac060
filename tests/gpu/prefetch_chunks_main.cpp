// How the push prefetch cuts an expert's words of every projection into chunks (kernels/prefetch/chunks.hpp), over
// the layer shapes the pools move and every grid of 1 to 300 blocks: every word in exactly one chunk, no chunk empty,
// chunks in whole 512-byte lines, at most one chunk a block once the grid has a block per projection, and no block
// given more than its share. Needs no GPU (host code of the kernels library).
// Run: build-cuda/tests/gpu/prefetch_chunks_main
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/prefetch/chunks.hpp"

namespace {

using flatep::kMaxPrefetchProjections;
using flatep::kernels::prefetch_chunks;
using flatep::kernels::PrefetchChunks;

int failures = 0;

void fail(const std::string& what, int blocks, const std::string& why) {
    if (++failures <= 10) std::fprintf(stderr, "FAIL: %s, %d blocks: %s\n", what.c_str(), blocks, why.c_str());
}

// Words of one expert per projection, for a layer of hidden H and ffn F.
std::vector<int64_t> bf16_matrix(int64_t H, int64_t F) { return {H * F * 2 / 16}; }
std::vector<int64_t> fp8_pair(int64_t H, int64_t F) { return {H * F / 16, H * F / 128 * 4 / 16}; }

void check(const std::string& what, const std::vector<int64_t>& n16, int blocks) {
    const int P = int(n16.size());
    const PrefetchChunks c = prefetch_chunks(n16.data(), P, blocks);
    int64_t total16 = 0;
    for (int64_t n : n16) total16 += n;
    if (c.chunk16 < 32 || c.chunk16 % 32 != 0) fail(what, blocks, "chunk16 " + std::to_string(c.chunk16));
    if (c.first_chunk[0] != 0) fail(what, blocks, "first_chunk[0] " + std::to_string(c.first_chunk[0]));
    for (int p = 0; p < P; ++p) {
        // Chunks [first_chunk[p], first_chunk[p + 1]) of chunk16 words cover projection p's n16[p] words: the last one
        // holds at least one word, and together they reach the end.
        const int64_t count = c.first_chunk[p + 1] - c.first_chunk[p];
        if (count < 1 || (count - 1) * c.chunk16 >= n16[p] || count * c.chunk16 < n16[p])
            fail(what, blocks,
                 "projection " + std::to_string(p) + ": " + std::to_string(count) + " chunks of " +
                     std::to_string(c.chunk16) + " words for " + std::to_string(n16[p]));
    }
    const int chunks = c.first_chunk[P];
    if (blocks >= P && chunks > blocks)
        fail(what, blocks, std::to_string(chunks) + " chunks: some block copies two of one expert");
    // A block's words: its share of blocks - (P - 1), in whole lines.
    const int64_t shares = blocks - (P - 1) > 1 ? blocks - (P - 1) : 1;
    if (c.chunk16 >= (total16 + shares - 1) / shares + 32 && c.chunk16 > 32)
        fail(what, blocks, "chunk16 " + std::to_string(c.chunk16) + " above the share of " + std::to_string(total16));
}

}  // namespace

int main() {
    struct Shape {
        std::string name;
        std::vector<int64_t> n16;
    };
    std::vector<Shape> shapes = {
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
    for (const Shape& s : shapes)
        for (int blocks = 1; blocks <= 300; ++blocks) check(s.name, s.n16, blocks);
    // The case that showed on the H200: 32 blocks a rank, FP8 weights and scales of H=7168 F=2048 in 32 chunks.
    const std::vector<int64_t> pair = fp8_pair(7168, 2048);
    const PrefetchChunks c = prefetch_chunks(pair.data(), 2, 32);
    if (c.first_chunk[2] != 32 || c.chunk16 != 30528)
        fail("fp8 + scales H=7168 F=2048", 32,
             std::to_string(c.first_chunk[2]) + " chunks of " + std::to_string(c.chunk16) + " words, want 32 of 30528");
    if (failures != 0) {
        std::fprintf(stderr, "%d failed checks. Reproduce: build-cuda/tests/gpu/prefetch_chunks_main\n", failures);
        return 1;
    }
    std::printf("prefetch chunks: %zu shapes x 300 grids, every check passed\n", shapes.size());
    return 0;
}
