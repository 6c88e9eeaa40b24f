// Causal flash attention on tensor cores: the products run as mma.sync m16n8k16 with bfloat16 operands and
// float32 accumulation, the online softmax in float32. Same semantics, arguments and saved lse as the
// float32 entries of attention.cu (grouped-query heads, scale, causal mask), for bf16 amp: operands are
// rounded to the nearest bfloat16 as they are loaded (exact for the bf16-valued float32 storage of amp),
// and so are P and dS before their products, as nn/flash.py's twin does under bf16_gemm.operands(True).
// Entries flash_mma_<op>_<S>_hd<HD>: S = f32 (float storage) or bf16 (bfloat16 bits as unsigned short, read
// directly); HD = 64 or 128, the head dim padded with zeros up to it (hd <= HD). Launcher: nn/flash_cuda.py.
//
// A block is WARPS warps; each warp owns 16 rows of the M side of its products:
//   fwd  (query tile of 16 * WARPS rows; key tiles of BN keys in shared memory):
//        S = Q K^T, online softmax, O += P V; saves o and lse = m + log l;
//   dq   (likewise, run first): writes D = rowsum(dO * O), then S, dP = dO V^T, dS = P (dP - D), dQ += dS K;
//   dkdv (key tile of 16 * WARPS keys, k and v in shared memory; query tiles of QT rows, every head of the
//        group): S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q.
// Q carries the scale (rounded to bf16 after it, as the twin's q * scale), so dk needs none and dq gets it
// at the end. Tiles wholly above the diagonal are skipped, per block and per warp.
// P is rounded after the running max of the key tiles seen so far is taken out, so o depends on the key
// tiling to bfloat16 rounding: BN = 64 equals the twin's default key block.
// Packed documents: seg, the last argument of every entry, is null (one document a row) or (B, T) int32
// document ids, nondecreasing along a row, as in attention.cu: a query sees a key iff causal and of its
// document; tiles whose ranges of ids do not meet are skipped per block (never loaded: the walks start or
// end at the tile doc_start / doc_end name) and per warp (no product), the key tiles keeping their BN-aligned
// starts, so P is rounded where the twin rounds it. A row whose document has not begun in a visited tile
// keeps m = -inf and is shifted by 0: exact zeros.
//
// Launch assumptions (flash_cuda.plan_mma computes them)
//   * blockDim.x = 32 * WARPS; grid = (ceil(T / (16 * WARPS)), B * H) for fwd and dq, (.., B * KH) for dkdv;
//   * dynamic shared memory (bytes, LD = HD + PAD): fwd 4 * BN * LD, dq 4 * BNQ * LD,
//     dkdv 4 * (16 * WARPS + QT) * LD + 8 * QT; all under 48 KiB;
//   * q, k, v, o, dO, dq, dk, dv are (B, heads, T, hd) with element strides (sb, sh, st) and a contiguous
//     last axis; lse and D are contiguous (B, H, T) float32; seg (if any) contiguous;
//   * static shared memory: the document ids of a key tile (fwd BN, dq BNQ ints) or query tile (dkdv QT).
//
// Fragments of mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (PTX ISA, "Matrix Fragments for
// mma.m16n8k16 with floating point type"). lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3.
//   A (16 x 16, row): 4 registers; register r holds A[A_ROW][A_COL] (low half) and A[A_ROW][A_COL + 1]:
//                     r = 0: (g, 2t)  r = 1: (g + 8, 2t)  r = 2: (g, 2t + 8)  r = 3: (g + 8, 2t + 8)
//   B (16 x 8, col):  2 registers; register r holds B[B_K][B_N] (low half) and B[B_K + 1][B_N]:
//                     r = 0: (2t, g)  r = 1: (2t + 8, g)
//   C, D (16 x 8):    4 floats; element e is C[C_ROW][C_COL]: e = 0, 1: (g, 2t + e)  e = 2, 3: (g + 8, 2t + e - 2)
// An accumulator row block becomes the A operand of the next product without moving between lanes: A
// register r of the 16 columns 16c.. packs elements PA_ELEM(r), PA_ELEM(r) + 1 of the C tile 2c + PA_TILE(r).
// The macros are plain integer expressions: tests/unit/test_flash_mma_kernels.py evaluates them in Python
// against the ISA's formulas.

