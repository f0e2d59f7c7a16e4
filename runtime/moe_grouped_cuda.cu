// Prefill-regime grouped GEMM over FP8 slots (e4m3 weights with 128x128 block scales, e4m3 activations with 1x128
// scales): GEMM1 (gate | up) or GEMM2 (down) of the fused MoE when each slot has many pairs. Built at first use by
// runtime/moe_grouped_cuda.py (nvcc, sm_90a: wgmma), launched through fuse_shared_grouped_gemm.
//
// The (token, slot) pairs come bucketed by slot in M blocks of 128 (runtime.moe_triton._align: a pair id per row,
// numel for padding, one slot per block). A tile is one M block times 128 output columns, over all of K.
//
// Warp specialization, persistent: a program is three warpgroups on one multiprocessor, looping over the tiles in
// grouped order (group_m M blocks, then the next column block, so that an expert's blocks read its weight tile at
// the same time and the activations stay in L2 across the column blocks):
// - the producer warpgroup copies each 128-input K step of the tile (the 128 rows of activations gathered by pair id,
//   the 128 weight rows, their scales) into a ring of STAGES shared-memory stages by cp.async, 16-byte copies, four
//   whole 128-byte rows per warp instruction, stored in the 128-byte swizzle wgmma reads; each thread's copies arrive
//   on the stage's "full" barrier when they land (cp.async.mbarrier.arrive);
// - two consumer warpgroups, 64 rows each, wait for a stage, run four wgmma m64n128k32 e4m3 MMAs (both operands from
//   shared memory) into a fresh float32 accumulator, release the stage ("empty" barrier) and add the accumulator
//   times the rows' activation scales and the weight block's scale into the tile's sum: the per-128-input promotion
//   the block scales need, in float32, as the Triton kernel and the reference do. While one consumer promotes, the
//   other's MMAs keep the tensor cores busy. A consumer whose 64 rows are all padding (the bucket's tail) skips its
//   MMAs: buckets cost whole 64-row halves, not whole 128-row tiles.
// The epilogue stores each row to its pair's row of c (GEMM2: times the pair's routing weight), bf16 or float32,
// while the producer already fills the stages of the program's next tile. GEMM1 may be gated: each tile pairs 64 gate
// rows with the 64 up rows of the same h columns, and the epilogue writes SwiGLU's h, half the bytes of gate | up.
#include <cstdint>
#include <cuda.h>  // CUtensorMap and its encoding's enums (the function itself through the runtime's entry points)
#include <cuda_runtime.h>

#include "cuda_common.cuh"

namespace {

struct Params {
    const uint8_t* a;           // e4m3 activations [rows, K] (row stride stride_am bytes)
    const float* a_scale;       // their 1x128 scales (strides stride_asm, stride_ask)
    const uint8_t* b;           // e4m3 weights [E, N, K] (strides stride_be, stride_bn bytes; K contiguous)
    const float* b_scale;       // 128x128 scales [E, N / 128, K / 128]
    void* c;                    // bf16 or float32 [numel, N] (row stride stride_cm elements)
    const int32_t* sorted;      // the pair of each row of the M blocks (numel: padding)
    const int32_t* expert_ids;  // the slot of each M block
    const int32_t* total;       // the padded pair count (M blocks times 128)
    const float* topk_w;        // the routing weight of each pair (mul_w)
    const float* alpha;         // gated: each slot's SwiGLU parameters
    const float* beta;
    const float* limit;
    int64_t N, K, numel, num_experts, a_div, max_m_blocks;
    int64_t gated, up_row, up_scale_row, post_clamp;  // gated: the up half's first weight row and scale row
    int64_t stride_am, stride_asm, stride_ask, stride_be, stride_bn, stride_bse, stride_bsn, stride_bsk, stride_cm;
    int64_t mul_w, out_f32, group_m, pdl;
    int64_t overlap;            // the next K step's MMAs in flight while a step is promoted (two accumulators)
    int64_t loads;              // 0: both operands by cp.async; 1: the weight tiles by tensor copies; 2: both
    int64_t b_rows, b_slots;    // the weights' rows per slot and slots (the tensor map's extent)
    int64_t a_rows;             // the activations' rows (their tensor map's extent)
};

constexpr int BM = 128, BN = 128, BK = 128;
constexpr int THREADS = 384;                  // the producer warpgroup, then two consumer warpgroups
constexpr int TILE = BM * BK;                 // bytes of one stage's activations, and of its weights (BN = BM)
constexpr int CONSUMER_WARPS = 8;
// registers per thread after the split (128 x 40 + 256 x 232 <= 64K): the consumers hold two accumulators and the sum
constexpr int PRODUCER_REGISTERS = 40, CONSUMER_REGISTERS = 232;

// ---- cp.async and mbarriers
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, uint32_t src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

// the barrier's arrival when this thread's earlier cp.async copies have landed (counted in the barrier's init count)
__device__ __forceinline__ void mbar_arrive_on_copies(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// bytes more that the barrier's phase waits for (tensor copies' transactions), with no arrival
__device__ __forceinline__ void mbar_expect_bytes(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}

// one row of the activations' tensor map (128 inputs) into shared memory; the 128-byte swizzle follows the
// destination's address bits, so a row lands where a tile copy would have put it
__device__ __forceinline__ void tma_load_row(uint32_t dst, const CUtensorMap* map, uint64_t* bar, int k, int row) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(smem_addr(bar))
        : "memory");
}

