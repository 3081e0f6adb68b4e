// kvmemory_cuda_graft: copy a chain of verified KV blocks from a staging buffer into a model's per-layer K/V
// cache tensors, all blocks x layers x {K,V} x heads in ONE kernel launch on the caller's stream.
//
// This is plain CUDA C++ with a C entry point (no torch headers): it is loaded with ctypes and called
// with raw pointers. Bytes are copied, never values: there is no dtype anywhere below, only an
// element size, so NaN payloads, -0.0 and any other bit pattern survive exactly.
//
// Layout contract (fixed; kvmemory's engine relies on it)
// -------------------------------------------------------
// Block b covers T_b consecutive token positions starting at absolute position pos_b. Its payload
// starts at byte `src_offset_b` of the staging buffer and is, for layer l = 0..L-1: K_l then V_l,
// C-contiguous arrays [Hk_l, T_b, Dk_l] and [Hv_l, T_b, Dv_l] of `esize`-byte elements (K and V
// usually share H and D; they may differ). So, within the payload,
//     K_l starts at  T_b * payload_prefix_l   (payload_prefix_l = sum_{l'<l} (Hk*Dk + Hv*Dv)*esize)
//     V_l starts at  T_b * payload_prefix_l + Hk_l*T_b*Dk_l*esize
// and head h of K_l (V_l) is the contiguous run of T_b*Dk_l*esize (T_b*Dv_l*esize) bytes at
// + h*T_b*Dk_l*esize (+ h*T_b*Dv_l*esize).
// Destination: per layer contiguous [1, Hk_l, S_l, Dk_l] K and [1, Hv_l, S_l, Dv_l] V tensors; the
// block lands at token rows [pos_b - dst_off_l, pos_b - dst_off_l + T_b) of every head, and rows
// outside [0, S_l) are skipped (sliding-window layers keep only a suffix). Since dst[0, h] is a
// contiguous [S_l, D] matrix, the rows of one (block, layer, K|V, head) are ONE contiguous run on
// both sides: each "row job" below is a plain contiguous memcpy, just with its own addresses.
//
// Staging may be device memory or page-locked (pinned) host memory. Pinned memory is addressable by
// the device through unified virtual addressing (cudaHostAlloc'ed memory, which torch's pinned
// allocator uses, is mapped into the device's address space on every 64-bit UVA platform; memory
// pinned by cudaHostRegister has a device alias reported by cudaPointerGetAttributes). The kernel
// then reads host memory directly over the link ("zero-copy"): no intermediate device buffer and
// no separate DMA. Pageable (unpinned) host memory is refused: the GPU cannot read it.
//
// Descriptor tables and their lifetime
// ------------------------------------
// The per-block and per-layer tables are packed into one host buffer, copied to a device buffer
// with cudaMemcpyAsync on the caller's stream and freed with cudaFreeAsync on the same stream after
// the kernel, so the whole call is stream ordered and never blocks the host. (A pageable-source
// cudaMemcpyAsync returns once the source has been staged, so the caller may free its host arrays on
// return.) Devices without stream-ordered memory pools fall back to cudaMalloc + a stream
// synchronize + cudaFree: correct, just synchronous.

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KVMEMORY_CUDA_GRAFT_ABI_VERSION 2
// The library is built with -fvisibility=hidden (the statically linked CUDA runtime stays private);
// only the C entry points below are exported.
#define KVMEMORY_CUDA_GRAFT_API __attribute__((visibility("default")))

extern "C" {

// One block of the chain. 32 bytes; mirrored by kvmemory_cuda_graft._lib.Block (ctypes).
typedef struct {
    int64_t src_offset;  // byte offset of the block's payload in the staging buffer
    int64_t pos;         // absolute position of the block's first token
    int64_t tokens;      // T >= 1
    int64_t reserved;    // keeps the struct 16-byte sized/aligned; must be 0
} kvgraft_block;

// One layer of the destination cache. 80 bytes; mirrored by kvmemory_cuda_graft._lib.Layer (ctypes).
typedef struct {
    uint64_t dst_k;           // device pointer to the [1, Hk, S, Dk] K cache (contiguous)
    uint64_t dst_v;           // device pointer to the [1, Hv, S, Dv] V cache (contiguous)
    int64_t k_heads;          // Hk_l
    int64_t k_dim;            // Dk_l
    int64_t v_heads;          // Hv_l
    int64_t v_dim;            // Dv_l
    int64_t seq;              // S_l (token rows the destination holds)
    int64_t dst_off;          // off_l: the block's position p lands at destination row p - off_l
    int64_t payload_prefix;   // sum_{l'<l} (Hk*Dk + Hv*Dv)*esize: bytes per token before layer l
    int64_t row_prefix;       // sum_{l'<l} (Hk + Hv): index of layer l's first row job in a block
} kvgraft_layer;

}  // extern "C"

namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // uint4 loads in flight per thread: latency hiding over the host link

// Copies n bytes from src to dst; this is the share of thread `tid` of `nth` cooperating threads (the
// CTA on the device; a sequential loop over tid in the host emulation, which is equivalent because
// threads never read what another thread writes). 16-byte vector accesses when src and dst are
// mutually aligned (after peeling a byte head), 4-byte when only that much is shared, bytes
// otherwise. Nothing is interpreted: this is memcpy.
__host__ __device__ __forceinline__ void copy_share(const uint8_t* __restrict__ src,
                                                    uint8_t* __restrict__ dst, size_t n,
                                                    size_t tid, size_t nth) {
    const uintptr_t sa = reinterpret_cast<uintptr_t>(src);
    const uintptr_t da = reinterpret_cast<uintptr_t>(dst);
    if ((sa & 15) == (da & 15)) {
        size_t head = (16 - (sa & 15)) & 15;
        if (head > n) head = n;
        for (size_t i = tid; i < head; i += nth) dst[i] = src[i];
        src += head;
        dst += head;
        n -= head;
        const uint4* __restrict__ s4 = reinterpret_cast<const uint4*>(src);
        uint4* __restrict__ d4 = reinterpret_cast<uint4*>(dst);
        const size_t nv = n >> 4;
        size_t i = tid;
        // Issue kUnroll independent loads before any store so that several 16-byte requests per
        // thread are in flight: with pinned host staging each load crosses PCIe / NVLink-C2C.
        for (; i + (kUnroll - 1) * nth < nv; i += kUnroll * nth) {
            uint4 r[kUnroll];
            for (int u = 0; u < kUnroll; ++u) r[u] = s4[i + u * nth];
            for (int u = 0; u < kUnroll; ++u) d4[i + u * nth] = r[u];
        }
        for (; i < nv; i += nth) d4[i] = s4[i];
        const size_t done = nv << 4;
        for (size_t j = done + tid; j < n; j += nth) dst[j] = src[j];
    } else if ((sa & 3) == (da & 3)) {
        size_t head = (4 - (sa & 3)) & 3;
        if (head > n) head = n;
        for (size_t i = tid; i < head; i += nth) dst[i] = src[i];
        src += head;
        dst += head;
        n -= head;
        const uint32_t* __restrict__ s4 = reinterpret_cast<const uint32_t*>(src);
        uint32_t* __restrict__ d4 = reinterpret_cast<uint32_t*>(dst);
        const size_t nw = n >> 2;
        for (size_t i = tid; i < nw; i += nth) d4[i] = s4[i];
        for (size_t j = (nw << 2) + tid; j < n; j += nth) dst[j] = src[j];
    } else {
        for (size_t i = tid; i < n; i += nth) dst[i] = src[i];
    }
}

// One row job: job = block * rows_per_block + row, where row enumerates (layer, K|V, head) in payload
// order; copies that head's in-range token rows (T*D*esize contiguous bytes at most).
__host__ __device__ __forceinline__ void graft_job(int64_t job, size_t tid, size_t nth,
                                                   const uint8_t* __restrict__ staging,
                                                   const kvgraft_block* __restrict__ blocks,
                                                   const kvgraft_layer* __restrict__ layers,
                                                   int n_layers, int64_t rows_per_block,
                                                   int64_t esize) {
    const int64_t b = job / rows_per_block;
    const int64_t row = job - b * rows_per_block;
    // Binary search for the layer whose [row_prefix, row_prefix + Hk + Hv) holds `row`.
    int lo = 0, hi = n_layers - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (layers[mid].row_prefix <= row) lo = mid; else hi = mid - 1;
    }
    const kvgraft_layer L = layers[lo];
    const kvgraft_block B = blocks[b];
    const int64_t local = row - L.row_prefix;  // in [0, Hk + Hv): K heads first, then V heads
    const bool is_v = local >= L.k_heads;
    const int64_t h = is_v ? local - L.k_heads : local;
    const int64_t T = B.tokens;
    const int64_t row_bytes = (is_v ? L.v_dim : L.k_dim) * esize;  // one token of one head
    // Destination row of the block's first token, and the in-range token window [t0, t1).
    const int64_t p = B.pos - L.dst_off;
    const int64_t t0 = p < 0 ? -p : 0;
    const int64_t t1 = (L.seq - p) < T ? (L.seq - p) : T;
    if (t1 <= t0) return;  // uniform across the CTA: no divergence around the copy
    const int64_t v_start = is_v ? L.k_heads * T * L.k_dim * esize : 0;
    const uint8_t* src = staging + B.src_offset + T * L.payload_prefix + v_start +
                         h * T * row_bytes + t0 * row_bytes;
    uint8_t* dst = reinterpret_cast<uint8_t*>(is_v ? L.dst_v : L.dst_k) + (h * L.seq + p + t0) * row_bytes;
    copy_share(src, dst, static_cast<size_t>((t1 - t0) * row_bytes), tid, nth);
}

