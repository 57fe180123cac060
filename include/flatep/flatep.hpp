// FlatEP public C++ API (torch-free). See docs/design.md for the contract.
#pragma once

#include "flatep/buffer.hpp"
#include "flatep/config.hpp"
#include "flatep/device.hpp"
#include "flatep/error.hpp"
#include "flatep/expert_pools.hpp"
#include "flatep/ffn.hpp"
#include "flatep/launch.hpp"
#include "flatep/transport.hpp"
#include "flatep/types.hpp"
