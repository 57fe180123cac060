// CPU twin of ExpertPools' write_grads (contract in ops/write_grads_args.hpp).
#pragma once

#include "ops/write_grads_args.hpp"

namespace flatep::host {

// Local (not collective).
void write_grads(const WriteGradsArgs& args);

}  // namespace flatep::host
