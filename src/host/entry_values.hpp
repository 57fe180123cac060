// CPU twin of entry_values: the reverse path of one fp32 value per receive row.
#pragma once

#include "ops/entry_values_args.hpp"

namespace flatep::host {

// Runs rank args.rank's part; collective.
//   barrier; destination side: copy row_values of this rank's real rows into its symmetric recv_w region;
//   barrier; source side: out[t*K+k] = the value at entry (t,k)'s row on its destination rank (0 for an entry
//   whose expert id was invalid).
void entry_values(const EntryValuesArgs& args);

}  // namespace flatep::host
