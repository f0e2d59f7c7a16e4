// Decode-regime GEMM over mixed slots (LAYOUT v3): four-bit routed slots (MXFP4, INT4 or NVFP4, as released) and FP8
// 128x128 shared slots, few tokens per slot. Built at first use by runtime/moe_mixed_cuda.py (nvcc, sm_90a), launched
// through fuse_shared_mixed_decode.
//
// A program (4 warps, one warpgroup) computes 64 weight rows (the MMA's M side, 16 per warp) times one M block of 8
// (token, slot) pairs (the MMA's N side) over a K range. Decode is bound by the weight bytes, so the K range streams
// through a ring of STAGES shared-memory stages (3, 4 or 6; dynamic shared memory) filled by cp.async: 16-byte copies,
// each run of 8 threads one 128-byte row segment, so every load instruction moves whole cache lines and STAGES - 1
// stages are in flight while one is computed. A stage is 128 bytes of each weight row (256 inputs of a four-bit row,
// 128 of an FP8 one) with the rows' scales, the activations of the 8 pairs and their 1x128 scales. The weights of the
// first stages are requested before the program waits for the launch before it (a programmatic dependent launch).
//
// The MMAs, e4m3 x e4m3 -> f32, one per 32 inputs:
// - on Hopper (sm_90a) wgmma m64n8k32, A (the weights) from registers, B (the activations) from shared memory, where
//   each stage's activations are stored de-interleaved into the MMA's K order once, for all 64 rows; mma.sync's e4m3
//   MMAs are emulated there (each becomes 12 conversions to FP16 and two FP16 MMAs), wgmma's are native;
// - elsewhere (sm_89, or decode_mma "mma.sync") mma.sync m16n8k32 per warp, B read from the same layout.
//
// The K order inside each 32-input group is permuted, the same way for A and B, so that each thread's A fragment is
// four contiguous bytes of the stored row:
//   thread (g = lane / 4, c = lane % 4), group j: bytes 16j + 4c .. 16j + 4c + 3 of row g hold inputs
//   32j + 8c .. 32j + 8c + 7, two per byte (the first in the low nibble). The low nibbles fill MMA slots 4c .. 4c+3,
//   the high nibbles slots 16 + 4c .. 16 + 4c + 3: slot s < 16 holds input 2s, slot 16 + s input 2s + 1, so B is the
//   group's even inputs, then its odd ones.
// FP8 shared rows use the same permutation (an 8-byte load and two permutes per row), so both kinds of slot share B.
// The rows' shared-memory strides (144 and 160 bytes) make the A loads free of bank conflicts.
//
// The codes become e4m3 operands exactly, with no table, a few bit operations per four codes:
// - e2m1 (MXFP4, NVFP4): the code s.e.e.m becomes s.0.0.e.e.m.0.0, which reads as the e2m1 value times 2^-6 (normal
//   and subnormal alike);
// - INT4 (stored q + 8, q in -8..7): sign and magnitude |q| <= 8 in the low four bits, which read as q times 2^-9 (the
//   magnitudes 0..7 are e4m3's subnormals, 8 its least normal); or (INT4U, int4_codes "unsigned") the stored code
//   u = q + 8 itself, which reads as u times 2^-9, each group's sum then less 8 times the pair's activation sum over
//   the group (summed once per stage, for all 64 rows): one mask per four codes instead of seven operations.
// The power of two is folded into the output. Each scale group is its own MMA into a fresh accumulator (so wgmma's
// reduced-precision FP8 sums never run past 32 products), scaled in float32 by the group's scale (E8M0 per 32
// inputs, INT4's float per 32 << SHIFT, NVFP4's e4m3 per 16: two MMAs per 32 inputs, each thread's operands zeroed in
// the one whose half it does not hold); each 128 inputs are then scaled by the activations' 1x128 scale and NVFP4
// rows by their global scale, as the Triton kernel and the PyTorch reference do.
#include <cstdint>
#include <cuda_runtime.h>

#include "cuda_common.cuh"