#define A_ROW(lane, r) (((lane) >> 2) + 8 * ((r) & 1))
#define A_COL(lane, r) (2 * ((lane) & 3) + 8 * ((r) >> 1))
#define B_K(lane, r) (2 * ((lane) & 3) + 8 * (r))
#define B_N(lane) ((lane) >> 2)
#define C_ROW(lane, e) (((lane) >> 2) + 8 * ((e) >> 1))
#define C_COL(lane, e) (2 * ((lane) & 3) + ((e) & 1))
#define PA_TILE(r) ((r) >> 1)
#define PA_ELEM(r) (2 * ((r) & 1))

#define WARPS 4
#define PAD 8                   // bf16 per shared row past HD: the fragment reads of a warp hit 32 banks
#define FULL 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)      // no math.h under NVRTC

typedef unsigned int u32;
typedef unsigned short u16;

// storage -> float32, float32 -> storage (bf16: round to nearest even, NaN stays a quiet NaN)
__device__ __forceinline__ float ld(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float ld(const u16* p, long long i) { return __uint_as_float(((u32)p[i]) << 16); }
__device__ __forceinline__ void st(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void st(u16* p, long long i, float v) {
    u32 u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) { p[i] = 0x7fc0; return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    p[i] = (u16)(u >> 16);
}

// float32 -> bfloat16 bits, nearest even; inf stays inf, a NaN a NaN (bf16_gemm.TO_BF16_BODY)
__device__ __forceinline__ u32 bf16(float x) {
    u32 u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u) return (u >> 16) | ((u & 0x007fffffu) ? 0x40u : 0u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
}
__device__ __forceinline__ u32 pack(float lo, float hi) { return bf16(lo) | (bf16(hi) << 16); }

__device__ __forceinline__ void mma(float* d, const u32* a, const u32* b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// fragments from shared tiles of bf16 with row stride ld (even, so every pair is one aligned 32-bit word)
__device__ __forceinline__ void frag_a(u32* a, const u16* s, int ld, int m0, int k0, int lane) {
#pragma unroll
    for (int r = 0; r < 4; ++r) a[r] = *(const u32*)(s + (m0 + A_ROW(lane, r)) * ld + k0 + A_COL(lane, r));
}
// B from a tile stored [n][k] (B = X^T of a row-major X): a pair is contiguous
__device__ __forceinline__ void frag_b_nk(u32* b, const u16* s, int ld, int k0, int n0, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) b[r] = *(const u32*)(s + (n0 + B_N(lane)) * ld + k0 + B_K(lane, r));
}
// B from a tile stored [k][n] (B = X of a row-major X): a pair is two rows of one column
__device__ __forceinline__ void frag_b_kn(u32* b, const u16* s, int ld, int k0, int n0, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u16* p = s + (k0 + B_K(lane, r)) * ld + n0 + B_N(lane);
        b[r] = (u32)p[0] | ((u32)p[ld] << 16);
    }
}
// A register pair straight from global rows (zero past T and hd), times mul before rounding
template <typename S>
__device__ __forceinline__ u32 gpair(const S* base, long long rs, int row, int col, int T, int hd, float mul) {
    const bool in = row < T;
    const long long at = (long long)(in ? row : 0) * rs + col;
    return pack(in && col < hd ? ld(base, at) * mul : 0.f, in && col + 1 < hd ? ld(base, at + 1) * mul : 0.f);
}
// the A fragments of 16 rows from r0 over all HD columns
template <typename S, int HD>
__device__ __forceinline__ void rows_a(u32 (*a)[4], const S* base, long long rs, int r0, int T, int hd, float mul,
                                       int lane) {
#pragma unroll
    for (int c = 0; c < HD / 16; ++c)
#pragma unroll
        for (int r = 0; r < 4; ++r) a[c][r] = gpair(base, rs, r0 + A_ROW(lane, r), 16 * c + A_COL(lane, r), T, hd, mul);
}
// A operand of the 16 columns 16c.. from an accumulator row block
__device__ __forceinline__ void acc_a(u32* a, float (*acc)[4], int c) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const float* t = acc[2 * c + PA_TILE(r)];
        a[r] = pack(t[PA_ELEM(r)], t[PA_ELEM(r) + 1]);
    }
}
// rows [r0, r0 + n) of one (batch, head) slice into sh as bf16 (n x HD, row stride HD + PAD; zero past T, hd)
template <typename S, int HD>
__device__ __forceinline__ void load_tile(u16* sh, const S* base, long long rs, int r0, int n, int T, int hd,
                                          float mul) {
    for (int e = threadIdx.x; e < n * HD; e += blockDim.x) {
        const int c = e / HD, col = e - c * HD, j = r0 + c;
        sh[c * (HD + PAD) + col] = (u16)bf16(j < T && col < hd ? ld(base, (long long)j * rs + col) * mul : 0.f);
    }
}
// S[n] = A . B^T over HD for 16 rows (A fragments given) and 8 * N columns of a shared [n][k] tile
template <int HD, int N>
__device__ __forceinline__ void scores(float (*s)[4], u32 (*a)[4], const u16* sh, int lane) {
#pragma unroll
    for (int n = 0; n < N; ++n) {
        s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int c = 0; c < HD / 16; ++c) {
            u32 b[2];
            frag_b_nk(b, sh, HD + PAD, 16 * c, 8 * n, lane);
            mma(s[n], a[c], b);
        }
    }
}
// acc[d] += P . X over K16 * 16 rows of a shared [k][n] tile X (P: accumulator row blocks)
template <int HD, int K16>
__device__ __forceinline__ void times_tile(float (*acc)[4], float (*p)[4], const u16* sh, int lane) {
#pragma unroll
    for (int c = 0; c < K16; ++c) {
        u32 a[4];
        acc_a(a, p, c);
#pragma unroll
        for (int d = 0; d < HD / 8; ++d) {
            u32 b[2];
            frag_b_kn(b, sh, HD + PAD, 16 * c, 8 * d, lane);
            mma(acc[d], a, b);
        }
    }
}
template <typename S, int HD>
__device__ __forceinline__ void store_rows(S* base, long long rs, int r0, int T, int hd, float (*acc)[4], float mul0,
                                           float mul1, int lane) {
#pragma unroll
    for (int d = 0; d < HD / 8; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = r0 + C_ROW(lane, e), col = 8 * d + C_COL(lane, e);
            if (i < T && col < hd) st(base, (long long)i * rs + col, acc[d][e] * (e < 2 ? mul0 : mul1));
        }
}
// whether queries [a, b) and keys [c, d) of one row (ids sg, rising) hold a document in common
__device__ __forceinline__ bool shared_doc(const int* sg, int a, int b, int c, int d) {
    return sg[c] <= sg[b - 1] && sg[a] <= sg[d - 1];
}
// ids rise along a row, so the tiles the rule keeps are contiguous: the key tiles of a query block start at
// the one holding the first key of its first query's document (doc_start), the query tiles of a key block
// end before the first query past its last key's document (doc_end); binary searches over the row
__device__ __forceinline__ int doc_start(const int* sg, int i) {
    int lo = 0, hi = i;                       // the first j <= i with sg[j] == sg[i]
    const int d = sg[i];
    while (lo < hi) { const int mid = (lo + hi) >> 1; if (sg[mid] < d) lo = mid + 1; else hi = mid; }
    return lo;
}
__device__ __forceinline__ int doc_end(const int* sg, int j, int T) {
    int lo = j + 1, hi = T;                   // the first i > j with sg[i] > sg[j], else T
    const int d = sg[j];
    while (lo < hi) { const int mid = (lo + hi) >> 1; if (sg[mid] <= d) lo = mid + 1; else hi = mid; }
    return lo;
}
// the document ids of the two rows r0 + C_ROW(lane, 0), r0 + C_ROW(lane, 2) a lane's accumulators hold
__device__ __forceinline__ void row_docs(int* out, const int* sg, int r0, int T, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) out[r] = sg ? sg[min(r0 + C_ROW(lane, 2 * r), T - 1)] : 0;
}
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(FULL, x, 1));
    return fmaxf(x, __shfl_xor_sync(FULL, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(FULL, x, 1);
    return x + __shfl_xor_sync(FULL, x, 2);
}

#define ARGS_QKV const S* q, long long q_sb, long long q_sh, long long q_st, const S* k, long long k_sb,        \
                 long long k_sh, long long k_st, const S* v, long long v_sb, long long v_sh, long long v_st
#define LANE_WARP const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

template <typename S, int HD, int BN>
__device__ void mma_fwd(ARGS_QKV, S* o, long long o_sb, long long o_sh, long long o_st, float* lse,
                        int H, int KH, int T, int hd, float scale, const int* seg) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int ksg[BN];
    u16* ks = (u16*)smem;
    u16* vs = ks + BN * (HD + PAD);
    LANE_WARP
    const int bh = blockIdx.y, b = bh / H, h = bh % H, kh = h / (H / KH);
    const int q0 = blockIdx.x * 16 * WARPS, qw = q0 + 16 * warp;
    const int* sg = seg ? seg + (long long)b * T : nullptr;
    int qsg[2];
    row_docs(qsg, sg, qw, T, lane);
    const S* kb = k + b * k_sb + kh * k_sh;
    const S* vb = v + b * v_sb + kh * v_sh;
    u32 qa[HD / 16][4];
    rows_a<S, HD>(qa, q + b * q_sb + h * q_sh, q_st, qw, T, hd, scale, lane);
    float acc[HD / 8][4] = {};
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    const int kend = min(q0 + 16 * WARPS, T);
    for (int k0 = sg ? doc_start(sg, q0) / BN * BN : 0; k0 < kend; k0 += BN) {
        const int kd = min(k0 + BN, T);
        __syncthreads();
        load_tile<S, HD>(ks, kb, k_st, k0, BN, T, hd, 1.f);
        load_tile<S, HD>(vs, vb, v_st, k0, BN, T, hd, 1.f);
        if (sg) for (int c = threadIdx.x; c < BN; c += blockDim.x) ksg[c] = k0 + c < T ? sg[k0 + c] : -1;
        __syncthreads();
        if (k0 > qw + 15) continue;                 // every key after this warp's last query
        if (sg && (qw >= T || !shared_doc(sg, qw, min(qw + 16, T), k0, kd))) continue;
        float s[BN / 8][4];
        scores<HD, BN / 8>(s, qa, ks, lane);
        float mn[2] = {m[0], m[1]};
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = qw + C_ROW(lane, e), c = 8 * n + C_COL(lane, e), j = k0 + c;
                if (j > i || j >= T || (sg && ksg[c] != qsg[e >> 1])) s[n][e] = NEG_INF;
                mn[e >> 1] = fmaxf(mn[e >> 1], s[n][e]);
            }
        // without documents mn is finite (the first tile holds key 0, which every row sees, rows past T too)
        // and sh is mn
        float alpha[2], sh[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mn[r] = quad_max(mn[r]);
            sh[r] = mn[r] == NEG_INF ? 0.f : mn[r];
            alpha[r] = expf(m[r] - sh[r]);
            l[r] *= alpha[r];
            m[r] = mn[r];
        }
#pragma unroll
        for (int d = 0; d < HD / 8; ++d)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[d][e] *= alpha[e >> 1];
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) { s[n][e] = expf(s[n][e] - sh[e >> 1]); l[e >> 1] += s[n][e]; }
        times_tile<HD, BN / 16>(acc, s, vs, lane);
    }
    l[0] = quad_sum(l[0]);
    l[1] = quad_sum(l[1]);
    store_rows<S, HD>(o + b * o_sb + h * o_sh, o_st, qw, T, hd, acc, 1.f / l[0], 1.f / l[1], lane);
    if ((lane & 3) == 0)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = qw + C_ROW(lane, 2 * r);
            if (i < T) lse[(long long)bh * T + i] = m[r] + logf(l[r]);
        }
}

