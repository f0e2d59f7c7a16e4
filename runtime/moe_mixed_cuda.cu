// Decode-regime GEMM over mixed slots (LAYOUT v3): four-bit routed slots (MXFP4, INT4 or NVFP4, as released) and FP8
// 128x128 shared slots, few tokens per slot. Built at first use by runtime/moe_mixed_cuda.py (nvcc, sm_90a), launched
// through fuse_shared_mixed_decode.
//
// One warp computes 16 output rows (the weight rows: the MMA's M side) times one M block of 8 (token, slot) pairs
// (the MMA's N side), over a K range, with mma.sync m16n8k32 e4m3 x e4m3 -> f32. The weights are the A operand and
// come straight from global memory into the registers the MMA reads: no shared-memory round trip, which is what a
// Triton dot over expanded four-bit tiles costs on Hopper.
//
// The K order inside each 32-input group is permuted, the same way for A and B, so that each thread's A fragment is
// four contiguous bytes of the stored row:
//   thread (g = lane / 4, c = lane % 4), group j: bytes 16j + 4c .. 16j + 4c + 3 of row g hold inputs
//   32j + 8c .. 32j + 8c + 7, two per byte (the first in the low nibble). The low nibbles fill MMA slots 4c .. 4c+3,
//   the high nibbles slots 16 + 4c .. 16 + 4c + 3; B (the activations of pair g) takes inputs 32j + 8c + 2i for slot
//   4c + i and 32j + 8c + 2i + 1 for slot 16 + 4c + i, one 8-byte load and two byte permutes.
// FP8 shared rows use the same permutation (an 8-byte load and two permutes per row), so both kinds of slot share B.
//
// The codes become e4m3 operands exactly, with no table, a few bit operations per four codes:
// - e2m1 (MXFP4, NVFP4): the code s.e.e.m becomes s.0.0.e.e.m.0.0, which reads as the e2m1 value times 2^-6 (normal
//   and subnormal alike);
// - INT4 (stored q + 8, q in -8..7): sign and magnitude |q| <= 8 in the low four bits, which read as q times 2^-9 (the
//   magnitudes 0..7 are e4m3's subnormals, 8 its least normal).
// The power of two is folded into the output. Each scale group is its own MMA into a zeroed accumulator, scaled in
// float32 by the group's scale (E8M0 per 32 inputs, INT4's float per 32 << group_shift, NVFP4's e4m3 per 16: two
// MMAs per 32 inputs, each thread's operands zeroed in the one whose half it does not hold); each 128 inputs are then
// scaled by the activations' 1x128 scale and NVFP4 rows by their global scale, as the Triton kernel and the PyTorch
// reference do.
#include <cstdint>
#include <cuda_runtime.h>

namespace {

struct Params {
    const uint8_t* a;           // e4m3 activations [rows, K]
    const float* a_scale;       // [rows, K / 128]
    const uint8_t* r;           // routed codes [E, N, K / 2], two per byte (INT4: the words' bytes)
    const uint8_t* r_scale;     // routed scales [E, N, groups]: E8M0 / BF16, FP16 or F32 (INT4) / e4m3 (NVFP4)
    const uint8_t* s;           // shared FP8 [S, N, K]
    const float* s_scale;       // shared 128x128 scales [S, row blocks, K / 128]
    float* c;                   // float32 [split, numel, N]
    const int32_t* sorted;      // pair of each M block column (aligned) or the flat slot ids (naive)
    const int32_t* expert_ids;  // slot of each M block (aligned)
    const int32_t* total;       // padded pair count (aligned) or the valid token count (naive, has_nvalid)
    const float* topk_w;        // routing weight per pair
    const float* r_global;      // NVFP4: float32 [E, 3], gate, up and down global scales
    int64_t N, K, numel, num_routed, num_slots, up_row, up_scale_row, a_div, global_col, group_shift, scale_dtype;
    int64_t stride_am, stride_asm, stride_re, stride_rn, stride_rse, stride_rsn;  // routed strides in bytes
    int64_t stride_se, stride_sn, stride_sse, stride_ssn, stride_cm, c_split_stride;
    int64_t split_k, naive, has_nvalid, mul_w;
};

constexpr int BM = 8;       // pairs per M block (the MMA's N)
constexpr int WARPS = 4;    // warps per program, 16 rows each
constexpr int MXFP4 = 0, INT4 = 1, NVFP4 = 2;  // runtime.moe_mixed_cuda.FORMATS
constexpr int SCALE_BF16 = 0, SCALE_F16 = 1;  // INT4's scale dtypes (Params.scale_dtype; 2: F32)

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
    return FMT == INT4 ? int4_to_e4m3(q & 0x0F0F0F0Fu) : e2m1_low_to_e4m3(q);
}