namespace {

struct Params {
    const uint8_t* a;           // e4m3 activations [rows, K]
    const float* a_scale;       // [rows, K / 128]
    const uint8_t* r;           // routed codes [E, N, K / 2], two per byte (INT4: the words' bytes)
    const uint8_t* r_scale;     // routed scales [E, N, groups]: E8M0 / BF16, FP16 or F32 (INT4) / e4m3 (NVFP4)
    const uint8_t* s;           // shared FP8 [S, N, K]
    const float* s_scale;       // shared 128x128 scales [S, row blocks, K / 128]
    float* c;                   // float32 [split_k * shared_split, numel, N]
    const int32_t* sorted;      // pair of each M block column (aligned) or the flat slot ids (naive)
    const int32_t* expert_ids;  // slot of each M block (aligned)
    const int32_t* total;       // padded pair count (aligned) or the valid token count (naive, has_nvalid)
    const float* topk_w;        // routing weight per pair
    const float* r_global;      // NVFP4: float32 [E, 3], gate, up and down global scales
    int64_t N, K, numel, num_routed, num_slots, up_row, up_scale_row, a_div, global_col, scale_dtype;
    int64_t scale_bytes;        // routed scale bytes per row per 128 inputs (a multiple of 4, or 2 with K % 256 == 0)
    int64_t stride_am, stride_asm, stride_re, stride_rn, stride_rse, stride_rsn;  // routed strides in bytes
    int64_t stride_se, stride_sn, stride_sse, stride_ssn, stride_cm, c_split_stride;
    int64_t split_k, shared_split, naive, has_nvalid, mul_w;
    int64_t stages;             // the ring's depth (3, 4 or 6)
    int64_t pdl;                // launched as a programmatic dependent launch (waits for the previous launch's data)
    int64_t wgmma;              // the MMAs by wgmma (sm_90a), else by mma.sync
};

constexpr int BM = 8;          // pairs per M block (the MMA's N)
constexpr int WARPS = 4;       // warps per program, 16 rows each
constexpr int ROWS = WARPS * 16;
constexpr int THREADS = WARPS * 32;
constexpr int MXFP4 = 0, INT4 = 1, NVFP4 = 2;  // runtime.moe_mixed_cuda.FORMATS
// INT4 read as its stored codes u = q + 8 (runtime.moe_mixed_cuda.INT4_UNSIGNED): each nibble, alone in a byte, is the
// e4m3 value u times 2^-9 with no arithmetic; each group's sum then takes 8 times the pair's activation sum off
constexpr int INT4U = 3;
__host__ __device__ constexpr bool is_int4(int fmt) { return fmt == INT4 || fmt == INT4U; }
constexpr int SCALE_BF16 = 0, SCALE_F32 = 2;  // INT4's scale dtypes (Params.scale_dtype; 1: FP16)

// one stage in shared memory: weight rows, the routed rows' scales, the pairs' activations and their scales, the
// shared slot's block scale
constexpr int W4_STRIDE = 144;  // a four-bit row's 128 bytes + 16: thread (g, c)'s 4-byte loads hit 32 banks
constexpr int W8_STRIDE = 160;  // an FP8 row's 128 bytes + 32: conflict-free 8-byte loads
constexpr int SC_OFF = ROWS * W8_STRIDE;
// The pairs' activations of a stage, in the MMAs' K order: per 32-input group j, two 8 x 16-byte blocks (the even
// inputs of the group's 8 pairs, then the odd ones), a pair's 16 bytes contiguous: the layout wgmma reads as a K-major
// B operand without swizzle (core matrices of 8 rows of 16 bytes, the second K half LBO = 128 bytes on)
constexpr int X_GROUP = 2 * BM * 16;
constexpr int X_BYTES = 8 * X_GROUP;

// a routed row's scale bytes in a stage, as laid out (MXFP4 8, read as one 8-byte word; else at least 16, read as
// 16-byte words)
__host__ __device__ constexpr int scale_stride(int fmt, int64_t scale_bytes) {
    return fmt == MXFP4 ? 8 : (int)(2 * scale_bytes > 16 ? 2 * scale_bytes : 16);
}

// ... then the pairs' activation scales, the shared slot's block scale, and (INT4U) each group's activation sums
struct StageLayout {
    int x_off, as_off, bs_off, gs_off, bytes;
    __host__ __device__ StageLayout(int sc_stride)
        : x_off(SC_OFF + ROWS * sc_stride), as_off(x_off + X_BYTES), bs_off(as_off + 2 * BM * 4), gs_off(bs_off + 16),
          bytes(gs_off + 8 * BM * 4) {}
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src));
}

__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

__device__ __forceinline__ uint32_t e2m1_low_to_e4m3(uint32_t q) {
    return ((q & 0x08080808u) << 4) | ((q & 0x07070707u) << 2);
}

__device__ __forceinline__ uint32_t e2m1_high_to_e4m3(uint32_t q) {
    return (q & 0x80808080u) | ((q >> 2) & 0x1C1C1C1Cu);
}