// a box of the weights' tensor map (128 inputs x 64 rows of one slot) into shared memory, in the map's 128-byte
// swizzle, counted on bar when it lands
__device__ __forceinline__ void tma_load_box(uint32_t dst, const CUtensorMap* map, uint64_t* bar, int k, int row,
                                             int slot) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
        ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(slot), "r"(smem_addr(bar))
        : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(smem_addr(bar)) : "memory");
}

// waits for the completion of the barrier's phase of this parity (the phase before a fresh barrier's counts as done)
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\nwait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n}" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}

// ---- wgmma (sm_90a)

// a K-major operand of 8-row groups of 128 bytes in the 128-byte swizzle, 1024 bytes per group
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
#ifdef FUSE_SHARED_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,"
        "%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,"
        "%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1;"
        "\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(scale_d));
#else
    __trap();
#endif
}

// the producer warpgroup's own barrier (named barrier 1: the consumers never wait on it)
__device__ __forceinline__ void producer_sync() { asm volatile("bar.sync 1, 128;" ::: "memory"); }

// the warpgroup's register budget from here on (the producer gives registers up for the consumers' accumulators)
template <int N>
__device__ __forceinline__ void set_max_registers() {
#ifdef FUSE_SHARED_WGMMA
    if constexpr (N < 168)
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
    else
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
#endif
}