template <int FMT>
__device__ __forceinline__ uint32_t expand_high(uint32_t q) {
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

__device__ __forceinline__ uint32_t ld32(const uint8_t* p) { return __ldg(reinterpret_cast<const uint32_t*>(p)); }

__device__ __forceinline__ uint2 ld64(const uint8_t* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }

__device__ __forceinline__ float e8m0(uint32_t s) {
    return s ? __uint_as_float(s << 23) : __uint_as_float(0x00400000u);  // 2^(s - 127); s = 0 is 2^-127
}

__device__ __forceinline__ float e4m3_to_float(uint32_t b) {  // one e4m3 byte (NVFP4's scales, never NaN)
    const uint32_t e = (b >> 3) & 15u, f = b & 7u;
    const float v = e ? __uint_as_float(((e + 120u) << 23) | (f << 20)) : (float)f * 0.001953125f;
    return (b & 128u) ? -v : v;
}

__device__ __forceinline__ float load_scale(const uint8_t* base, int64_t i, int64_t dtype) {  // INT4's group scale
    if (dtype == SCALE_BF16) return __uint_as_float((uint32_t)__ldg(reinterpret_cast<const uint16_t*>(base) + i) << 16);
    if (dtype == SCALE_F16) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(__ldg(reinterpret_cast<const uint16_t*>(base) + i)));
        return f;
    }
    return __ldg(reinterpret_cast<const float*>(base) + i);
}

// A row's scales for one K step of 128 inputs, as loaded: MXFP4 four E8M0 bytes (w[0]), NVFP4 eight e4m3 bytes
// (w[0], w[1]), INT4 four floats (one per 32 inputs, repeated where a group is longer)
template <int FMT>
struct StepScales {
    uint32_t w[FMT == MXFP4 ? 1 : FMT == NVFP4 ? 2 : 4];
};

template <int FMT>
__device__ __forceinline__ StepScales<FMT> load_step_scales(const uint8_t* row, int64_t k, const Params& p) {
    StepScales<FMT> s;
    if constexpr (FMT == MXFP4) {
        s.w[0] = ld32(row + k * 4);
    } else if constexpr (FMT == NVFP4) {
        const uint2 v = ld64(row + k * 8);
        s.w[0] = v.x;
        s.w[1] = v.y;
    } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
            s.w[j] = __float_as_uint(load_scale(row, (k * 4 + j) >> p.group_shift, p.scale_dtype));
    }
    return s;
}

// the scale of 32-input group j (MXFP4, INT4) or of its 16-input half h (NVFP4)
template <int FMT>
__device__ __forceinline__ float group_scale(const StepScales<FMT>& s, int j, int h) {
    if constexpr (FMT == MXFP4) return e8m0((s.w[0] >> (8 * j)) & 255u);
    else if constexpr (FMT == NVFP4) return e4m3_to_float((s.w[j >> 1] >> (16 * (j & 1) + 8 * h)) & 255u);
    else return __uint_as_float(s.w[j]);
}