template <typename S, int HD, int BN>
__device__ void mma_bwd_dq(ARGS_QKV, const S* o, long long o_sb, long long o_sh, long long o_st,
                           const S* dout, long long d_sb, long long d_sh, long long d_st, const float* lse, float* dd,
                           S* dq, long long dq_sb, long long dq_sh, long long dq_st,
                           int H, int KH, int T, int hd, float scale, const int* seg) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int ksg[BN];
    u16* ks = (u16*)smem;
    u16* vs = ks + BN * (HD + PAD);
    LANE_WARP
    const int bh = blockIdx.y, b = bh / H, h = bh % H, kh = h / (H / KH);
    const int q0 = blockIdx.x * 16 * WARPS, qw = q0 + 16 * warp;
    const S* kb = k + b * k_sb + kh * k_sh;
    const S* vb = v + b * v_sb + kh * v_sh;
    const S* db = dout + b * d_sb + h * d_sh;
    // D of row qw + lane / 2 from two lanes in float32 storage precision, then to the lanes of rows g, g + 8
    const int dr = qw + (lane >> 1);
    float part = 0.f;
    if (dr < T) {
        const S* op = o + b * o_sb + h * o_sh + (long long)dr * o_st;
        for (int c = lane & 1; c < hd; c += 2) part += ld(db, (long long)dr * d_st + c) * ld(op, c);
    }
    part += __shfl_xor_sync(FULL, part, 1);
    if (dr < T && (lane & 1) == 0) dd[(long long)bh * T + dr] = part;
    float D[2], li[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = qw + C_ROW(lane, 2 * r);
        D[r] = __shfl_sync(FULL, part, 2 * C_ROW(lane, 2 * r));
        li[r] = i < T ? lse[(long long)bh * T + i] : 0.f;
    }
    u32 qa[HD / 16][4], da[HD / 16][4];
    rows_a<S, HD>(qa, q + b * q_sb + h * q_sh, q_st, qw, T, hd, scale, lane);
    rows_a<S, HD>(da, db, d_st, qw, T, hd, 1.f, lane);
    float acc[HD / 8][4] = {};
    const int* sg = seg ? seg + (long long)b * T : nullptr;
    int qsg[2];
    row_docs(qsg, sg, qw, T, lane);
    const int kend = min(q0 + 16 * WARPS, T);
    for (int k0 = sg ? doc_start(sg, q0) / BN * BN : 0; k0 < kend; k0 += BN) {
        const int kd = min(k0 + BN, T);
        __syncthreads();
        load_tile<S, HD>(ks, kb, k_st, k0, BN, T, hd, 1.f);
        load_tile<S, HD>(vs, vb, v_st, k0, BN, T, hd, 1.f);
        if (sg) for (int c = threadIdx.x; c < BN; c += blockDim.x) ksg[c] = k0 + c < T ? sg[k0 + c] : -1;
        __syncthreads();
        if (k0 > qw + 15) continue;
        if (sg && (qw >= T || !shared_doc(sg, qw, min(qw + 16, T), k0, kd))) continue;
        float s[BN / 8][4], dp[BN / 8][4];
        scores<HD, BN / 8>(s, qa, ks, lane);
        scores<HD, BN / 8>(dp, da, vs, lane);
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = qw + C_ROW(lane, e), c = 8 * n + C_COL(lane, e), j = k0 + c;
                const bool seen = j <= i && j < T && i < T && (!sg || ksg[c] == qsg[e >> 1]);
                const float p = seen ? expf(s[n][e] - li[e >> 1]) : 0.f;
                s[n][e] = p * (dp[n][e] - D[e >> 1]);
            }
        times_tile<HD, BN / 16>(acc, s, ks, lane);
    }
    store_rows<S, HD>(dq + b * dq_sb + h * dq_sh, dq_st, qw, T, hd, acc, scale, scale, lane);
}