// two floats as bf16, round to nearest even (lo in the low half)
__device__ __forceinline__ uint32_t bf16x2(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// keeps the compiler from moving reads of the accumulator above the wait for the MMAs writing it
__device__ __forceinline__ void fence_operands(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// the tile's M block and column block, in groups of group_m M blocks (an expert's blocks side by side)
__device__ __forceinline__ void tile_coords(int tile, int num_m, int num_n, int group_m, int& m, int& n) {
    const int per_group = group_m * num_n;
    const int g = tile / per_group, first = g * group_m;
    const int size = min(num_m - first, group_m);
    const int r = tile - g * per_group;
    m = first + r % size;
    n = r / size;
}

template <int STAGES>
struct Smem {
    static constexpr int AS_OFF = STAGES * 2 * TILE;             // activation scales [STAGES][BM]
    static constexpr int BS_OFF = AS_OFF + STAGES * BM * 4;      // weight block scale [STAGES] (16 bytes each)
    static constexpr int BAR_OFF = BS_OFF + STAGES * 16;         // full[STAGES], empty[STAGES]
    static constexpr int ROWS_OFF = BAR_OFF + 2 * STAGES * 8;    // the producer's row offsets of its tile [BM]
    static constexpr int BYTES = ROWS_OFF + BM * 4 + 1024;       // + the alignment of the base to 1024
};

// a consumer warpgroup's view of the ring for one tile: the stage and phase of the tile's K step kb, its MMAs, and
// its promotion into the tile's sum
template <int STAGES>
struct Ring {
    uint32_t base;
    uint64_t* full;
    uint64_t* empty;
    const float* s_as;
    const float* s_bs;
    uint32_t it0;  // the program's K steps before this tile
    int row;       // this thread's first row in the tile (the other is row + 8)

    __device__ __forceinline__ int stage(int kb) const { return (it0 + kb) % STAGES; }

    // waits for step kb's stage and issues its four MMAs (one commit group) into acc
    __device__ __forceinline__ void issue(float (&acc)[64], int kb, int half) const {
        const int s = stage(kb);
        mbar_wait(full + s, ((it0 + kb) / STAGES) & 1);
        fence_proxy_async();
        const uint32_t sa = base + s * 2 * TILE + half * 64 * 128, sb = base + s * 2 * TILE + TILE;
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) wgmma_m64n128k32(acc, sw128_desc(sa + 32 * k), sw128_desc(sb + 32 * k), k);
        wgmma_commit();
    }

    // step kb, whose MMAs into cur are in flight: issues step kb + 1's into next where kb + 1 < issue_until, waits
    // for step kb's, releases its stage, and adds cur times the rows' and the weight block's scales into sum
    template <bool GATED>
    __device__ __forceinline__ void step(float (&cur)[64], float (&next)[64], float (&sum)[64], int kb,
                                         int issue_until, int half, int lane) const {
        if (kb + 1 < issue_until) {
            issue(next, kb + 1, half);
            wgmma_wait<1>();
        } else {
            wgmma_wait<0>();
        }
        fence_operands(cur);
        const int s = stage(kb);
        const float as0 = s_as[s * BM + row], as1 = s_as[s * BM + row + 8], bsc = s_bs[s * 4];
        const float bsu = GATED ? s_bs[s * 4 + 1] : bsc;
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + s);
        const float f0 = as0 * bsc, f1 = as1 * bsc, u0 = as0 * bsu, u1 = as1 * bsu;  // GATED: u for the up half
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const float x0 = j >= 8 ? u0 : f0, x1 = j >= 8 ? u1 : f1;
            sum[4 * j + 0] += cur[4 * j + 0] * x0;
            sum[4 * j + 1] += cur[4 * j + 1] * x0;
            sum[4 * j + 2] += cur[4 * j + 2] * x1;
            sum[4 * j + 3] += cur[4 * j + 3] * x1;
        }
    }
};

// LAYOUT section 3, as runtime.moe_triton._swiglu
__device__ __forceinline__ float swiglu(float g, float u, float alpha, float beta, float lim, bool post_clamp) {
    if (!post_clamp) g = fminf(g, lim);
    u = fminf(fmaxf(u, -lim), lim);
    float act = g / (1.f + __expf(-alpha * g));
    if (post_clamp) act = fminf(act, lim);
    return act * (u + beta);
}

