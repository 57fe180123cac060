// flatep::Buffer and flatep::Plan: the per-layer communication object of one EP rank (design §3) and the plan
// one step's routing produces. Torch-free; bf16 rows cross the API as uint16_t bit patterns.
//
//   flatep::Buffer buffer(config, transport);             // collective over the config's R ranks
//   flatep::Plan plan = buffer.plan(topk_idx, 8, s);     // topk_idx: [s][K] int64 (index_bytes 8) or int32 (4)
//   buffer.dispatch(plan, x, topk_weights, recv_x, recv_w);   // x [s][H] -> recv_x [NvS][H], recv_w [NvS]
//   ... grouped GEMM over recv_x with offs = plan.cu_seqlens(rank) ...
//   buffer.combine(plan, y, nullptr, out);               // y [NvS][H] -> out [s][H]
//
// Every op is collective: all R ranks call the same sequence of ops (each with its own arguments), and every
// cross-rank barrier carries the op and the step (plan generation) it belongs to. A rank that does not arrive makes
// the others throw kTimeout (the transport's timeout_s when the Buffer was built; FLATEP_TIMEOUT_S by default) naming
// it; ranks that call different ops, or pass plans of different steps, all throw kMismatch naming both sides. After any
// such failure the Buffer is poisoned on every rank: every later call throws kRuntime until it is destroyed and
// rebuilt on every rank (design §8). A device Buffer learns of a GPU-side failure without synchronising, from a
// host-mapped record read at every op's entry: the first op enqueued after the GPU recorded it throws.
//
// Plan validity rule: a Plan owns everything it needs (counts, allocation, routing of this rank's entries and the
// row chains of this rank's receive rows); the symmetric buffer is scratch that every op rewrites. So a plan stays
// valid for any number of later ops on the Buffer that made it, including after later plan() calls (backward
// reuses the forward's saved plan). Using a plan with another Buffer is a kMismatch error (an empty Plan:
// kInvalidArgument). The generation id (incremented by every plan() call, identical on every rank for the same step)
// tags every barrier of the ops that use the plan, so ranks passing plans of different steps fail (low 20 bits).
//
// Device Buffers keep plans in device memory that is set up before the step: either storage the caller passes to
// plan() (plan_words() int32 words, e.g. from the framework's allocator, so CUDA-graph capture pools work; the
// caller keeps it alive and unused by anything else while the Plan is used), or one of the Buffer's num_plan_slots
// slots, allocated at construction and reused in turn. A plan whose slot has since been reused is stale: every op and
// accessor rejects it (kMismatch naming both steps). No plan() call allocates or frees device memory.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "flatep/config.hpp"
#include "flatep/fp8.hpp"
#include "flatep/launch.hpp"
#include "flatep/transport.hpp"
#include "flatep/types.hpp"

namespace flatep {

class ExpertPools;  // flatep/expert_pools.hpp

class Plan {
  public:
    Plan() = default;  // empty; every op rejects it

    bool empty() const { return data_ == nullptr; }
    uint64_t generation() const;
    uint64_t buffer_id() const;  // id of the Buffer that made it (process-unique)
    int rank() const;
    int num_tokens() const;  // s: tokens passed to plan()
    PlannerKind planner() const;
    // The static planner: the Buffer's placement_epoch() when the plan was made (its slot_expert is that placement);
    // 0 for the other planners.
    uint64_t placement_epoch() const;

    std::span<const int32_t> tpe_all() const;              // [R][E] all-gathered counts
    std::span<const int32_t> alloc() const;                // [R][E] entries of expert e computed on rank d
    std::span<const int32_t> slot_expert(int rank) const;  // [epn] expert per slot of `rank`, -1 = empty
    std::span<const int32_t> cu_seqlens(int rank) const;   // [num_groups] inclusive padded group ends (GEMM offs)
    const PlanStats& stats() const;
    std::span<const int32_t> entry_ranks() const;  // [s*K] destination rank of entry t*K+k, -1 for a bad id
    std::span<const int32_t> entry_rows() const;   // [s*K] destination row of that entry
    std::span<const int32_t> row_heads() const;    // [NvS] chain head of each receive row, -1 padding/unused
    std::span<const int32_t> row_nexts() const;    // [NvS] next row of the chain, -1 at its end