template <typename S, int HD, int QT>
__device__ void mma_bwd_dkdv(ARGS_QKV, const S* dout, long long d_sb, long long d_sh, long long d_st,
                             const float* lse, const float* dd,
                             S* dk, long long dk_sb, long long dk_sh, long long dk_st,
                             S* dv, long long dv_sb, long long dv_sh, long long dv_st,
                             int H, int KH, int T, int hd, float scale, const int* seg) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int qsg[QT];
    constexpr int KR = 16 * WARPS, LD = HD + PAD;
    u16* ks = (u16*)smem;
    u16* vs = ks + KR * LD;
    u16* qs = vs + KR * LD;
    u16* dos = qs + QT * LD;
    float* ls = (float*)(dos + QT * LD);
    float* ds_ = ls + QT;
    LANE_WARP
    const int bk = blockIdx.y, b = bk / KH, kh = bk % KH, g = H / KH;
    const int k0 = blockIdx.x * KR, kw = k0 + 16 * warp;
    load_tile<S, HD>(ks, k + b * k_sb + kh * k_sh, k_st, k0, KR, T, hd, 1.f);
    load_tile<S, HD>(vs, v + b * v_sb + kh * v_sh, v_st, k0, KR, T, hd, 1.f);
    float dka[HD / 8][4] = {}, dva[HD / 8][4] = {};
    const int* sg = seg ? seg + (long long)b * T : nullptr;
    int ksg[2];
    row_docs(ksg, sg, kw, T, lane);
    const int qend = sg ? doc_end(sg, min(k0 + KR, T) - 1, T) : T;
    for (int hh = 0; hh < g; ++hh) {
        const int h = kh * g + hh;
        const long long bh = (long long)b * H + h;
        for (int q0 = k0 - k0 % QT; q0 < qend; q0 += QT) {   // query tiles wholly before k0: skipped
            __syncthreads();
            load_tile<S, HD>(qs, q + b * q_sb + h * q_sh, q_st, q0, QT, T, hd, scale);
            load_tile<S, HD>(dos, dout + b * d_sb + h * d_sh, d_st, q0, QT, T, hd, 1.f);
            for (int c = threadIdx.x; c < QT; c += blockDim.x) {
                ls[c] = q0 + c < T ? lse[bh * T + q0 + c] : 0.f;
                ds_[c] = q0 + c < T ? dd[bh * T + q0 + c] : 0.f;
                if (sg) qsg[c] = q0 + c < T ? sg[q0 + c] : -1;
            }
            __syncthreads();
            if (q0 + QT - 1 < kw) continue;         // every query before this warp's first key
            if (sg && (kw >= T || !shared_doc(sg, q0, min(q0 + QT, T), kw, min(kw + 16, T)))) continue;
            float s[QT / 8][4], dp[QT / 8][4];
            {
                u32 a[HD / 16][4];
#pragma unroll
                for (int c = 0; c < HD / 16; ++c) frag_a(a[c], ks, LD, 16 * warp, 16 * c, lane);
                scores<HD, QT / 8>(s, a, qs, lane);
#pragma unroll
                for (int c = 0; c < HD / 16; ++c) frag_a(a[c], vs, LD, 16 * warp, 16 * c, lane);
                scores<HD, QT / 8>(dp, a, dos, lane);
            }
#pragma unroll
            for (int n = 0; n < QT / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {                 // row: key j; column: query i
                    const int j = kw + C_ROW(lane, e), c = 8 * n + C_COL(lane, e), i = q0 + c;
                    const bool seen = j <= i && i < T && j < T && (!sg || qsg[c] == ksg[e >> 1]);
                    const float p = seen ? expf(s[n][e] - ls[c]) : 0.f;
                    s[n][e] = p;
                    dp[n][e] = p * (dp[n][e] - ds_[c]);
                }
            times_tile<HD, QT / 16>(dva, s, dos, lane);
            times_tile<HD, QT / 16>(dka, dp, qs, lane);
        }
    }
    store_rows<S, HD>(dk + b * dk_sb + kh * dk_sh, dk_st, kw, T, hd, dka, 1.f, 1.f, lane);
    store_rows<S, HD>(dv + b * dv_sb + kh * dv_sh, dv_st, kw, T, hd, dva, 1.f, 1.f, lane);
}