// GATED: a tile's 128 weight rows are 64 gate rows and the 64 up rows of the same h columns, so the epilogue puts
// each pair of sums through the slot's SwiGLU and writes 64 columns of h instead of 128 of gate | up
// OVERLAP: each K step's MMAs are issued before the previous step is promoted (two accumulators); else each step
// waits for its MMAs, then promotes
// LOADS 1: the weight tiles come by two tensor copies of 64 rows each, issued by one producer thread, instead of the
// producers' cp.async (which move them through the load/store units with the activations); LOADS 2: each producer
// thread's activation row too, by a one-row tensor copy (padding rows are left as they were: their sums are never
// stored)
template <int STAGES, bool GATED, bool OVERLAP, int LOADS>
__global__ void __launch_bounds__(THREADS, 1)
    grouped_gemm_kernel(const Params p, const __grid_constant__ CUtensorMap b_map,
                        const __grid_constant__ CUtensorMap a_map) {
    constexpr bool B_TMA = LOADS >= 1, A_TMA = LOADS == 2;
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);  // the swizzle needs 1024-aligned
    using L = Smem<STAGES>;
    float* s_as = reinterpret_cast<float*>(smem + L::AS_OFF);
    float* s_bs = reinterpret_cast<float*>(smem + L::BS_OFF);
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::BAR_OFF);
    uint64_t* empty = full + STAGES;
    const int tid = threadIdx.x, wg = tid / 128, t = tid % 128;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full + s, 128);              // every producer thread's copies (and the tensor copies' bytes)
            mbar_init(empty + s, CONSUMER_WARPS);  // every consumer warp done reading
        }
    }
    __syncthreads();
    if (p.pdl) {
        // the routing and the activations come from the launches before this one
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;");
    }
    const int num_m = __ldg(p.total) / BM;
    const int num_n = GATED ? (int)(p.up_row / 64) : (int)(p.N / BN), nk = (int)(p.K / BK);
    const int tiles = num_m * num_n, group_m = (int)p.group_m;
    const uint32_t base = smem_addr(smem);
    uint32_t it = 0;  // the K steps this program has passed through the ring
    if (wg == 0) {
        // producer: thread t copies 16-byte chunk t % 8 of rows t / 8 + 16 i (i < 8) of both operands, and the
        // activation scale of row t
        set_max_registers<PRODUCER_REGISTERS>();
        const int chunk = t % 8, row0 = t / 8;
        uint32_t* s_rows = reinterpret_cast<uint32_t*>(smem + L::ROWS_OFF);
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            int m, n;
            tile_coords(tile, num_m, num_n, group_m, m, n);
            const int e = __ldg(p.expert_ids + m);
            if (e < 0 || e >= p.num_experts) continue;
            // the tile's rows' byte offsets in a (32 bits: the host checks that a fits; ~0: padding), in shared memory
            // rather than registers: the producer runs on PRODUCER_REGISTERS
            const int my_pair = __ldg(p.sorted + (int64_t)m * BM + t);
            const bool my_ok = my_pair < p.numel;
            const int my_row = my_ok ? my_pair / (int)p.a_div : 0;
            producer_sync();  // the previous tile's offsets are read
            s_rows[t] = my_ok ? (uint32_t)my_row * (uint32_t)p.stride_am : ~0u;
            producer_sync();
            const float* as_row = p.a_scale + (int64_t)my_row * p.stride_asm;
            // weight row of copy i: row0 + 16 i of the tile; GATED, rows 0..63 are gate rows 64 n.., rows 64..127 the
            // up rows of the same h columns (up_row - 64 further on)
            const uint8_t* b_expert = p.b + e * p.stride_be + chunk * 16;
            const uint32_t first_row = GATED ? n * 64 : n * BN;
            const uint32_t b_off = (first_row + row0) * (uint32_t)p.stride_bn, b_step = 16 * (uint32_t)p.stride_bn;
            const uint32_t b_jump = GATED ? (uint32_t)(p.up_row - 64) * (uint32_t)p.stride_bn : 0u;
            const float* bs = p.b_scale + e * p.stride_bse + (first_row / 128) * p.stride_bsn;
            const float* bs_up = p.b_scale + e * p.stride_bse + (p.up_scale_row + first_row / 128) * p.stride_bsn;
            for (int kb = 0; kb < nk; ++kb, ++it) {
                const int s = it % STAGES;
                mbar_wait(empty + s, ((it / STAGES) & 1) ^ 1);
                const uint32_t sa = base + s * 2 * TILE + row0 * 128 + ((chunk ^ (row0 & 7)) * 16), sb = sa + TILE;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const uint32_t a_off = s_rows[row0 + 16 * i];  // rows 16 apart: the same swizzle as row0
                    if (!A_TMA)
                        cp_async16(sa + 2048 * i, p.a + (a_off == ~0u ? 0u : a_off) + chunk * 16 + kb * BK,
                                   a_off == ~0u ? 0 : 16);
                    if (!B_TMA)
                        cp_async16(sb + 2048 * i, b_expert + b_off + i * b_step + (i >= 4 ? b_jump : 0u) + kb * BK, 16);
                }
                if (A_TMA && my_ok) {
                    mbar_expect_bytes(full + s, BK);
                    tma_load_row(base + s * 2 * TILE + t * 128, &a_map, full + s, kb * BK, my_row);
                }
                if (B_TMA && t == 0) {
                    const uint32_t tile_b = base + s * 2 * TILE + TILE;
                    mbar_expect_bytes(full + s, TILE);
                    tma_load_box(tile_b, &b_map, full + s, kb * BK, first_row, e);
                    tma_load_box(tile_b + TILE / 2, &b_map, full + s, kb * BK,
                                 GATED ? (int)(p.up_row + first_row) : (int)first_row + 64, e);
                }
                cp_async4(base + L::AS_OFF + (s * BM + t) * 4, as_row + kb * p.stride_ask, my_ok ? 4 : 0);
                if (t == 0) cp_async4(base + L::BS_OFF + s * 16, bs + kb * p.stride_bsk, 4);
                if (GATED && t == 1) cp_async4(base + L::BS_OFF + s * 16 + 4, bs_up + kb * p.stride_bsk, 4);
                mbar_arrive_on_copies(full + s);
            }
        }
        return;
    }
    // consumers: warpgroup half (0, 1) takes rows 64 half .. 64 half + 63; its thread holds rows r0 and r0 + 8 of
    // them and columns 8 j + 2 (lane % 4) + {0, 1} of the accumulator (the wgmma D fragment)
    set_max_registers<CONSUMER_REGISTERS>();
    const int half = wg - 1, warp = t / 32, lane = t % 32;
    const int r0 = warp * 16 + lane / 4;
    float acc0[64], acc1[64], sum[64];
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int m, n;
        tile_coords(tile, num_m, num_n, group_m, m, n);
        const int e = __ldg(p.expert_ids + m);
        if (e < 0 || e >= p.num_experts) continue;
        const int64_t row_base = (int64_t)m * BM + half * 64;
        const bool live = __ldg(p.sorted + row_base) < p.numel;  // padding only at a bucket's end
        if (!live) {
            for (int kb = 0; kb < nk; ++kb, ++it) {
                mbar_wait(full + it % STAGES, (it / STAGES) & 1);
                __syncwarp();
                if (lane == 0) mbar_arrive(empty + it % STAGES);
            }
            continue;
        }