template <int FMT, int U>
__global__ void __launch_bounds__(WARPS * 32) mixed_decode_kernel(const Params p) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, c = lane & 3;
    const int64_t pid_m = blockIdx.y, pid_k = blockIdx.z;
    int64_t e;
    int64_t pair_g, pair_0, pair_1;  // B's column g; the accumulator's columns 2c and 2c + 1
    if (p.naive) {
        e = p.sorted[pid_m];
        if (e < 0 || e >= p.num_slots || (p.has_nvalid && *p.total < 1)) return;
        pair_g = g == 0 ? pid_m : p.numel;
        pair_0 = c == 0 ? pid_m : p.numel;
        pair_1 = p.numel;
    } else {
        if (pid_m * BM >= *p.total) return;
        e = p.expert_ids[pid_m];
        if (e < 0 || e >= p.num_slots) return;
        pair_g = p.sorted[pid_m * BM + g];
        pair_0 = p.sorted[pid_m * BM + 2 * c];
        pair_1 = p.sorted[pid_m * BM + 2 * c + 1];
    }
    const int64_t n0 = (int64_t)blockIdx.x * (WARPS * 16) + warp * 16;
    if (n0 >= p.N) return;
    const int64_t row0 = n0 + g, row1 = row0 + 8;
    const bool ok_g = pair_g < p.numel, ok_0 = pair_0 < p.numel, ok_1 = pair_1 < p.numel;
    const uint8_t* x = p.a + (ok_g ? pair_g / p.a_div : 0) * p.stride_am + 8 * c;
    const float* xs0 = p.a_scale + (ok_0 ? pair_0 / p.a_div : 0) * p.stride_asm;
    const float* xs1 = p.a_scale + (ok_1 ? pair_1 / p.a_div : 0) * p.stride_asm;

    const int64_t nk = p.K / 128, per = (nk + p.split_k - 1) / p.split_k;
    const int64_t first = pid_k * per, stop = first + per < nk ? first + per : nk;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    const bool routed = e < p.num_routed;

    if (routed) {
        const uint8_t* w0 = p.r + e * p.stride_re + row0 * p.stride_rn + 4 * c;
        const uint8_t* w1 = w0 + 8 * p.stride_rn;
        const uint8_t* s0 = p.r_scale + e * p.stride_rse + row0 * p.stride_rsn;
        const uint8_t* s1 = s0 + 8 * p.stride_rsn;
        const bool first_half = c < 2;  // NVFP4: this thread's inputs 8c .. 8c + 7 lie in the group's first 16
        for (int64_t kb = first; kb < stop; kb += U) {
            uint32_t q0[U][4], q1[U][4];
            StepScales<FMT> sc0[U], sc1[U];
            uint2 xv[U][4];
            float as0[U], as1[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int64_t k = kb + u < stop ? kb + u : stop - 1;  // a repeated last step, not added below
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    q0[u][j] = ld32(w0 + k * 64 + 16 * j);
                    q1[u][j] = ld32(w1 + k * 64 + 16 * j);
                    xv[u][j] = ok_g ? ld64(x + k * 128 + 32 * j) : make_uint2(0u, 0u);
                }
                sc0[u] = load_step_scales<FMT>(s0, k, p);
                sc1[u] = load_step_scales<FMT>(s1, k, p);
                as0[u] = ok_0 ? __ldg(xs0 + k) : 0.f;
                as1[u] = ok_1 ? __ldg(xs1 + k) : 0.f;
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (kb + u >= stop) break;
                float blk[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const uint32_t b0 = prmt(xv[u][j].x, xv[u][j].y, 0x6420u);
                    const uint32_t b1 = prmt(xv[u][j].x, xv[u][j].y, 0x7531u);
                    const uint32_t a0 = expand_low<FMT>(q0[u][j]), a1 = expand_low<FMT>(q1[u][j]);
                    const uint32_t a2 = expand_high<FMT>(q0[u][j]), a3 = expand_high<FMT>(q1[u][j]);
#pragma unroll
                    for (int h = 0; h < (FMT == NVFP4 ? 2 : 1); ++h) {
                        const bool mine = FMT != NVFP4 || first_half == (h == 0);
                        float t[4] = {0.f, 0.f, 0.f, 0.f};
                        mma_e4m3(t, mine ? a0 : 0u, mine ? a1 : 0u, mine ? a2 : 0u, mine ? a3 : 0u, b0, b1);
                        const float g0 = group_scale<FMT>(sc0[u], j, h), g1 = group_scale<FMT>(sc1[u], j, h);
                        blk[0] = fmaf(t[0], g0, blk[0]);
                        blk[1] = fmaf(t[1], g0, blk[1]);
                        blk[2] = fmaf(t[2], g1, blk[2]);
                        blk[3] = fmaf(t[3], g1, blk[3]);
                    }
                }
                acc[0] = fmaf(blk[0], as0[u], acc[0]);
                acc[1] = fmaf(blk[1], as1[u], acc[1]);
                acc[2] = fmaf(blk[2], as0[u], acc[2]);
                acc[3] = fmaf(blk[3], as1[u], acc[3]);
            }
        }
        // the e4m3 operands are the codes' values times 2^-6 (e2m1) or 2^-9 (INT4); NVFP4 rows take their global scale
        float f0 = FMT == INT4 ? 512.f : 64.f, f1 = f0;
        if constexpr (FMT == NVFP4) {
            const float* gl = p.r_global + e * 3 + p.global_col;
            f0 *= __ldg(gl + (row0 >= p.up_row ? 1 : 0));
            f1 *= __ldg(gl + (row1 >= p.up_row ? 1 : 0));
        }
        acc[0] *= f0;
        acc[1] *= f0;
        acc[2] *= f1;
        acc[3] *= f1;
    } else {
        const int64_t sl = e - p.num_routed;
        const uint8_t* w0 = p.s + sl * p.stride_se + row0 * p.stride_sn + 8 * c;
        const uint8_t* w1 = w0 + 8 * p.stride_sn;
        const int64_t b0row = row0 < p.up_row ? row0 / 128 : p.up_scale_row + (row0 - p.up_row) / 128;
        const int64_t b1row = row1 < p.up_row ? row1 / 128 : p.up_scale_row + (row1 - p.up_row) / 128;
        const float* ws0 = p.s_scale + sl * p.stride_sse + b0row * p.stride_ssn;
        const float* ws1 = p.s_scale + sl * p.stride_sse + b1row * p.stride_ssn;
        for (int64_t kb = first; kb < stop; kb += U) {
            uint2 v0[U][4], v1[U][4], xv[U][4];
            float as0[U], as1[U], bs0[U], bs1[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int64_t k = kb + u < stop ? kb + u : stop - 1;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    v0[u][j] = ld64(w0 + k * 128 + 32 * j);
                    v1[u][j] = ld64(w1 + k * 128 + 32 * j);
                    xv[u][j] = ok_g ? ld64(x + k * 128 + 32 * j) : make_uint2(0u, 0u);
                }
                as0[u] = ok_0 ? __ldg(xs0 + k) : 0.f;
                as1[u] = ok_1 ? __ldg(xs1 + k) : 0.f;
                bs0[u] = __ldg(ws0 + k);
                bs1[u] = __ldg(ws1 + k);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (kb + u >= stop) break;
                float blk[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const uint32_t b0 = prmt(xv[u][j].x, xv[u][j].y, 0x6420u);
                    const uint32_t b1 = prmt(xv[u][j].x, xv[u][j].y, 0x7531u);
                    mma_e4m3(blk, prmt(v0[u][j].x, v0[u][j].y, 0x6420u), prmt(v1[u][j].x, v1[u][j].y, 0x6420u),
                             prmt(v0[u][j].x, v0[u][j].y, 0x7531u), prmt(v1[u][j].x, v1[u][j].y, 0x7531u), b0, b1);
                }
                acc[0] = fmaf(blk[0], as0[u] * bs0[u], acc[0]);
                acc[1] = fmaf(blk[1], as1[u] * bs0[u], acc[1]);
                acc[2] = fmaf(blk[2], as0[u] * bs1[u], acc[2]);
                acc[3] = fmaf(blk[3], as1[u] * bs1[u], acc[3]);
            }
        }
    }
    float* out = p.c + pid_k * p.c_split_stride;
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