// MMA_ENTRIES(suffix, storage S, HD, BN, BNQ, QT): the extern "C" entries of one storage type and head dim;
// the C signatures equal attention.cu's float32 entries (A = float)
#define MMA_ENTRIES(SUF, S, HD, BN, BNQ, QT)                                                                    \
extern "C" __global__ void __launch_bounds__(32 * WARPS) flash_mma_fwd_##SUF(                                   \
        const S* q, long long q_sb, long long q_sh, long long q_st,                                             \
        const S* k, long long k_sb, long long k_sh, long long k_st,                                             \
        const S* v, long long v_sb, long long v_sh, long long v_st,                                             \
        S* o, long long o_sb, long long o_sh, long long o_st, float* lse, int H, int KH, int T, int hd,        \
        float scale, const int* seg) {                                                                          \
    mma_fwd<S, HD, BN>(q, q_sb, q_sh, q_st, k, k_sb, k_sh, k_st, v, v_sb, v_sh, v_st,                           \
                       o, o_sb, o_sh, o_st, lse, H, KH, T, hd, scale, seg); }                                   \
extern "C" __global__ void __launch_bounds__(32 * WARPS) flash_mma_bwd_dq_##SUF(                                \
        const S* q, long long q_sb, long long q_sh, long long q_st,                                             \
        const S* k, long long k_sb, long long k_sh, long long k_st,                                             \
        const S* v, long long v_sb, long long v_sh, long long v_st,                                             \
        const S* o, long long o_sb, long long o_sh, long long o_st,                                             \
        const S* dout, long long d_sb, long long d_sh, long long d_st, const float* lse, float* dd,             \
        S* dq, long long dq_sb, long long dq_sh, long long dq_st, int H, int KH, int T, int hd, float scale,   \
        const int* seg) {                                                                                       \
    mma_bwd_dq<S, HD, BNQ>(q, q_sb, q_sh, q_st, k, k_sb, k_sh, k_st, v, v_sb, v_sh, v_st,                       \
                           o, o_sb, o_sh, o_st, dout, d_sb, d_sh, d_st, lse, dd,                                \
                           dq, dq_sb, dq_sh, dq_st, H, KH, T, hd, scale, seg); }                                \
