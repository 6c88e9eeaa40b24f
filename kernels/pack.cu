// Gather segments of a buffer into one contiguous message and scatter it back (entries pack_f32,
// unpack_f32, pack_f64, unpack_f64); pack_bf16_f32 gathers bfloat16 bits (unsigned short) into a float32
// message, each value exact (the bits are its high half). NumPy twins: hpengine.kernels.pack_numpy /
// unpack_numpy / pack_bf16_numpy.
//
// Segment k is src[offsets[k] : offsets[k] + sizes[k]]; in the message it sits at
// buf[starts[k] : starts[k] + sizes[k]], starts being the exclusive prefix sum of sizes. A strided
// slice (a column block of a row-major matrix, say) is one segment per row.
//
// Launch assumptions
//   * 2-D grid: blockIdx.y walks the segments (grid-stride, so gridDim.y <= 65535 covers any count),
//     blockIdx.x with 1-D blocks grid-strides inside a segment; any grid covers any input.
//   * offsets, starts, sizes are int64 device arrays of nseg entries. The message and the buffer do
//     not overlap; for unpack, the destination segments do not overlap each other.
//   * 16-byte vector copies when a segment's source and destination sit at the same offset from a
//     16-byte boundary (scalar peel and tail); otherwise that segment copies element by element.

typedef unsigned long long u64;

template <typename T> struct Vec;
template <> struct Vec<float> { typedef float4 type; enum { N = 4 }; };
template <> struct Vec<double> { typedef double2 type; enum { N = 2 }; };

// Copy n elements in -> out with the threads of this grid row (tid, stride along x).
template <typename T>
__device__ __forceinline__ void copy_run(T* __restrict__ out, const T* __restrict__ in, long long n,
                                         long long tid, long long stride) {
    typedef typename Vec<T>::type VT;
    const int N = Vec<T>::N;
    long long head = (long long)(((16 - ((u64)out & 15)) & 15) / sizeof(T));
    if (head > n) head = n;
    if (((u64)(in + head) & 15) != 0) head = n;           // different offsets: all scalar
    const long long nvec = (n - head) / N, rest = n - nvec * N;
    VT* vo = reinterpret_cast<VT*>(out + head);
    const VT* vi = reinterpret_cast<const VT*>(in + head);
    long long k = tid;
    for (; k + 3 * stride < nvec; k += 4 * stride) {     // four loads in flight per thread, then the stores
        const VT a = vi[k], b = vi[k + stride], c = vi[k + 2 * stride], d = vi[k + 3 * stride];
        vo[k] = a; vo[k + stride] = b; vo[k + 2 * stride] = c; vo[k + 3 * stride] = d;
    }
    for (; k < nvec; k += stride) vo[k] = vi[k];
    for (long long r = tid; r < rest; r += stride) {      // the peel [0, head) and the tail
        const long long i = r < head ? r : r + nvec * N;
        out[i] = in[i];
    }
}

template <typename T>
__device__ void copy_segments(T* out, const T* in, const long long* out_off, const long long* in_off,
                              const long long* sizes, int nseg) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (int k = blockIdx.y; k < nseg; k += gridDim.y)
        copy_run<T>(out + out_off[k], in + in_off[k], sizes[k], tid, stride);
}

extern "C" __global__ void pack_f32(float* buf, const float* src, const long long* offsets,
                                    const long long* starts, const long long* sizes, int nseg) {
    copy_segments<float>(buf, src, starts, offsets, sizes, nseg);
}

extern "C" __global__ void unpack_f32(const float* buf, float* dst, const long long* offsets,
                                      const long long* starts, const long long* sizes, int nseg) {
    copy_segments<float>(dst, buf, offsets, starts, sizes, nseg);
}

extern "C" __global__ void pack_f64(double* buf, const double* src, const long long* offsets,
                                    const long long* starts, const long long* sizes, int nseg) {
    copy_segments<double>(buf, src, starts, offsets, sizes, nseg);
}

extern "C" __global__ void unpack_f64(const double* buf, double* dst, const long long* offsets,
                                      const long long* starts, const long long* sizes, int nseg) {
    copy_segments<double>(dst, buf, offsets, starts, sizes, nseg);
}

// bfloat16 bits to float32 values, element by element (a block's small tensors: a few thousand elements)
extern "C" __global__ void pack_bf16_f32(float* buf, const unsigned short* src, const long long* offsets,
                                         const long long* starts, const long long* sizes, int nseg) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (int k = blockIdx.y; k < nseg; k += gridDim.y) {
        float* out = buf + starts[k];
        const unsigned short* in = src + offsets[k];
        for (long long i = tid; i < sizes[k]; i += stride) out[i] = __uint_as_float((unsigned int)in[i] << 16);
    }
}
