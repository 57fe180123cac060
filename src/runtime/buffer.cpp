#include "flatep/buffer.hpp"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/check.hpp"
#include "common/env.hpp"
#include "common/log.hpp"
#include "host/combine.hpp"
#include "host/combine_grad.hpp"
#include "host/dispatch.hpp"
#include "host/dispatch_fp8.hpp"
#include "host/entry_values.hpp"
#include "layout/layout.hpp"
#include "ops/plan_args.hpp"
#include "runtime/collective_guard.hpp"
#include "runtime/device_ops.hpp"
#include "runtime/host_plan.hpp"
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

// Fills the fields every data-plane op's Args share: layout, rank, plan, peer bases and barrier state (tagged with
// the plan's step).
template <typename Args>
Args common_args(const Layout& l, int rank, const Plan& plan, const PlanView& view, const SymmetricRegion& region,
                 uint64_t* epoch, double timeout_s) {
    Args args{};
    args.layout = l;
    args.rank = rank;
    args.plan = view;
    for (int p = 0; p < l.num_ranks; ++p) args.peers[p] = region.peers[p];
    args.sync = make_sync(region, make_symmetric_layout(l), epoch, rank, l.num_ranks, timeout_s);
    args.sync.step = plan.generation();
    return args;
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
const planner::HostPlan& Plan::host_plan() const { return data().host_plan(); }

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

Buffer::Buffer(const Config& config, std::shared_ptr<Transport> transport, PlannerKind planner, int num_plan_slots)
    : config_(config),
      transport_(std::move(transport)),
      planner_(planner),
      id_(next_buffer_id++),
      guard_(std::make_unique<CollectiveGuard>("Buffer")),
      num_plan_slots_(num_plan_slots) {
    // Validate everything before allocating anything.
    FLATEP_CHECK(planner == PlannerKind::kGreedy || planner == PlannerKind::kBalanced || planner == PlannerKind::kOwner,
                 "Buffer: unknown planner kind ", int(planner));
    layout_ = std::make_unique<Layout>(make_layout(config_, planner));  // the owner planner's capacity is R*S*K
    FLATEP_CHECK(num_plan_slots >= 0 && num_plan_slots <= 1024, "Buffer: num_plan_slots must be in [0, 1024], got ",
                 num_plan_slots);
    FLATEP_CHECK(transport_ != nullptr, "Buffer: transport is null");
    timeout_s_ = transport_->timeout_s();  // this Buffer's bound, whatever later objects set on the shared transport
    FLATEP_CHECK(transport_->num_ranks() == config_.num_ranks, "Buffer: config.num_ranks (", config_.num_ranks,
                 ") differs from the transport's (", transport_->num_ranks(), ")");
    FLATEP_CHECK(transport_->rank() == config_.rank, "Buffer: config.rank (", config_.rank,
                 ") differs from the transport's rank (", transport_->rank(), ")");
    FLATEP_CHECK(transport_->memory_kind() == MemoryKind::kHost || device::built_with_cuda(), "Buffer: transport '",
                 transport_->name(), "' has device memory but this build has no CUDA support");

    // Every rank must agree on the config: compare against every peer so that every rank throws.
    ConfigBlob mine;
    std::memset(static_cast<void*>(&mine), 0, sizeof(mine));  // no uninitialised padding bytes on the wire
    mine.config = config_;
    mine.planner = planner_;
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
        if (theirs.config.rank != p) {
            FLATEP_THROW(ErrorCategory::kMismatch, "config mismatch with rank ", p, ": rank: that rank's config says ",
                         theirs.config.rank);
        }
    }

    if (transport_->memory_kind() == MemoryKind::kDevice) {
        const std::unique_ptr<DeviceBinding> bound = transport_->bind_device();  // the state lands on its GPU
        device_ = std::make_unique<device::Context>(*layout_);
        if (num_plan_slots_ > 0)
            plan_slots_ = device::allocate_words(size_t(num_plan_slots_) * size_t(plan_words()), transport_);
        slot_generations_ = std::make_shared<std::vector<uint64_t>>(size_t(num_plan_slots_), 0);
    }
    region_ = transport_->allocate(size_t(make_symmetric_layout(*layout_).total_bytes));
    if (device_ == nullptr) {
        const int64_t at = make_symmetric_layout(*layout_).barrier_offset;
        guard_->set_site({transport_.get(), reinterpret_cast<const uint64_t*>(region_.local + at), &epoch_});
    }
    if (device_ != nullptr) {
        // The region's zero fill must be complete on every rank before any rank's kernels write into it.
        device::synchronize_device(*transport_);
        transport_->bootstrap().all_gather(std::string());
    }
    debug_ = env::debug();
}