    // Device plans (Buffers over device-memory transports): the arrays live in device memory and the host
    // accessors above copy them once, synchronising with the device (diagnostics, not for the step's hot path).
    bool on_device() const;
    const int32_t* device_cu_seqlens(int rank) const;   // [num_groups] int32 in device memory (grouped-GEMM offs)
    const int32_t* device_slot_expert(int rank) const;  // [epn] int32 in device memory

    // The plan's state: opaque outside the library (only a Buffer makes one).
    struct Data;
    explicit Plan(std::shared_ptr<const Data> data) : data_(std::move(data)) {}
    const Data& data() const;

  private:
    std::shared_ptr<const Data> data_;
};

class Buffer {
  public:
    // Validates the config (before allocating anything), checks it against the transport, all-gathers it
    // (any difference -> kMismatch "config mismatch with rank p: field: mine vs theirs" on every rank) and
    // allocates the symmetric buffer. Collective. The backend follows the transport's memory kind: host memory runs
    // the CPU backend (every op synchronously on the calling thread), device memory the CUDA kernels.
    // num_plan_slots: device plans the Buffer keeps itself (0: every device plan() call must pass storage).
    // The groups of its plans follow the training layout (2*epn groups: own experts, then epn slots).
    static constexpr int kDefaultPlanSlots = 4;
    Buffer(const Config& config, std::shared_ptr<Transport> transport, PlannerKind planner = PlannerKind::kBalanced,
           int num_plan_slots = kDefaultPlanSlots);
    // A Buffer whose plans `pools` take, over the pools' transport: it takes their replica slots B and view stride Q
    // (serving pools, B < epn: the R*Q + B groups of the weights view, design §5 "Serving layout"; training pools:
    // the training layout). config's E / R must be the pools' experts_per_rank. Collective, as above.
    Buffer(const Config& config, const ExpertPools& pools, PlannerKind planner = PlannerKind::kBalanced,
           int num_plan_slots = kDefaultPlanSlots);
    ~Buffer();  // releases the symmetric buffer; never throws
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;

    // topk_idx: [num_tokens][K] int32 (index_bytes 4) or int64 (8), num_tokens in [0, S]. Expert ids outside
    // [0, E) are skipped and recorded (check_status reports them). plan_storage: device Buffers only, null (the next
    // of the Buffer's plan slots) or plan_words() int32 words of device memory that the Plan then lives in.
    // Every op takes a Launch last (stream, SM budget and options of this call; see flatep/launch.hpp); only dispatch,
    // dispatch_fp8 and combine take an option (plan_ordered).
    Plan plan(const void* topk_idx, int index_bytes, int num_tokens, int32_t* plan_storage = nullptr,
              const Launch& launch = {});
    // int32 words of one device plan (the storage plan() takes).
    int64_t plan_words() const;
    int num_plan_slots() const;

    // The static planner (PlannerKind::kStatic; design §4 "The static planner"). Collective: every rank passes the
    // same placement, [R][B] int32 expert ids in host memory (B = num_slots(): its pools' slots, or epn in the
    // training layout), row d the experts rank d's slots hold, -1 for an empty slot. Valid: R*B entries, each -1 or an
    // id in [0, E) that is not rank d's own expert, no expert twice in a row. Ranks whose placements differ all throw
    // kMismatch naming the first difference; an invalid placement throws kInvalidArgument naming the entry and its
    // value; either way the Buffer keeps the placement it had. A Buffer of another planner throws kInvalidArgument.
    // From the next plan() on, every plan computes expert e on its copies (its home rank, then the ranks whose slots
    // hold it, in ascending rank) with floor(T_e / n_e) entries each and one more for the T_e mod n_e copies from copy
    // (e mod n_e) on, cyclically; slot_expert is the placement itself, every step. Which entries of a source go to
    // which copy is the planners' keep / spill / take order (layout/plan.hpp), so routing is a fixed function of the
    // counts. The weights are not moved here: ExpertPools::prefetch with a plan of this placement moves them.
    // Device Buffers copy the placement to device memory on launch.stream (no host synchronisation of the step; the
    // host waits only for a previous set_placement's copy still in flight): plan ops ordered after it on the device
    // read it, a CUDA graph captured earlier included. plan() on a static Buffer without a placement throws.
    void set_placement(std::span<const int32_t> placement, const Launch& launch = {});
    // The placement set last ([R][B]; empty before the first set_placement) and how many set_placement calls took
    // effect (what plans record: Plan::placement_epoch).
    std::span<const int32_t> placement() const;
    uint64_t placement_epoch() const;