// q + 8 in the low four bits of each byte -> sign.0.0.0.|q| (q times 2^-9 in e4m3): negative where bit 3 is clear,
// |q| = 8 - (q + 8) = ((q + 8) ^ 7) + 1 there; no byte carries into the next
__device__ __forceinline__ uint32_t int4_to_e4m3(uint32_t u) {
    const uint32_t neg = (~u >> 3) & 0x01010101u;
    return (((u & 0x07070707u) ^ (neg * 7u)) + neg) | (neg << 7);
}

template <int FMT>
__device__ __forceinline__ uint32_t expand_low(uint32_t q) {
    if constexpr (FMT == INT4U) return q & 0x0F0F0F0Fu;
    return FMT == INT4 ? int4_to_e4m3(q & 0x0F0F0F0Fu) : e2m1_low_to_e4m3(q);
}

template <int FMT>
__device__ __forceinline__ uint32_t expand_high(uint32_t q) {
    if constexpr (FMT == INT4U) return (q >> 4) & 0x0F0F0F0Fu;
    return FMT == INT4 ? int4_to_e4m3((q >> 4) & 0x0F0F0F0Fu) : e2m1_high_to_e4m3(q);
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// a K-major B operand in shared memory without swizzle: start, the second K half 128 bytes on (LBO), one 8-row block
__device__ __forceinline__ uint64_t b_desc(const void* smem) {
    return (uint64_t)((smem_addr(smem) & 0x3FFFF) >> 4) | ((uint64_t)(128 >> 4) << 16) | ((uint64_t)(256 >> 4) << 32);
}

// d = (scale_d ? d : 0) + A (64 x 32 e4m3, in registers: this thread's rows g and g + 8 of its warp's 16) x B (32 x 8)
// (the wgmma helpers trap where the build has no wgmma: the host launches them on sm_90a alone)
__device__ __forceinline__ void wgmma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint64_t desc, int scale_d) {
#ifdef FUSE_SHARED_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(scale_d));
#else
    __trap();
#endif
}

// pins an accumulator after the wait: the compiler may not move its reads above it
__device__ __forceinline__ void fence_operand(float (&d)[4]) {
    asm volatile("" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])::"memory");
}

__device__ __forceinline__ float e8m0(uint32_t s) {
    return s ? __uint_as_float(s << 23) : __uint_as_float(0x00400000u);  // 2^(s - 127); s = 0 is 2^-127
}

__device__ __forceinline__ float e4m3_to_float(uint32_t b) {  // one e4m3 byte (NVFP4's scales, never NaN)
    uint32_t h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((unsigned short)(b & 255u)));
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(h2 & 0xFFFFu)));
    return f;
}

__device__ __forceinline__ float half_to_float(uint32_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
}

// the sum of four e4m3 values (one word), in float32
__device__ __forceinline__ float e4m3x4_sum(uint32_t w) {
    uint32_t lo, hi;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(lo) : "h"((unsigned short)(w & 0xFFFFu)));
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hi) : "h"((unsigned short)(w >> 16)));
    return (half_to_float(lo & 0xFFFFu) + half_to_float(lo >> 16)) +
           (half_to_float(hi & 0xFFFFu) + half_to_float(hi >> 16));
}

// A routed row's scales for one stage (256 inputs), as copied: MXFP4 eight E8M0 bytes, NVFP4 sixteen e4m3 bytes,
// INT4 its groups' floats (BF16, FP16 or F32) from the stage's first group on
template <int FMT>
struct StageScales {
    uint32_t w[FMT == MXFP4 ? 2 : FMT == NVFP4 ? 4 : 8];
};

template <int FMT>
__device__ __forceinline__ StageScales<FMT> load_stage_scales(const uint8_t* row, int sc_stride) {
    StageScales<FMT> s = {};
    if constexpr (FMT == MXFP4) {
        const uint2 v = *reinterpret_cast<const uint2*>(row);
        s.w[0] = v.x, s.w[1] = v.y;
    } else {
#pragma unroll
        for (int i = 0; i < (FMT == NVFP4 ? 1 : 2); ++i) {
            if (16 * i >= sc_stride) break;  // INT4: only F32 scales in groups of 32 fill a second word
            const uint4 v = *reinterpret_cast<const uint4*>(row + 16 * i);
            s.w[4 * i] = v.x, s.w[4 * i + 1] = v.y, s.w[4 * i + 2] = v.z, s.w[4 * i + 3] = v.w;
        }
    }
    return s;
}

