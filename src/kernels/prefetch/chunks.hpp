// Host and device, plain C++ (no device code, so a test without a GPU includes it): how the push prefetch (training's)
// cuts an expert's words of every projection into chunks, one a block, and how serving's pull cuts its filled slots'
// words, one stream, over the grid (prefetch.cu applies both; tests/unit/kernels holds them to their contract).
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "common/math.hpp"
#include "ops/prefetch_args.hpp"

namespace flatep::kernels {

// An expert's words (16 bytes each) of all projections cut into chunks of chunk16 words, each projection's last one
// shorter: projection p holds the chunks [first_chunk[p], first_chunk[p + 1]) of an expert's first_chunk[P].
struct PrefetchChunks {
    int64_t chunk16;
    int32_t first_chunk[kMaxPrefetchProjections + 1];
};

// The chunks of a grid of `blocks`: chunk16 an expert's share (all projections) of one block, in whole 512-byte lines
// (32 words), so that every block copies about the same number of words whatever the number of experts. Each
// projection's shorter last chunk can add one chunk, up to P - 1 more than total16 / chunk16 (the sum over p of
// ceil(n16[p] / chunk16) is below total16 / chunk16 + P), so chunk16 is sized for blocks - (P - 1) shares: then an
// expert's chunks number at most `blocks` whenever blocks >= P. Sized for `blocks` shares, FP8 weights and their
// scales made 33 chunks for 32 blocks and one block copied two, a third more time for the op on 8 virtual ranks of
// an H200 (seen in the pull, which then used these chunks too). n16: words of one expert per projection;
// num_projections in [1, kMaxPrefetchProjections]; blocks >= 1.
inline PrefetchChunks prefetch_chunks(const int64_t* n16, int num_projections, int blocks) {
    PrefetchChunks c{};
    int64_t total16 = 0;
    for (int p = 0; p < num_projections; ++p) total16 += n16[p];
    const int64_t shares = max_of<int64_t>(1, int64_t(blocks) - (num_projections - 1));
    c.chunk16 = max_of<int64_t>(32, round_up<int64_t>(ceil_div<int64_t>(total16, shares), 32));
    for (int p = 0; p < num_projections; ++p)
        c.first_chunk[p + 1] = c.first_chunk[p] + int32_t(ceil_div<int64_t>(n16[p], c.chunk16));
    return c;
}

// The pull's share of block `block` of a grid of `blocks` (kernels/prefetch/prefetch.cu): the words [begin, end) of
// a stream of `words` 16-byte words (its filled slots, all projections one after the other), cut evenly over the
// grid in whole 512-byte lines (32 words): the blocks' ranges follow each other and together cover the stream once.
struct WordRange {
    int64_t begin, end;
};
FLATEP_HD WordRange pull_block_words(int64_t words, int64_t block, int64_t blocks) {
    const int64_t lines = ceil_div<int64_t>(words, 32);
    return WordRange{lines * block / blocks * 32, min_of<int64_t>(lines * (block + 1) / blocks * 32, words)};
}

}  // namespace flatep::kernels