Buffer::~Buffer() {
    guard_->set_site({});  // before the flags go
    // The device state is freed on the transport's GPU, from whatever thread drops the object.
    if (device_ != nullptr) device::reset_on_device(*transport_, device_, "Buffer");
    if (transport_ != nullptr) transport_->release(region_);
}

const Layout& Buffer::layout() const { return *layout_; }

uint16_t* Buffer::symmetric_recv_x() {
    return region_at<uint16_t>(region_.local, make_symmetric_layout(*layout_).recv_x_offset);
}
float* Buffer::symmetric_recv_w() {
    return region_at<float>(region_.local, make_symmetric_layout(*layout_).recv_w_offset);
}

uint8_t* Buffer::symmetric_recv_x_fp8() { return region_.local + fp8_recv_x_offset(make_symmetric_layout(*layout_)); }
float* Buffer::symmetric_recv_scales() {
    return region_at<float>(region_.local, fp8_recv_scales_offset(*layout_, make_symmetric_layout(*layout_)));
}

int64_t Buffer::plan_words() const { return make_plan_sizes(*layout_).total_words; }

bool Buffer::poisoned() const { return guard_->poisoned(); }

void Buffer::set_max_blocks(int blocks) {
    blocks = env::check_sm_budget("Buffer", blocks);
    if (device_ != nullptr) {
        device_->set_max_blocks(blocks);
    } else {
        max_blocks_ = blocks;
    }
}

int Buffer::max_blocks() const { return device_ != nullptr ? device_->max_blocks() : max_blocks_; }

void Buffer::enter(const char* op) {
    if (device_ == nullptr) return guard_->enter(op, "", 0);
    guard_->enter(op, device_->failure_message(), device_->failure_code());
    int32_t words[4];
    if (device_->take_status(words)) {  // an error an earlier op recorded on the GPU (e.g. a bad expert id)
        int32_t* status = region_at<int32_t>(region_.local, make_symmetric_layout(*layout_).status_offset);
        device_->zero(status, sizeof(words), stream_);  // stream-ordered: the device copy is reported here too
        throw_status(words);
    }
}

void Buffer::check_plan(const Plan& plan, const char* op) const {
    FLATEP_CHECK(!plan.empty(), op, ": plan is empty (default-constructed); get one from Buffer::plan()");
    if (plan.buffer_id() != id_) {
        FLATEP_THROW(ErrorCategory::kMismatch, op, ": plan was made by buffer ", plan.buffer_id(),
                     ", not by this buffer (", id_, ")");
    }
    plan.data().check_fresh(op);
}

