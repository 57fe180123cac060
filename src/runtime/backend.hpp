// The backends of Buffer and ExpertPools: one object per Buffer / pools, chosen once at construction from the
// transport's memory kind (host memory: the CPU backend's host twins, each op synchronously on the calling thread;
// device memory: the CUDA kernels, each op enqueued on its launch's stream). The runtime fills an op's Args, checks
// them once (check_<op>_args, next to the Args in src/ops) and calls one method here: no runtime code tests a pointer
// or a memory kind to pick a backend. A backend trusts checked Args.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flatep/buffer.hpp"
#include "flatep/launch.hpp"
#include "flatep/transport.hpp"
#include "runtime/collective_guard.hpp"
#include "runtime/op_list.hpp"

namespace flatep {
namespace host {
struct OpStats;
}  // namespace host

namespace runtime {

// What every op of one object's backend shares: the failure record of its cross-rank waits and the status words.
class OpsBackend {
  public:
    virtual ~OpsBackend() = default;
    virtual bool on_device() const = 0;
    // The SM budget the object starts with (FLATEP_NUM_SMS on the device; 0 on the host, which ignores it).
    virtual int default_num_sms() const = 0;
    // The first failed cross-rank wait an earlier op recorded without a host synchronisation ("" and 0 when none;
    // always on the host, whose ops raise inside the failing call).
    virtual std::string failure_message() const = 0;
    virtual int32_t failure_code() const = 0;
    // Takes the status words (sync::StatusWord) an earlier op recorded without a synchronisation, if any: copies them
    // to `words`, clears both copies (`status`: this rank's words in its symmetric memory; the device's are zeroed on
    // the launch's stream) and returns true. Host: false (its ops report at once).
    virtual bool take_status(int32_t words[4], int32_t* status, const Launch& launch) = 0;
    // A synchronising read of the status words (diagnostics) and their reset.
    virtual void read_status(int32_t words[4], const int32_t* status, const Launch& launch) = 0;
    virtual void clear_status(int32_t* status, const Launch& launch) = 0;
    // Fills the backend's part of a collective op's sync::SyncArgs (device: epoch word, wait record, host-mapped
    // status).
    virtual void fill_sync(sync::SyncArgs& sync) const = 0;
    // Construction only: waits for all work of the backend's device (the zero fill of new regions runs outside the
    // ops' streams). A no-op on the host.
    virtual void synchronize() = 0;
    // Registers where the object's host barriers meet (CollectiveGuard::set_site: a host timeout then names what a
    // peer does in the rank's other objects). Device flags live in device memory, which the host does not read: a
    // no-op there.
    virtual void watch_site(const CollectiveSite& site) = 0;
};

// One op of the lists of runtime/op_list.hpp: `void method(Args&, const Launch&)` (local: const Args&).
#define FLATEP_OP_VIRTUAL(method, Args, kind) \
    virtual void method(FLATEP_OP_ARGS(Args, kind) args, const Launch& launch) = 0;

// A Buffer's ops. `launch`: the call's stream and its resolved SM budget (never -1).
class BufferBackend : public OpsBackend {
  public:
    // The plan op into `data` (host: data.host; device: `storage`, null for one of the Buffer's plan slots).
    virtual void plan(PlanArgs& args, Plan::Data& data, int32_t* storage, const Launch& launch) = 0;
    virtual void dispatch(DispatchArgs& args, const Launch& launch) = 0;
    FLATEP_BUFFER_OPS(FLATEP_OP_VIRTUAL)
    // The static planner's placement table (planner/static_placement.hpp) where the plan op reads it: the backend's
    // own memory, the same address for every call (host: a copy; device: device memory it fills on launch.stream, no
    // host synchronisation except a wait for the previous call's copy). Returns that address.
    virtual const int32_t* store_placement(const std::vector<int32_t>& table, const Launch& launch) = 0;
};

// What a Buffer's backend needs of it at construction.
struct BufferSite {
    const Layout* layout;
    std::shared_ptr<Transport> transport;
    CollectiveGuard* guard;       // host ops run inside guard->run (poisoning on a failed wait)
    host::OpStats* const* stats;  // the Buffer's optional counters of the CPU backend's ops
    int num_plan_slots;           // device plans the backend keeps itself
    int64_t plan_words;           // int32 words of one device plan
};

// The backend of the transport's memory kind (the one place that looks at it), and each kind's own factory (the
// device one throws in a build without CUDA).
std::unique_ptr<BufferBackend> make_buffer_backend(const BufferSite& site);
std::unique_ptr<BufferBackend> make_host_buffer_backend(const BufferSite& site);
std::unique_ptr<BufferBackend> make_device_buffer_backend(const BufferSite& site);

// An ExpertPools' ops.
class PoolsBackend : public OpsBackend {
  public:
    FLATEP_POOLS_OPS(FLATEP_OP_VIRTUAL)
};

#undef FLATEP_OP_VIRTUAL

std::unique_ptr<PoolsBackend> make_pools_backend(std::shared_ptr<Transport> transport, CollectiveGuard* guard);
std::unique_ptr<PoolsBackend> make_host_pools_backend(CollectiveGuard* guard);
std::unique_ptr<PoolsBackend> make_device_pools_backend(std::shared_ptr<Transport> transport);

}  // namespace runtime
}  // namespace flatep