// Grid-stride over row jobs; one CTA copies one job at a time with all its threads.
__global__ void __launch_bounds__(kThreads)
graft_kernel(const uint8_t* __restrict__ staging, const kvgraft_block* __restrict__ blocks,
             const kvgraft_layer* __restrict__ layers, int n_layers, int64_t rows_per_block,
             int64_t n_jobs, int64_t esize) {
    for (int64_t job = blockIdx.x; job < n_jobs; job += gridDim.x)
        graft_job(job, threadIdx.x, blockDim.x, staging, blocks, layers, n_layers, rows_per_block, esize);
}

// Checks the tables the way the kernel relies on them; returns rows per block or -1.
int64_t rows_per_block_of(const kvgraft_layer* layers, int n_layers) {
    int64_t rows = 0;
    for (int l = 0; l < n_layers; ++l) {
        const kvgraft_layer& L = layers[l];
        if (L.k_heads <= 0 || L.k_dim <= 0 || L.v_heads <= 0 || L.v_dim <= 0 || L.seq < 0 ||
            L.row_prefix != rows)
            return -1;
        rows += L.k_heads + L.v_heads;
    }
    return rows;
}

// Custom error codes live above every cudaError_t value.
constexpr int kErrBadArgs = 100001;
constexpr int kErrStagingNotAccessible = 100002;
constexpr int kErrStagingOtherDevice = 100003;
constexpr int kErrHostAlloc = 100004;

}  // namespace

