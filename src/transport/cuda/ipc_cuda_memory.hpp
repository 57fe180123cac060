// Device memory for the ipc transport: CUDA VMM allocations (cuMemCreate) exportable as POSIX file descriptors,
// imported by peers (cuMemImportFromShareableHandle) and mapped with cuMemMap + cuMemSetAccess for this process's
// device. Compiled only in builds with CUDA (library flatep_transport_cuda).
#pragma once

#include <memory>

#include "transport/ipc_memory.hpp"

namespace flatep {

// Uses the calling thread's current CUDA context (retains device 0's primary context when there is none).
// Throws kRuntime when the device cannot export POSIX-fd VMM handles.
std::unique_ptr<IpcMemory> make_cuda_ipc_memory();

}  // namespace flatep
