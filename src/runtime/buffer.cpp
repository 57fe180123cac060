#include "flatep/buffer.hpp"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/check.hpp"
#include "common/env.hpp"
#include "common/log.hpp"
#include "layout/invariants.hpp"
#include "layout/layout.hpp"
#include "ops/plan_args.hpp"
#include "runtime/backend.hpp"
#include "runtime/collective_guard.hpp"
#include "runtime/internal.hpp"
#include "runtime/launch.hpp"
#include "runtime/placement.hpp"
#include "runtime/plan_data.hpp"
#include "sync/barrier_host.hpp"
#include "sync/sync.hpp"

namespace flatep {

namespace {

std::atomic<uint64_t> next_buffer_id{1};

// What every rank publishes at construction: its config and planner (both trivially copyable).
struct ConfigBlob {
    Config config;
    PlannerKind planner;
    int32_t num_slots, view_stride;  // B and Q of the groups (the pools' for a Buffer made from pools)
};

sync::SyncArgs make_sync(const SymmetricRegion& region, const SymmetricLayout& sym, uint64_t* epoch, int rank,
                         int num_ranks, double timeout_s) {
    sync::SyncArgs s{};
    for (int p = 0; p < num_ranks; ++p) s.flags[p] = region_at<uint64_t>(region.peers[p], sym.barrier_offset);
    s.epoch = epoch;
    s.status = region_at<int32_t>(region.local, sym.status_offset);
    s.rank = rank;
    s.num_ranks = num_ranks;
    s.timeout_s = timeout_s;
    return s;
}

}  // namespace

// ---- Plan ----

const Plan::Data& Plan::data() const {
    FLATEP_CHECK(data_ != nullptr, "plan is empty (default-constructed); get one from Buffer::plan()");
    return *data_;
}
uint64_t Plan::generation() const { return data().generation; }
uint64_t Plan::buffer_id() const { return data().buffer_id; }
int Plan::rank() const { return data().rank; }
int Plan::num_tokens() const { return data().num_tokens; }
PlannerKind Plan::planner() const { return data().planner; }
bool Plan::on_device() const { return data().on_device(); }

const int32_t* Plan::device_cu_seqlens(int rank) const {
    const Data& d = data();
    FLATEP_CHECK(d.on_device(), "device_cu_seqlens: the plan is in host memory (CPU backend)");
    d.check_fresh("device_cu_seqlens");
    FLATEP_CHECK(rank >= 0 && rank < d.host.layout.num_ranks, "device_cu_seqlens: rank must be in [0, ",
                 d.host.layout.num_ranks, "), got ", rank);
    return d.device_view.cu_seqlens + int64_t(rank) * d.host.layout.num_groups();
}
const int32_t* Plan::device_slot_expert(int rank) const {
    const Data& d = data();
    FLATEP_CHECK(d.on_device(), "device_slot_expert: the plan is in host memory (CPU backend)");
    d.check_fresh("device_slot_expert");
    FLATEP_CHECK(rank >= 0 && rank < d.host.layout.num_ranks, "device_slot_expert: rank must be in [0, ",
                 d.host.layout.num_ranks, "), got ", rank);
    return d.device_view.slot_expert + int64_t(rank) * d.host.layout.experts_per_rank;
}

std::span<const int32_t> Plan::tpe_all() const {
    const planner::HostPlan& h = data().host_plan();
    return {h.view.tpe_all, size_t(h.layout.num_ranks) * h.layout.num_experts};
}
std::span<const int32_t> Plan::alloc() const {
    const planner::HostPlan& h = data().host_plan();
    return {h.view.alloc, size_t(h.layout.num_ranks) * h.layout.num_experts};
}
std::span<const int32_t> Plan::slot_expert(int rank) const {
    const planner::HostPlan& h = data().host_plan();
    FLATEP_CHECK(rank >= 0 && rank < h.layout.num_ranks, "slot_expert: rank must be in [0, ", h.layout.num_ranks,
                 "), got ", rank);
    const int epn = h.layout.experts_per_rank;
    return {h.view.slot_expert + int64_t(rank) * epn, size_t(epn)};
}
std::span<const int32_t> Plan::cu_seqlens(int rank) const {
    const planner::HostPlan& h = data().host_plan();
    FLATEP_CHECK(rank >= 0 && rank < h.layout.num_ranks, "cu_seqlens: rank must be in [0, ", h.layout.num_ranks,
                 "), got ", rank);
    const int groups = h.layout.num_groups();
    return {h.view.cu_seqlens + int64_t(rank) * groups, size_t(groups)};
}
const PlanStats& Plan::stats() const { return *data().host_plan().view.stats; }
std::span<const int32_t> Plan::entry_ranks() const {
    const planner::HostPlan& h = data().host_plan();
    return {h.view.entry_rank, size_t(num_tokens()) * h.layout.topk};
}
std::span<const int32_t> Plan::entry_rows() const {
    const planner::HostPlan& h = data().host_plan();
    return {h.view.entry_row, size_t(num_tokens()) * h.layout.topk};
}
std::span<const int32_t> Plan::row_heads() const {
    const planner::HostPlan& h = data().host_plan();
    return {h.view.row_head, size_t(h.layout.num_recv_rows)};
}
std::span<const int32_t> Plan::row_nexts() const {
    const planner::HostPlan& h = data().host_plan();
    return {h.view.row_next, size_t(h.layout.num_recv_rows)};
}

// ---- Buffer ----

// The Buffer's state and its ops (include/flatep/buffer.hpp documents each); Buffer forwards to it.
struct Buffer::Impl {
    Impl(const Config& config, std::shared_ptr<Transport> transport, PlannerKind planner, int num_plan_slots,
         const ViewShape& view);
    ~Impl();  // releases the symmetric buffer; never throws