extern "C" {

KVMEMORY_CUDA_GRAFT_API int kvgraft_abi_version(void) { return KVMEMORY_CUDA_GRAFT_ABI_VERSION; }

KVMEMORY_CUDA_GRAFT_API const char* kvgraft_error_string(int code) {
    switch (code) {
        case 0: return "success";
        case kErrBadArgs: return "kvmemory_cuda_graft: invalid arguments (counts, sizes or null pointers)";
        case kErrStagingNotAccessible:
            return "kvmemory_cuda_graft: staging is neither device memory nor pinned host memory the device can "
                   "address (pin it, e.g. torch.empty(..., pin_memory=True))";
        case kErrStagingOtherDevice:
            return "kvmemory_cuda_graft: staging is device memory of another GPU than the destination";
        case kErrHostAlloc: return "kvmemory_cuda_graft: host allocation of the descriptor table failed";
        default: return cudaGetErrorString(static_cast<cudaError_t>(code));
    }
}

// Runtime and driver versions as seen by this library (the runtime is linked statically, so a
// driver older than the toolkit that built it shows up here, before any launch fails).
KVMEMORY_CUDA_GRAFT_API int kvgraft_cuda_versions(int* runtime, int* driver) {
    cudaError_t e = cudaRuntimeGetVersion(runtime);
    if (e != cudaSuccess) return e;
    return cudaDriverGetVersion(driver);
}

// Copies n_blocks blocks into n_layers layers. All pointers in `layers` are device pointers of
// `device`; `staging` is a device pointer of `device` or a pinned host pointer; `blocks` and
// `layers` are host arrays (read before return). `stream` is a cudaStream_t (0 = legacy default).
// Returns 0 or an error code for kvgraft_error_string. Asynchronous with respect to the host.
KVMEMORY_CUDA_GRAFT_API int kvgraft_copy(int device, const void* staging, const kvgraft_block* blocks,
                             int n_blocks, const kvgraft_layer* layers, int n_layers, int64_t esize,
                             void* stream) {
    if (n_blocks < 0 || n_layers <= 0 || esize <= 0 || (n_blocks > 0 && (!staging || !blocks)) ||
        !layers)
        return kErrBadArgs;
    if (n_blocks == 0) return 0;
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) return e;
    cudaStream_t s = static_cast<cudaStream_t>(stream);

    // Resolve the address the device uses for the staging buffer.
    cudaPointerAttributes attr;
    e = cudaPointerGetAttributes(&attr, staging);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return kErrStagingNotAccessible;
    }
    const uint8_t* src = nullptr;
    if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) {
        if (attr.type == cudaMemoryTypeDevice && attr.device != device) return kErrStagingOtherDevice;
        src = static_cast<const uint8_t*>(staging);
    } else if (attr.type == cudaMemoryTypeHost) {
        src = static_cast<const uint8_t*>(attr.devicePointer);
        if (!src) return kErrStagingNotAccessible;
    } else {
        return kErrStagingNotAccessible;  // pageable / unregistered host memory
    }

    const int64_t rows_per_block = rows_per_block_of(layers, n_layers);
    if (rows_per_block <= 0) return kErrBadArgs;
    const int64_t n_jobs = rows_per_block * n_blocks;

    // One host table -> one H2D copy. Blocks first (32 B each), then layers (80 B each): every field
    // is 8 bytes and the blocks part is a 16-byte multiple, so both tables stay naturally aligned.
    const size_t bytes_blocks = sizeof(kvgraft_block) * static_cast<size_t>(n_blocks);
    const size_t bytes_layers = sizeof(kvgraft_layer) * static_cast<size_t>(n_layers);
    const size_t table_bytes = bytes_blocks + bytes_layers;
    uint8_t* host_table = static_cast<uint8_t*>(malloc(table_bytes));
    if (!host_table) return kErrHostAlloc;
    memcpy(host_table, blocks, bytes_blocks);
    memcpy(host_table + bytes_blocks, layers, bytes_layers);

    int pools = 0;
    if (cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device) != cudaSuccess) {
        cudaGetLastError();
        pools = 0;
    }
    void* dev_table = nullptr;
    e = pools ? cudaMallocAsync(&dev_table, table_bytes, s) : cudaMalloc(&dev_table, table_bytes);
    if (e != cudaSuccess) {
        free(host_table);
        return e;
    }
    e = cudaMemcpyAsync(dev_table, host_table, table_bytes, cudaMemcpyHostToDevice, s);
    if (e == cudaSuccess) {
        const int64_t max_grid = int64_t(1) << 20;  // grid-stride loop covers any remainder
        const unsigned grid = static_cast<unsigned>(n_jobs < max_grid ? n_jobs : max_grid);
        const uint8_t* dt = static_cast<const uint8_t*>(dev_table);
        graft_kernel<<<grid, kThreads, 0, s>>>(
            src, reinterpret_cast<const kvgraft_block*>(dt),
            reinterpret_cast<const kvgraft_layer*>(dt + bytes_blocks), n_layers, rows_per_block,
            n_jobs, esize);
        e = cudaGetLastError();
    }
    cudaError_t e2;
    if (pools) {
        e2 = cudaFreeAsync(dev_table, s);  // stream ordered: released after the kernel finished
    } else {
        e2 = cudaStreamSynchronize(s);     // the pageable copy and kernel must finish before free
        cudaError_t e3 = cudaFree(dev_table);
        if (e2 == cudaSuccess) e2 = e3;
    }
    // The pageable-source cudaMemcpyAsync has staged host_table before returning (or completed,
    // in the synchronous path), so it can be released now.
    free(host_table);
    return e != cudaSuccess ? e : e2;
}

// Test hook: runs the kernel's exact per-job code on the CPU, with `nth` emulated threads per job
// (each thread's share in turn), over HOST pointers. Lets the index arithmetic and the alignment
// paths be checked byte for byte against the twin on machines without a GPU. Synchronous.
KVMEMORY_CUDA_GRAFT_API int kvgraft_emulate(const void* staging, const kvgraft_block* blocks, int n_blocks,
                                const kvgraft_layer* layers, int n_layers, int64_t esize, int nth) {
    if (n_blocks < 0 || n_layers <= 0 || esize <= 0 || nth <= 0 ||
        (n_blocks > 0 && (!staging || !blocks)) || !layers)
        return kErrBadArgs;
    const int64_t rows_per_block = rows_per_block_of(layers, n_layers);
    if (rows_per_block <= 0) return kErrBadArgs;
    const int64_t n_jobs = rows_per_block * n_blocks;
    for (int64_t job = 0; job < n_jobs; ++job)
        for (int tid = 0; tid < nth; ++tid)
            graft_job(job, tid, nth, static_cast<const uint8_t*>(staging), blocks, layers, n_layers,
                      rows_per_block, esize);
    return 0;
}

}  // extern "C"