template <int FMT>
int launch(const Params* p, dim3 grid, int64_t unroll, cudaStream_t st) {
    switch (unroll) {
        case 1: mixed_decode_kernel<FMT, 1><<<grid, WARPS * 32, 0, st>>>(*p); break;
        case 2: mixed_decode_kernel<FMT, 2><<<grid, WARPS * 32, 0, st>>>(*p); break;
        case 4: mixed_decode_kernel<FMT, 4><<<grid, WARPS * 32, 0, st>>>(*p); break;
        default: return (int)cudaErrorInvalidValue;
    }
    return (int)cudaGetLastError();
}

}  // namespace

// Returns the CUDA error code of the launch (0: launched). fmt: 0 MXFP4, 1 INT4, 2 NVFP4; unroll: K steps of 128
// inputs loaded ahead (1, 2 or 4).
// (Params is the caller's struct, passed as void*: a signature naming a type of the unnamed namespace would give the
// function internal linkage, and the library would not export it)
extern "C" int fuse_shared_mixed_decode(const void* params, int64_t fmt, int64_t grid_m, int64_t unroll,
                                        void* stream) {
    const Params* p = static_cast<const Params*>(params);
    const dim3 grid((unsigned)((p->N + WARPS * 16 - 1) / (WARPS * 16)), (unsigned)grid_m, (unsigned)p->split_k);
    const cudaStream_t st = static_cast<cudaStream_t>(stream);
    switch (fmt) {
        case MXFP4: return launch<MXFP4>(p, grid, unroll, st);
        case INT4: return launch<INT4>(p, grid, unroll, st);
        case NVFP4: return launch<NVFP4>(p, grid, unroll, st);
        default: return (int)cudaErrorInvalidValue;
    }
}