    Plan plan(const void* topk_idx, int index_bytes, int num_tokens, int32_t* plan_storage, const Launch& launch);
    void dispatch(const Plan& plan, const uint16_t* x, const float* topk_weights, uint16_t* recv_x, float* recv_w,
                  const Launch& launch);
    void dispatch_fp8(const Plan& plan, const uint16_t* x_bf16, const uint8_t* x_fp8, const float* x_scales,
                      const float* topk_weights, uint8_t* recv_x, float* recv_scales, float* recv_w,
                      Fp8Scale scale_mode, const Launch& launch);
    void combine(const Plan& plan, const uint16_t* y, const float* weights, uint16_t* out, const Launch& launch);
    void combine_grad(const Plan& plan, const uint16_t* rows, const uint16_t* y, const float* weights, uint16_t* grad_y,
                      float* grad_weights, const Launch& launch);
    void entry_values(const Plan& plan, const float* row_values, float* out, const Launch& launch);
    void check_status(const Launch& launch);
    bool poisoned() const;
    bool on_device() const;
    void set_num_sms(int num_sms);
    int64_t plan_words() const;
    uint16_t* symmetric_recv_x();
    float* symmetric_recv_w();
    uint8_t* symmetric_recv_x_fp8();
    float* symmetric_recv_scales();

    void check_plan(const Plan& plan, const char* op) const;
    // The call's launch with its budget resolved (after refusing an option the op does not take).
    Launch enter(const char* op, const Launch& launch, bool takes_plan_ordered = false);
    [[noreturn]] void throw_status(const int32_t words[4]) const;  // the error the status words hold
    void after_op(const Launch& launch);
    template <typename Args>
    Args op_args(const Plan& plan);  // the fields every data-plane op's Args share