#pragma unroll
        for (int i = 0; i < 64; ++i) sum[i] = 0.f;
        const Ring<STAGES> ring{base, full, empty, s_as, s_bs, it, half * 64 + r0};
        if constexpr (OVERLAP) {
            // step kb + 1's MMAs (into the other accumulator) run while step kb is promoted
            ring.issue(acc0, 0, half);
            for (int kb = 0; kb < nk; kb += 2) {
                ring.template step<GATED>(acc0, acc1, sum, kb, nk, half, lane);
                if (kb + 1 < nk) ring.template step<GATED>(acc1, acc0, sum, kb + 1, nk, half, lane);
            }
        } else {
            for (int kb = 0; kb < nk; ++kb) {
                ring.issue(acc0, kb, half);
                ring.template step<GATED>(acc0, acc1, sum, kb, kb + 1, half, lane);
            }
        }
        it += nk;
        if (!live) continue;
        const int pair0 = __ldg(p.sorted + row_base + r0), pair1 = __ldg(p.sorted + row_base + r0 + 8);
        if constexpr (GATED) {
            // columns 8 j + 2 (lane % 4) of the gate half pair with the same ones of the up half (j + 8)
            const float al = __ldg(p.alpha + e), be = __ldg(p.beta + e), li = __ldg(p.limit + e);
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q)
                    sum[4 * j + q] = swiglu(sum[4 * j + q], sum[4 * (j + 8) + q], al, be, li, p.post_clamp != 0);
        }
        constexpr int JN = GATED ? 8 : 16;  // 8-column groups written
        const int64_t col = (int64_t)n * (GATED ? 64 : BN) + 2 * (lane % 4);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int pair = h ? pair1 : pair0;
            if (pair >= p.numel) continue;
            const float w = p.mul_w ? __ldg(p.topk_w + pair) : 1.f;
            if (p.out_f32) {
                float* out = static_cast<float*>(p.c) + pair * p.stride_cm + col;
#pragma unroll
                for (int j = 0; j < JN; ++j)
                    *reinterpret_cast<float2*>(out + 8 * j) = make_float2(sum[4 * j + 2 * h] * w, sum[4 * j + 2 * h + 1] * w);
            } else {
                uint16_t* out = static_cast<uint16_t*>(p.c) + pair * p.stride_cm + col;
#pragma unroll
                for (int j = 0; j < JN; ++j)
                    *reinterpret_cast<uint32_t*>(out + 8 * j) = bf16x2(sum[4 * j + 2 * h] * w, sum[4 * j + 2 * h + 1] * w);
            }
        }
    }
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// the weights [slots, rows, K] as a 3-D tensor map of bytes, boxes of 128 inputs x 64 rows in the 128-byte swizzle;
// the activations [rows, K] as a 2-D one, boxes of one row
int tensor_maps(const Params* p, CUtensorMap* b_map, CUtensorMap* a_map, bool activations) {
    static EncodeTiled encode = nullptr;
    if (!encode) {
        cudaDriverEntryPointQueryResult found;
        void* fn = nullptr;
        cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                                           &found);
        if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || !fn) return (int)cudaErrorNotSupported;
        encode = reinterpret_cast<EncodeTiled>(fn);
    }
    const cuuint64_t dims[3] = {(cuuint64_t)p->K, (cuuint64_t)p->b_rows, (cuuint64_t)p->b_slots};
    const cuuint64_t strides[2] = {(cuuint64_t)p->stride_bn, (cuuint64_t)p->stride_be};
    const cuuint32_t box[3] = {BK, 64, 1}, unit[3] = {1, 1, 1};
    CUresult r = encode(b_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<uint8_t*>(p->b), dims, strides, box,
                        unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r == CUDA_SUCCESS && activations) {
        const cuuint64_t a_dims[2] = {(cuuint64_t)p->K, (cuuint64_t)p->a_rows};
        const cuuint64_t a_strides[1] = {(cuuint64_t)p->stride_am};
        const cuuint32_t a_box[2] = {BK, 1};
        r = encode(a_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<uint8_t*>(p->a), a_dims, a_strides, a_box, unit,
                   CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    }
    return r == CUDA_SUCCESS ? 0 : (int)cudaErrorInvalidValue;
}