extern "C" __global__ void __launch_bounds__(32 * WARPS) flash_mma_bwd_dkdv_##SUF(                              \
        const S* q, long long q_sb, long long q_sh, long long q_st,                                             \
        const S* k, long long k_sb, long long k_sh, long long k_st,                                             \
        const S* v, long long v_sb, long long v_sh, long long v_st,                                             \
        const S* dout, long long d_sb, long long d_sh, long long d_st, const float* lse, const float* dd,       \
        S* dk, long long dk_sb, long long dk_sh, long long dk_st,                                               \
        S* dv, long long dv_sb, long long dv_sh, long long dv_st, int H, int KH, int T, int hd, float scale,   \
        const int* seg) {                                                                                       \
    mma_bwd_dkdv<S, HD, QT>(q, q_sb, q_sh, q_st, k, k_sb, k_sh, k_st, v, v_sb, v_sh, v_st,                      \
                            dout, d_sb, d_sh, d_st, lse, dd, dk, dk_sb, dk_sh, dk_st,                           \
                            dv, dv_sb, dv_sh, dv_st, H, KH, T, hd, scale, seg); }

MMA_ENTRIES(f32_hd64, float, 64, 64, 64, 64)
MMA_ENTRIES(f32_hd128, float, 128, 64, 32, 16)
MMA_ENTRIES(bf16_hd64, unsigned short, 64, 64, 64, 64)
MMA_ENTRIES(bf16_hd128, unsigned short, 128, 64, 32, 16)
