// What both CUDA kernels of the runtime share (moe_mixed_cuda.cu, moe_grouped_cuda.cu): the device PTX helpers
// (shared-memory addresses, wgmma's fences, commit groups and waits, the proxy fence between generic writes and
// wgmma's reads) and the host launch. The wgmma helpers compile to nothing where the build has no wgmma
// (FUSE_SHARED_WGMMA: sm_90a); the hosts launch the wgmma kernels on sm_90a alone.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FUSE_SHARED_WGMMA 1  // Hopper (sm_90a): wgmma, whose e4m3 MMAs are native (mma.sync's are emulated in FP16)
#endif

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void wgmma_fence() {
#ifdef FUSE_SHARED_WGMMA
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#ifdef FUSE_SHARED_WGMMA
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}

// waits until at most N of this warpgroup's commit groups are in flight
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef FUSE_SHARED_WGMMA
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}

// the generic proxy's shared-memory writes (stores, cp.async), once seen, made visible to wgmma's reads (async proxy)
__device__ __forceinline__ void fence_proxy_async() {
#ifdef FUSE_SHARED_WGMMA
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// launches kernel<<<grid, block, smem, stream>>>(args...) with its dynamic shared memory limit raised to smem, as a
// programmatic dependent launch where pdl (it may start while the launch before it drains; the kernel waits for that
// launch's data itself); returns the CUDA error code (0: launched)
template <typename Kernel, typename... Args>
int launch_kernel(Kernel kernel, dim3 grid, dim3 block, int smem, cudaStream_t stream, bool pdl, Args... args) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return (int)err;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    err = cudaLaunchKernelEx(&cfg, kernel, args...);
    return (int)(err != cudaSuccess ? err : cudaGetLastError());
}