    // x: [s][H] bf16; topk_weights: [s][K] fp32 or null (weight 1); recv_x: [NvS][H] bf16 out (may be
    // symmetric_recv_x()); recv_w: [NvS] fp32 out or null. Real rows get their token row and weight, padding rows
    // inside a group's padded range are zero with weight 0, rows past the last group end are not written.
    // A rank that passes no tokens (num_tokens 0) may pass null x (and null out / combine, entry_values).
    // launch.options.plan_ordered (every rank alike): no entry barrier. The plan op that made `plan`, stream-ordered
    // before this call on every rank, met every rank after its earlier reads of the receive region, so none can still
    // be reading it. The caller promises that this is the first op on this Buffer since that plan op, and that whatever
    // read the region before (the previous step's FFN on zero-copy rows, say) is stream-ordered before that plan op on
    // every rank. An inference step (plan, dispatch, expert FFN, combine on one stream) keeps it.
    void dispatch(const Plan& plan, const uint16_t* x, const float* topk_weights, uint16_t* recv_x, float* recv_w,
                  const Launch& launch = {});

    // dispatch of FP8 rows (design §6, "FP8 rows"): the same plan, receive layout and weights, with each row moved as
    // H e4m3 bytes plus H/128 fp32 scales (x ~= e4m3(q) * scale per block of 128 channels). H must be a multiple of
    // 128. Input, exactly one of:
    //   x_bf16: [s][H] bf16, quantised by the design §6 rule in the source's kernel before it is pushed (x_fp8 and
    //           x_scales null); scale_mode picks the scales (Fp8Scale::kUe8m0: powers of two);
    //   x_fp8:  [s][H] e4m3 with x_scales [s][H/128] fp32, moved as given (scale_mode is not used).
    // recv_x: [NvS][H] e4m3 out, recv_scales: [NvS][H/128] fp32 out (either may be symmetric_recv_x_fp8() /
    // symmetric_recv_scales() to skip the copy-out), recv_w: [NvS] fp32 out or null. Real rows get their token's
    // e4m3 row, scales and weight; padding rows inside a group's padded range get zero bytes, zero scales and weight
    // 0; rows past the last group end are not written. Both backends give the same bits. launch.options.plan_ordered:
    // as dispatch's.
    void dispatch_fp8(const Plan& plan, const uint16_t* x_bf16, const uint8_t* x_fp8, const float* x_scales,
                      const float* topk_weights, uint8_t* recv_x, float* recv_scales, float* recv_w,
                      Fp8Scale scale_mode = Fp8Scale::kFloat, const Launch& launch = {});

    // y: [NvS][H] bf16 expert outputs; weights: [NvS] fp32 per-row weights (weighted combine) or null;
    // out: [s][H] bf16, the sum of each token's K rows (design §6 numerics).
    // launch.options.plan_ordered (every rank alike): no entry barrier. This step's plan op and dispatch (a
    // plan_ordered one or not), stream-ordered before this call on every rank, met every rank after its previous
    // combine's reads of the partials; the caller promises that no other op ran on this Buffer between that dispatch
    // and this combine.
    void combine(const Plan& plan, const uint16_t* y, const float* weights, uint16_t* out, const Launch& launch = {});

