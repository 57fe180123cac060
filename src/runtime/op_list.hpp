// The ops that every backend runs the same way, as X-macro lists, so that adding one is one line here: the pure
// virtual of BufferBackend / PoolsBackend (runtime/backend.hpp) and both overrides are generated from it.
//   X(method, Args, kind)   kind: collective (barriers; its Args holds a SyncArgs `sync`) or local (no barrier)
// The interface:    void method(Args& args, const Launch& launch)   (local: const Args&)
// The CPU backend:  host::run(args) (ops/<op>_args.hpp; with the Buffer's host::OpStats where the twin counts them),
//                   a collective op inside collective(args.sync, ...), which poisons the object when a wait fails
//                   (runtime/host_backend.cpp)
// The CUDA backend: a collective op fill_sync(args.sync) then kernels::launch(args, stream, num_sms); a local op the
//                   launch alone (runtime/device_backend.cpp)
// Not in the lists, because they differ between the backends:
//   plan      written by hand in the three files: its own arguments (the plan's data and its storage); the CUDA
//             backend launches its kernels' two halves around the GPU planner (runtime/device_ops.hpp), the CPU
//             backend the twin's halves around the host planner (runtime/host_plan.hpp)
//   dispatch  its virtual and its CUDA override written by hand (the CUDA backend tells the kernels whether an earlier
//             dispatch has marked the receive rows, DispatchArgs::marks_valid, and records that this one did); the
//             CPU backend's override is the generated one (FLATEP_HOST_OP)
#pragma once

#include "ops/combine_args.hpp"
#include "ops/combine_grad_args.hpp"
#include "ops/dispatch_args.hpp"
#include "ops/dispatch_fp8_args.hpp"
#include "ops/entry_values_args.hpp"
#include "ops/grad_reduce_args.hpp"
#include "ops/plan_args.hpp"
#include "ops/prefetch_args.hpp"
#include "ops/write_grads_args.hpp"

// A Buffer's ops (besides plan and dispatch).
#define FLATEP_BUFFER_OPS(X)                     \
    X(dispatch_fp8, DispatchFp8Args, collective) \
    X(combine, CombineArgs, collective)          \
    X(entry_values, EntryValuesArgs, collective) \
    X(combine_grad, CombineGradArgs, local)

// An ExpertPools' ops.
#define FLATEP_POOLS_OPS(X)                    \
    X(prefetch, PrefetchArgs, collective)      \
    X(grad_reduce, GradReduceArgs, collective) \
    X(write_grads, WriteGradsArgs, local)

// The Args parameter of an op of each kind: a collective op's backend fills its SyncArgs.
#define FLATEP_OP_ARGS_collective(Args) Args&
#define FLATEP_OP_ARGS_local(Args) const Args&
#define FLATEP_OP_ARGS(Args, kind) FLATEP_OP_ARGS_##kind(Args)
