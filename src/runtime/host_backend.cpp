// The CPU backend of Buffer and ExpertPools (runtime/backend.hpp): every op runs its host twin (src/host) on the
// calling thread, inside the object's CollectiveGuard, and has finished when it returns. It ignores streams and SM
// budgets.
#include <memory>
#include <vector>

#include "host/op_stats.hpp"
#include "runtime/backend.hpp"
#include "runtime/host_plan.hpp"
#include "runtime/plan_data.hpp"

namespace flatep::runtime {

namespace {

// What both host backends share: no device record; the status words are plain host memory.
template <class Base>
class HostOps : public Base {
  public:
    explicit HostOps(CollectiveGuard* guard, host::OpStats* const* stats = nullptr) : guard_(guard), stats_(stats) {}
    bool on_device() const override { return false; }
    int default_num_sms() const override { return 0; }
    std::string failure_message() const override { return ""; }
    int32_t failure_code() const override { return 0; }
    bool take_status(int32_t*, int32_t*, const Launch&) override { return false; }
    void read_status(int32_t words[4], const int32_t* status, const Launch&) override {
        for (int i = 0; i < 4; ++i) words[i] = status[i];
    }
    void clear_status(int32_t* status, const Launch&) override {
        for (int i = 0; i < 4; ++i) status[i] = 0;
    }
    void fill_sync(sync::SyncArgs&) const override {}
    void synchronize() override {}
    void watch_site(const CollectiveSite& site) override { guard_->set_site(site); }

  protected:
    // Runs a collective host op: a wait that fails inside it poisons the object (CollectiveGuard::run).
    template <typename Body>
    void collective(const sync::SyncArgs& sync, Body&& body) {
        guard_->run(sync.status, body);
    }
    // The op's twin (ops/<op>_args.hpp), given the object's counters where it takes them.
    template <class Args>
    void twin(const Args& args) {
        if constexpr (requires(host::OpStats * stats) { host::run(args, stats); })
            host::run(args, stats_ != nullptr ? *stats_ : nullptr);
        else
            host::run(args);
    }

  private:
    CollectiveGuard* guard_;
    host::OpStats* const* stats_;  // the Buffer's optional counters (null for ExpertPools)
};

// The overrides of the ops of runtime/op_list.hpp: the twin, a collective one inside collective().
#define FLATEP_HOST_OP_collective(method, Args)       \
    void method(Args& args, const Launch&) override { \
        collective(args.sync, [&] { twin(args); });   \
    }
#define FLATEP_HOST_OP_local(method, Args) \
    void method(const Args& args, const Launch&) override { twin(args); }
#define FLATEP_HOST_OP(method, Args, kind) FLATEP_HOST_OP_##kind(method, Args)

class HostBufferBackend final : public HostOps<BufferBackend> {
  public:
    explicit HostBufferBackend(const BufferSite& site) : HostOps(site.guard, site.stats) {}

    void plan(PlanArgs& args, Plan::Data& data, int32_t* storage, const Launch&) override {
        FLATEP_CHECK(storage == nullptr, "plan: plan_storage is for device Buffers; this one is on the host");
        args.plan = data.host.view;
        collective(args.sync, [&] { run_host_plan(args); });
        data.host.view.header[kHeaderGenerationLo] = int32_t(uint32_t(data.generation));
        data.host.view.header[kHeaderGenerationHi] = int32_t(uint32_t(data.generation >> 32));
    }
    FLATEP_HOST_OP(dispatch, DispatchArgs, collective)
    FLATEP_BUFFER_OPS(FLATEP_HOST_OP)
    const int32_t* store_placement(const std::vector<int32_t>& table, const Launch&) override {
        placement_ = table;  // the same size every time: the same storage (ops run synchronously, none in flight)
        return placement_.data();
    }

  private:
    std::vector<int32_t> placement_;
};

class HostPoolsBackend final : public HostOps<PoolsBackend> {
  public:
    using HostOps::HostOps;
    FLATEP_POOLS_OPS(FLATEP_HOST_OP)
};

}  // namespace

std::unique_ptr<BufferBackend> make_host_buffer_backend(const BufferSite& site) {
    return std::make_unique<HostBufferBackend>(site);
}

std::unique_ptr<PoolsBackend> make_host_pools_backend(CollectiveGuard* guard) {
    return std::make_unique<HostPoolsBackend>(guard);
}

}  // namespace flatep::runtime