// the scale of the stage's 32-input group pos (0..7: k step pos / 4, group pos % 4), or of its 16-input half h (NVFP4)
template <int FMT, int SHIFT>
__device__ __forceinline__ float group_scale(const StageScales<FMT>& s, int pos, int h, int64_t dtype) {
    if constexpr (FMT == MXFP4) {
        return e8m0((s.w[pos >> 2] >> (8 * (pos & 3))) & 255u);
    } else if constexpr (FMT == NVFP4) {
        return e4m3_to_float((s.w[pos >> 1] >> (16 * (pos & 1) + 8 * h)) & 255u);
    } else {
        const int gi = pos >> SHIFT;
        const uint32_t half = (s.w[gi >> 1] >> (16 * (gi & 1))) & 0xFFFFu;
        if (dtype == SCALE_F32) return __uint_as_float(s.w[gi]);
        return dtype == SCALE_BF16 ? __uint_as_float(half << 16) : half_to_float(half);
    }
}

// t[jj][h] = A x B for JB consecutive 32-input groups of routed rows: A this thread's operands a[jj] (NVFP4: those of
// 16-input half h, the other half's zeroed), B the pairs' activations of the groups from xg0 on
template <int FMT, int JB, int H, bool WG>
__device__ __forceinline__ void routed_group_mmas(float (&t)[JB][H][4], const uint32_t (&a)[JB][4], const uint8_t* xg0,
                                                  bool first_half, int g, int c) {
    if constexpr (WG) {
        // every operand made before the fence: operands written between wgmmas would serialize them
        uint32_t am[JB][H][4];
#pragma unroll
        for (int jj = 0; jj < JB; ++jj)
#pragma unroll
            for (int h = 0; h < H; ++h) {
                const uint32_t keep = FMT != NVFP4 || first_half == (h == 0) ? ~0u : 0u;
#pragma unroll
                for (int r = 0; r < 4; ++r) am[jj][h][r] = a[jj][r] & keep;
            }
        wgmma_fence();
#pragma unroll
        for (int jj = 0; jj < JB; ++jj)
#pragma unroll
            for (int h = 0; h < H; ++h)
                wgmma_e4m3(t[jj][h], am[jj][h][0], am[jj][h][1], am[jj][h][2], am[jj][h][3],
                           b_desc(xg0 + jj * X_GROUP), 0);
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int jj = 0; jj < JB; ++jj)
#pragma unroll
            for (int h = 0; h < H; ++h) fence_operand(t[jj][h]);
    } else {
#pragma unroll
        for (int jj = 0; jj < JB; ++jj) {
            const uint8_t* xg = xg0 + jj * X_GROUP + 16 * g + 4 * c;
            const uint32_t b0 = *reinterpret_cast<const uint32_t*>(xg);
            const uint32_t b1 = *reinterpret_cast<const uint32_t*>(xg + BM * 16);
#pragma unroll
            for (int h = 0; h < H; ++h) {
                const uint32_t keep = FMT != NVFP4 || first_half == (h == 0) ? ~0u : 0u;
                t[jj][h][0] = t[jj][h][1] = t[jj][h][2] = t[jj][h][3] = 0.f;
                mma_e4m3(t[jj][h], a[jj][0] & keep, a[jj][1] & keep, a[jj][2] & keep, a[jj][3] & keep, b0, b1);
            }
        }
    }
}

// blk = A x B over the 4 groups of an FP8 stage (128 inputs): A this thread's operands a[j], B the pairs' activations
template <bool WG>
__device__ __forceinline__ void shared_group_mmas(float (&blk)[4], const uint32_t (&a)[4][4], const uint8_t* xs, int g,
                                                  int c) {
    blk[0] = blk[1] = blk[2] = blk[3] = 0.f;
    if constexpr (WG) {
        // one accumulator per 32 inputs, summed in float32: wgmma adds FP8 products in reduced precision
        float t[4][4];
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j) wgmma_e4m3(t[j], a[j][0], a[j][1], a[j][2], a[j][3], b_desc(xs + j * X_GROUP), 0);
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            fence_operand(t[j]);
#pragma unroll
            for (int r = 0; r < 4; ++r) blk[r] += t[j][r];
        }
    } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint8_t* xg = xs + j * X_GROUP + 16 * g + 4 * c;
            mma_e4m3(blk, a[j][0], a[j][1], a[j][2], a[j][3], *reinterpret_cast<const uint32_t*>(xg),
                     *reinterpret_cast<const uint32_t*>(xg + BM * 16));
        }
    }
}

