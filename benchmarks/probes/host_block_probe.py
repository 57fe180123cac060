"""Which host calls wait for a kernel that is still running on another stream? (CUDA device only.)

Virtual ranks driven from one thread (flatep.virtual) rely on no host call between two ranks' ops waiting for the
device: a rank's kernel may spin until a peer this thread has yet to enqueue arrives. The CUDA programming guide
lists device and page-locked memory allocation among the implicitly synchronising actions: work issued after such an
action may not start on the device until the work issued before it is done, and the host call itself may wait. This
probe measures both, for the calls a program like tests/python/test_streams.py makes. Each probe starts a kernel that
sleeps about one second on stream A, times one call issued for stream B on the host, then enqueues a tiny kernel on B
and checks, 0.3 s later, whether it has run: a call that made B's later work wait for A's kernel shows SERIALISED.

    python3 benchmarks/probes/host_block_probe.py  # one line per call: host milliseconds, BLOCKED / ok, SERIALISED / ok
"""

import os
import threading
import time

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # as flatep.virtual sets them, before CUDA starts
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
import torch  # noqa: E402

SLEEP_CYCLES = int(2e9)  # about one second at the H200's clock


def main():
    if not torch.cuda.is_available():
        print("host_block_probe: no CUDA device")
        return
    dev = torch.device("cuda", 0)
    a, b = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    torch.cuda.synchronize()

    def probe(name, fn):
        with torch.cuda.stream(a):
            torch.cuda._sleep(SLEEP_CYCLES)
        time.sleep(0.05)  # A's kernel is running
        t = time.perf_counter()
        with torch.cuda.stream(b):
            fn()
        ms = (time.perf_counter() - t) * 1e3
        with torch.cuda.stream(b):  # later work on B: does it run while A's kernel still sleeps?
            torch.cuda._sleep(1000)
            ran = torch.cuda.Event()
            ran.record()
        time.sleep(0.3)
        serialised = ms < 500 and not ran.query()  # (a blocked call already waited A's kernel out)
        torch.cuda.synchronize()
        print(f"{name:58s} {ms:9.2f} ms  {'BLOCKED' if ms > 500 else 'ok':8s} {'SERIALISED' if serialised else 'ok'}",
              flush=True)

    x = torch.ones(1000, device=dev)
    probe("nothing (the method's control: ok, ok)", lambda: None)
    probe("torch.cuda.synchronize() (its other control: BLOCKED)", torch.cuda.synchronize)
    probe("torch.empty(1000): the stream's first block (new segment)", lambda: torch.empty(1000, device=dev))
    probe("torch.empty(1000) again (cached segment)", lambda: torch.empty(1000, device=dev))
    probe("torch.empty of 64 MiB (new large segment)", lambda: torch.empty(16 << 20, device=dev))
    probe("(x.float() * 1.5).to(bf16): kernels and small blocks", lambda: (x.float() * 1.5).to(torch.bfloat16))
    probe("torch.cuda.Event().record()", lambda: torch.cuda.Event().record())
    probe("torch.cuda.Stream(): a new stream", lambda: torch.cuda.Stream(dev))
    probe("torch.empty of 1 MiB pinned host memory", lambda: torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True))
    torch.cuda.empty_cache()
    probe("torch.empty(1000) after empty_cache (new segment)", lambda: torch.empty(1000, device=dev))
    probe("torch.cuda.empty_cache() (frees cached segments)", torch.cuda.empty_cache)

    # What a rank's first step does on its own thread (issue 59): a fresh thread's first cuBLAS call makes its handle
    # and workspace; a matmul on a stream new to cuBLAS gets a workspace for that stream.
    m = torch.randn(64, 64, device=dev)

    def on_fresh_thread(fn):
        def run():
            box = []
            t = threading.Thread(target=lambda: box.append(fn()))
            t.start()
            t.join()
        return run

    def set_device_then(fn):
        def run():
            torch.cuda.set_device(dev)
            return fn()
        return run

    probe("fresh thread: torch.cuda.set_device (context current)", on_fresh_thread(lambda: torch.cuda.set_device(dev)))
    probe("fresh thread: current_blas_handle() (cuBLAS handle)",
          on_fresh_thread(set_device_then(torch.cuda.current_blas_handle)))
    probe("fresh thread: first matmul (handle + workspace)", on_fresh_thread(set_device_then(lambda: m @ m)))
    probe("fresh thread, no set_device: first matmul", on_fresh_thread(lambda: m @ m))
    c = torch.cuda.Stream(dev)

    def on_new_stream():
        with torch.cuda.stream(c):
            return m @ m

    probe("matmul on a stream new to cuBLAS (workspace)", on_new_stream)
    probe("float64 matmul, first of its kind (new kernel)", lambda: m.double() @ m.double())
    probe("softmax + topk on new shapes", lambda: torch.softmax(torch.randn(300, 48, device=dev), -1).topk(4, -1))


LAZY_CHILD = """
import time, torch
dev = torch.device("cuda", 0)
a, b = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
x = torch.ones(1000, device=dev)
torch.cuda.synchronize()
with torch.cuda.stream(a):
    torch.cuda._sleep(int(2e9))
time.sleep(0.05)
t = time.perf_counter()
with torch.cuda.stream(b):
    torch.cumsum(x.to(torch.int16), 0)  # kernels this process never launched: loaded now under lazy loading
ms = (time.perf_counter() - t) * 1e3
torch.cuda.synchronize()
print(f"{'CUDA_MODULE_LOADING=LAZY: first launch of a never-loaded kernel':58s} {ms:9.2f} ms  "
      f"{'BLOCKED' if ms > 500 else 'ok'}", flush=True)
"""


def lazy_probe():
    import subprocess
    import sys

    env = dict(os.environ, CUDA_MODULE_LOADING="LAZY")
    out = subprocess.run([sys.executable, "-c", LAZY_CHILD], env=env, capture_output=True, text=True, timeout=60)
    print((out.stdout + out.stderr).strip()[-2000:], flush=True)


if __name__ == "__main__":
    main()
    lazy_probe()
