// Optional counters of the CPU backend's ops (tests use them to check dedup and traffic; null = not counted).
#pragma once

#include <cstdint>

namespace flatep::host {

struct OpStats {
    int64_t rows_pushed = 0;         // dispatch: bf16 rows a source wrote into a destination's symmetric recv_x
    int64_t rows_pushed_remote = 0;  // ... of which to a rank other than the source
    int64_t rows_fanned_out = 0;     // dispatch: local copies on the destination (duplicates and copy-out)
    int64_t partials_written = 0;    // combine: partial rows a destination wrote (one per chain)
    int64_t partials_pulled = 0;     // combine: partial rows a source read from destinations
    int64_t partials_pulled_remote = 0;
};

}  // namespace flatep::host