    Config config_;
    std::unique_ptr<Layout> layout_;
    std::shared_ptr<Transport> transport_;
    PlannerKind planner_;
    uint64_t id_;
    uint64_t generation_ = 0;
    SymmetricRegion region_;
    uint64_t epoch_ = 0;
    bool debug_ = false;
    host::OpStats* op_stats_ = nullptr;  // optional counters of the CPU backend's ops (tests; the internal API)
    int num_sms_ = 0;
    std::unique_ptr<CollectiveGuard> guard_;
    double timeout_s_ = 0;  // the transport's timeout when this Buffer was built: every op's waits
    int num_plan_slots_ = 0;
    std::unique_ptr<runtime::BufferBackend> backend_;
    std::unique_ptr<runtime::PlacementState> placement_;  // the static planner's (set_placement)
};

namespace {
// The view shape of a Buffer made from `pools` (its config validated first, so that E / R means something).
ViewShape view_of(const Config& config, PlannerKind planner, const ExpertPools& pools) {
    config.validate(planner);
    FLATEP_CHECK(config.num_experts / config.num_ranks == pools.experts_per_rank(),
                 "Buffer: the config has E/R = ", config.num_experts, "/", config.num_ranks, " = ",
                 config.num_experts / config.num_ranks,
                 " experts per rank but the pools have experts_per_rank=", pools.experts_per_rank());
    return ViewShape{pools.num_slots(), pools.view_stride()};
}
}  // namespace

Buffer::Buffer(const Config& config, std::shared_ptr<Transport> transport, PlannerKind planner, int num_plan_slots)
    : impl_(std::make_unique<Impl>(config, std::move(transport), planner, num_plan_slots, ViewShape{})) {}
Buffer::Buffer(const Config& config, const ExpertPools& pools, PlannerKind planner, int num_plan_slots)
    : impl_(std::make_unique<Impl>(config, internal::transport(pools), planner, num_plan_slots,
                                   view_of(config, planner, pools))) {}
Buffer::Buffer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Buffer::~Buffer() = default;

Plan Buffer::plan(const void* topk_idx, int index_bytes, int num_tokens, int32_t* plan_storage, const Launch& launch) {
    return impl_->plan(topk_idx, index_bytes, num_tokens, plan_storage, launch);
}
void Buffer::dispatch(const Plan& plan, const uint16_t* x, const float* topk_weights, uint16_t* recv_x, float* recv_w,
                      const Launch& launch) {
    impl_->dispatch(plan, x, topk_weights, recv_x, recv_w, launch);
}
void Buffer::dispatch_fp8(const Plan& plan, const uint16_t* x_bf16, const uint8_t* x_fp8, const float* x_scales,
                          const float* topk_weights, uint8_t* recv_x, float* recv_scales, float* recv_w,
                          Fp8Scale scale_mode, const Launch& launch) {
    impl_->dispatch_fp8(plan, x_bf16, x_fp8, x_scales, topk_weights, recv_x, recv_scales, recv_w, scale_mode, launch);
}
void Buffer::combine(const Plan& plan, const uint16_t* y, const float* weights, uint16_t* out, const Launch& launch) {
    impl_->combine(plan, y, weights, out, launch);
}
void Buffer::combine_grad(const Plan& plan, const uint16_t* rows, const uint16_t* y, const float* weights,
                          uint16_t* grad_y, float* grad_weights, const Launch& launch) {
    impl_->combine_grad(plan, rows, y, weights, grad_y, grad_weights, launch);
}
void Buffer::entry_values(const Plan& plan, const float* row_values, float* out, const Launch& launch) {
    impl_->entry_values(plan, row_values, out, launch);
}
void Buffer::check_status(const Launch& launch) { impl_->check_status(launch); }
bool Buffer::poisoned() const { return impl_->poisoned(); }
const Config& Buffer::config() const { return impl_->config_; }
PlannerKind Buffer::planner() const { return impl_->planner_; }
uint64_t Buffer::id() const { return impl_->id_; }
uint64_t Buffer::generation() const { return impl_->generation_; }
Transport& Buffer::transport() { return *impl_->transport_; }
int Buffer::experts_per_rank() const { return impl_->layout_->experts_per_rank; }
int Buffer::num_recv_rows() const { return impl_->layout_->num_recv_rows; }
int Buffer::num_groups() const { return impl_->layout_->num_groups(); }
int Buffer::capacity() const { return impl_->layout_->capacity; }
int Buffer::num_slots() const { return impl_->layout_->num_slots; }
int Buffer::view_stride() const { return impl_->layout_->view_stride; }
bool Buffer::serving() const { return impl_->layout_->serving; }
bool Buffer::on_device() const { return impl_->on_device(); }
int Buffer::num_sms() const { return impl_->num_sms_; }
void Buffer::set_num_sms(int num_sms) { impl_->set_num_sms(num_sms); }
int64_t Buffer::plan_words() const { return impl_->plan_words(); }
int Buffer::num_plan_slots() const { return impl_->num_plan_slots_; }
uint16_t* Buffer::symmetric_recv_x() { return impl_->symmetric_recv_x(); }
float* Buffer::symmetric_recv_w() { return impl_->symmetric_recv_w(); }
uint8_t* Buffer::symmetric_recv_x_fp8() { return impl_->symmetric_recv_x_fp8(); }
float* Buffer::symmetric_recv_scales() { return impl_->symmetric_recv_scales(); }
void Buffer::set_placement(std::span<const int32_t> placement, const Launch& launch) {
    const Launch run = impl_->enter("set_placement", launch);
    runtime::set_placement(*impl_->placement_, *impl_->layout_, impl_->planner_, *impl_->transport_, *impl_->backend_,
                           placement, run);
    impl_->after_op(run);
}
std::span<const int32_t> Buffer::placement() const { return runtime::placement_of(*impl_->placement_); }
uint64_t Buffer::placement_epoch() const { return impl_->placement_->epoch; }

// The internal API (runtime/internal.hpp).
namespace internal {
const Layout& layout(const Buffer& buffer) { return *buffer.impl().layout_; }
const Layout& layout(const Plan& plan) { return plan.data().host.layout; }
const planner::HostPlan& host_plan(const Plan& plan) { return plan.data().host_plan(); }
void set_op_stats(Buffer& buffer, host::OpStats* stats) { buffer.impl().op_stats_ = stats; }
std::unique_ptr<Buffer> make_buffer(const Config& config, std::shared_ptr<Transport> transport, PlannerKind planner,
                                    const ViewShape& view, int num_plan_slots) {
    return std::make_unique<Buffer>(
        std::make_unique<Buffer::Impl>(config, std::move(transport), planner, num_plan_slots, view));
}
}  // namespace internal

Buffer::Impl::Impl(const Config& config, std::shared_ptr<Transport> transport, PlannerKind planner, int num_plan_slots,
                   const ViewShape& view)
    : config_(config),
      transport_(std::move(transport)),
      planner_(planner),
      id_(next_buffer_id++),
      guard_(std::make_unique<CollectiveGuard>("Buffer")),
      num_plan_slots_(num_plan_slots),
      placement_(std::make_unique<runtime::PlacementState>()) {
    // Validate everything before allocating anything.
    FLATEP_CHECK(planner == PlannerKind::kGreedy || planner == PlannerKind::kBalanced ||
                     planner == PlannerKind::kOwner || planner == PlannerKind::kStatic,
                 "Buffer: unknown planner kind ", int(planner));
    layout_ = std::make_unique<Layout>(make_layout(config_, planner, view));  // the owner planner's capacity is R*S*K
    FLATEP_CHECK(num_plan_slots >= 0 && num_plan_slots <= 1024, "Buffer: num_plan_slots must be in [0, 1024], got ",
                 num_plan_slots);
    FLATEP_CHECK(transport_ != nullptr, "Buffer: transport is null");
    timeout_s_ = transport_->timeout_s();  // this Buffer's bound, whatever later objects set on the shared transport
    FLATEP_CHECK(transport_->num_ranks() == config_.num_ranks, "Buffer: config.num_ranks (", config_.num_ranks,
                 ") differs from the transport's (", transport_->num_ranks(), ")");
    FLATEP_CHECK(transport_->rank() == config_.rank, "Buffer: config.rank (", config_.rank,
                 ") differs from the transport's rank (", transport_->rank(), ")");

    // Every rank must agree on the config: compare against every peer so that every rank throws.
    ConfigBlob mine;
    std::memset(static_cast<void*>(&mine), 0, sizeof(mine));  // no uninitialised padding bytes on the wire
    mine.config = config_;
    mine.planner = planner_;
    mine.num_slots = layout_->num_slots;
    mine.view_stride = layout_->view_stride;
    const std::vector<std::string> blobs =
        transport_->bootstrap().all_gather(std::string(reinterpret_cast<const char*>(&mine), sizeof(mine)));
    for (int p = 0; p < config_.num_ranks; ++p) {
        FLATEP_CHECK_RUNTIME(blobs[p].size() == sizeof(ConfigBlob), "Buffer: rank ", p, " sent a config of ",
                             blobs[p].size(), " bytes, expected ", sizeof(ConfigBlob));
        ConfigBlob theirs;
        std::memcpy(&theirs, blobs[p].data(), sizeof(theirs));
        const std::string diff = config_.mismatch(theirs.config);
        if (!diff.empty()) FLATEP_THROW(ErrorCategory::kMismatch, "config mismatch with rank ", p, ": ", diff);
        if (theirs.planner != planner_) {
            FLATEP_THROW(ErrorCategory::kMismatch, "config mismatch with rank ", p,
                         ": planner: ", planner_name(planner_), " vs ", planner_name(theirs.planner));
        }
        if (theirs.num_slots != mine.num_slots || theirs.view_stride != mine.view_stride) {
            FLATEP_THROW(ErrorCategory::kMismatch, "config mismatch with rank ", p,
                         ": num_slots, view_stride: ", mine.num_slots, ", ", mine.view_stride, " vs ", theirs.num_slots,
                         ", ", theirs.view_stride);
        }
        if (theirs.config.rank != p) {
            FLATEP_THROW(ErrorCategory::kMismatch, "config mismatch with rank ", p, ": rank: that rank's config says ",
                         theirs.config.rank);
        }
    }

    runtime::BufferSite site{layout_.get(), transport_, guard_.get(), &op_stats_, num_plan_slots_, plan_words()};
    backend_ = runtime::make_buffer_backend(site);
    num_sms_ = backend_->default_num_sms();
    region_ = transport_->allocate(size_t(make_symmetric_layout(*layout_).total_bytes));
    FLATEP_CHECK_INVARIANT("Buffer", symmetric_layout_violation(*layout_, int64_t(region_.bytes)));
    FLATEP_CHECK_INVARIANT("Buffer", plan_sizes_violation(*layout_, plan_words()));
    const int64_t at = make_symmetric_layout(*layout_).barrier_offset;
    backend_->watch_site({transport_.get(), reinterpret_cast<const uint64_t*>(region_.local + at), &epoch_});
    // Every rank's zero fill of the region (on the device: the legacy stream, which the ops' streams do not wait for)
    // is complete before any rank's op writes into it.
    backend_->synchronize();
    transport_->bootstrap().all_gather(std::string());
    debug_ = env::debug();
}

Buffer::Impl::~Impl() {
    guard_->set_site({});  // before the flags go
    backend_.reset();      // frees its device state on the transport's GPU (runtime/device_backend.cpp)
    if (transport_ != nullptr) transport_->release(region_);
}

bool Buffer::Impl::on_device() const { return backend_->on_device(); }

uint16_t* Buffer::Impl::symmetric_recv_x() {
    return region_at<uint16_t>(region_.local, make_symmetric_layout(*layout_).recv_x_offset);
}
float* Buffer::Impl::symmetric_recv_w() {
    return region_at<float>(region_.local, make_symmetric_layout(*layout_).recv_w_offset);
}

uint8_t* Buffer::Impl::symmetric_recv_x_fp8() {
    return region_.local + fp8_recv_x_offset(make_symmetric_layout(*layout_));
}
float* Buffer::Impl::symmetric_recv_scales() {
    return region_at<float>(region_.local, fp8_recv_scales_offset(*layout_, make_symmetric_layout(*layout_)));
}

int64_t Buffer::Impl::plan_words() const { return make_plan_sizes(*layout_).total_words; }

bool Buffer::Impl::poisoned() const { return guard_->poisoned(); }

void Buffer::Impl::set_num_sms(int num_sms) { num_sms_ = env::check_num_sms("Buffer", num_sms); }

Launch Buffer::Impl::enter(const char* op, const Launch& launch, bool takes_plan_ordered) {
    const Launch resolved = runtime::resolve_launch(
        op, launch, num_sms_, takes_plan_ordered ? runtime::Takes::kPlanOrdered : runtime::Takes::kNoOption);
    guard_->enter(op, backend_->failure_message(), backend_->failure_code());
    int32_t words[4];
    int32_t* status = region_at<int32_t>(region_.local, make_symmetric_layout(*layout_).status_offset);
    if (backend_->take_status(words, status, resolved)) throw_status(words);  // an earlier op's error (a bad id)
    return resolved;
}

void Buffer::Impl::check_plan(const Plan& plan, const char* op) const {
    FLATEP_CHECK(!plan.empty(), op, ": plan is empty (default-constructed); get one from Buffer::plan()");
    if (plan.buffer_id() != id_) {
        FLATEP_THROW(ErrorCategory::kMismatch, op, ": plan was made by buffer ", plan.buffer_id(),
                     ", not by this buffer (", id_, ")");
    }
    plan.data().check_fresh(op);
}

template <typename Args>
Args Buffer::Impl::op_args(const Plan& plan) {
    const Layout& l = *layout_;
    Args args{};
    args.layout = l;
    args.rank = config_.rank;
    args.plan = plan.data().op_view();
    for (int p = 0; p < l.num_ranks; ++p) args.peers[p] = region_.peers[p];
    args.sync = make_sync(region_, make_symmetric_layout(l), &epoch_, config_.rank, l.num_ranks, timeout_s_);
    args.sync.step = plan.generation();
    backend_->fill_sync(args.sync);
    return args;
}

Plan Buffer::Impl::plan(const void* topk_idx, int index_bytes, int num_tokens, int32_t* plan_storage,
                        const Launch& launch) {
    const Launch run = enter("plan", launch);
    const Layout& l = *layout_;
    PlanArgs args{};
    args.layout = l;
    args.rank = config_.rank;
    args.num_tokens = num_tokens;
    args.topk_idx = topk_idx;
    args.index_bytes = index_bytes;
    args.planner = planner_;
    args.placement = placement_->table;  // the static planner's (null before set_placement)
    for (int p = 0; p < l.num_ranks; ++p) args.peers[p] = region_.peers[p];
    check_plan_args(args);  // before anything is allocated

    auto data = std::make_shared<Plan::Data>(l);
    data->generation = ++generation_;
    data->buffer_id = id_;
    data->rank = config_.rank;
    data->num_tokens = num_tokens;
    data->planner = planner_;
    data->placement = placement_->slots;
    data->placement_epoch = placement_->epoch;
    args.sync = make_sync(region_, make_symmetric_layout(l), &epoch_, config_.rank, l.num_ranks, timeout_s_);
    args.sync.step = data->generation;
    backend_->plan(args, *data, plan_storage, run);
    after_op(run);
    return Plan(std::move(data));
}

void Buffer::Impl::dispatch(const Plan& plan, const uint16_t* x, const float* topk_weights, uint16_t* recv_x,
                            float* recv_w, const Launch& launch) {
    const Launch run = enter("dispatch", launch, true);
    check_plan(plan, "dispatch");
    auto args = op_args<DispatchArgs>(plan);
    args.x = x;
    args.topk_weights = topk_weights;
    args.recv_x = recv_x;
    args.recv_w = recv_w;
    args.plan_ordered = run.options.plan_ordered;
    check_dispatch_args(args, plan.num_tokens());
    backend_->dispatch(args, run);
    after_op(run);
}

void Buffer::Impl::dispatch_fp8(const Plan& plan, const uint16_t* x_bf16, const uint8_t* x_fp8, const float* x_scales,
                                const float* topk_weights, uint8_t* recv_x, float* recv_scales, float* recv_w,
                                Fp8Scale scale_mode, const Launch& launch) {
    const Launch run = enter("dispatch_fp8", launch, true);
    check_plan(plan, "dispatch_fp8");
    auto args = op_args<DispatchFp8Args>(plan);
    args.x_bf16 = x_bf16;
    args.x_fp8 = x_fp8;
    args.x_scales = x_scales;
    args.topk_weights = topk_weights;
    args.scale_mode = scale_mode;
    args.recv_x = recv_x;
    args.recv_scales = recv_scales;
    args.recv_w = recv_w;
    args.plan_ordered = run.options.plan_ordered;
    check_dispatch_fp8_args(args, plan.num_tokens());
    backend_->dispatch_fp8(args, run);
    after_op(run);
}

void Buffer::Impl::combine(const Plan& plan, const uint16_t* y, const float* weights, uint16_t* out,
                           const Launch& launch) {
    const Launch run = enter("combine", launch, true);
    check_plan(plan, "combine");
    auto args = op_args<CombineArgs>(plan);
    args.y = y;
    args.weights = weights;
    args.out = out;
    args.plan_ordered = run.options.plan_ordered;
    check_combine_args(args, plan.num_tokens());
    backend_->combine(args, run);
    after_op(run);
}

void Buffer::Impl::entry_values(const Plan& plan, const float* row_values, float* out, const Launch& launch) {
    const Launch run = enter("entry_values", launch);
    check_plan(plan, "entry_values");
    auto args = op_args<EntryValuesArgs>(plan);
    args.row_values = row_values;
    args.out = out;
    check_entry_values_args(args, plan.num_tokens());
    backend_->entry_values(args, run);
    after_op(run);
}

void Buffer::Impl::combine_grad(const Plan& plan, const uint16_t* rows, const uint16_t* y, const float* weights,
                                uint16_t* grad_y, float* grad_weights, const Launch& launch) {
    const Launch run = enter("combine_grad", launch);
    check_plan(plan, "combine_grad");
    CombineGradArgs args{};
    args.layout = *layout_;
    args.rank = config_.rank;
    args.plan = plan.data().op_view();
    args.rows = rows;
    args.y = y;
    args.weights = weights;
    args.grad_y = grad_y;
    args.grad_weights = grad_weights;
    check_combine_grad_args(args);
    backend_->combine_grad(args, run);
    after_op(run);
}

void Buffer::Impl::check_status(const Launch& launch) {
    runtime::check_options("check_status", launch.options, runtime::Takes::kNoOption);
    int32_t* status = region_at<int32_t>(region_.local, make_symmetric_layout(*layout_).status_offset);
    int32_t words[4];
    backend_->read_status(words, status, launch);  // device: a synchronising point, the record is complete now
    const std::string failure = backend_->failure_message();
    if (!failure.empty()) {
        FLATEP_THROW(sync::host::wait_failure_category(backend_->failure_code()), "rank ", config_.rank, ": ", failure);
    }
    if (words[sync::kStatusCode] == sync::kStatusOk) return;
    backend_->clear_status(status, launch);
    throw_status(words);
}

void Buffer::Impl::throw_status(const int32_t words[4]) const {
    const int32_t code = words[sync::kStatusCode];
    const int32_t index = words[sync::kStatusIndex], value = words[sync::kStatusValue], peer = words[sync::kStatusPeer];
    const int K = layout_->topk;
    switch (code) {
        case sync::kStatusBadExpert:
            // The status word holds int32: an int64 id beyond that range arrives clamped to INT32_MAX / INT32_MIN.
            FLATEP_THROW(ErrorCategory::kInvalidArgument, "rank ", config_.rank, ": invalid expert id ", value,
                         value == INT32_MAX ? " or above" : (value == INT32_MIN ? " or below" : ""),
                         " at topk_idx flat index ", index, " (token ", index / K, ", k ", index % K,
                         "); ids must be in [0, E=", layout_->num_experts, "); the entry was skipped");
        case sync::kStatusTimeout:
            FLATEP_THROW(ErrorCategory::kTimeout, "rank ", config_.rank, ": ", sync::op_name(sync::OpId(index)),
                         " timed out waiting for peer ", peer, " (flag ", value, ")");
        case sync::kStatusMismatch:
            FLATEP_THROW(ErrorCategory::kMismatch, "rank ", config_.rank, ": ", sync::op_name(sync::OpId(index)),
                         ": peer ", peer, " was in ", sync::op_name(sync::OpId(value)), " at the same barrier");
        case sync::kStatusPeerAborted:
            FLATEP_THROW(ErrorCategory::kRuntime, "rank ", config_.rank, ": ", sync::op_name(sync::OpId(index)),
                         ": peer ", peer, " failed an earlier wait and gave up");
        default:
            FLATEP_THROW(ErrorCategory::kRuntime, "rank ", config_.rank, ": unknown status code ", code);
    }
}

void Buffer::Impl::after_op(const Launch& launch) {
    if (debug_) check_status(launch);
}

}  // namespace flatep
