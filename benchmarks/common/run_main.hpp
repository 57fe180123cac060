// The entry of a driver's main: an exception (flatep::Error: a CUDA call that failed, a wait that timed out; or any
// std::exception) ends the program with "PROGRAM: error: what" on stderr and exit status 1, not std::terminate.
#pragma once

#include <cstdio>
#include <exception>

namespace flatep::bench {

template <class Body>
int run_main(const char* program, Body&& body) {
    try {
        return body();
    } catch (const std::exception& e) {
        std::fflush(stdout);
        std::fprintf(stderr, "%s: error: %s\n", program, e.what());
        return 1;
    }
}

}  // namespace flatep::bench