template <int FMT, int SHIFT, int STAGES, bool WG>
__global__ void __launch_bounds__(THREADS, 4) mixed_decode_kernel(const Params p) {
    extern __shared__ __align__(16) uint8_t ring[];  // STAGES stages of StageLayout(sc_stride).bytes
    const int sc_stride = scale_stride(FMT, p.scale_bytes);
    const StageLayout L(sc_stride);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, c = lane & 3;
    const int64_t pid_m = blockIdx.y, pid_k = blockIdx.z;
    int64_t e;
    if (p.naive) {
        e = p.sorted[pid_m];
        if (e < 0 || e >= p.num_slots || (p.has_nvalid && *p.total < 1)) return;
    } else {
        if (pid_m * BM >= *p.total) return;
        e = p.expert_ids[pid_m];
        if (e < 0 || e >= p.num_slots) return;
    }
    // the pair in column q of this M block (numel where none: padding, or naive blocks' columns past the first)
    auto pair_of = [&](int q) -> int64_t {
        if (p.naive) return q == 0 ? pid_m : p.numel;
        return p.sorted[pid_m * BM + q];
    };
    const int64_t n0 = (int64_t)blockIdx.x * ROWS;
    if (n0 >= p.N) return;
    const bool routed = e < p.num_routed;
    const int64_t nk = p.K / 128;
    // this program's stages: four-bit stages of 256 inputs over split_k parts, FP8 stages of 128 inputs over
    // split_k * shared_split parts (gridDim.z); a routed program past its parts writes zeros
    int64_t first, count;
    if (routed) {
        const int64_t nst = (nk + 1) / 2, per = (nst + p.split_k - 1) / p.split_k;
        first = pid_k * per;
        count = pid_k < p.split_k ? (first + per < nst ? per : nst - first) : 0;
    } else {
        const int64_t parts = p.split_k * p.shared_split, per = (nk + parts - 1) / parts;
        first = pid_k * per;
        count = first + per < nk ? per : nk - first;
    }
    if (count < 0) count = 0;

    // what this thread copies, fixed over the stages: one 32-input group of one pair's activations (routed stages
    // hold 8 groups, FP8 ones 4) and one activation scale
    const int groups = routed ? 8 : 4;
    const int xq = tid / groups, xj = tid % groups;
    const int64_t x_pair = xq < BM ? pair_of(xq) : p.numel;
    const int asq = routed ? tid >> 1 : tid - 64;
    const bool copies_as = routed ? tid < 16 : tid >= 64 && tid < 72;
    const int64_t as_pair = copies_as ? pair_of(asq) : p.numel;
    const uint8_t* x_src = p.a + (x_pair < p.numel ? x_pair / p.a_div : 0) * p.stride_am + 32 * xj;
    const float* as_src = p.a_scale + (as_pair < p.numel ? as_pair / p.a_div : 0) * p.stride_asm;

    const int64_t sl = e - p.num_routed;
    const uint8_t* w_src =
        routed ? p.r + e * p.stride_re + n0 * p.stride_rn : p.s + sl * p.stride_se + n0 * p.stride_sn;
    const int64_t w_stride = routed ? p.stride_rn : p.stride_sn;
    const uint8_t* sc_src = p.r_scale + e * p.stride_rse + n0 * p.stride_rsn;
    // the shared slot's 128x128 scale row: a program's 64 rows lie in one 128-row block (up_row is a multiple of 128)
    const int64_t srow = n0 < p.up_row ? n0 / 128 : p.up_scale_row + (n0 - p.up_row) / 128;
    const float* bs_src = p.s_scale + (routed ? 0 : sl * p.stride_sse + srow * p.stride_ssn);

    auto stage = [&](int64_t i) { return ring + (i % STAGES) * L.bytes; };
    auto steps_in = [&](int64_t i) { return routed && 2 * (first + i) + 1 >= nk ? 1 : 2; };  // routed: 128 inputs
    // stage i's weights and their scales, and its activation scales, by cp.async; the weights never depend on the
    // launch before this one (the activation scales do: only after the prologue's wait)
    auto copy_weights = [&](int64_t i) {
        uint8_t* st = stage(i);
        const int64_t k = first + i;  // stage index: four-bit 256 inputs, FP8 128
        if (routed) {
            const int nks = steps_in(i);
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                const int idx = tid + THREADS * t, r = idx >> 3, ch = idx & 7;
                if (ch < 4 * nks) cp_async16(st + r * W4_STRIDE + 16 * ch, w_src + r * w_stride + k * 128 + 16 * ch);
            }
            const int nw = (int)(nks * p.scale_bytes) >> 2;  // scale words per row (1..8)
            for (int idx = tid; idx < ROWS * nw; idx += THREADS) {
                const int r = idx / nw, w = idx - r * nw;
                cp_async4(st + SC_OFF + r * sc_stride + 4 * w,
                          sc_src + r * p.stride_rsn + k * 2 * p.scale_bytes + 4 * w);
            }
        } else {
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                const int idx = tid + THREADS * t, r = idx >> 3, ch = idx & 7;
                cp_async16(st + r * W8_STRIDE + 16 * ch, w_src + r * w_stride + k * 128 + 16 * ch);
            }
            if (tid == 72) cp_async4(st + L.bs_off, bs_src + k);
        }
    };
    auto copy_act_scale = [&](int64_t i, bool async) {
        const int64_t k = first + i;
        if (as_pair >= p.numel || (routed && (tid & 1) >= steps_in(i))) return;
        float* dst = reinterpret_cast<float*>(stage(i) + L.as_off) + (routed ? tid : asq);
        const float* src = as_src + (routed ? 2 * k + (tid & 1) : k);
        if (async) cp_async4(dst, src);
        else *dst = *src;
    };
    // this thread's activation group of stage i (the previous launch's output): loaded into registers, then stored
    // de-interleaved (even inputs, odd inputs: the MMAs' K order) once the stage's buffer is free
    struct XGroup {
        uint4 lo, hi;
        bool ok;
    };
    auto load_x = [&](int64_t i) {
        XGroup v;
        v.ok = x_pair < p.numel && xj < 4 * steps_in(i);
        if (v.ok) {
            const uint8_t* src = x_src + (first + i) * (routed ? 256 : 128);
            v.lo = *reinterpret_cast<const uint4*>(src);
            v.hi = *reinterpret_cast<const uint4*>(src + 16);
        }
        return v;
    };
    auto store_x = [&](int64_t i, const XGroup& v) {
        if (!v.ok) return;
        uint8_t* dst = stage(i) + L.x_off + xj * X_GROUP + 16 * xq;
        *reinterpret_cast<uint4*>(dst) =
            make_uint4(prmt(v.lo.x, v.lo.y, 0x6420u), prmt(v.lo.z, v.lo.w, 0x6420u), prmt(v.hi.x, v.hi.y, 0x6420u),
                       prmt(v.hi.z, v.hi.w, 0x6420u));
        *reinterpret_cast<uint4*>(dst + BM * 16) =
            make_uint4(prmt(v.lo.x, v.lo.y, 0x7531u), prmt(v.lo.z, v.lo.w, 0x7531u), prmt(v.hi.x, v.hi.y, 0x7531u),
                       prmt(v.hi.z, v.hi.w, 0x7531u));
        if constexpr (FMT == INT4U) {
            const float sum = (e4m3x4_sum(v.lo.x) + e4m3x4_sum(v.lo.y)) + (e4m3x4_sum(v.lo.z) + e4m3x4_sum(v.lo.w)) +
                              ((e4m3x4_sum(v.hi.x) + e4m3x4_sum(v.hi.y)) + (e4m3x4_sum(v.hi.z) + e4m3x4_sum(v.hi.w)));
            reinterpret_cast<float*>(stage(i) + L.gs_off)[xj * BM + xq] = sum;
        }
        if constexpr (WG) fence_proxy_async();
    };

    // the accumulator's pairs: the accumulator's columns 2c and 2c + 1
    const int64_t pair_0 = pair_of(2 * c), pair_1 = pair_of(2 * c + 1);
    const bool ok_0 = pair_0 < p.numel, ok_1 = pair_1 < p.numel;
    const int r0 = warp * 16 + g, r1 = r0 + 8;  // this thread's rows in the program
    float acc[4] = {0.f, 0.f, 0.f, 0.f};

    // the prologue: the first STAGES - 1 stages' weights, one copy group each, in flight before this program waits
    // for the launch before it (a programmatic dependent launch starts while that one drains); then their
    // activations, which that launch wrote
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < count) copy_weights(i);
        cp_async_commit();
    }