Plan Buffer::plan(const void* topk_idx, int index_bytes, int num_tokens, int32_t* plan_storage) {
    enter("plan");
    const Layout& l = *layout_;
    check_plan_inputs(l, num_tokens, topk_idx, index_bytes);  // before anything is allocated

    auto data = std::make_shared<Plan::Data>(l);
    data->generation = ++generation_;
    data->buffer_id = id_;
    data->rank = config_.rank;
    data->num_tokens = num_tokens;
    data->planner = planner_;
    const SymmetricLayout sym = make_symmetric_layout(l);

    PlanArgs args{};
    args.layout = l;
    args.rank = config_.rank;
    args.num_tokens = num_tokens;
    args.topk_idx = topk_idx;
    args.index_bytes = index_bytes;
    args.planner = planner_;
    for (int p = 0; p < l.num_ranks; ++p) args.peers[p] = region_.peers[p];
    args.sync = make_sync(region_, sym, &epoch_, config_.rank, l.num_ranks, timeout_s_);
    args.sync.step = data->generation;
    if (device_ != nullptr) {
        const int64_t words = plan_words();
        if (plan_storage != nullptr) {
            data->device_words = std::shared_ptr<int32_t>(plan_storage, [](int32_t*) {});  // the caller's memory
        } else {
            FLATEP_CHECK(num_plan_slots_ > 0,
                         "plan: this Buffer has no plan slots (num_plan_slots=0): pass "
                         "plan_storage of plan_words()=",
                         words, " int32");
            data->slot = int((data->generation - 1) % uint64_t(num_plan_slots_));
            (*slot_generations_)[size_t(data->slot)] = data->generation;
            data->slot_generations = slot_generations_;
            data->device_words = std::shared_ptr<int32_t>(plan_slots_, plan_slots_.get() + data->slot * words);
        }
        data->device_view = make_plan_view(l, data->device_words.get());
        data->refresh_host = [words, source = data->device_words, transport = transport_](planner::HostPlan& host) {
            device::copy_to_host(host.view.tpe_all, source.get(), size_t(words) * sizeof(int32_t), *transport);
        };
        device_->zero(data->device_words.get(), size_t(words) * sizeof(int32_t), stream_);  // ordered on the stream
        args.plan = data->device_view;
        args.workspace = device_->workspace();
        device_->fill_sync(args.sync);
        device_->plan(args, stream_);
    } else {
        FLATEP_CHECK(plan_storage == nullptr, "plan: plan_storage is for device Buffers; this one is on the host");
        args.plan = data->host.view;
        guard_->run(args.sync.status, [&] { run_host_plan(args); });
        data->host.view.header[kHeaderGenerationLo] = int32_t(uint32_t(data->generation));
        data->host.view.header[kHeaderGenerationHi] = int32_t(uint32_t(data->generation >> 32));
    }
    after_op();
    return Plan(std::move(data));
}

void Buffer::dispatch(const Plan& plan, const uint16_t* x, const float* topk_weights, uint16_t* recv_x, float* recv_w) {
    enter("dispatch");
    check_plan(plan, "dispatch");
    FLATEP_CHECK(plan.num_tokens() == 0 || x != nullptr, "dispatch: x is null");
    FLATEP_CHECK(recv_x != nullptr, "dispatch: recv_x is null");
    auto args =
        common_args<DispatchArgs>(*layout_, config_.rank, plan, plan.data().op_view(), region_, &epoch_, timeout_s_);
    args.x = x;
    args.topk_weights = topk_weights;
    args.recv_x = recv_x;
    args.recv_w = recv_w;
    if (device_ != nullptr) {
        args.marks_valid = recv_marks_valid_;
        device_->fill_sync(args.sync);
        device_->dispatch(args, stream_);
        recv_marks_valid_ = true;  // this launch marks every row (stream order: the next dispatch sees them)
    } else {
        guard_->run(args.sync.status, [&] { host::dispatch(args, op_stats_); });
    }
    after_op();
}

void Buffer::dispatch_fp8(const Plan& plan, const uint16_t* x_bf16, const uint8_t* x_fp8, const float* x_scales,
                          const float* topk_weights, uint8_t* recv_x, float* recv_scales, float* recv_w,
                          Fp8Scale scale_mode) {
    enter("dispatch_fp8");
    check_plan(plan, "dispatch_fp8");
    const Layout& l = *layout_;
    auto args =
        common_args<DispatchFp8Args>(l, config_.rank, plan, plan.data().op_view(), region_, &epoch_, timeout_s_);
    args.x_bf16 = x_bf16;
    args.x_fp8 = x_fp8;
    args.x_scales = x_scales;
    args.topk_weights = topk_weights;
    args.scale_mode = scale_mode;
    args.recv_x = recv_x;
    args.recv_scales = recv_scales;
    args.recv_w = recv_w;
    check_dispatch_fp8_args(args);
    check_dispatch_fp8_x(args, plan.num_tokens());
    if (device_ != nullptr) {
        device_->fill_sync(args.sync);
        device_->dispatch_fp8(args, stream_);
    } else {
        guard_->run(args.sync.status, [&] { host::dispatch_fp8(args, op_stats_); });
    }
    after_op();
}

