/* Row copies between two [rows, row_bytes] byte views, for hicache/transfer/rows.py
 * (built on first use by hicache/transfer/native/__init__.py; nothing else is linked).
 *
 * dst[dst_row(i)] = src[src_row(i)] for i in 0..count-1, where a side's row is its index
 * array's i-th entry, or start + i when the index pointer is NULL (a run). Strides are in
 * bytes, so packed and strided (page_first) views are the same call. Bounds are checked by
 * the caller (check_row_pair) before this runs; nothing here allocates.
 *
 * Modes (benchmarks/row_kernels.py measures each; rows.py uses mode 0):
 * mode 0: rows under 16 KiB by a 128-bytes-a-round AVX2 loop where the CPU has AVX2, larger
 *   rows by memcpy (copies of 1-8 KiB pieces measured 0.53-0.84 of a 64 KiB-piece copy with
 *   glibc's memcpy, 0.86-0.96 with this loop; from 16 KiB memcpy is level or ahead);
 * mode 1: streaming (non-temporal) stores, which skip the read of each destination line
 *   before it is written (x86-64 only; elsewhere memcpy);
 * mode 2: one memcpy per row.
 * In every mode the first lines of the next row's source are prefetched before this row
 * copies: random rows defeat the hardware prefetcher at every row start.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HICACHE_HAVE_STREAM 1
#else
#define HICACHE_HAVE_STREAM 0
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HICACHE_HAVE_AVX2_LOOP 1
#else
#define HICACHE_HAVE_AVX2_LOOP 0
#endif

#define LINE 64
#define SMALL_ROW 16384 /* rows below this go through the AVX2 loop in mode 0 */
#define PREFETCH_BYTES 1024 /* of the next row's source, issued before this row's copy */

int hicache_rowcopy_version(void) { return 2; }

int hicache_rowcopy_has_stream(void) { return HICACHE_HAVE_STREAM; }

static inline void prefetch_src(const uint8_t *p, int64_t row_bytes) {
    int64_t n = row_bytes < PREFETCH_BYTES ? row_bytes : PREFETCH_BYTES;
    for (int64_t off = 0; off < n; off += LINE) __builtin_prefetch(p + off, 0, 0);
}

#if HICACHE_HAVE_AVX2_LOOP
/* Built for AVX2 whatever the compiler's default target; only called after the CPU said it
 * has AVX2 (cpu_has_avx2), so the library loads and runs on any x86-64. */
__attribute__((target("avx2"))) static void avx2_copy(uint8_t *dst, const uint8_t *src,
                                                      int64_t n) {
    int64_t off = 0;
    for (; off + 128 <= n; off += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + off));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + off + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + off + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + off + 96));
        _mm256_storeu_si256((__m256i *)(dst + off), a);
        _mm256_storeu_si256((__m256i *)(dst + off + 32), b);
        _mm256_storeu_si256((__m256i *)(dst + off + 64), c);
        _mm256_storeu_si256((__m256i *)(dst + off + 96), d);
    }
    if (off < n) memcpy(dst + off, src + off, (size_t)(n - off));
}

static int cpu_has_avx2(void) {
    static int known = -1; /* every thread that races here computes the same answer */
    int have = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (have < 0) {
        __builtin_cpu_init();
        have = __builtin_cpu_supports("avx2") ? 1 : 0;
        __atomic_store_n(&known, have, __ATOMIC_RELAXED);
    }
    return have;
}
#endif

int hicache_rowcopy_has_avx2_loop(void) {
#if HICACHE_HAVE_AVX2_LOOP
    return cpu_has_avx2();
#else
    return 0;
#endif
}

#if HICACHE_HAVE_STREAM
static inline void stream_copy(uint8_t *dst, const uint8_t *src, int64_t n) {
    /* head up to a 16-byte aligned destination, then 64 bytes per round, then the tail */
    int64_t head = (int64_t)((16 - ((uintptr_t)dst & 15)) & 15);
    if (head > n) head = n;
    if (head) {
        memcpy(dst, src, (size_t)head);
        dst += head;
        src += head;
        n -= head;
    }
    while (n >= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + 0));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)(dst + 0), a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
        dst += 64;
        src += 64;
        n -= 64;
    }
    if (n) memcpy(dst, src, (size_t)n);
}
#endif

int hicache_copy_rows(uint8_t *dst, int64_t dst_stride, const int64_t *dst_index,
                      int64_t dst_start, const uint8_t *src, int64_t src_stride,
                      const int64_t *src_index, int64_t src_start, int64_t count,
                      int64_t row_bytes, int mode) {
    if (count <= 0 || row_bytes <= 0) return 0;
#if !HICACHE_HAVE_STREAM
    if (mode == 1) mode = 2;
#endif
    int small = 0;
#if HICACHE_HAVE_AVX2_LOOP
    small = mode == 0 && row_bytes < SMALL_ROW && cpu_has_avx2();
#endif
    for (int64_t i = 0; i < count; i++) {
        int64_t s = src_index ? src_index[i] : src_start + i;
        int64_t d = dst_index ? dst_index[i] : dst_start + i;
        if (i + 1 < count) {
            int64_t next = src_index ? src_index[i + 1] : src_start + i + 1;
            prefetch_src(src + next * src_stride, row_bytes);
        }
        uint8_t *to = dst + d * dst_stride;
        const uint8_t *from = src + s * src_stride;
#if HICACHE_HAVE_AVX2_LOOP
        if (small) {
            avx2_copy(to, from, row_bytes);
            continue;
        }
#endif
#if HICACHE_HAVE_STREAM
        if (mode == 1) {
            stream_copy(to, from, row_bytes);
            continue;
        }
#endif
        memcpy(to, from, (size_t)row_bytes);
    }
#if HICACHE_HAVE_STREAM
    if (mode == 1) _mm_sfence(); /* streamed stores visible before the call returns */
#endif
    return 0;
}