template <int STAGES, bool GATED, bool OVERLAP, int LOADS>
int launch_stages(const Params* p, cudaStream_t st) {
    const auto kernel = grouped_gemm_kernel<STAGES, GATED, OVERLAP, LOADS>;
    CUtensorMap map = {}, a_map = {};
    if (LOADS) {
        const int bad = tensor_maps(p, &map, &a_map, LOADS == 2);
        if (bad) return bad;
    }
    const int smem = Smem<STAGES>::BYTES;
    int device = 0, sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    const int64_t max_tiles = p->max_m_blocks * (GATED ? p->up_row / 64 : p->N / BN);
    const dim3 grid((unsigned)(max_tiles < sms ? max_tiles : sms));
    return launch_kernel(kernel, grid, dim3(THREADS), smem, st, p->pdl != 0, *p, map, a_map);
}

template <int STAGES, bool GATED>
int launch_schedule(const Params* p, cudaStream_t st) {
    switch ((p->overlap ? 3 : 0) + (int)p->loads) {
        case 0: return launch_stages<STAGES, GATED, false, 0>(p, st);
        case 1: return launch_stages<STAGES, GATED, false, 1>(p, st);
        case 2: return launch_stages<STAGES, GATED, false, 2>(p, st);
        case 3: return launch_stages<STAGES, GATED, true, 0>(p, st);
        case 4: return launch_stages<STAGES, GATED, true, 1>(p, st);
        case 5: return launch_stages<STAGES, GATED, true, 2>(p, st);
        default: return (int)cudaErrorInvalidValue;
    }
}

}  // namespace

// Returns the CUDA error code of the launch (0: launched). stages: the ring's depth (4, 5 or 6).
// (Params is the caller's struct, passed as void*: a signature naming a type of the unnamed namespace would give the
// function internal linkage, and the library would not export it)
extern "C" int fuse_shared_grouped_gemm(const void* params, int64_t stages, void* stream) {
    const Params* p = static_cast<const Params*>(params);
    const cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (p->max_m_blocks <= 0) return 0;
    switch (stages * 2 + (p->gated ? 1 : 0)) {
        case 8: return launch_schedule<4, false>(p, st);
        case 9: return launch_schedule<4, true>(p, st);
        case 10: return launch_schedule<5, false>(p, st);
        case 11: return launch_schedule<5, true>(p, st);
        case 12: return launch_schedule<6, false>(p, st);
        case 13: return launch_schedule<6, true>(p, st);
    }
    return (int)cudaErrorInvalidValue;
}