    // Local (not collective) rest of a weighted combine's backward, after the output gradient was dispatched back to
    // the rows (dispatch(plan, grad_out, nullptr, rows, nullptr)). For every receive row i in [0, NvS) of this rank:
    //   rows, y: [NvS][H] bf16; weights: [NvS] fp32 (the forward combine's y and weights);
    //   grad_y: [NvS][H] bf16 out, grad_y[i][h] = bf16(float(rows[i][h]) * weights[i]) (one fp32 multiply, RNE);
    //   grad_weights: [NvS] fp32 out, the dot of rows[i] and y[i] in a fixed fp32 order (both backends bitwise equal;
    //   ops/combine_grad_args.hpp defines it).
    // Only real rows (holding an entry) are computed; padding rows and rows past the last group end get zeros and
    // their rows / y / weights are never read. Either output may be null (not computed), not both; y may be null
    // without grad_weights, weights without grad_y. Device buffers: enqueued on stream(), no host synchronisation.
    void combine_grad(const Plan& plan, const uint16_t* rows, const uint16_t* y, const float* weights, uint16_t* grad_y,
                      float* grad_weights, const Launch& launch = {});

    // The reverse path of one fp32 value per receive row: row_values [NvS] fp32 on every rank (e.g. dL/d(routing
    // weight) computed next to each expert output row); out [s][K] fp32 gets, for each entry (t, k) of this rank,
    // the value at its row on its destination rank (0 for an entry whose expert id was invalid).
    void entry_values(const Plan& plan, const float* row_values, float* out, const Launch& launch = {});

    // Throws the first error recorded by an op since the last check (bad expert id: kInvalidArgument naming the id
    // and its flat index; a wait that timed out: kTimeout; ranks in different ops or steps: kMismatch) and clears
    // it; on a poisoned Buffer, the poisoning failure. FLATEP_DEBUG=1 runs it after every op.
    void check_status(const Launch& launch = {});
    // True after a failed cross-rank wait (every later op throws); reason() says which.
    bool poisoned() const;

    const Config& config() const;
    PlannerKind planner() const;
    uint64_t id() const;
    uint64_t generation() const;
    Transport& transport();

    // What the config derives (design §1, §5): epn = E / R; the receive rows NvS (recv_x [NvS][H], recv_w [NvS]);
    // the row groups of a plan's cu_seqlens (2*epn, or R*Q + B for a Buffer of serving pools); the receive capacity C.
    int experts_per_rank() const;
    int num_recv_rows() const;
    int num_groups() const;
    int capacity() const;
    // B and Q (its pools'; epn and epn for the training layout), and whether the groups are the serving layout (B <
    // epn).
    int num_slots() const;
    int view_stride() const;
    bool serving() const;

    // Device backend (a transport with MemoryKind::kDevice): every op is enqueued on its Launch's CUDA stream and never
    // synchronises with the host; all pointers passed to the ops are device pointers. check_status() is a
    // synchronising point there.
    bool on_device() const;
    // The SM budget of calls whose Launch says -1: the most thread blocks one launch of an op uses (0: no cap). Starts
    // at FLATEP_NUM_SMS (0 on the CPU backend, which ignores it). Outside [0, kMaxNumSms]: kInvalidArgument.
    int num_sms() const;
    void set_num_sms(int num_sms);

    // This rank's symmetric receive regions ([NvS][H] bf16, [NvS] fp32): pass them to dispatch to skip the
    // copy-out of chain-head rows. Rewritten by the next dispatch on any rank.
    uint16_t* symmetric_recv_x();
    float* symmetric_recv_w();
    // The same for dispatch_fp8 ([NvS][H] e4m3, [NvS][H/128] fp32): both live in the bf16 receive region.
    uint8_t* symmetric_recv_x_fp8();
    float* symmetric_recv_scales();

    // The implementation (src/runtime): opaque outside the library, which reaches it through its internal API.
    struct Impl;
    explicit Buffer(std::unique_ptr<Impl> impl);
    Impl& impl() const { return *impl_; }

  private:
    std::unique_ptr<Impl> impl_;
};

}  // namespace flatep