#if __CUDA_ARCH__ >= 900
    if (p.pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;");
    }
#endif
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < count) {
            store_x(i, load_x(i));
            copy_act_scale(i, false);
        }
    }
    for (int64_t i = 0; i < count; ++i) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        // the stage STAGES - 1 on, into the buffer computed in the last iteration, which every thread has left: its
        // copies now (an empty group past the end keeps the wait counts uniform), its activations loaded now and
        // stored after this stage's MMAs
        const int64_t next = i + STAGES - 1;
        XGroup xv;
        xv.ok = false;
        if (next < count) {
            copy_weights(next);
            copy_act_scale(next, true);
            xv = load_x(next);
        }
        cp_async_commit();
        const uint8_t* st = stage(i);
        const uint8_t* xs = st + L.x_off;
        const float* as = reinterpret_cast<const float*>(st + L.as_off);
        if (routed) {
            const int nks = steps_in(i);
            const StageScales<FMT> sc0 = load_stage_scales<FMT>(st + SC_OFF + r0 * sc_stride, sc_stride);
            const StageScales<FMT> sc1 = load_stage_scales<FMT>(st + SC_OFF + r1 * sc_stride, sc_stride);
            const bool first_half = c < 2;  // NVFP4: this thread's inputs 8c .. 8c + 7 lie in the group's first 16
            constexpr int H = FMT == NVFP4 ? 2 : 1;
            constexpr int JB = 4 / H;  // 32-input groups per batch of MMAs (NVFP4's two per group: half as many)
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                if (u >= nks) break;
                float blk[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int jb = 0; jb < 4; jb += JB) {
                    uint32_t a[JB][4];
#pragma unroll
                    for (int jj = 0; jj < JB; ++jj) {
                        const int at = 64 * u + 16 * (jb + jj) + 4 * c;
                        const uint32_t q0 = *reinterpret_cast<const uint32_t*>(st + r0 * W4_STRIDE + at);
                        const uint32_t q1 = *reinterpret_cast<const uint32_t*>(st + r1 * W4_STRIDE + at);
                        a[jj][0] = expand_low<FMT>(q0), a[jj][1] = expand_low<FMT>(q1);
                        a[jj][2] = expand_high<FMT>(q0), a[jj][3] = expand_high<FMT>(q1);
                    }
                    float t[JB][H][4];
                    routed_group_mmas<FMT, JB, H, WG>(t, a, xs + (4 * u + jb) * X_GROUP, first_half, g, c);
                    if constexpr (FMT == INT4U) {  // sum (u - 8) x = sum u x - 8 sum x, in units of 2^-9
                        const float* gs = reinterpret_cast<const float*>(st + L.gs_off) + (4 * u + jb) * BM;
#pragma unroll
                        for (int jj = 0; jj < JB; ++jj) {
                            const float s0 = ok_0 ? gs[jj * BM + 2 * c] : 0.f;
                            const float s1 = ok_1 ? gs[jj * BM + 2 * c + 1] : 0.f;
                            t[jj][0][0] = fmaf(-0.015625f, s0, t[jj][0][0]);
                            t[jj][0][1] = fmaf(-0.015625f, s1, t[jj][0][1]);
                            t[jj][0][2] = fmaf(-0.015625f, s0, t[jj][0][2]);
                            t[jj][0][3] = fmaf(-0.015625f, s1, t[jj][0][3]);
                        }
                    }
#pragma unroll
                    for (int jj = 0; jj < JB; ++jj)
#pragma unroll
                        for (int h = 0; h < H; ++h) {
                            const float g0 = group_scale<FMT, SHIFT>(sc0, 4 * u + jb + jj, h, p.scale_dtype);
                            const float g1 = group_scale<FMT, SHIFT>(sc1, 4 * u + jb + jj, h, p.scale_dtype);
                            blk[0] = fmaf(t[jj][h][0], g0, blk[0]);
                            blk[1] = fmaf(t[jj][h][1], g0, blk[1]);
                            blk[2] = fmaf(t[jj][h][2], g1, blk[2]);
                            blk[3] = fmaf(t[jj][h][3], g1, blk[3]);
                        }
                }
                const float as0 = ok_0 ? as[2 * (2 * c) + u] : 0.f, as1 = ok_1 ? as[2 * (2 * c + 1) + u] : 0.f;
                acc[0] = fmaf(blk[0], as0, acc[0]);
                acc[1] = fmaf(blk[1], as1, acc[1]);
                acc[2] = fmaf(blk[2], as0, acc[2]);
                acc[3] = fmaf(blk[3], as1, acc[3]);
            }
        } else {
            uint32_t a[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint2 v0 = *reinterpret_cast<const uint2*>(st + r0 * W8_STRIDE + 32 * j + 8 * c);
                const uint2 v1 = *reinterpret_cast<const uint2*>(st + r1 * W8_STRIDE + 32 * j + 8 * c);
                a[j][0] = prmt(v0.x, v0.y, 0x6420u), a[j][1] = prmt(v1.x, v1.y, 0x6420u);
                a[j][2] = prmt(v0.x, v0.y, 0x7531u), a[j][3] = prmt(v1.x, v1.y, 0x7531u);
            }
            float blk[4];
            shared_group_mmas<WG>(blk, a, xs, g, c);
            const float bs = *reinterpret_cast<const float*>(st + L.bs_off);
            const float as0 = ok_0 ? as[2 * c] * bs : 0.f, as1 = ok_1 ? as[2 * c + 1] * bs : 0.f;
            acc[0] = fmaf(blk[0], as0, acc[0]);
            acc[1] = fmaf(blk[1], as1, acc[1]);
            acc[2] = fmaf(blk[2], as0, acc[2]);
            acc[3] = fmaf(blk[3], as1, acc[3]);
        }
        if (next < count) store_x(next, xv);
    }
    cp_async_wait<0>();  // no copy outlives the program
    if (routed) {
        // the e4m3 operands are the codes' values times 2^-6 (e2m1) or 2^-9 (INT4); NVFP4 rows take their global scale
        float f0 = is_int4(FMT) ? 512.f : 64.f, f1 = f0;
        if constexpr (FMT == NVFP4) {
            const float* gl = p.r_global + e * 3 + p.global_col;
            f0 *= __ldg(gl + (n0 + r0 >= p.up_row ? 1 : 0));
            f1 *= __ldg(gl + (n0 + r1 >= p.up_row ? 1 : 0));
        }
        acc[0] *= f0;
        acc[1] *= f0;
        acc[2] *= f1;
        acc[3] *= f1;
    }
    float* out = p.c + pid_k * p.c_split_stride;
    const int64_t row0 = n0 + r0, row1 = n0 + r1;
    if (ok_0) {
        const float w = p.mul_w ? p.topk_w[pair_0] : 1.f;
        out[pair_0 * p.stride_cm + row0] = acc[0] * w;
        out[pair_0 * p.stride_cm + row1] = acc[2] * w;
    }
    if (ok_1) {
        const float w = p.mul_w ? p.topk_w[pair_1] : 1.f;
        out[pair_1 * p.stride_cm + row0] = acc[1] * w;
        out[pair_1 * p.stride_cm + row1] = acc[3] * w;
    }
}

