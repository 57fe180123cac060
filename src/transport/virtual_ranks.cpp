// flatep::make_virtual_ranks and flatep::run_threads (include/flatep/ipc.hpp): R ranks as threads of one process,
// each with the ipc transport (same_process) over the in-process all-gather of LocalHostWorld.
#include <exception>
#include <thread>

#include "common/check.hpp"
#include "common/env.hpp"
#include "flatep/ipc.hpp"
#include "transport/local_host.hpp"

namespace flatep {

void run_threads(int num_ranks, const std::function<void(int rank)>& fn) {
    std::vector<std::exception_ptr> errors(static_cast<size_t>(num_ranks));
    std::vector<std::thread> threads;
    for (int r = 0; r < num_ranks; ++r) {
        threads.emplace_back([&, r] {
            try {
                fn(r);
            } catch (...) {
                errors[size_t(r)] = std::current_exception();
            }
        });
    }
    for (std::thread& t : threads) t.join();
    for (const std::exception_ptr& e : errors)
        if (e) std::rethrow_exception(e);
}

std::vector<std::shared_ptr<Transport>> make_virtual_ranks(int num_ranks, MemoryKind kind, double timeout_s,
                                                           const std::vector<int>& devices) {
    FLATEP_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, "virtual ranks: num_ranks must be in [1, ", kMaxRanks,
                 "], got ", num_ranks);
    const int D = int(devices.size());
    FLATEP_CHECK(D == 0 || (kind == MemoryKind::kDevice && D <= num_ranks && num_ranks % D == 0),
                 "virtual ranks: ", num_ranks, " ranks cannot be split evenly over ", D, " devices",
                 kind == MemoryKind::kHost ? " (host memory has none)" : "");
    FLATEP_CHECK(kind == MemoryKind::kHost || kind == MemoryKind::kDevice,
                 "virtual ranks: memory kind must be kHost (0) or kDevice (1), got ", int(kind));
    // 0: FLATEP_TIMEOUT_S; anything else checked as make_ipc_transport checks it.
    transport::LocalHostWorld world(num_ranks, env::resolve_timeout("virtual ranks", timeout_s));
    const std::vector<std::shared_ptr<Bootstrap>> bootstraps = world.bootstraps();
    std::vector<std::shared_ptr<Transport>> transports(static_cast<size_t>(num_ranks));
    run_threads(num_ranks, [&](int r) {
        const int device = D == 0 ? -1 : devices[size_t(r * D / num_ranks)];
        transports[size_t(r)] =
            make_ipc_transport(bootstraps[size_t(r)], kind, timeout_s, /*same_process=*/true, device);
    });
    return transports;
}

}  // namespace flatep
