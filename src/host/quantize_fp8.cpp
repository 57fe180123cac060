// flatep::quantize_fp8_rows (include/flatep/fp8.hpp): the design §6 rule over host rows, the one the CPU backend
// applies inside dispatch_fp8.
#include "flatep/fp8.hpp"

#include "common/check.hpp"
#include "common/fp8.hpp"

namespace flatep {

void quantize_fp8_rows(const uint16_t* x, int64_t rows, int hidden, Fp8Scale mode, uint8_t* q, float* scales) {
    FLATEP_CHECK(hidden > 0 && hidden % kFp8BlockSize == 0,
                 "quantize_fp8_rows: hidden (H) must be a positive multiple of ", kFp8BlockSize, " (one scale per ",
                 kFp8BlockSize, " channels), got H=", hidden);
    FLATEP_CHECK(rows >= 0, "quantize_fp8_rows: rows must be >= 0, got ", rows);
    FLATEP_CHECK(mode == Fp8Scale::kFloat || mode == Fp8Scale::kUe8m0,
                 "quantize_fp8_rows: mode must be Fp8Scale::kFloat (0) or kUe8m0 (1), got ", int(mode));
    FLATEP_CHECK(rows == 0 || (x != nullptr && q != nullptr && scales != nullptr),
                 "quantize_fp8_rows: x, q and scales must be set");
    const int num_blocks = hidden / kFp8BlockSize;
    for (int64_t r = 0; r < rows; ++r) {
        fp8::quantize_row(x + r * hidden, num_blocks, mode, q + r * hidden, scales + r * num_blocks);
    }
}

}  // namespace flatep