template <int FMT, int SHIFT, int STAGES, bool WG>
int launch_stages(const Params* p, dim3 grid, cudaStream_t st) {
    const auto kernel = mixed_decode_kernel<FMT, SHIFT, STAGES, WG>;
    const int smem = STAGES * StageLayout(scale_stride(FMT, p->scale_bytes)).bytes;
    return launch_kernel(kernel, grid, dim3(THREADS), smem, st, p->pdl != 0, *p);
}

template <int FMT, int SHIFT>
int launch(const Params* p, dim3 grid, cudaStream_t st) {
    switch (p->stages * 2 + (p->wgmma ? 1 : 0)) {
        case 6: return launch_stages<FMT, SHIFT, 3, false>(p, grid, st);
        case 7: return launch_stages<FMT, SHIFT, 3, true>(p, grid, st);
        case 8: return launch_stages<FMT, SHIFT, 4, false>(p, grid, st);
        case 9: return launch_stages<FMT, SHIFT, 4, true>(p, grid, st);
        case 12: return launch_stages<FMT, SHIFT, 6, false>(p, grid, st);
        case 13: return launch_stages<FMT, SHIFT, 6, true>(p, grid, st);
        default: return (int)cudaErrorInvalidValue;
    }
}

}  // namespace

// Returns the CUDA error code of the launch (0: launched). fmt: 0 MXFP4, 1 INT4, 2 NVFP4, 3 INT4 read unsigned; shift:
// INT4's scale groups
// are 32 << shift inputs (0, 1 or 2).
// (Params is the caller's struct, passed as void*: a signature naming a type of the unnamed namespace would give the
// function internal linkage, and the library would not export it)
extern "C" int fuse_shared_mixed_decode(const void* params, int64_t fmt, int64_t grid_m, int64_t shift,
                                        void* stream) {
    const Params* p = static_cast<const Params*>(params);
    const dim3 grid((unsigned)((p->N + ROWS - 1) / ROWS), (unsigned)grid_m, (unsigned)(p->split_k * p->shared_split));
    const cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (fmt == MXFP4) return launch<MXFP4, 0>(p, grid, st);
    if (fmt == NVFP4) return launch<NVFP4, 0>(p, grid, st);
    if (fmt == INT4 && shift == 0) return launch<INT4, 0>(p, grid, st);
    if (fmt == INT4 && shift == 1) return launch<INT4, 1>(p, grid, st);
    if (fmt == INT4 && shift == 2) return launch<INT4, 2>(p, grid, st);
    if (fmt == INT4U && shift == 0) return launch<INT4U, 0>(p, grid, st);
    if (fmt == INT4U && shift == 1) return launch<INT4U, 1>(p, grid, st);
    if (fmt == INT4U && shift == 2) return launch<INT4U, 2>(p, grid, st);
    return (int)cudaErrorInvalidValue;
}
