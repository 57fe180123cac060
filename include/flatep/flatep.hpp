// FlatEP public C++ API (torch-free). See docs/design.md for the contract.
#pragma once

#include "flatep/config.hpp"
#include "flatep/error.hpp"