void Buffer::combine(const Plan& plan, const uint16_t* y, const float* weights, uint16_t* out) {
    enter("combine");
    check_plan(plan, "combine");
    FLATEP_CHECK(y != nullptr, "combine: y is null");
    FLATEP_CHECK(plan.num_tokens() == 0 || out != nullptr, "combine: out is null");
    auto args =
        common_args<CombineArgs>(*layout_, config_.rank, plan, plan.data().op_view(), region_, &epoch_, timeout_s_);
    args.y = y;
    args.weights = weights;
    args.out = out;
    if (device_ != nullptr) {
        device_->fill_sync(args.sync);
        device_->combine(args, stream_);
    } else {
        guard_->run(args.sync.status, [&] { host::combine(args, op_stats_); });
    }
    after_op();
}

void Buffer::entry_values(const Plan& plan, const float* row_values, float* out) {
    enter("entry_values");
    check_plan(plan, "entry_values");
    FLATEP_CHECK(row_values != nullptr, "entry_values: row_values is null");
    FLATEP_CHECK(plan.num_tokens() == 0 || out != nullptr, "entry_values: out is null");
    auto args =
        common_args<EntryValuesArgs>(*layout_, config_.rank, plan, plan.data().op_view(), region_, &epoch_, timeout_s_);
    args.row_values = row_values;
    args.out = out;
    if (device_ != nullptr) {
        device_->fill_sync(args.sync);
        device_->entry_values(args, stream_);
    } else {
        guard_->run(args.sync.status, [&] { host::entry_values(args); });
    }
    after_op();
}

void Buffer::combine_grad(const Plan& plan, const uint16_t* rows, const uint16_t* y, const float* weights,
                          uint16_t* grad_y, float* grad_weights) {
    enter("combine_grad");
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
    if (device_ != nullptr) {
        args.max_blocks = device_->max_blocks();
        device_->combine_grad(args, stream_);
    } else {
        host::combine_grad(args);
    }
    after_op();
}

void Buffer::check_status() {
    int32_t* status = region_at<int32_t>(region_.local, make_symmetric_layout(*layout_).status_offset);
    int32_t words[4];
    if (device_ != nullptr) {
        device_->read(words, status, sizeof(words), stream_);  // a synchronising point: the record is complete now
        const std::string failure = device_->failure_message();
        if (!failure.empty()) {
            FLATEP_THROW(sync::host::wait_failure_category(device_->failure_code()), "rank ", config_.rank, ": ",
                         failure);
        }
    } else {
        for (int i = 0; i < 4; ++i) words[i] = status[i];
    }
    if (words[sync::kStatusCode] == sync::kStatusOk) return;
    if (device_ != nullptr) {
        device_->zero(status, sizeof(words), stream_);
        device_->take_status(words);  // the host-mapped twin holds the same error: it is reported now
    } else {
        for (int i = 0; i < 4; ++i) status[i] = 0;
    }
    throw_status(words);
}

void Buffer::throw_status(const int32_t words[4]) const {
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
            FLATEP_THROW(ErrorCategory::kTimeout, "rank ", config_.rank, ": ", sync::host::op_name(sync::OpId(index)),
                         " timed out waiting for peer ", peer, " (flag ", value, ")");
        case sync::kStatusMismatch:
            FLATEP_THROW(ErrorCategory::kMismatch, "rank ", config_.rank, ": ", sync::host::op_name(sync::OpId(index)),
                         ": peer ", peer, " was in ", sync::host::op_name(sync::OpId(value)), " at the same barrier");
        case sync::kStatusPeerAborted:
            FLATEP_THROW(ErrorCategory::kRuntime, "rank ", config_.rank, ": ", sync::host::op_name(sync::OpId(index)),
                         ": peer ", peer, " failed an earlier wait and gave up");
        default:
            FLATEP_THROW(ErrorCategory::kRuntime, "rank ", config_.rank, ": unknown status code ", code);
    }
}

void Buffer::after_op() {
    if (debug_) check_status();
}

}  // namespace flatep
